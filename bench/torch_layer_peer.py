#!/usr/bin/env python3
"""PyTorch peer of the whole MoE layer on one GPU (world 1): what a plain PyTorch engine runs.

Per call, from the router's top-k (the router itself, x @ w_router, top-k and a softmax over the
chosen logits, is timed apart: tw_moe_layer takes top-k ids and weights as given):
  permute   a stable argsort of the slots by expert and a gather of the token rows;
  GEMM1     (rows, 2F) = rows @ w13_e^T, w13 (E, 2F, H) gate rows first (vLLM / SGLang layout);
  SwiGLU    h = silu(gate) * up;
  GEMM2     (rows, H) = h @ w2_e^T, w2 (E, H, F);
  combine   the rows back in slot order and out[t] = sum_j w[t][j] * row(t, j) (fp32 sum).
Two forms of the expert GEMMs: `grouped`, torch._grouped_mm over expert groups padded to 16 rows
(offsets on the device: no host synchronisation in the call), and `loop`, one matmul per expert
(the counts read on the host once per call). Both are checked against each other and against an
fp32 recomputation of four tokens; a difference above --tol fails the script (exit 1).
Times: CUDA events around each call after --warmup calls, the forms interleaved, medians. Prints
one markdown row per point (model, tokens): both forms' us, the faster one's TFLOP/s over the two
GEMMs (2 x rows x 3F x H), the router's us, and the errors.

Examples:
  python3 bench/torch_layer_peer.py --model deepseek-v3 --tokens 1024,4096,16384
  python3 bench/torch_layer_peer.py --hidden 2048 --ffn 768 --experts 16 --topk 2 --tokens 4096
"""
import argparse
import sys

import torch

# The routed experts of tilewave's large-model presets (src/plan/problem.c).
MODELS = {
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),
    "mixtral-8x22b": (6144, 16384, 8, 2),
}


def route(x, w_router, k):
    """Top-k ids (T, k) int64 and weights (T, k) fp32: a softmax over the k chosen logits."""
    logits = (x @ w_router).float()
    top, ids = torch.topk(logits, k, dim=1)
    return ids, torch.softmax(top, dim=1)


def permute(x, ids, experts):
    """Slots sorted by expert (stable: token order within an expert), their token rows, and the
    experts' row counts."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    return order, x.index_select(0, order // k), counts, flat.index_select(0, order)


def combine(rows, order, weights, tokens, k):
    """out[t] = sum_j w[t][j] * row(t, j): the rows back in slot order, fp32 sum, bf16 out."""
    back = torch.empty_like(rows)
    back.index_copy_(0, order, rows)
    y = back.view(tokens, k, -1).float() * weights.unsqueeze(-1)
    return y.sum(1).to(torch.bfloat16)


def layer_grouped(x, ids, weights, w13, w2):
    """torch._grouped_mm over groups padded to 16 rows (its offsets' alignment); the padded
    buffer has the worst-case size, so nothing is read back on the host."""
    tokens, k = ids.shape
    experts, f2, _ = w13.shape
    f = f2 // 2
    order, xs, counts, sorted_e = permute(x, ids, experts)
    padded = (counts + 15) // 16 * 16
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts, 0) - counts
    n = xs.shape[0]
    dst = pad_start.index_select(0, sorted_e) + torch.arange(n, device=x.device) - \
        start.index_select(0, sorted_e)
    xp = torch.zeros(n + 16 * experts, x.shape[1], dtype=x.dtype, device=x.device)
    xp.index_copy_(0, dst, xs)
    offs = pad_end.to(torch.int32)
    gu = torch._grouped_mm(xp, w13.transpose(1, 2), offs=offs)
    h = torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]
    out2 = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    return combine(out2.index_select(0, dst), order, weights, tokens, k)


def layer_loop(x, ids, weights, w13, w2):
    """One matmul per expert (the counts on the host)."""
    tokens, k = ids.shape
    experts, f2, _ = w13.shape
    f = f2 // 2
    order, xs, counts, _ = permute(x, ids, experts)
    out2 = torch.empty(xs.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    r0 = 0
    for e, m in enumerate(counts.tolist()):
        if m:
            gu = xs[r0:r0 + m] @ w13[e].t()
            out2[r0:r0 + m] = (torch.nn.functional.silu(gu[:, :f]) * gu[:, f:]) @ w2[e].t()
        r0 += m
    return combine(out2, order, weights, tokens, k)


def reference(x, ids, weights, w13, w2, tokens):
    """fp32 recomputation of some tokens' outputs."""
    f = w13.shape[1] // 2
    rows = []
    for t in tokens:
        acc = torch.zeros(w2.shape[1], dtype=torch.float32, device=x.device)
        xt = x[t].float()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].float() @ xt
            h = torch.nn.functional.silu(gu[:f]) * gu[f:]
            acc += float(weights[t, j]) * (w2[e].float() @ h)
        rows.append(acc)
    return torch.stack(rows)


