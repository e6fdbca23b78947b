#!/usr/bin/env python3
"""Regenerates the benchmark plots from the committed JSON under bench/results/.

    python3 bench/plots.py            # writes bench/results/plots/*.png (needs matplotlib)
    python3 bench/plots.py --check    # loads and validates the JSON inputs only (no matplotlib)
    bash bench/plots.sh               # installs matplotlib if it is missing, then plots
    python3 bench/plots.py --layer-trace trace.json [--out DIR]
                                      # the layer's phases of one `tilewave trace --op layer` file

Every number drawn comes from the gzip JSON files named in SOURCES (and LAYER_TRACES); the run,
date, commit and GPU in the titles are the ones their .md result files state (checked by
--check). The plots: the grid's speedup and efficiency (run 58), the add dataflow over the routers
(run 59), the measured C sweep against the model (run 62) and its regret (run 62), the producer
against cuBLAS and the roofline (run 58), and the layer's time by phase from a traced layer call
(LAYER_TRACES: run 84's, two in-process ranks on one H200).
"""

import argparse
import gzip
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
PLOTS = os.path.join(RESULTS, "plots")
DPI = 110

# One entry per input: the JSON, the .md that states its run, date, commit and machine, and the
# strings that .md must contain (so a title cannot drift from the result file it names).
SOURCES = {
    "run58_reduce": {
        "json": "2026-11-30-run58-bench.json.gz",
        "md": "2026-11-30-run58.md",
        "run": "run 58", "date": "2026-11-30", "commit": "05bfb48", "gpu": "2 x NVIDIA H200",
        "command": "bench", "points": 20, "dataflow": "reduce",
    },
    "run58_add": {
        "json": "2026-11-30-run58-bench-add.json.gz",
        "md": "2026-11-30-run58.md",
        "run": "run 58", "date": "2026-11-30", "commit": "05bfb48", "gpu": "2 x NVIDIA H200",
        "command": "bench", "points": 20, "dataflow": "add",
    },
    "run59_add": {
        "json": "2026-11-30-run59-bench-full-add.json.gz",
        "md": "2026-11-30-run59-full-grid.md",
        "run": "run 59", "date": "2026-11-30", "commit": "05bfb48", "gpu": "2 x NVIDIA H200",
        "command": "bench", "points": 60, "dataflow": "add",
    },
    "run62_oracle": {
        "json": "2026-12-01-run62-oracle-full.json.gz",
        "md": "2026-12-01-run62-oracle-full.md",
        "run": "run 62", "date": "2026-12-01", "commit": "1e54b9b", "gpu": "2 x NVIDIA H200",
        "command": "sweep_oracle", "points": 114, "dataflow": None,
    },
}

# Traced layer calls (`tilewave trace --op layer --out F`, then gzip F): the layer's time by phase
# per rank. An entry names the file, the .md of its run and what that .md states, e.g.
#   "runNN_layer": {"json": "2026-12-0D-runNN-trace-layer.json.gz", "md": "2026-12-0D-runNN.md",
#                   "run": "run NN", "date": "2026-12-0D", "commit": "abcdef0",
#                   "gpu": "1 x NVIDIA H200"},
LAYER_TRACES = {
    "run84_layer": {"json": "2026-12-02-run84-trace-layer.json.gz",
                    "md": "2026-12-02-run80-85-soak-layer.md", "run": "run 84",
                    "date": "2026-12-02", "commit": "1234052",
                    "gpu": "1 x NVIDIA H200 (2 in-process ranks)"},
}

# The producer's roofline (plot_producer_roofline): the dense rate one concatenated cuBLAS GEMM
# reaches (docs/hardware.md: bf16 8192^3, 793 TFLOP/s) and the weight-streaming rate of a
# memory-bound grouped GEMM (docs/hardware.md, `bench gemm --hbm-gbps`'s default).
ROOF_TFLOPS = 793.0
ROOF_GBPS = 4100.0

ROUTERS = ("balanced", "moderate_skew", "stress_skew")
BENCH_FIELDS = ("dataflow", "tokens_per_rank", "ffn", "hidden", "experts", "top_k", "router",
                "comm_ctas", "coalesce", "seq_us", "ours_us", "speedup", "ideal_us", "efficiency")
