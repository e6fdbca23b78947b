#!/usr/bin/env python3
"""PyTorch peer of the MoE return path: what a PyTorch engine does without tilewave.

Per rank: one torch.matmul per local expert over its rows (expert-major, bf16), a permutation to
owner-major order, dist.all_to_all_single to the token owners, and the owner's weighted
reduction of each token's top-k rows (a batched matmul: fp32 sums, bf16 gate weights and
result). Times each phase with CUDA events around one sequential run; the latency of a sample
is the maximum over ranks; medians over the timed iterations are printed as a markdown table
(the columns of the PyTorch table in the project's hardware notes) or JSON.

Runs without torchrun: it spawns one process per rank itself with torch.multiprocessing and an
NCCL process group over 127.0.0.1. The routing is, in order of preference: a routing file written
by `tilewave bench --write-routing FILE` (--routing), the same seeded generator `tilewave bench`
uses through the Python binding (python/tilewave, libtilewave.so; --seed as in tilewave), or, if
the binding cannot be loaded, a uniform top-k routing from numpy (said so in the output).

Examples:
  python3 bench/torch_peer.py                       # default points, 2 GPUs
  python3 bench/torch_peer.py --tokens 8192 --hidden 8192 --ffn 2048 --experts 16 --topk 2
  python3 bench/torch_peer.py --routing r.txt --hidden 4096 --ffn 2048
"""
import argparse
import json
import os
import socket
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------------------------
# Routing
# ------------------------------------------------------------------------------------------------

def read_routing_file(path):
    """Parses the text format of tw_routing_write: returns (world, experts, top_k, [ids],
    [weights]), one ids/weights array of shape (tokens, top_k) per rank."""
    with open(path) as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
    head = lines[0].split()
    if head[0] != "tilewave-routing":
        raise ValueError("%s: not a tilewave routing file" % path)
    kv = dict(zip(head[2::2], head[3::2]))
    world, experts, top_k = int(kv["world_size"]), int(kv["experts"]), int(kv["top_k"])
    ids, weights, i = [], [], 1
    for _ in range(world):
        words = lines[i].split()
        tokens = int(words[3])
        rows = np.array([ln.split() for ln in lines[i + 1:i + 1 + tokens]], dtype=np.float64)
        rows = rows.reshape(tokens, 2 * top_k)
        ids.append(rows[:, :top_k].astype(np.int64))
        weights.append(rows[:, top_k:].astype(np.float32))
        i += 1 + tokens
    return world, experts, top_k, ids, weights


def tilewave_routing(world, hidden, ffn, experts, top_k, tokens, router, seed):
    """The routing `tilewave bench` builds for these arguments (same library, same seed)."""
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import tilewave  # noqa: E402  (ctypes binding; needs libtilewave.so)
    p = tilewave.Problem(world_size=world, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k,
                         max_tokens=tokens)
    r = tilewave.Routing.generate(p, router=router, tokens_per_rank=tokens, seed=seed)
    ids, ws = [], []
    for rank in range(world):
        i, w = r.rank(rank, as_numpy=True)
        ids.append(np.asarray(i, dtype=np.int64).reshape(-1, top_k))
        ws.append(np.asarray(w, dtype=np.float32).reshape(-1, top_k))
    return ids, ws


def uniform_routing(world, experts, top_k, tokens, seed):
    rng = np.random.default_rng(seed)
    ids, ws = [], []
    for _ in range(world):
        i = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
        logits = rng.standard_normal((tokens, top_k))
        w = np.exp(logits - logits.max(axis=1, keepdims=True))
        ids.append(i.astype(np.int64))
        ws.append((w / w.sum(axis=1, keepdims=True)).astype(np.float32))
    return ids, ws