def rel(a, b):
    """Normwise max|a - b| / max|b|; inf if anything is not finite."""
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def time_forms(fns, warmup, iters):
    """Median us of each function, interleaved call by call with a rotating start."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    samples = [[] for _ in fns]
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
    for i in range(iters):
        for j in range(len(fns)):
            f = (i + j) % len(fns)
            ev[j][0].record()
            fns[f]()
            ev[j][1].record()
            torch.cuda.synchronize()
            samples[f].append(ev[j][0].elapsed_time(ev[j][1]) * 1e3)
    return [sorted(s)[len(s) // 2] for s in samples]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS))
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--tokens", default="1024,4096,16384")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tol", type=float, default=2e-2)
    a = ap.parse_args()
    shape = list(MODELS[a.model]) if a.model else [None] * 4
    for i, v in enumerate((a.hidden, a.ffn, a.experts, a.topk)):
        if v is not None:
            shape[i] = v
    if None in shape:
        ap.error("give --model or all of --hidden, --ffn, --experts, --topk")
    H, F, E, K = shape
    if not torch.cuda.is_available():
        print("torch_layer_peer.py: no CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(a.seed)
    dev = "cuda"
    bf = torch.bfloat16
    # Projections of order 1 (x in [-1, 1)), as `tilewave bench layer` scales its weights.
    w13 = ((torch.rand(E, 2 * F, H, device=dev) * 2 - 1) * (2 / H ** 0.5)).to(bf)
    w2 = ((torch.rand(E, H, F, device=dev) * 2 - 1) * (2 / F ** 0.5)).to(bf)
    w_router = (torch.randn(H, E, device=dev) / H ** 0.5).to(bf)
    print("# PyTorch %s layer peer on %s, world 1, H %d F %d E %d top-%d, median of %d calls"
          % (torch.__version__, torch.cuda.get_device_name(0), H, F, E, K, a.iters))
    print()
    print("| model | tokens | grouped us | loop us | best TF/s | router us | err grouped/loop "
          "| err vs fp32 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    failed = 0
    for T in [int(t) for t in a.tokens.split(",")]:
        x = (torch.rand(T, H, device=dev) * 2 - 1).to(bf)
        ids, weights = route(x, w_router, K)
        og = layer_grouped(x, ids, weights, w13, w2)
        ol = layer_loop(x, ids, weights, w13, w2)
        pick = [0, T - 1, T // 2, T // 3]
        ref = reference(x, ids, weights, w13, w2, pick)
        e_forms = rel(og, ol)
        e_ref = max(rel(og[pick], ref), rel(ol[pick], ref))
        tg, tl, tr = time_forms([lambda: layer_grouped(x, ids, weights, w13, w2),
                                 lambda: layer_loop(x, ids, weights, w13, w2),
                                 lambda: route(x, w_router, K)], a.warmup, a.iters)
        flops = 2.0 * T * K * 3 * F * H
        bad = not (e_forms <= a.tol and e_ref <= a.tol)
        failed += bad
        print("| %s | %d | %.1f | %.1f | %.0f | %.1f | %.1e | %.1e%s |"
              % (a.model or "-", T, tg, tl, flops / min(tg, tl) * 1e-6, tr, e_forms, e_ref,
                 " FAIL" if bad else ""), flush=True)
    if failed:
        print("torch_layer_peer.py: %d point(s) FAILED the check (--tol %g)" % (failed, a.tol),
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
