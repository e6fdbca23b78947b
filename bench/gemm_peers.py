#!/usr/bin/env python3
"""The producer's grouped GEMM side by side with DeepGEMM and torch._grouped_mm, same inputs.

One process, one GPU. Per grid point (model, expert-parallel width EP, tokens per rank, router),
the per-expert row counts of the busiest rank come from the library's own routing generator
(tilewave.Routing.generate, the one `tilewave bench` uses), and each GEMM runs on the same
values:
  * GEMM1 (K = hidden, N = 2F, SwiGLU): ours fused (libtw_gemm_peer.so, the producer's
    tw__gemm1_swiglu_launch); DeepGEMM's m_grouped_bf16_gemm_nt_contiguous to (rows, 2F) alone
    and followed by the SwiGLU kernel (harness/swiglu.cu, vLLM's silu_and_mul); torch._grouped_mm
    followed by the same SwiGLU kernel.
  * GEMM2 (K = F, N = hidden): ours (tw__gemm_launch), DeepGEMM, torch._grouped_mm.
Ours and DeepGEMM read the very same tensors: activations in DeepGEMM's contiguous layout (each
expert's rows from a multiple of 128, padding rows zero and marked -1 in its layout), weights
(E, N, K). torch gets the same rows packed at 16-row group boundaries (its offsets' alignment)
and the same weight storage as a transposed (E, K, N) view. Ours computes only each expert's
rows (its tiles start at the expert's first row, the last band partial); DeepGEMM computes
whole 128-row blocks; torch its own tiles. TFLOP/s count the valid rows only.

Timing: CUDA events around each call; before every call an L2 flush (a 2 x L2 write, unless
--no-flush) and --delay-us of a nearly idle device (one spinning thread: the host enqueues the
call meanwhile, so host overhead does not count, as in `tilewave bench gemm --delay-us`); the
calls interleaved rep by rep with the first one rotated; medians. Outputs: every peer against a
per-expert torch.mm reference (cuBLAS, fp32 accumulation, bf16 out; for GEMM1 SwiGLU in fp32 on
it), elementwise within a few bf16 ulps, after poisoning the outputs with NaN, so that a wrong or
partial kernel shows in the "#wrong" column (and the exit status) instead of a fast time.

Roofline = max(FLOPs / the dense rate, bytes / the HBM rate): the dense rate is one 8192^3 bf16
torch.mm measured here with the same protocol (--dense-tflops to fix it), bytes are every local
expert's weights + the input rows + the output rows (GEMM1: the F-wide SwiGLU output), HBM
--hbm-gbps (4100). ours/roof = roofline time / our time (1 = at the limit). The columns
"tile rows/rows" (rows our tiles compute per valid row) and "waves" (our tiles / SMs) say where
a miss comes from: partial last bands, or few tiles per SM.

--ab adds the levers measured beside the default (same process, same inputs): the tile group
(TW_TILE_GROUP: bands walked column by column together, i.e. the raster that keeps a weight
panel in L2) at 16 and 32 against the default 8; GEMM2's 128-wide tiles against the planner's
256 (finer waves, and less of a partial last column tile where N is not a multiple of 256, as
gpt-oss's 2880); 64-row bands (64-row tiles) where the experts average at most 128 rows; for
GEMM1, "ours plain": GEMM2's kernel on the same rows and w13 (N = 2F, no activation; checked
through the SwiGLU kernel, timed without it), which tells GEMM1's main loop from its epilogue
against DeepGEMM's GEMM alone; and the SwiGLU instance's lab levers (TW_GEMM1_LEVER_*,
src/kernels/kernels.h): 3 stages, one TMA box for a stage's gate and up rows, silu through
tanh.approx, and all three.

Needs torch with a Hopper GPU, libtw_gemm_peer.so and libtilewave.so (the build directory,
--build), and DeepGEMM on PYTHONPATH (bench/gemm_peers.sh builds it; without it, or with
--no-deepgemm, the DeepGEMM columns print "-"). --self-test checks what runs without a GPU.

Examples:
  python3 bench/gemm_peers.py --build build --quick
  python3 bench/gemm_peers.py --build build --models deepseek-v3 --ep 8 --tokens 4096 --ab
  python3 bench/gemm_peers.py --build build --self-test
"""
import argparse
import ctypes
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (hidden, expert FFN F, routed experts, top-k): the published configs.
MODELS = {
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-235b": (4096, 1536, 128, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),
    "mixtral-8x22b": (6144, 16384, 8, 2),
}
EPS = (2, 4, 8)
TOKENS = (1024, 4096, 16384)
ROUTERS = ("balanced", "stress_skew")
# --quick: one point per model at EP 8, plus the largest and the most skewed DeepSeek points.
QUICK = [("deepseek-v3", 8, 4096, "balanced"), ("qwen3-235b", 8, 4096, "balanced"),
         ("gpt-oss-120b", 8, 4096, "balanced"), ("mixtral-8x22b", 8, 4096, "balanced"),
         ("deepseek-v3", 2, 16384, "balanced"), ("deepseek-v3", 8, 4096, "stress_skew")]