CONFIG_FIELDS = ("name", "comm_ctas", "coalesce", "median_us", "predicted_us")


class CheckError(Exception):
    pass


def need(cond, msg):
    if not cond:
        raise CheckError(msg)


def load(key):
    src = SOURCES[key]
    path = os.path.join(RESULTS, src["json"])
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    md_path = os.path.join(RESULTS, src["md"])
    with open(md_path) as f:
        md = f.read()
    head = "\n".join(md.splitlines()[:12])
    for word in (src["run"], src["date"], src["commit"], "NVIDIA H200"):
        need(word in head, "%s: its header does not state '%s'" % (src["md"], word))
    need("2 x" in head, "%s: its header does not state 2 x H200" % src["md"])
    need(data.get("command") == src["command"],
         "%s: command %r, expected %r" % (src["json"], data.get("command"), src["command"]))
    need(data.get("world_size") == 2, "%s: world_size is not 2" % src["json"])
    pts = data.get("points")
    need(isinstance(pts, list) and len(pts) == src["points"],
         "%s: %s points, expected %d" % (src["json"], len(pts) if isinstance(pts, list) else "no",
                                         src["points"]))
    if src["command"] == "bench":
        check_bench(src, pts)
    else:
        check_oracle(src, data)
    return data


def check_bench(src, pts):
    for i, p in enumerate(pts):
        for k in BENCH_FIELDS:
            need(k in p, "%s: point %d has no '%s'" % (src["json"], i, k))
        need(p["dataflow"] == src["dataflow"], "%s: point %d dataflow %s" % (src["json"], i, p["dataflow"]))
        need(p["router"] in ROUTERS, "%s: point %d router %s" % (src["json"], i, p["router"]))
        for k in ("seq_us", "ours_us", "ideal_us", "speedup", "efficiency"):
            need(isinstance(p[k], (int, float)) and p[k] > 0,
                 "%s: point %d %s = %r" % (src["json"], i, k, p[k]))
        # the stored ratios are the stored times' ratios (rounded to 4 digits)
        need(abs(p["speedup"] - p["seq_us"] / p["ours_us"]) < 2e-3,
             "%s: point %d speedup != seq / ours" % (src["json"], i))
        need(abs(p["efficiency"] - p["ideal_us"] / p["ours_us"]) < 2e-3,
             "%s: point %d efficiency != ideal / ours" % (src["json"], i))
        pol = {q.get("name"): q for q in p.get("policies", [])}
        for k in ("gemm", "cublas"):  # the producer alone and cuBLAS's GEMM (the roofline plot)
            need(k in pol and pol[k].get("median_us", 0) > 0,
                 "%s: point %d has no '%s' policy time" % (src["json"], i, k))
        need(abs(pol["gemm"]["median_us"] - p["gemm_us"]) < 0.011,
             "%s: point %d gemm_us != the gemm policy's median" % (src["json"], i))
    if src["points"] == 60:
        for r in ROUTERS:
            n = sum(1 for p in pts if p["router"] == r)
            need(n == 20, "%s: %d points with router %s, expected 20" % (src["json"], n, r))


