"""What the model scripts share: how a matrix point's shape is given to `tilewave plan`."""
import json
import subprocess

PRESETS = {"granite-3.1-1b-a400m", "qwen1.5-moe-a2.7b", "deepseek-v2-lite", "m-gpt", "m-bert",
           "m-trans-xl"}


def shape_args(workload, hidden, ffn, experts, top_k):
    """`tilewave plan` flags for a point: the preset's name, or the grid's shape flags."""
    if workload in PRESETS:
        return ["--model", workload]
    return ["--hidden", str(hidden), "--ffn", str(ffn), "--experts", str(experts), "--topk",
            str(top_k)]


def family(workload):
    """The point's workload for per-family summaries: a preset's name, else "grid"."""
    return workload if workload in PRESETS else "grid"


def plan_json(tw, p, seed, *extra):
    """`tilewave plan --json` for a matrix point (its routing seed, extra flags), parsed."""
    args = [tw, "plan", "--tokens", str(p["tokens_per_rank"]), "--router", p["router"], "--seed",
            str(seed), "--json", *extra]
    args += shape_args(p["workload"], p["hidden"], p["ffn"], p["experts"], p["top_k"])
    return json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)


def plan_ranks(tw, p, seed, *extra):
    """The ranks' list of plan_json."""
    return plan_json(tw, p, seed, *extra)["ranks"]