DG_ALIGN = 128   # deep_gemm.get_mk_alignment_for_contiguous_layout() on SM90 (checked at run time)
TORCH_ALIGN = 16  # torch._grouped_mm: group ends multiples of 16
PREWARM_GB = 90  # GPU memory the compiling processes may hold together (of the H200's 139 GiB)
BAR_ROOF, BAR_DG, BAR_DG_MANY, MANY_EXPERTS = 0.90, 1.00, 1.10, 16


def align(x, a):
    return (x + a - 1) // a * a


# ------------------------------------------------------------------------------------------------
# Row counts and layouts (host only)
# ------------------------------------------------------------------------------------------------

def busiest_rank_rows(model, ep, tokens, router, seed):
    """Per-expert rows of the rank that receives the most rows (the one that sets the layer's
    time), from the library's routing generator: returns (rank, [rows of its local experts])."""
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import tilewave  # noqa: E402  (ctypes binding; needs libtilewave.so)
    hidden, ffn, experts, top_k = MODELS[model]
    p = tilewave.Problem(world_size=ep, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k,
                         max_tokens=tokens)
    with tilewave.Routing.generate(p, router=router, tokens_per_rank=tokens, seed=seed) as r:
        loads = [int(x) for x in r.expert_loads()]
    e_local = experts // ep  # rank r owns global experts [r E_local, (r + 1) E_local)
    per_rank = [loads[i * e_local:(i + 1) * e_local] for i in range(ep)]
    rank = max(range(ep), key=lambda i: sum(per_rank[i]))
    return rank, per_rank[rank]


def layout(rows, alignment):
    """Expert-major rows, each expert starting at a multiple of `alignment`: (row0 per expert,
    total rows, group ends)."""
    row0, ends, r = [], [], 0
    for m in rows:
        row0.append(r)
        r += align(m, alignment)
        ends.append(r)
    return row0, r, ends


def roofline_us(flop, nbytes, dense_tflops, hbm_gbps):
    t_flop, t_mem = flop / (dense_tflops * 1e6), nbytes / (hbm_gbps * 1e3)
    return (t_flop, "flop") if t_flop >= t_mem else (t_mem, "mem")


def tile_rows(rows, tm):
    return sum(align(m, tm) for m in rows)


# ------------------------------------------------------------------------------------------------
# Ours through libtw_gemm_peer.so
# ------------------------------------------------------------------------------------------------

class Ours:
    """ctypes handle on libtw_gemm_peer.so (tools/gemm_peer_lib.cu)."""

    def __init__(self, path):
        self.lib = lib = ctypes.CDLL(path)
        i32, i64, vp = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        p32 = ctypes.POINTER(ctypes.c_int32)
        lib.twpeer_gemm2_create.argtypes = [vp, vp, vp, i64, i32, i32, i32, p32, p32, i32, i32,
                                            i32, i32, i32, ctypes.POINTER(vp)]
        lib.twpeer_gemm1_create.argtypes = [vp, vp, vp, i64, i32, i32, i32, p32, p32, i32, i32,
                                            i32, i32, ctypes.POINTER(vp)]
        lib.twpeer_launch.argtypes = [vp, vp]
        lib.twpeer_set_levers.argtypes = [vp, i32]
        lib.twpeer_info.argtypes = [vp, p32, p32, p32, p32]
        lib.twpeer_destroy.argtypes = [vp]
        lib.twpeer_destroy.restype = None
        lib.twpeer_delay.argtypes = [vp, i32]
        lib.twpeer_swiglu.argtypes = [vp, vp, i64, i32, vp]
        lib.twpeer_last_error.restype = ctypes.c_char_p

    def check(self, status, what):
        if status != 0:
            raise RuntimeError("%s: status %d: %s" % (what, status,
                                                      self.lib.twpeer_last_error().decode()))

    def create(self, kind, a, w, out, rows_total, k, n, row0, rows, tm=128, tn=0, variant=0,
               grid=0, tile_group=0):
        """A launch handle for GEMM2 (kind 2: n output columns) or GEMM1 + SwiGLU (kind 1: n =
        ffn); a, w, out are device pointers (ints)."""
        E = len(rows)
        r0 = (ctypes.c_int32 * E)(*row0)
        rs = (ctypes.c_int32 * E)(*rows)
        h = ctypes.c_void_p()
        if kind == 2:
            st = self.lib.twpeer_gemm2_create(a, w, out, rows_total, k, n, E, r0, rs, tm, tn,
                                              variant, grid, tile_group, ctypes.byref(h))
        else:
            st = self.lib.twpeer_gemm1_create(a, w, out, rows_total, k, n, E, r0, rs, tm,
                                              variant, grid, tile_group, ctypes.byref(h))
        self.check(st, "twpeer_gemm%d_create" % kind)
        return h

    def info(self, h):
        v = [ctypes.c_int32() for _ in range(4)]
        self.check(self.lib.twpeer_info(h, *[ctypes.byref(x) for x in v]), "twpeer_info")
        return [x.value for x in v]  # num_tiles, tm, tn, tile_group


