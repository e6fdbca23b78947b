#!/usr/bin/env python3
"""How far the model's predicted call time is from the measured one, over an oracle matrix.

For every point of a `tilewave sweep --oracle --json-file` run, plans all ranks again on the CPU
(`tilewave plan --all-ranks`, same routing seed) and compares, with the time the run measured for
the model's choice, (a) rank 0's prediction (what the sweep's table prints as "predicted us") and
(b) the largest prediction over the ranks (the slowest rank bounds the call):

    dev/model/accuracy.py bench/results/archive/2026-11-30-run17-oracle.json.gz [--tilewave build/tilewave]

The choice of C depends only on the shape of each rank's predicted curve, so an offset common to
all C costs no regret; this measures the model's absolute accuracy, not its choices.
"""
import argparse
import gzip
import json
import statistics
import subprocess

from points import family, shape_args


def describe(v):
    q = sorted(v)
    return "median %+.1f%%, mean |error| %.1f%%, p10 %+.1f%%, p90 %+.1f%%" % (
        100 * statistics.median(v), 100 * statistics.mean(map(abs, v)), 100 * q[len(q) // 10],
        100 * q[9 * len(q) // 10])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("oracle_json", help="sweep --oracle --json-file output (.json or .json.gz)")
    ap.add_argument("--tilewave", default="build/tilewave", help="the tilewave binary to plan with")
    a = ap.parse_args()
    opener = gzip.open if a.oracle_json.endswith(".gz") else open
    with opener(a.oracle_json, "rt") as f:
        d = json.load(f)
    rows = []
    for p in d["points"]:
        args = [a.tilewave, "plan", "--tokens", str(p["tokens_per_rank"]), "--router", p["router"],
                "--seed", str(d.get("seed", 1)), "--json", "--all-ranks"]
        args += shape_args(p["workload"], p["hidden"], p["ffn"], p["experts"], p["top_k"])
        ranks = json.loads(subprocess.run(args, capture_output=True, text=True,
                                          check=True).stdout)["ranks"]
        measured = p["model"]["us"]
        first = ranks[0]["predicted_us"]
        slowest = max(r["predicted_us"] for r in ranks)
        wl = family(p["workload"])
        rows.append((slowest / measured - 1, first / measured - 1, p["index"], wl,
                     p["tokens_per_rank"], p["router"], measured, first, slowest))
    print("predicted / measured - 1 over %d points (the model's choice as the run measured it):"
          % len(rows))
    print("  rank 0's prediction:      " + describe([r[1] for r in rows]))
    print("  the largest over ranks:   " + describe([r[0] for r in rows]))
    by = {}
    for r in rows:
        by.setdefault(r[3], []).append(r[0])
    for wl, v in sorted(by.items()):
        print("  %-22s largest over ranks: median %+.1f%% (%d points)" %
              (wl, 100 * statistics.median(v), len(v)))
    print("largest under-predictions (largest over ranks):")
    for r in sorted(rows)[:6]:
        print("  #%d %s %d %s: measured %.1f us, rank 0 %.1f, largest %.1f (%+.1f%%)" %
              (r[2], r[3], r[4], r[5], r[6], r[7], r[8], 100 * r[0]))


if __name__ == "__main__":
    main()
