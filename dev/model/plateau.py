#!/usr/bin/env python3
"""Replays the decision's plateau walk (plan.h, TW_MODEL_PLATEAU) on a measured oracle matrix.

The walk moves each rank's choice up in C, so rank 0's choice, which `replay.py` looks up, is the
cold rank's on skewed routings (its own T stays flat far longer than the call's). Here every rank's
predicted curve (`tilewave plan --all-ranks --json`, mgb 1) is walked by the rule, and the point's
choice is the slowest rank's (largest predicted minimum), looked up in the grid cells (every rank
at that C). That treats the call as its slowest rank's; the oracle run itself measures the ranks
each at its own choice.

    dev/model/plateau.py bench/results/2026-11-30-run57-oracle-full.json.gz [--dataflow add]

Prints, per rule (none, the walk at several bands, and variants without the wave-count stop),
the mean and maximum regret against the run's oracle (its best cell) and the worst points.
"""
import argparse
import gzip
import json
import math
import statistics
from concurrent.futures import ThreadPoolExecutor

from points import plan_json


def rank_curves(tw, p, seed, dataflow):
    """Per rank: (tiles, predicted T by C at mgb 1, the machine's SM count the plan used)."""
    doc = plan_json(tw, p, seed, "--all-ranks", "--dataflow", dataflow)
    sms = doc["hardware"]["sm_count"]  # P = sms - C with one CTA per SM
    # predicted_us_by_c[c - 1][j]: column j is mgb 1 (the first of the listed mgbs)
    return [(r["tiles"], [row[r["mgb"].index(1)] for row in r["predicted_us_by_c"]], sms)
            for r in doc["ranks"]]


def walk(tiles, curve, band, stop, sms):
    """stop: 'none' (argmin only), 'band' (within the band), 'wave' (also the same wave count),
    'margin' (the model's rule: also the next C keeps the wave count)."""
    t = {c: v for c, v in enumerate(curve, 1)}
    best = min(t, key=lambda c: (t[c], c))
    if stop == "none":
        return best
    waves = lambda c: math.ceil(tiles / (sms - c))
    c = best
    while c + 1 <= len(curve) and t[c + 1] <= t[best] * (1 + band):
        if stop == "wave" and waves(c + 1) != waves(best):
            break
        if stop == "margin" and (c + 2 > len(curve) or waves(c + 2) != waves(best)):
            break
        c += 1
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("oracle_json", help="sweep --oracle --json-file output (.json or .json.gz)")
    ap.add_argument("--tilewave", default="build/tilewave")
    ap.add_argument("--dataflow", default="reduce")
    a = ap.parse_args()
    opener = gzip.open if a.oracle_json.endswith(".gz") else open
    with opener(a.oracle_json, "rt") as f:
        d = json.load(f)
    seed = d.get("seed", 1)
    with ThreadPoolExecutor(8) as ex:
        curves = list(ex.map(lambda p: rank_curves(a.tilewave, p, seed, a.dataflow), d["points"]))
    rules = [("none", 0.0), ("margin", 0.01), ("margin", 0.015), ("margin", 0.02), ("margin", 0.03),
             ("wave", 0.02), ("band", 0.02)]
    for stop, band in rules:
        regrets = []
        for p, ranks in zip(d["points"], curves):
            cells = {x["comm_ctas"]: x["median_us"] for x in p["configs"]
                     if x["name"].startswith("C") and x["coalesce"] == 1}
            oracle = min(x["median_us"] for x in p["configs"] if x["name"].startswith("C"))
            slowest = max((min(curve), walk(tiles, curve, band, stop, sms))
                          for tiles, curve, sms in ranks)
            c = slowest[1]
            regrets.append((cells[c] / oracle - 1, p["index"], p["workload"], p["tokens_per_rank"],
                            p["router"], c))
        regrets.sort(reverse=True)
        worst = ", ".join("#%d %s %d %s C %d %.2f%%" % (i, w, t, r, c, 100 * g)
                          for g, i, w, t, r, c in regrets[:3])
        print("%-6s %.3f: mean %.2f%%, max %.2f%%, above 3%% at %d; worst %s" % (
            stop, band, 100 * statistics.mean(g[0] for g in regrets), 100 * regrets[0][0],
            sum(g[0] > 0.03 for g in regrets), worst))


if __name__ == "__main__":
    main()
