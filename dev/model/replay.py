#!/usr/bin/env python3
"""Replays a measured oracle matrix against the model as it is now, on the CPU.

`tilewave sweep --oracle --json-file F` records, per point, the measured time of every (C, mgb)
and of the model's choice with each schedule. This script plans every point again with the
current `tilewave plan` (same routing seed, rank 0) and looks the new choice up in the measured
table, so that a model change can be judged before any GPU time is spent:

    dev/model/replay.py bench/results/archive/2026-11-30-run4-oracle.json.gz [--calibration FILE]

Caveats (the output counts only the points it could not look up): the grid cells were measured
in the schedule the model of the run chose for each mgb, so a point whose schedule choice changes is looked up in the other
schedule's cells only where the run measured it (the model's own (C, mgb)), else counted apart;
ranks that chose differently are approximated by rank 0; regret is against the run's oracle.
Since the plateau walk (docs/model.md) rank 0, the cold rank of a skewed routing, walks to far
larger C than the slowest rank, and its cell (every rank at that C) overstates the call: for a
model change read `plateau.py`'s lookup (the slowest rank's choice) beside this one.

--symmetric compares old and new choices alike: rank 0's (C, mgb) is looked up in the grid cells
(every rank at that C), also where it is the run's own choice, whose measured cell ran each rank
at its own C (per-rank choices can be far better on skewed routings: m-gpt 1024 stress_skew
measured 102 us with its ranks at C 24 and 28, 118 us with both at 28). The run's own choice
replayed this way is the baseline a change is compared with; the points slower than the best
fixed cell of the run (its summary's `fixed`, (12, 1) in files without one) are counted the
same way.
"""
import argparse
import gzip
import json
import statistics
import sys

from points import family, plan_ranks


def plan(tw, p, seed, calibration):
    return plan_ranks(tw, p, seed, *(["--calibration", calibration] if calibration else []))[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("oracle_json", help="sweep --oracle --json-file output (.json or .json.gz)")
    ap.add_argument("--tilewave", default="build/tilewave", help="the tilewave binary to plan with")
    ap.add_argument("--calibration", default=None, help="hardware description file")
    ap.add_argument("--worst", type=int, default=8, help="list the N largest regrets")
    ap.add_argument("--symmetric", action="store_true",
                    help="look every choice up in the grid cells (see above)")
    a = ap.parse_args()
    opener = gzip.open if a.oracle_json.endswith(".gz") else open
    with opener(a.oracle_json, "rt") as f:
        d = json.load(f)
    seed = d.get("seed", 1)
    fx = d.get("summary", {}).get("fixed", {})
    fixed_cell = (fx.get("comm_ctas", 12), fx.get("coalesce", 1))
    regrets, by, rows, unknown, slower, slower1 = [], {}, [], 0, 0, 0
    for p in d["points"]:
        r = plan(a.tilewave, p, seed, a.calibration)
        m = p["model"]
        cells = {(x["comm_ctas"], x["coalesce"]): x["median_us"] for x in p["configs"]
                 if x["name"].startswith("C")}
        oracle = min(cells.values()) if a.symmetric else p["oracle"]["us"]
        key = (r["comm_ctas"], r["coalesce"])
        if r["schedule"] == m.get("schedule", r["schedule"]):
            t = cells.get(key)
            if key == (m["comm_ctas"], m["coalesce"]) and not a.symmetric:
                t = m["us"]
        elif key == (m["comm_ctas"], m["coalesce"]) and "other_schedule_us" in m:
            t = m["other_schedule_us"]
        else:
            t = None
        if t is None:
            unknown += 1
            continue
        reg = t / oracle - 1
        regrets.append(reg)
        fixed = cells.get(fixed_cell)
        if fixed is not None:
            slower += t > fixed
            slower1 += t > 1.01 * fixed
        wl = family(p["workload"])
        by.setdefault(wl, []).append(reg)
        rows.append((reg, p["index"], wl, p["tokens_per_rank"], p["router"], r["schedule"],
                     key, t, oracle))
    if not regrets:
        sys.exit("no point could be looked up")
    print("replayed %d of %d points (%d whose new choice was not measured)" %
          (len(regrets), len(d["points"]), unknown))
    print("mean regret %.2f%%, max %.2f%%; slower than the %s cell at %d points, %d by > 1%%" %
          (100 * statistics.mean(regrets), 100 * max(regrets), fixed_cell, slower, slower1))
    for wl, v in by.items():
        print("  %-22s mean %.2f%% max %.2f%%" % (wl, 100 * statistics.mean(v), 100 * max(v)))
    for x in sorted(rows, reverse=True)[:a.worst]:
        print("  %.2f%%  #%d %s %d %s %s C=%d mgb=%d %.1f us (oracle %.1f)" %
              (100 * x[0], x[1], x[2], x[3], x[4], x[5], x[6][0], x[6][1], x[7], x[8]))


if __name__ == "__main__":
    main()