# ------------------------------------------------------------------------------------------------
# Timing and checks (torch)
# ------------------------------------------------------------------------------------------------

class Timer:
    """Interleaved timing of several calls on torch's current stream (see the module doc)."""

    def __init__(self, ours, torch, delay_us, flush, warmup, reps):
        self.ours, self.torch = ours, torch
        self.delay_us, self.warmup, self.reps = delay_us, warmup, reps
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        self.flush_buf = torch.empty(2 * l2, dtype=torch.uint8, device="cuda") if flush else None

    def _pre(self):
        if self.flush_buf is not None:
            self.flush_buf.zero_()
        s = self.torch.cuda.current_stream().cuda_stream
        self.ours.check(self.ours.lib.twpeer_delay(ctypes.c_void_p(s), self.delay_us), "delay")

    def run(self, fns):
        """Median microseconds of each function of fns (each enqueues its call)."""
        torch, n = self.torch, len(fns)
        for _ in range(self.warmup):
            for f in fns:
                self._pre()
                f()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(n)]
        ms = [[] for _ in range(n)]
        for i in range(self.reps):
            for j in range(n):
                self._pre()
                ev[j][0].record()
                fns[(j + i) % n]()
                ev[j][1].record()
            ev[n - 1][1].synchronize()
            for j in range(n):
                ms[(j + i) % n].append(ev[j][0].elapsed_time(ev[j][1]))
        return [sorted(m)[len(m) // 2] * 1e3 for m in ms]


def count_wrong(torch, x, ref, rel, abs_tol):
    """Elements of x (valid rows) off the reference by more than rel x (|x| + |ref|) + abs_tol
    (NaN, i.e. an unwritten poisoned element, always counts)."""
    xf, rf = x.float(), ref.float()
    ok = (xf - rf).abs() <= (xf.abs() + rf.abs()) * rel + abs_tol
    return int((~ok).sum().item())


def dense_tflops(torch, timer):
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    (us,) = timer.run([lambda: torch.mm(a, b)])
    del a, b
    return 2 * 8192 ** 3 / us * 1e-6


# ------------------------------------------------------------------------------------------------
# One grid point
# ------------------------------------------------------------------------------------------------

def run_point(pt, args, env):
    """Both GEMMs of one grid point: a list of result dicts (one per GEMM)."""
    torch, ours, dg, timer = env["torch"], env["ours"], env["dg"], env["timer"]
    model, ep, tokens, router = pt["model"], pt["ep"], pt["tokens"], pt["router"]
    hidden, ffn, _, _ = MODELS[model]
    rows = pt["rows"]
    E, M = len(rows), sum(rows)
    dg_row0, dg_total, _ = layout(rows, DG_ALIGN)
    t_row0, t_total, t_ends = layout(rows, TORCH_ALIGN)
    dev = "cuda"
    # Where each valid row lives in the two layouts.
    idx_dg = torch.cat([torch.arange(r, r + m) for r, m in zip(dg_row0, rows)]).to(dev)
    idx_t = torch.cat([torch.arange(r, r + m) for r, m in zip(t_row0, rows)]).to(dev)
    m_indices = torch.full((dg_total,), -1, dtype=torch.int32, device=dev)
    for e, (r, m) in enumerate(zip(dg_row0, rows)):
        m_indices[r:r + m] = e
    offs = torch.tensor(t_ends, dtype=torch.int32, device=dev)
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    results = []
    for gemm in args.gemms:
        K, N = (hidden, 2 * ffn) if gemm == 1 else (ffn, hidden)
        n_out = ffn if gemm == 1 else hidden  # columns of the layer's output
        # Fresh values each GEMM: rows in [-1, 1), weights of std 2 / sqrt(K), so that outputs
        # are of order 1, where silu is neither linear nor zero.
        x = torch.rand(M, K, dtype=torch.bfloat16, device=dev).mul_(2).sub_(1)
        w = torch.randn(E, N, K, dtype=torch.bfloat16, device=dev).mul_(2.0 / math.sqrt(K))
        a_dg = torch.zeros(dg_total, K, dtype=torch.bfloat16, device=dev)
        a_dg[idx_dg] = x
        a_t = torch.zeros(t_total, K, dtype=torch.bfloat16, device=dev)
        a_t[idx_t] = x
        w_t = w.transpose(1, 2)  # (E, K, N) view of the same storage: torch's column-major B
        out_ours = torch.empty(dg_total, n_out, dtype=torch.bfloat16, device=dev)
        gu_dg = torch.empty(dg_total, N, dtype=torch.bfloat16, device=dev)
        h_dg = torch.empty(dg_total, ffn, dtype=torch.bfloat16, device=dev) if gemm == 1 else None
        h_t = torch.empty(t_total, ffn, dtype=torch.bfloat16, device=dev) if gemm == 1 else None
        t_out = {}

        def torch_gemm():
            t_out["gu"] = torch._grouped_mm(a_t, w_t, offs=offs)

        def torch_gemm_act():
            torch_gemm()
            ours.check(ours.lib.twpeer_swiglu(t_out["gu"].data_ptr(), h_t.data_ptr(), t_total, ffn,
                                              stream()), "swiglu")

        def dg_gemm():
            dg.m_grouped_bf16_gemm_nt_contiguous(a_dg, w, gu_dg, m_indices)

        def dg_gemm_act():
            dg_gemm()
            ours.check(ours.lib.twpeer_swiglu(gu_dg.data_ptr(), h_dg.data_ptr(), dg_total, ffn,
                                              stream()), "swiglu")

        def ours_fn(h):
            return lambda: ours.check(ours.lib.twpeer_launch(h, stream()), "twpeer_launch")

        def make_ours(**kw):
            return ours.create(gemm, a_dg.data_ptr(), w.data_ptr(), out_ours.data_ptr(),
                               dg_total, K, n_out if gemm == 1 else N, dg_row0, rows, **kw)

        handles = {"ours": make_ours()}
        if args.ab:
            for g in (16, 32):
                handles["ours g%d" % g] = make_ours(tile_group=g)
            if gemm == 2:  # the planner's 256 here (hidden >= 2048): 128 is the other width
                handles["ours tn128"] = make_ours(tn=128)
            if M <= 128 * E:  # short groups: a 128-row band would be half padding or more
                handles["ours tm64"] = make_ours(tm=64)
            if gemm == 1:  # the SwiGLU instance's lab levers (dev/gemm/NOTES.md v21)
                for name, lv in (("3 stages", 1), ("one box", 2), ("tanh", 4), ("all three", 7)):
                    h = make_ours()
                    ours.check(ours.lib.twpeer_set_levers(h, lv), "twpeer_set_levers")
                    handles["ours " + name] = h
        plain = gu_ours = h_ours = None
        if args.ab and gemm == 1:
            # GEMM1's main loop without SwiGLU: GEMM2's kernel on the same rows and w13 as one
            # (E, 2F, H) weight, (rows, 2F) out, checked through the activation as DeepGEMM's.
            gu_ours = torch.empty(dg_total, N, dtype=torch.bfloat16, device=dev)
            h_ours = torch.empty(dg_total, ffn, dtype=torch.bfloat16, device=dev)
            plain = ours.create(2, a_dg.data_ptr(), w.data_ptr(), gu_ours.data_ptr(), dg_total, K,
                                N, dg_row0, rows)
        n_tiles, tm, tn, group = ours.info(handles["ours"])
        # The reference: per-expert torch.mm (cuBLAS), bf16 out; GEMM1 SwiGLU on it in fp32.
        ref = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
        r = 0
        for e, m in enumerate(rows):
            if m:
                torch.mm(x[r:r + m], w[e].t(), out=ref[r:r + m])
            r += m
        if gemm == 1:
            rf = ref.float()
            ref = (torch.nn.functional.silu(rf[:, :ffn]) * rf[:, ffn:])
            del rf
        rel, abs_tol = (1.0 / 64, 1e-3) if gemm == 1 else (1.0 / 128, 1e-2)
        fns, wrong, errors = {}, {}, {}

        def checked(name, fn, out, rows_idx):
            """Runs fn once on a NaN-poisoned output and counts the wrong valid elements; fn is
            timed only if it ran."""
            try:
                if out is not None:
                    out.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                got = t_out["gu"] if out is None else out
                wrong[name] = count_wrong(torch, got[rows_idx], ref, rel, abs_tol)
                fns[name] = fn
            except Exception as ex:  # one peer failing must not stop the grid
                errors[name] = str(ex).splitlines()[0][:120]
                torch.cuda.synchronize()

        for name, h in handles.items():
            checked(name, ours_fn(h), out_ours, idx_dg)
        if plain is not None:
            def plain_act():
                ours_fn(plain)()
                ours.check(ours.lib.twpeer_swiglu(gu_ours.data_ptr(), h_ours.data_ptr(), dg_total,
                                                  ffn, stream()), "swiglu")
            checked("ours plain+act", plain_act, h_ours, idx_dg)
            if "ours plain+act" in fns:  # timed without the activation, like "deepgemm"
                fns["ours plain"] = ours_fn(plain)
                del fns["ours plain+act"]
        if dg is not None:
            if gemm == 1:
                # Its (rows, 2F) GEMM output is checked through the activation after it.
                checked("deepgemm+act", dg_gemm_act, h_dg, idx_dg)
                if "deepgemm+act" in fns:
                    fns["deepgemm"] = dg_gemm
            else:
                checked("deepgemm", dg_gemm, gu_dg, idx_dg)
        if gemm == 1:
            checked("torch+act", torch_gemm_act, h_t, idx_t)
        else:
            checked("torch", torch_gemm, None, idx_t)
        names = list(fns)
        us = dict(zip(names, timer.run([fns[k] for k in names]))) if names else {}
        for h in list(handles.values()) + ([plain] if plain is not None else []):
            ours.lib.twpeer_destroy(h)
        flop = 2.0 * M * N * K
        nbytes = 2.0 * (E * N * K + M * K + M * n_out)
        roof, bound = roofline_us(flop, nbytes, env["dense_tflops"], args.hbm_gbps)
        results.append(dict(pt, gemm=gemm, K=K, N=N, experts=E, valid_rows=M, dg_rows=dg_total,
                            torch_rows=t_total, us=us, wrong=wrong, errors=errors,
                            roofline_us=roof, bound=bound, flop=flop, bytes=nbytes,
                            tiles=n_tiles, tm=tm, tn=tn, tile_group=group,
                            tile_rows=tile_rows(rows, tm) / max(M, 1),
                            waves=n_tiles / env["sms"]))
        del x, w, a_dg, a_t, w_t, out_ours, gu_dg, h_dg, h_t, ref, t_out, gu_ours, h_ours
        torch.cuda.empty_cache()
    return results


# ------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------

def fmt_us(r, name):
    us = r["us"].get(name)
    if us is None:
        return "-" if name not in r["errors"] else "error"
    return "%.1f %.0f" % (us, r["flop"] / us * 1e-6)


def ratio(r, num, den):
    a, b = r["us"].get(num), r["us"].get(den)
    return (a / b) if a and b else None


def fmt_ratio(x, bar=None):
    if x is None:
        return "-"
    return "%.2f%s" % (x, "" if bar is None or x >= bar else " (miss)")


def main_table(results, gemm):
    rs = [r for r in results if r["gemm"] == gemm]
    if not rs:
        return
    dg_cols = "deepgemm us TF/s | deepgemm+act us TF/s |" if gemm == 1 else "deepgemm us TF/s |"
    t_name = "torch+act" if gemm == 1 else "torch"
    dg_name = "deepgemm+act" if gemm == 1 else "deepgemm"
    print("\n### GEMM%d%s\n" % (gemm, " + SwiGLU (K = hidden, N = 2F)" if gemm == 1
                                  else " (K = F, N = hidden)"))
    dg_ratios = "deepgemm/ours | deepgemm+act/ours |" if gemm == 1 else "deepgemm/ours |"
    print("| model | EP | E | tokens | router | rows (max/mean per expert) | ours us TF/s | %s "
          "%s us TF/s | roofline us, bound | ours/roof | %s %s/ours | tile rows/rows | "
          "waves | #wrong ours/dg/torch |" % (dg_cols, t_name, dg_ratios, t_name))
    print("|" + " --- |" * (18 if gemm == 1 else 16))
    for r in rs:
        mean = r["valid_rows"] / r["experts"]
        dg_cells = ("%s | %s |" % (fmt_us(r, "deepgemm"), fmt_us(r, "deepgemm+act"))
                    if gemm == 1 else "%s |" % fmt_us(r, "deepgemm"))
        roof_ratio = (r["roofline_us"] / r["us"]["ours"]) if r["us"].get("ours") else None
        bar_dg = BAR_DG_MANY if r["experts"] >= MANY_EXPERTS else BAR_DG
        dg_r = fmt_ratio(ratio(r, "deepgemm", "ours"), bar_dg)
        if gemm == 1:
            dg_r += " | " + fmt_ratio(ratio(r, "deepgemm+act", "ours"), bar_dg)
        w = r["wrong"]
        wrong = "/".join(str(w.get(k, "-")) for k in ("ours", dg_name, t_name))
        print("| %s | %d | %d | %d | %s | %d (%d/%.0f) | %s | %s %s | %.1f %s | %s | %s | %s | "
              "%.3f | %.2f | %s |" % (
                  r["model"], r["ep"], r["experts"], r["tokens"], r["router"], r["valid_rows"],
                  max(r["rows"]), mean, fmt_us(r, "ours"), dg_cells, fmt_us(r, t_name),
                  r["roofline_us"], r["bound"], fmt_ratio(roof_ratio, BAR_ROOF), dg_r,
                  fmt_ratio(ratio(r, t_name, "ours")), r["tile_rows"], r["waves"], wrong))
    for r in rs:
        for k, v in r["errors"].items():
            print("* %s EP %d %d %s: %s failed: %s" % (r["model"], r["ep"], r["tokens"],
                                                       r["router"], k, v))


def ab_table(results):
    rs = [r for r in results if any(k.startswith("ours ") for k in r["us"])]
    if not rs:
        return
    names = sorted({k for r in rs for k in r["us"] if k.startswith("ours ")})
    print("\n### Levers, side by side (time / ours' default; < 1 is faster)\n")
    print("| GEMM | model | EP | E | tokens | router | ours us (g%d, tn %s) | %s |" % (
        rs[0]["tile_group"], "/".join(sorted({str(r["tn"]) for r in rs})),
        " | ".join(names)))
    print("|" + " --- |" * (7 + len(names)))
    for r in rs:
        cells = [fmt_ratio(ratio(r, k, "ours")) for k in names]
        print("| %d | %s | %d | %d | %d | %s | %.1f | %s |" % (
            r["gemm"], r["model"], r["ep"], r["experts"], r["tokens"], r["router"],
            r["us"]["ours"], " | ".join(cells)))


def summary(results):
    print("\n### Against the bars\n")
    print("| GEMM | points | ours/roof >= %.2f | ours >= deepgemm | >= %.2fx deepgemm at E >= %d | "
          "worst ours/roof | worst deepgemm/ours | wrong |" % (BAR_ROOF, BAR_DG_MANY, MANY_EXPERTS))
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for gemm, dg_name in ((1, "deepgemm+act"), (1, "deepgemm"), (2, "deepgemm")):
        rs = [r for r in results if r["gemm"] == gemm and r["us"].get("ours")]
        if not rs:
            continue
        roof = [(r["roofline_us"] / r["us"]["ours"], r) for r in rs]
        dg = [(ratio(r, dg_name, "ours"), r) for r in rs if ratio(r, dg_name, "ours")]
        many = [(x, r) for x, r in dg if r["experts"] >= MANY_EXPERTS]
        wrong = sum(1 for r in rs if any(v for v in r["wrong"].values()))

        def worst(pairs):
            if not pairs:
                return "-"
            x, r = min(pairs, key=lambda p: p[0])
            return "%.2f (%s EP %d %d %s)" % (x, r["model"], r["ep"], r["tokens"], r["router"])

        print("| %d against %s | %d | %d | %s | %s | %s | %s | %d |" % (
            gemm, dg_name, len(rs), sum(1 for x, _ in roof if x >= BAR_ROOF),
            "%d of %d" % (sum(1 for x, _ in dg if x >= BAR_DG), len(dg)) if dg else "-",
            "%d of %d" % (sum(1 for x, _ in many if x >= BAR_DG_MANY), len(many)) if many else "-",
            worst(roof), worst(dg), wrong))


# ------------------------------------------------------------------------------------------------
# DeepGEMM's kernels compiled ahead, in parallel processes
# ------------------------------------------------------------------------------------------------

def _prewarm_group(specs):
    """Compiles (JIT) DeepGEMM's kernels for one (N, K, groups) at each of its row counts: its
    cache on disk is what the timed process then loads. One process a group, its row counts in
    turn, because row counts that pick the same configuration share a kernel (compiled once).
    The layouts are all padding, so the launches compute nothing."""
    import torch
    import deep_gemm
    for m, n, k, g in specs:
        a = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
        b = torch.empty(g, n, k, dtype=torch.bfloat16, device="cuda")
        d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        idx = torch.full((m,), -1, dtype=torch.int32, device="cuda")
        deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, b, d, idx)
        torch.cuda.synchronize()
        del a, b, d, idx
    return len(specs)


def prewarm(points, gemms, jobs):
    """Compiles DeepGEMM's kernels for every point ahead, in `jobs` processes: (seconds, shapes)."""
    groups = {}
    for pt in points:
        hidden, ffn, _, _ = MODELS[pt["model"]]
        _, total, _ = layout(pt["rows"], DG_ALIGN)
        for g in gemms:
            n, k = (2 * ffn, hidden) if g == 1 else (hidden, ffn)
            groups.setdefault((n, k, len(pt["rows"])), set()).add((total, n, k, len(pt["rows"])))
    tasks = sorted((sorted(v) for v in groups.values()), key=len, reverse=True)
    shapes = sum(len(t) for t in tasks)
    # The processes' operands share the GPU: as many as fit in PREWARM_GB if the largest tasks
    # ran at once (an input, all weights and an output per task, bf16).
    foot = sorted((max(2 * (m * k + g * n * k + m * n) for m, n, k, g in t) for t in tasks),
                  reverse=True)
    while jobs > 1 and sum(foot[:jobs]) > PREWARM_GB * 2 ** 30:
        jobs -= 1
    if jobs <= 1 or not tasks:
        return 0, shapes
    import multiprocessing as mp
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(jobs, len(tasks))) as pool:
        list(pool.imap_unordered(_prewarm_group, tasks))
    return time.time() - t0, shapes


