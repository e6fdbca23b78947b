#!/usr/bin/env python3
"""Times the model's decision on every point of an oracle matrix, on the CPU, point by point.

    dev/model/solve_time.py [--tilewave build/tilewave] [--reps 400] [--matrix full]

Runs `tilewave plan --bench-solve REPS` (rank 0, the decision alone, each repetition a fresh
plan) for every point that `tilewave sweep --oracle --list` prints, and reports each point's
median and p99 and the median of the medians: the figure #5's bar reads, here without a GPU and
outside the launch path (sweep --oracle measures it inside tw_plan_create, per rank). Use it to
compare two builds on one machine; interleave them, since a shared host moves by +-20%.
"""
import argparse
import re
import statistics
import subprocess

from points import shape_args


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tilewave", default="build/tilewave")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--matrix", default="full")
    a = ap.parse_args()
    listing = subprocess.run([a.tilewave, "sweep", "--oracle", "--matrix", a.matrix, "--list"],
                             capture_output=True, text=True, check=True).stdout
    medians = []
    print("| # | workload | tokens/rank | router | median us | p99 us |")
    print("| ---: | --- | ---: | --- | ---: | ---: |")
    for line in listing.splitlines():
        f = [x.strip() for x in line.strip("|").split("|")]
        if len(f) < 10 or not f[0].isdigit():
            continue
        idx, wl, tokens, k, n, e, topk, router = f[:8]
        args = [a.tilewave, "plan", "--tokens", tokens, "--router", router, "--bench-solve",
                str(a.reps)]
        args += shape_args(wl, n, k, e, topk)
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        m = re.search(r"EP model.*median ([0-9.]+) us, p99 ([0-9.]+) us", out)
        if m is None:
            raise SystemExit("no solve time for point %s: %s" % (idx, out[-300:]))
        medians.append(float(m.group(1)))
        print("| %s | %s | %s | %s | %s | %s |" % (idx, wl, tokens, router, m.group(1), m.group(2)),
              flush=True)
    print("\n%d points, %d decisions each: median of the medians %.3f us, max %.3f us" %
          (len(medians), a.reps, statistics.median(medians), max(medians)))


if __name__ == "__main__":
    main()