def expert_major_rows(world, E, ids, rank):
    """The (owner, token, slot, local expert) rows rank computes, in the GEMM's expert-major
    order: by local expert, then owner, token, slot."""
    own, tok, slot, exp = [], [], [], []
    for o in range(world):
        t, j = np.nonzero(ids[o] // E == rank)
        own.append(np.full(t.shape, o))
        tok.append(t)
        slot.append(j)
        exp.append(ids[o][t, j] % E)
    own, tok, slot, exp = (np.concatenate(a) for a in (own, tok, slot, exp))
    order = np.lexsort((slot, tok, own, exp))
    return own[order], tok[order], slot[order], exp[order]


def rank_layout(rank, world, experts, top_k, ids):
    """Index arrays of one rank: which (owner, token, slot) rows it computes (expert-major), the
    permutation to owner-major send order, send and receive counts, and where each of its own
    tokens' slots lands in the receive buffer."""
    E = experts // world
    own, tok, slot, exp = expert_major_rows(world, E, ids, rank)
    expert_counts = np.bincount(exp, minlength=E)
    # Owner-major send order: by owner, then local expert, token, slot.
    perm = np.lexsort((slot, tok, exp, own))
    send_counts = np.bincount(own, minlength=world)
    # Receive side: rows for this rank's tokens arrive by source rank, each source sending in its
    # own (local expert, token, slot) order.
    mine = ids[rank]
    t, j = np.nonzero(np.ones_like(mine, dtype=bool))
    src = mine[t, j] // E
    e = mine[t, j] % E
    recv_order = np.lexsort((j, t, e, src))
    slot_row = np.empty(mine.size, dtype=np.int64)
    slot_row[recv_order] = np.arange(mine.size)
    recv_counts = np.bincount(src, minlength=world)
    return dict(expert_counts=expert_counts, perm=perm, send_counts=send_counts,
                recv_counts=recv_counts, slot_row=slot_row.reshape(mine.shape), rows=own.size)


# ------------------------------------------------------------------------------------------------
# One rank
# ------------------------------------------------------------------------------------------------

def worker(rank, world, port, points, args, queue):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world, device_id=dev)
    results = []
    try:
        for pt in points:
            results.append(run_point(rank, world, pt, args, torch, dist, dev))
    finally:
        dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def run_point(rank, world, pt, args, torch, dist, dev):
    H, F, ET, k = pt["hidden"], pt["ffn"], pt["experts"], pt["top_k"]
    E = ET // world
    lay = rank_layout(rank, world, ET, k, pt["ids"])
    g = torch.Generator(device=dev)
    g.manual_seed(args.seed * 1000 + rank)
    rows = lay["rows"]
    a = (torch.rand((rows, F), generator=g, device=dev) * 2 - 1).to(torch.bfloat16)
    w2 = ((torch.rand((E, H, F), generator=g, device=dev) * 2 - 1) / F ** 0.5).to(torch.bfloat16)
    c = torch.empty((rows, H), dtype=torch.bfloat16, device=dev)
    bounds = np.concatenate([[0], np.cumsum(lay["expert_counts"])]).tolist()
    perm = torch.from_numpy(lay["perm"]).to(dev)
    send_counts = lay["send_counts"].tolist()
    recv_counts = lay["recv_counts"].tolist()
    recv = torch.empty((sum(recv_counts), H), dtype=torch.bfloat16, device=dev)
    slot_row = torch.from_numpy(lay["slot_row"]).to(dev)
    gate = torch.from_numpy(pt["weights"][rank]).to(dev)
    gate_b = gate.to(torch.bfloat16).unsqueeze(1)  # (tokens, 1, k): bmm operand
    tokens = gate.shape[0]

    def gemm():
        for e in range(E):
            lo, hi = bounds[e], bounds[e + 1]
            if hi > lo:
                torch.matmul(a[lo:hi], w2[e].t(), out=c[lo:hi])

    def exchange():
        send = c.index_select(0, perm)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_counts,
                               input_split_sizes=send_counts)

    def reduce():
        # Gather each token's k rows, then one batched (1 x k) @ (k x H) product per token:
        # cuBLAS accumulates in fp32; the gate weights are cast to bf16 as MoE layers do.
        rows_kh = recv.index_select(0, slot_row.reshape(-1)).reshape(tokens, k, H)
        return torch.bmm(gate_b, rows_kh).squeeze(1)

    flag = torch.zeros(1, device=dev)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    samples = []
    for it in range(args.warmup + args.iters):
        dist.all_reduce(flag)  # ranks start each sample together
        torch.cuda.synchronize()
        ev[0].record()
        gemm()
        ev[1].record()
        exchange()
        ev[2].record()
        out = reduce()
        ev[3].record()
        torch.cuda.synchronize()
        if it >= args.warmup:
            samples.append([ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2]),
                            ev[2].elapsed_time(ev[3]), ev[0].elapsed_time(ev[3]),
                            ev[0].elapsed_time(ev[2])])
    t = torch.tensor(samples, device=dev) * 1000.0  # us
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a sample's latency is its slowest rank's
    med = t.median(dim=0).values.tolist()
    p10 = t.quantile(0.1, dim=0).tolist()
    p90 = t.quantile(0.9, dim=0).tolist()

    # Self-check on the last output: recompute a few tokens from the gathered GEMM outputs.
    ok = check_tokens(rank, world, pt, lay, a, w2, out, torch, dist, dev, E)
    flops = 2.0 * rows * H * F
    return dict(tokens_per_rank=tokens, rows_per_rank=rows, ffn=F, hidden=H, experts=ET, top_k=k,
                gemm_us=med[0], a2a_us=med[1], reduce_us=med[2], total_us=med[3],
                sequential_us=med[4], seq_p10_us=p10[4], seq_p90_us=p90[4],
                gemm_p10_us=p10[0], gemm_p90_us=p90[0],
                gemm_tflops=flops / (med[0] * 1e-6) / 1e12, check=ok,
                routing=pt["routing_source"])