# ------------------------------------------------------------------------------------------------
# Without a GPU
# ------------------------------------------------------------------------------------------------

def self_test(args):
    """The host arithmetic, the row counts from the library, and libtw_gemm_peer.so's argument
    checks (made before any CUDA call): what CI can run."""
    fails = 0
    os.environ.setdefault("TW_DEBUG", "NONE")  # the refusals below are expected: no WARN lines

    def expect(cond, what):
        nonlocal fails
        if not cond:
            fails += 1
            print("FAIL: %s" % what)

    row0, total, ends = layout([5, 0, 130, 128], DG_ALIGN)
    expect(row0 == [0, 128, 128, 384] and total == 512 and ends == [128, 128, 384, 512],
           "layout at 128: %s %s %s" % (row0, total, ends))
    row0, total, ends = layout([5, 0, 17], TORCH_ALIGN)
    expect(row0 == [0, 16, 16] and total == 48 and ends == [16, 16, 48], "layout at 16")
    expect(tile_rows([5, 0, 130], 128) == 384, "tile rows")
    t, b = roofline_us(2 * 8192 ** 3, 1e9, 800.0, 4000.0)
    expect(b == "flop" and abs(t - 2 * 8192 ** 3 / 800e6) < 1e-6, "roofline, flop bound")
    t, b = roofline_us(1e9, 4e9, 800.0, 4000.0)
    expect(b == "mem" and abs(t - 1000.0) < 1e-9, "roofline, memory bound")
    # Row counts: every routed slot of every rank lands on some rank's expert.
    for model in MODELS:
        hidden, ffn, experts, top_k = MODELS[model]
        for router in ROUTERS:
            rank, rows = busiest_rank_rows(model, 4 if experts >= 4 else 1, 1024, router, 1)
            expect(len(rows) == experts // 4 and sum(rows) > 0 and min(rows) >= 0,
                   "%s %s: rows %s" % (model, router, rows[:4]))
            expect(sum(rows) <= 4 * 1024 * top_k, "%s %s: %d rows" % (model, router, sum(rows)))
    _, bal = busiest_rank_rows("deepseek-v3", 8, 4096, "balanced", 1)
    _, skew = busiest_rank_rows("deepseek-v3", 8, 4096, "stress_skew", 1)
    expect(sum(skew) > sum(bal), "stress_skew's busiest rank gets more rows than balanced's")
    # The library refuses bad arguments, naming them, before touching a device.
    ours = Ours(args.lib)
    fake = 1 << 20  # never dereferenced: the checks fail first
    for kind, kw, want in [(2, dict(k=100, n=256), "multiple of 64"),
                           (2, dict(k=128, n=256, tm=96), "tm 96"),
                           (2, dict(k=128, n=256, tn=64), "tn 64"),
                           (2, dict(k=128, n=256, tile_group=65), "tile_group 65"),
                           (1, dict(k=128, n=100), "multiple of 8"),
                           (2, dict(k=128, n=256, rows=[4, 300]), "not inside"),
                           (2, dict(k=128, n=256, row0=[0, 2]), "inside expert 0")]:
        rows = kw.pop("rows", [4, 4])
        row0 = kw.pop("row0", [0, 8])
        try:
            ours.create(kind, fake, fake, fake, 64, row0=row0, rows=rows, **kw)
            expect(False, "kind %d %s accepted" % (kind, kw))
        except RuntimeError as e:
            expect(want in str(e), "kind %d %s: %s" % (kind, kw, e))
    print("gemm_peers self-test: %s" % ("passed" if fails == 0 else "%d failed" % fails))
    return 1 if fails else 0


