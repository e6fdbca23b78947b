#!/usr/bin/env python3
"""Model predictions of `tilewave plan` for 2, 4 and 8 ranks (no GPU needed).

Runs the planner and the analytical model over the second paper's grid (tokens/rank 8192 and 16384,
top-2, K = 2048, N = 4096 and 8192, 4 to 64 experts per rank, three routers) and the model presets,
and prints one markdown table per world size: chosen C and mgb, predicted time, predicted sequential
time, speedup, padding and bytes sent by rank 0. These are predictions, not measurements.

Usage: bench/plan_ranks.py [path/to/tilewave] > table.md
"""
import json
import subprocess
import sys

TOOL = sys.argv[1] if len(sys.argv) > 1 else "build/tilewave"


def plan(args):
    out = subprocess.run([TOOL, "plan", "--json"] + args, check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def row(label, args):
    d = plan(args)
    r = d["ranks"][0]
    return "| %s | %.2f | %d | %d | %.0f | %.0f | %.2f | %.1f | %.1f |" % (
        label, d["routing"]["r_expert"], r["comm_ctas"], r["coalesce"], r["predicted_us"],
        r["sequential_us"], r["speedup"], r["padding_pct"], r["send_bytes"] / 2**20)


def main():
    header = ("| point | R_expert | C | mgb | predicted us | sequential us | speedup | padding % | "
              "sent MiB |\n|---|---|---|---|---|---|---|---|---|")
    listing = subprocess.run([TOOL, "plan", "--list-models"], check=True, capture_output=True,
                             text=True).stdout.splitlines()
    presets = [line.split()[0] for line in listing if line.strip()]
    for world in (2, 4, 8):
        print("\n## %d ranks\n" % world)
        print(header)
        for tokens in (8192, 16384):
            for n in (4096, 8192):
                for e_local in (4, 8, 16, 32, 64):
                    for router in ("balanced", "moderate_skew", "stress_skew"):
                        label = "tokens %d, N %d, K 2048, E/rank %d, %s" % (tokens, n, e_local, router)
                        print(row(label, ["--gpus", str(world), "--tokens", str(tokens), "--hidden",
                                          str(n), "--ffn", "2048", "--experts",
                                          str(e_local * world), "--topk", "2", "--router", router]),
                              flush=True)
        for name in presets:
            for tokens in (4096, 16384):
                try:
                    print(row("%s, tokens %d" % (name, tokens),
                              ["--gpus", str(world), "--model", name, "--tokens", str(tokens)]),
                          flush=True)
                except subprocess.CalledProcessError as e:
                    print("| %s, tokens %d | not plannable: %s |" % (name, tokens,
                                                                     e.stderr.strip().splitlines()[-1]))


if __name__ == "__main__":
    main()