def check_tokens(rank, world, pt, lay, a, w2, out, torch, dist, dev, E):
    """Recomputes the first 4 tokens of every rank in fp32 from all ranks' inputs and compares
    them with the peer's bf16 outputs (normwise relative error below 2e-2)."""
    H, k = pt["hidden"], pt["top_k"]
    # Every rank's GEMM inputs and weights are needed for an owner's tokens: gather them.
    sizes = [None] * world
    dist.all_gather_object(sizes, lay["rows"])
    mx = max(sizes)
    pad = torch.zeros((mx, a.shape[1]), dtype=a.dtype, device=dev)
    pad[:a.shape[0]] = a
    a_all = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(a_all, pad)
    w_all = [torch.empty_like(w2) for _ in range(world)]
    dist.all_gather(w_all, w2)
    ok = True
    ids, gate = pt["ids"][rank], pt["weights"][rank]
    for t in range(min(4, ids.shape[0])):
        acc = torch.zeros(H, device=dev)
        for j in range(k):
            g = int(ids[t, j])
            src, e = g // E, g % E
            # Row index of (rank, t, j) in src's expert-major order.
            row = locate_row(world, E, pt["ids"], src, rank, t, j)
            acc += float(gate[t, j]) * (a_all[src][row].float() @ w_all[src][e].float().t())
        err = (out[t].float() - acc).abs().max() / acc.abs().max().clamp_min(1e-30)
        ok = ok and bool(err < 2e-2)
    flag = torch.tensor([1 if ok else 0], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # pass only if every rank passed
    return bool(flag.item() == 1)


def locate_row(world, E, ids, src, owner, t, j):
    """Position of (owner, t, j) among the rows src computes, in expert-major order."""
    own, tok, slot, _ = expert_major_rows(world, E, ids, src)
    hit = np.nonzero((own == owner) & (tok == t) & (slot == j))[0]
    return int(hit[0])


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_points(args, world):
    shapes = []
    if args.routing:
        w, experts, top_k, ids, ws = read_routing_file(args.routing)
        if w != world:
            raise SystemExit("routing file is for %d ranks, %d requested" % (w, world))
        shapes.append(dict(hidden=args.hidden or 4096, ffn=args.ffn or 2048, experts=experts,
                           top_k=top_k, ids=ids, weights=ws, routing_source="file"))
        return shapes
    if any(v is not None for v in (args.hidden, args.ffn, args.experts, args.topk, args.tokens)):
        grid = [(args.tokens or 8192, args.hidden or 4096, args.ffn or 2048, args.experts or 16,
                 args.topk or 2)]
    else:  # default: the main grid's corners that the hardware notes tabulate
        grid = [(8192, n, 2048, e, 2) for n in (4096, 8192) for e in (16, 64)]
    for tokens, hidden, ffn, experts, top_k in grid:
        try:
            ids, ws = tilewave_routing(world, hidden, ffn, experts, top_k, tokens, args.router,
                                       args.seed)
            src = "tilewave seed %d" % args.seed
        except Exception as exc:  # no binding or library: same distribution, not the same draw
            print("torch_peer: tilewave routing unavailable (%s); using numpy uniform routing"
                  % exc, file=sys.stderr)
            if args.router != "balanced":
                raise SystemExit("torch_peer: --router %s needs the tilewave binding"
                                 % args.router)
            ids, ws = uniform_routing(world, experts, top_k, tokens, args.seed)
            src = "numpy uniform seed %d" % args.seed
        shapes.append(dict(hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, ids=ids,
                           weights=ws, routing_source=src))
    return shapes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--ffn", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--topk", type=int)
    ap.add_argument("--router", default="balanced",
                    choices=["balanced", "moderate_skew", "stress_skew"])
    ap.add_argument("--routing", help="routing file written by tilewave --write-routing")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch
    import torch.multiprocessing as mp
    if torch.cuda.device_count() < args.ranks:
        raise SystemExit("torch_peer: needs %d GPUs, found %d" % (args.ranks,
                                                                 torch.cuda.device_count()))
    points = build_points(args, args.ranks)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args.ranks, free_port(), points, args, queue),
                       nprocs=args.ranks, join=True, start_method="spawn")
    results = queue.get()
    if args.json:
        print(json.dumps({"command": "torch_peer", "world_size": args.ranks, "points": results},
                         indent=1))
        return
    print("| tokens/rank | rows/rank | K | N | E | GEMM us (TFLOP/s) | all-to-all us | "
          "sequential us (p10-p90) | max(GEMM, a2a) us | reduce us | with reduce us | check "
          "| routing |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- "
          "| --- |")
    for r in results:
        print("| %d | %d | %d | %d | %d | %.1f (%.0f) | %.1f | %.1f (%.1f-%.1f) | %.1f | %.1f | "
              "%.1f | %s | %s |" % (r["tokens_per_rank"], r["rows_per_rank"], r["ffn"],
                                    r["hidden"], r["experts"], r["gemm_us"], r["gemm_tflops"],
                                    r["a2a_us"], r["sequential_us"], r["seq_p10_us"],
                                    r["seq_p90_us"], max(r["gemm_us"], r["a2a_us"]),
                                    r["reduce_us"], r["total_us"],
                                    "pass" if r["check"] else "FAIL", r["routing"]))
    print("\nsequential = GEMM then all-to-all (permutation included), as in the hardware notes; "
          "'with reduce' adds the owner's weighted sum. Medians of %d samples, max over ranks."
          % args.iters)
    if not all(r["check"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