def check_oracle(src, data):
    pts = data["points"]
    for p in pts:
        i = p.get("index")
        for k in ("index", "workload", "tokens_per_rank", "router", "regret", "oracle", "model",
                  "configs"):
            need(k in p, "%s: point %s has no '%s'" % (src["json"], i, k))
        for k in ("comm_ctas", "coalesce", "us"):
            need(k in p["oracle"], "%s: point %d oracle has no '%s'" % (src["json"], i, k))
        for k in ("comm_ctas", "coalesce", "comm_ctas_min", "comm_ctas_max", "us", "predicted_us"):
            need(k in p["model"], "%s: point %d model has no '%s'" % (src["json"], i, k))
        cells = {}
        for c in p["configs"]:
            for k in CONFIG_FIELDS:
                need(k in c, "%s: point %d config has no '%s'" % (src["json"], i, k))
            if c["name"].startswith("C"):
                need(c["median_us"] > 0 and c["predicted_us"] > 0,
                     "%s: point %d %s has no time" % (src["json"], i, c["name"]))
                cells[(c["comm_ctas"], c["coalesce"])] = c
        for cc in range(1, data["c_max"] + 1):
            need((cc, 1) in cells, "%s: point %d has no C%d_mgb1" % (src["json"], i, cc))
        # the oracle is the fastest of every timed launch: the cells, the other schedule and the
        # model's own launch (each rank at its own choice)
        best = min(c["median_us"] for c in p["configs"])
        need(abs(best - p["oracle"]["us"]) <= 0.011,
             "%s: point %d oracle %.2f us is not its fastest launch %.2f" % (src["json"], i,
                                                                            p["oracle"]["us"], best))
        need(p["regret"] >= 0 and abs(p["regret"] - (p["model"]["us"] / p["oracle"]["us"] - 1)) < 1e-3,
             "%s: point %d regret != model / oracle - 1" % (src["json"], i))
    s = data["summary"]
    regrets = [p["regret"] for p in pts]
    need(s["points"] == len(pts), "%s: summary.points %d" % (src["json"], s["points"]))
    need(abs(s["mean_regret"] - sum(regrets) / len(regrets)) < 1e-4,
         "%s: summary.mean_regret != the points' mean" % src["json"])
    need(abs(s["max_regret"] - max(regrets)) < 1e-6, "%s: summary.max_regret" % src["json"])


def load_all():
    return {k: load(k) for k in SOURCES}