# ------------------------------------------------------------------------------------------------

def grid_points(args):
    if args.quick:
        pts = [p for p in QUICK if p[0] in args.models]
    else:
        pts = [(m, ep, t, r) for m in args.models for ep in args.ep for t in args.tokens
               for r in args.routers if MODELS[m][2] % ep == 0]
    out = []
    for m, ep, t, r in pts:
        rank, rows = busiest_rank_rows(m, ep, t, r, args.seed)
        out.append(dict(model=m, ep=ep, tokens=t, router=r, rank=rank, rows=rows))
    return out


def csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"),
                    help="build directory holding libtw_gemm_peer.so and libtilewave.so")
    ap.add_argument("--lib", help="libtw_gemm_peer.so (default: BUILD/libtw_gemm_peer.so)")
    ap.add_argument("--models", type=csv(str), default=list(MODELS))
    ap.add_argument("--ep", type=csv(int), default=list(EPS))
    ap.add_argument("--tokens", type=csv(int), default=list(TOKENS))
    ap.add_argument("--routers", type=csv(str), default=list(ROUTERS))
    ap.add_argument("--gemms", type=csv(int), default=[1, 2], help="1, 2 or 1,2")
    ap.add_argument("--quick", action="store_true", help="six points (QUICK) instead of the grid")
    ap.add_argument("--ab", action="store_true", help="the levers beside ours' default")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--delay-us", type=int, default=300)
    ap.add_argument("--no-flush", action="store_true", help="no L2 flush before each call")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dense-tflops", type=float, default=0.0,
                    help="the roofline's dense rate (default: measured here)")
    ap.add_argument("--hbm-gbps", type=float, default=4100.0)
    ap.add_argument("--no-deepgemm", action="store_true")
    ap.add_argument("--prewarm-jobs", type=int,
                    default=min(16, max(1, (os.cpu_count() or 2) - 2)),
                    help="processes compiling DeepGEMM's kernels ahead (1: compile in line)")
    ap.add_argument("--json", help="write every measurement to this file")
    ap.add_argument("--tables", metavar="JSON", help="print the tables of a --json file, no GPU")
    ap.add_argument("--self-test", action="store_true", help="host checks only, no GPU")
    args = ap.parse_args()
    args.lib = args.lib or os.path.join(args.build, "libtw_gemm_peer.so")
    if "TILEWAVE_LIBRARY" not in os.environ:
        os.environ["TILEWAVE_LIBRARY"] = os.path.join(args.build, "libtilewave.so")
    bad = [m for m in args.models if m not in MODELS] + \
          [r for r in args.routers if r not in ROUTERS] + [g for g in args.gemms if g not in (1, 2)]
    if bad:
        ap.error("unknown %s; models %s, routers %s, gemms 1, 2" % (bad, list(MODELS),
                                                                    list(ROUTERS)))
    if args.self_test:
        return self_test(args)
    if args.tables:
        with open(args.tables) as f:
            d = json.load(f)
        print("# gemm_peers on %s, torch %s; median of %d reps, %s%d us idle before each call; "
              "roofline at %.0f TFLOP/s and %.0f GB/s" % (
                  d["device"], d["torch"], d["reps"], "L2 flushed, " if d["flush"] else "",
                  d["delay_us"], d["dense_tflops"], d["hbm_gbps"]))
        render(d["results"])
        return 0

    import torch  # after the argument checks: --help and --self-test need no torch
    if not torch.cuda.is_available():
        print("gemm_peers: no CUDA device (use --self-test on a machine without one)")
        return 77
    ours = Ours(args.lib)
    dg = None
    if not args.no_deepgemm:
        try:
            import deep_gemm as dg
            if dg.get_mk_alignment_for_contiguous_layout() != DG_ALIGN:
                raise RuntimeError("DeepGEMM's contiguous alignment is %d, this script lays out "
                                   "%d" % (dg.get_mk_alignment_for_contiguous_layout(), DG_ALIGN))
        except Exception as ex:  # no DeepGEMM: the other columns still run
            print("gemm_peers: DeepGEMM not used: %s" % ex)
            dg = None
    t0 = time.time()
    points = grid_points(args)
    warm_s, nspecs = prewarm(points, args.gemms, args.prewarm_jobs) if dg else (0, 0)
    prop = torch.cuda.get_device_properties(0)
    timer = Timer(ours, torch, args.delay_us, not args.no_flush, args.warmup, args.reps)
    env = dict(torch=torch, ours=ours, dg=dg, timer=timer, sms=prop.multi_processor_count)
    env["dense_tflops"] = args.dense_tflops or dense_tflops(torch, timer)
    print("# gemm_peers on %s (%d SMs), torch %s, DeepGEMM %s; median of %d reps, %s%d us idle "
          "before each call; roofline at %.0f TFLOP/s%s and %.0f GB/s; %d points, routing seed %d, "
          "the busiest rank's rows; DeepGEMM's kernels of %d shapes compiled ahead in %.0f s" % (
              prop.name, prop.multi_processor_count, torch.__version__,
              getattr(dg, "__version__", "yes") if dg else "not used", args.reps,
              "" if args.no_flush else "L2 flushed, ", args.delay_us, env["dense_tflops"],
              "" if args.dense_tflops else " (measured)", args.hbm_gbps, len(points), args.seed,
              nspecs, warm_s))
    results = []
    for i, pt in enumerate(points):
        try:
            results += run_point(pt, args, env)
        except Exception as ex:  # e.g. out of memory at one point: say so, go on
            print("* %s EP %d %d %s: point failed: %s" % (pt["model"], pt["ep"], pt["tokens"],
                                                          pt["router"], ex))
            torch.cuda.empty_cache()
        print("point %d of %d done at %.0f s" % (i + 1, len(points), time.time() - t0),
              file=sys.stderr)
        if args.json:  # after every point: a run cut short keeps what it measured (--tables)
            with open(args.json, "w") as f:
                json.dump(dict(device=prop.name, torch=torch.__version__,
                               dense_tflops=env["dense_tflops"], hbm_gbps=args.hbm_gbps,
                               reps=args.reps, delay_us=args.delay_us, flush=not args.no_flush,
                               seed=args.seed, results=results), f)
    render(results)
    print("\n%d results in %.0f s" % (len(results), time.time() - t0))
    return 1 if any(any(v for v in r["wrong"].values()) for r in results) else 0


def render(results):
    for g in (1, 2):
        main_table(results, g)
    ab_table(results)
    summary(results)


if __name__ == "__main__":
    sys.exit(main())
