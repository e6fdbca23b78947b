#!/usr/bin/env python3
"""Summarizes `tilewave bench --json-file` outputs against #4's bars, for the committed results.

    bench/summarize.py REDUCE.json ADD.json     the two dataflows' grids side by side
    bench/summarize.py ADD.json                 one grid (e.g. `bench --full --dataflow add`)

Per point: the sequential (cuBLAS + NCCL) time, each dataflow's C, time, speedup and efficiency
(max(GEMM alone, comm alone) / ours), add / reduce, add / best chunked, and the add dataflow's
phases (producer end, consumer end). Then the geometric-mean speedups, the efficiency range at
N 8192 with the count at or above 0.90, and the points faster than the best chunked pipeline,
per router. Nothing is timed here: every number comes from the files.
"""
import json
import math
import sys


def load(path):
    with open(path) as f:
        return {key(p): p for p in json.load(f)["points"]}


def key(p):
    return (p["tokens_per_rank"], p["hidden"], p["experts"], p["router"])


def gmean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def cell(p):
    return "%d, %.1f, %.3fx, %.3f" % (p["comm_ctas"], p["ours_us"], p["speedup"], p["efficiency"])


def summary(name, pts):
    n8 = [p for p in pts if p["hidden"] == 8192]
    effs = [p["efficiency"] for p in n8]
    faster = sum(p["ours_us"] < p["chunked_us"] for p in pts)
    out = "%s: speedup over cuBLAS + NCCL %.3fx (geometric mean of %d points)" % (
        name, gmean([p["speedup"] for p in pts]), len(pts))
    if effs:
        out += "; efficiency at N 8192 %.3f-%.3f, >= 0.90 at %d of %d" % (
            min(effs), max(effs), sum(e >= 0.90 for e in effs), len(effs))
    out += "; faster than the best chunked at %d of %d" % (faster, len(pts))
    if not all(p["pass"] for p in pts):
        out += "; SOME POINTS FAILED THEIR CHECK"
    return out


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    grids = [load(f) for f in sys.argv[1:]]
    names = [next(iter(g.values()))["dataflow"] for g in grids]
    keys = [k for k in grids[0] if all(k in g for g in grids)]
    head = "| tokens/rank | N | E | router | seq us | " + " | ".join(
        "%s: C, us, speedup, eff" % n for n in names)
    sep = "| ---: | ---: | ---: | --- | ---: |" + " --- |" * len(names)
    two = len(grids) == 2
    if two:
        head += " | %s / %s" % (names[1], names[0])
        sep += " ---: |"
    head += " | %s / chunked | %s: producer end, consumer end us |" % (names[-1], names[-1])
    sep += " ---: | --- |"
    print(head)
    print(sep)
    for k in keys:
        ps = [g[k] for g in grids]
        last = ps[-1]
        row = "| %d | %d | %d | %s | %.1f | " % (k[0], k[1], k[2], k[3], ps[0]["seq_us"])
        row += " | ".join(cell(p) for p in ps)
        if two:
            row += " | %.4f" % (ps[1]["ours_us"] / ps[0]["ours_us"])
        ph = last.get("phases_us") or {}
        phases = ("%.1f, %.1f" % (ph["producer_end"], ph["consumer_end"])
                  if "producer_end" in ph else "-")
        row += " | %.3f | %s |" % (last["ours_us"] / last["chunked_us"], phases)
        print(row)
    print()
    routers = sorted({k[3] for k in keys})
    for n, g in zip(names, grids):
        print(summary(n, [g[k] for k in keys]))
        if len(routers) > 1:
            for r in routers:
                print("  " + summary(r, [g[k] for k in keys if k[3] == r]))
    if two:
        print("%s / %s: %.4f (geometric mean)" % (
            names[1], names[0], gmean([grids[1][k]["ours_us"] / grids[0][k]["ours_us"]
                                       for k in keys])))


if __name__ == "__main__":
    main()