def read_json_any(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


# The layer's phases, in call order: (name, the span names whose last end closes the phase).
# Each phase runs from the end of the one before (the call's first record for the first) to the
# last end of its spans on the rank: the gaps between kernels (launches, the host) fall into the
# phase after them, except the host's planning between the count and the place passes, which is
# its own phase (from the count pass's end to the place pass's first begin).
LAYER_PHASES = (
    ("count (scan pass 1)", ("count",)),
    ("plan on the host", None),
    ("place (scan pass 2)", ("place",)),
    ("send rows", ("send CTA",)),
    ("wait for the peers' rows", ("wait rows",)),
    ("GEMM1 + SwiGLU", ("gemm1 tile",)),
    ("GEMM2 + combine", ("tile", "consumer CTA")),
    ("reduction", ("reduce CTA",)),
)


def layer_phases(doc):
    """Per rank (pid): [(phase, us)] of a traced layer call (tilewave trace --op layer)."""
    spans = {}
    for e in doc.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        spans.setdefault(e["pid"], {}).setdefault(e["name"], []).append(
            (float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    out = {}
    for pid, by in sorted(spans.items()):
        need("count" in by and "place" in by and "gemm1 tile" in by,
             "rank %d: no count, place or gemm1 tile spans: not a layer trace" % pid)
        t = min(b for v in by.values() for b, _ in v)
        phases = []
        for name, keys in LAYER_PHASES:
            if keys is None:  # the host: from the count's end to the place's first begin
                end = max(t, min(b for b, _ in by["place"]))
            else:
                ends = [e for k in keys for _, e in by.get(k, [])]
                end = max([t] + ends)
            phases.append((name, end - t))
            t = end
        out[pid] = phases
    return out


def check_layer_trace(name, doc):
    meta = doc.get("metadata", {})
    need(meta.get("op") == "layer", "%s: metadata.op is %r, not 'layer'" % (name, meta.get("op")))
    for k in ("hidden", "ffn", "experts", "top_k", "tokens_per_rank", "world_size", "ranks"):
        need(k in meta, "%s: metadata has no '%s'" % (name, k))
    ph = layer_phases(doc)
    need(len(ph) == meta["world_size"], "%s: %d ranks with spans, world_size %d" % (
        name, len(ph), meta["world_size"]))
    for r in meta["ranks"]:
        need(r.get("dropped", 0) == 0, "%s: rank %d dropped records" % (name, r.get("rank", -1)))
    return ph


def load_layer_traces():
    out = {}
    for k, src in LAYER_TRACES.items():
        doc = read_json_any(os.path.join(RESULTS, src["json"]))
        with open(os.path.join(RESULTS, src["md"])) as f:
            head = "\n".join(f.read().splitlines()[:12])
        for word in (src["run"], src["date"], src["commit"]):
            need(word in head, "%s: its header does not state '%s'" % (src["md"], word))
        check_layer_trace(src["json"], doc)
        out[k] = doc
    return out


# ---------------------------------------------------------------- plots (matplotlib from here)

def title_of(key, what):
    s = SOURCES[key]
    return "%s\n%s, %s, commit %s, %s" % (what, s["run"], s["date"], s["commit"], s["gpu"])


def title_of_layer(src):
    return "One traced layer call by phase\n%s, %s, commit %s, %s" % (
        src["run"], src["date"], src["commit"], src["gpu"])


def grid_key(p):
    return (p["tokens_per_rank"], p["hidden"], p["experts"])


def grid_label(k):
    return "%d\n%d\n%d" % k


def axis_grid_labels(ax, keys):
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([grid_label(k) for k in keys], fontsize=7)
    ax.set_xlim(-0.6, len(keys) - 0.4)
    ax.text(-0.01, -0.02, "tokens/rank\nN\nexperts", transform=ax.transAxes, ha="right",
            va="top", fontsize=7)


def bar_line(ax, bar, n):
    """The target as a dashed line, and light separators between the grid's blocks of 5 expert
    counts (one block per tokens/rank x N)."""
    ax.axhline(bar, color="k", ls="--", lw=1,
               label="bar %.2f" % bar if bar < 1 else "bar %.1fx" % bar)
    for b in range(5, n, 5):
        ax.axvline(b - 0.5, color="0.75", lw=0.8)


def save(plt, fig, name, written):
    """Writes the figure as a 256-colour PNG (Pillow, a matplotlib dependency): a few plain line
    colours on white lose nothing visible, and the files stay well under 200 KB."""
    import io
    from PIL import Image
    path = os.path.join(PLOTS, name)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    plt.close(fig)
    buf.seek(0)
    img = Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    img.save(path, format="PNG", optimize=True)
    written.append(path)


def plot_grid_dataflows(plt, data, written):
    red = {grid_key(p): p for p in data["run58_reduce"]["points"]}
    add = {grid_key(p): p for p in data["run58_add"]["points"]}
    keys = sorted(set(red) & set(add))
    x = list(range(len(keys)))
    w = 0.38
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True)
    for ax, field, bar, ylab in ((axes[0], "speedup", 1.5, "speedup over cuBLAS + NCCL"),
                                 (axes[1], "efficiency", 0.90, "efficiency = max(GEMM, comm) / ours")):
        yr = [red[k][field] for k in keys]
        ya = [add[k][field] for k in keys]
        ax.plot([i - w / 4 for i in x], yr, "o", ms=6, label="reduce", color="#4c72b0")
        ax.plot([i + w / 4 for i in x], ya, "s", ms=6, label="add", color="#dd8452")
        bar_line(ax, bar, len(keys))
        lo = min(yr + ya)
        hi = max(yr + ya + [bar])
        ax.set_ylim(lo - (hi - lo) * 0.35, hi + (hi - lo) * 0.15)
        ax.set_ylabel(ylab, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="lower left", ncol=3)
    axis_grid_labels(axes[1], keys)
    axes[0].set_title(title_of("run58_reduce", "The combine grid, both dataflows "
                               "(top-2, K 2048, balanced routing, the model's C and mgb)"),
                      fontsize=9)
    fig.tight_layout()
    save(plt, fig, "run58-grid-dataflows.png", written)


def plot_routers(plt, data, written):
    pts = data["run59_add"]["points"]
    by = {(grid_key(p), p["router"]): p for p in pts}
    keys = sorted({grid_key(p) for p in pts})
    colors = {"balanced": "#4c72b0", "moderate_skew": "#55a868", "stress_skew": "#c44e52"}
    w = 0.27
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True)
    for ax, field, bar, ylab in ((axes[0], "efficiency", 0.90, "efficiency = max(GEMM, comm) / ours"),
                                 (axes[1], "speedup", 1.5, "speedup over cuBLAS + NCCL")):
        allv = []
        marks = {"balanced": "o", "moderate_skew": "^", "stress_skew": "v"}
        for j, r in enumerate(ROUTERS):
            y = [by[(k, r)][field] for k in keys]
            allv += y
            ax.plot([i + (j - 1) * w for i in range(len(keys))], y, marks[r], ms=6, label=r,
                    color=colors[r])
        bar_line(ax, bar, len(keys))
        lo, hi = min(allv), max(allv + [bar])
        ax.set_ylim(lo - (hi - lo) * 0.35, hi + (hi - lo) * 0.15)
        ax.set_ylabel(ylab, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="lower left", ncol=4)
    axis_grid_labels(axes[1], keys)
    axes[0].set_title(title_of("run59_add", "The add dataflow over the three routers "
                               "(top-2, K 2048, the model's C and mgb)"), fontsize=9)
    fig.tight_layout()
    save(plt, fig, "run59-add-routers.png", written)


def pick_sweep_points(pts):
    """The worst regret, the point nearest the median regret, and one balanced point per preset
    family at its middle token count (grid: its default point). Returns (point, why) pairs."""
    chosen = []
    worst = max(pts, key=lambda p: p["regret"])
    chosen.append((worst, "worst regret"))
    srt = sorted(pts, key=lambda p: p["regret"])
    med = srt[len(srt) // 2]["regret"]
    typical = min((p for p in pts if p is not worst), key=lambda p: abs(p["regret"] - med))
    chosen.append((typical, "typical (median regret)"))
    taken = {worst["index"], typical["index"]}
    families = [("granite", ["granite-3.1-1b-a400m"]), ("qwen", ["qwen1.5-moe-a2.7b"]),
                ("deepseek", ["deepseek-v2-lite"]),
                ("first paper's models", ["m-gpt", "m-bert", "m-trans-xl"])]
    for fam, wls in families:
        used = {q["workload"] for q, _ in chosen}
        wl = ([w for w in wls if w not in used] or wls)[0]
        cand = [p for p in pts if p["workload"] == wl and p["router"] == "balanced"
                and p["index"] not in taken]
        if not cand:
            continue
        toks = sorted({p["tokens_per_rank"] for p in cand})
        mid = toks[len(toks) // 2]
        p = [q for q in cand if q["tokens_per_rank"] == mid][0]
        chosen.append((p, fam))
        taken.add(p["index"])
    return chosen


def point_name(p):
    if p["workload"] == "grid":
        shape = "grid N %d, %d experts" % (p["hidden"], p["experts"])
    else:
        shape = p["workload"]
    return "#%d %s, %d tok/rank, %s" % (p["index"], shape, p["tokens_per_rank"], p["router"])


def plot_c_sweep(plt, data, written):
    d = data["run62_oracle"]
    chosen = pick_sweep_points(d["points"])
    n = len(chosen)
    cols = 3
    rows = int(math.ceil(n / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(11, 3.3 * rows + 0.6))
    axes = [a for row in (axes if rows > 1 else [axes]) for a in row]
    for ax, (p, why) in zip(axes, chosen):
        cells = [c for c in p["configs"] if c["name"].startswith("C") and c["coalesce"] == 1]
        cells.sort(key=lambda c: c["comm_ctas"])
        cs = [c["comm_ctas"] for c in cells]
        ax.plot(cs, [c["median_us"] for c in cells], "o-", ms=3, lw=1.2, color="#4c72b0",
                label="measured median (mgb 1)")
        ax.plot(cs, [c["predicted_us"] for c in cells], "s--", ms=2.5, lw=1.2, color="#dd8452",
                label="predicted (rank 0's model, mgb 1)")
        o, m = p["oracle"], p["model"]
        ax.plot([o["comm_ctas"]], [o["us"]], "*", ms=13, color="#2ca02c", zorder=5,
                label="oracle C %d mgb %d: %.1f us" % (o["comm_ctas"], o["coalesce"], o["us"]))
        rng = ("" if m["comm_ctas_min"] == m["comm_ctas_max"]
               else " (ranks %d-%d)" % (m["comm_ctas_min"], m["comm_ctas_max"]))
        ax.plot([m["comm_ctas"]], [m["us"]], "X", ms=10, color="#c44e52", zorder=6,
                label="model C %d%s mgb %d: %.1f us" % (m["comm_ctas"], rng, m["coalesce"], m["us"]))
        ax.set_title("%s (regret %.2f%%)\n%s" % (why, 100 * p["regret"], point_name(p)),
                     fontsize=7.5)
        # zoom on the plateau: the small-C times (several x the best) run off the top
        lo = min(min(c["median_us"] for c in cells), min(c["predicted_us"] for c in cells))
        hi = max(min(c["median_us"] for c in cells), min(c["predicted_us"] for c in cells))
        top = max(1.8 * hi, 1.1 * max(cells[-1]["median_us"], cells[-1]["predicted_us"]))
        ax.set_ylim(0.85 * lo, top)
        ax.set_xlim(0, cs[-1] + 1)
        ax.set_xlabel("C (consumer CTAs)", fontsize=8)
        ax.set_ylabel("us (small C off the top)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper right")
    for ax in axes[n:]:
        ax.set_visible(False)
    fig.suptitle(title_of("run62_oracle", "Measured C sweep against the model's prediction "
                          "(reduce dataflow, 15 timed rounds per cell)"), fontsize=9)
    fig.tight_layout()
    save(plt, fig, "run62-c-sweep.png", written)
    return chosen


def plot_regret(plt, data, written):
    d = data["run62_oracle"]
    pts = d["points"]
    s = d["summary"]
    reg = [100 * p["regret"] for p in pts]
    mean, mx = 100 * s["mean_regret"], 100 * s["max_regret"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    srt = sorted(reg)
    a1.plot(range(1, len(srt) + 1), srt, "o-", ms=2.5, lw=1, color="#4c72b0")
    a1.axhline(mean, color="#2ca02c", lw=1, label="mean %.2f%%" % mean)
    a1.axhline(2.0, color="k", ls="--", lw=0.8, label="bar mean <= 2%")
    a1.axhline(5.0, color="k", ls=":", lw=0.8, label="bar max <= 5%")
    a1.annotate("max %.2f%% (#%d)" % (mx, s["max_regret_point"]), (len(srt), srt[-1]),
                xytext=(-110, -5), textcoords="offset points", fontsize=8,
                arrowprops=dict(arrowstyle="->", lw=0.8))
    a1.set_xlabel("points, sorted by regret", fontsize=8)
    a1.set_ylabel("regret: model / oracle - 1 (%)", fontsize=8)
    a1.set_ylim(0, 5.5)
    a1.grid(alpha=0.3)
    a1.legend(fontsize=8, loc="upper left")
    a1.tick_params(labelsize=7)
    colors = {"balanced": "#4c72b0", "moderate_skew": "#55a868", "stress_skew": "#c44e52"}
    bins = [0.25 * i for i in range(0, 21)]
    stack = [[100 * p["regret"] for p in pts if p["router"] == r] for r in ROUTERS]
    a2.hist(stack, bins=bins, stacked=True, color=[colors[r] for r in ROUTERS],
            label=["%s (%d)" % (r, len(v)) for r, v in zip(ROUTERS, stack)])
    a2.axvline(mean, color="#2ca02c", lw=1.2, label="mean %.2f%%" % mean)
    a2.axvline(mx, color="#c44e52", lw=1.2, ls="-.", label="max %.2f%%" % mx)
    a2.set_xlabel("regret (%), bins of 0.25%", fontsize=8)
    a2.set_ylabel("points", fontsize=8)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=8)
    a2.tick_params(labelsize=7)
    fig.suptitle(title_of("run62_oracle", "The model's regret against the measured oracle over "
                          "%d points (every C 1..%d x mgb 1/2/4)" % (len(pts), d["c_max"])),
                 fontsize=9)
    fig.tight_layout()
    save(plt, fig, "run62-regret.png", written)


def roofline_us(p):
    """The grouped GEMM2's bound at a bench point: max(its FLOPs at ROOF_TFLOPS, its bytes (every
    local expert's weights, the rows in and out, bf16) at ROOF_GBPS); rows = tokens/rank x top-k
    (what a rank computes under the balanced router, padding aside), 2 ranks."""
    rows = p["tokens_per_rank"] * p["top_k"]
    k, n, e = p["ffn"], p["hidden"], p["experts"] // 2
    flops = 2.0 * rows * k * n
    nbytes = 2.0 * (e * n * k + rows * k + rows * n)
    t_flops, t_bytes = flops / (ROOF_TFLOPS * 1e6), nbytes / (ROOF_GBPS * 1e3)
    return max(t_flops, t_bytes), ("flops" if t_flops >= t_bytes else "bytes")


def plot_producer_roofline(plt, data, written):
    pts = data["run58_reduce"]["points"]
    by = {grid_key(p): p for p in pts}
    keys = sorted(by)
    x = list(range(len(keys)))
    pol = [{q["name"]: q for q in by[k]["policies"]} for k in keys]
    ours = [q["gemm"]["median_us"] for q in pol]
    cub = [q["cublas"]["median_us"] for q in pol]
    roof = [roofline_us(by[k]) for k in keys]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True)
    a1.plot(x, ours, "o", ms=6, color="#4c72b0", label="ours: the producer alone (P = 132 - C SMs)")
    a1.plot(x, cub, "s", ms=5, color="#dd8452", label="cuBLAS: the sequential baseline's GEMM (132 SMs)")
    a1.plot(x, [r for r, _ in roof], "_", ms=16, mew=2, color="k",
            label="roofline: max(FLOPs at %.0f TF/s, bytes at %.1f TB/s)" % (ROOF_TFLOPS,
                                                                         ROOF_GBPS / 1e3))
    a1.set_yscale("log")
    a1.set_ylabel("GEMM2 us (log)", fontsize=8)
    a1.grid(axis="y", alpha=0.3, which="both")
    a1.legend(fontsize=7.5, loc="upper left")
    for b in range(5, len(keys), 5):
        a1.axvline(b - 0.5, color="0.75", lw=0.8)
    fo = [r / t for (r, _), t in zip(roof, ours)]
    fc = [r / t for (r, _), t in zip(roof, cub)]
    a2.plot(x, fo, "o", ms=6, color="#4c72b0", label="ours")
    a2.plot(x, fc, "s", ms=5, color="#dd8452", label="cuBLAS")
    for i, (_, bound) in enumerate(roof):
        if bound == "bytes":
            a2.annotate("mem", (i, fo[i]), xytext=(0, 6), textcoords="offset points",
                        ha="center", fontsize=6)
    bar_line(a2, 0.90, len(keys))
    lo = min(fo + fc)
    a2.set_ylim(min(lo - 0.05, 0.6), 1.05)
    a2.set_ylabel("roofline / time (1 = at the bound)", fontsize=8)
    a2.grid(axis="y", alpha=0.3)
    a2.legend(fontsize=8, loc="lower left", ncol=3)
    axis_grid_labels(a2, keys)
    a1.set_title(title_of("run58_reduce", "The producer GEMM inside the call against cuBLAS and "
                          "the roofline (GEMM2, K 2048, top-2, balanced)"), fontsize=9)
    fig.tight_layout()
    save(plt, fig, "run58-producer-roofline.png", written)


def plot_layer_phases(plt, doc, title, path, written):
    """One horizontal bar per rank, the layer call's phases stacked in call order."""
    ph = layer_phases(doc)
    meta = doc.get("metadata", {})
    colors = ["#8172b2", "#cccccc", "#64b5cd", "#4c72b0", "#c44e52", "#55a868", "#dd8452",
              "#937860"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.55 * len(ph) + 1.4))
    ranks = sorted(ph)
    for row, pid in enumerate(ranks):
        left = 0.0
        for j, (name, us) in enumerate(ph[pid]):
            ax.barh(row, us, left=left, color=colors[j % len(colors)], edgecolor="white",
                    label=name if row == 0 else None)
            if us > 0.06 * sum(u for _, u in ph[pid]):
                ax.text(left + us / 2, row, "%.0f" % us, ha="center", va="center", fontsize=7)
            left += us
        ax.text(left, row, " %.0f us" % left, va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels(["rank %d" % r for r in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("us from the rank's first record (numbers in the bars: each phase's us)",
                  fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=4)
    ax.set_title("%s\nH %s, F %s, %s experts, top-%s, %s tokens/rank, %s rank(s), %s" % (
        title, meta.get("hidden"), meta.get("ffn"), meta.get("experts"), meta.get("top_k"),
        meta.get("tokens_per_rank"), meta.get("world_size"), meta.get("device")), fontsize=9)
    fig.tight_layout()
    save_path(plt, fig, path, written)


def save_path(plt, fig, path, written):
    d, name = os.path.split(path)
    global PLOTS
    old = PLOTS
    PLOTS = d or "."
    try:
        save(plt, fig, name, written)
    finally:
        PLOTS = old


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="only load and validate the JSON inputs (no matplotlib)")
    ap.add_argument("--layer-trace", metavar="FILE",
                    help="only the layer's phases of this `tilewave trace --op layer` file "
                    "(.json or .json.gz), written to --out")
    ap.add_argument("--out", metavar="DIR", default=".",
                    help="where --layer-trace's PNG goes (default: the current directory)")
    args = ap.parse_args()
    if args.layer_trace:
        try:
            doc = read_json_any(args.layer_trace)
            ph = check_layer_trace(args.layer_trace, doc)
        except (OSError, ValueError, KeyError, CheckError) as e:
            print("plots.py: %s" % e, file=sys.stderr)
            return 1
        for pid, phases in sorted(ph.items()):
            print("rank %d: %s" % (pid, ", ".join("%s %.1f us" % x for x in phases)))
        if args.check:
            return 0
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        base = os.path.basename(args.layer_trace).split(".json")[0]
        written = []
        plot_layer_phases(plt, doc, "One traced layer call by phase (%s)" % base,
                          os.path.join(args.out, "layer-phases-%s.png" % base), written)
        print("wrote %s (%d bytes)" % (written[0], os.path.getsize(written[0])))
        return 0
    try:
        data = load_all()
        layers = load_layer_traces()
    except (OSError, ValueError, KeyError, CheckError) as e:
        print("plots.py: %s" % e, file=sys.stderr)
        return 1
    if args.check:
        for k, src in SOURCES.items():
            print("ok %s: %d points (%s, %s)" % (src["json"], len(data[k]["points"]), src["run"],
                                                 src["commit"]))
        for k, src in LAYER_TRACES.items():
            print("ok %s: a layer trace of %d rank(s) (%s, %s)" % (
                src["json"], layers[k]["metadata"]["world_size"], src["run"], src["commit"]))
        if not LAYER_TRACES:
            print("no layer trace committed yet: the layer-phases plot needs one "
                  "(tilewave trace --op layer on a GPU; LAYER_TRACES says how to add it)")
        return 0
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(PLOTS, exist_ok=True)
    written = []
    plot_grid_dataflows(plt, data, written)
    plot_routers(plt, data, written)
    chosen = plot_c_sweep(plt, data, written)
    plot_regret(plt, data, written)
    plot_producer_roofline(plt, data, written)
    for k, src in LAYER_TRACES.items():
        plot_layer_phases(plt, layers[k], title_of_layer(src),
                          os.path.join(PLOTS, "%s-layer-phases.png" % k.split("_")[0]), written)
    if not LAYER_TRACES:
        print("layer phases: no traced layer call committed (LAYER_TRACES): not drawn")
    for path in written:
        print("wrote %s (%d bytes)" % (os.path.relpath(path, os.path.dirname(HERE)),
                                       os.path.getsize(path)))
    print("C sweep points: %s" % "; ".join("%s: %s" % (why, point_name(p)) for p, why in chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
