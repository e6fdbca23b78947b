"""Tests of tilewave.torch (plain unittest, no pytest).

  test_torch.py --checks   the host-side argument checks, on CPU and meta tensors: every wrong
                           dtype, shape, count, layout and device raises the documented
                           exception before any C call (the library's runtime functions are
                           replaced by a stub that fails the test if one is reached). Needs torch,
                           no GPU.
  test_torch.py --gpu      moe_layer, MoELayer, dispatch + combine on an in-process team of one
                           rank against a plain PyTorch reference layer (per-expert matmuls,
                           SwiGLU, weighted sum) within bf16 tolerance, and the library's own
                           refusals surfacing as TilewaveError. Needs torch and a Hopper GPU.

Without torch (or, for --gpu, without a usable GPU) the test prints why and exits with 77, which
ctest counts as skipped. Otherwise it prints "N passed, N failed" and exits non-zero on failure.
TW_TEST_SEED repeats a run.
"""

import ctypes
import os
import random
import subprocess
import sys
import unittest

from hopper import missing_hopper

SKIP = 77
MODE = "--gpu" if "--gpu" in sys.argv[1:] else "--checks"

try:
    import torch
except ImportError as e:
    print("skipped: torch is not importable (%s); tilewave.torch needs it (pip install torch)" % e)
    sys.exit(SKIP)

import tilewave as tw
import tilewave.torch as twt

SEED = int(os.environ.get("TW_TEST_SEED", random.SystemRandom().randrange(1 << 30)))


class _NoC:
    """Stands in for libtilewave's runtime half: any function looked up on it fails the test."""

    def __init__(self):
        self.reached = []

    def __getattr__(self, name):
        self.reached.append(name)
        raise AssertionError("%s reached C before the checks refused the call" % name)


def _problem(**kw):
    args = dict(world_size=1, hidden=256, ffn=128, experts=8, top_k=2, max_tokens=64)
    args.update(kw)
    return tw.Problem(**args)


class TestChecks(unittest.TestCase):
    """Every refusal before C: the context is one with no C context behind it, the runtime is a
    stub, the tensors are on the CPU (or meta) so that only the device check can fail for a set
    whose dtypes and shapes are right."""

    def setUp(self):
        self.stub = _NoC()
        self.saved = twt._runtime, twt._load
        twt._runtime = self.stub
        twt._load = lambda: self.stub
        self.p = _problem()
        self.ctx = twt.Context._for_checks(self.p)
        g = torch.Generator().manual_seed(SEED)
        T, H, F, E, k = 10, 256, 128, 8, 2
        self.T = T
        self.x = torch.randn(T, H, generator=g).bfloat16()
        self.ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()
        self.w = torch.rand(T, k, generator=g)
        self.w13 = torch.randn(E, 2 * F, H, generator=g).bfloat16()
        self.w2 = torch.randn(E, H, F, generator=g).bfloat16()

    def tearDown(self):
        twt._runtime, twt._load = self.saved
        self.assertEqual(self.stub.reached, [])

    def args(self, **kw):
        a = dict(x=self.x, topk_ids=self.ids, topk_weights=self.w, w13=self.w13, w2=self.w2)
        a.update(kw)
        return a

    def refuse(self, exc, pattern, status=None, fn=None, **kw):
        fn = fn or (lambda **a: twt.moe_layer(context=self.ctx, **a))
        with self.assertRaises(exc) as cm:
            fn(**self.args(**kw))
        e = cm.exception
        self.assertIsInstance(e, tw.TilewaveError)
        self.assertIsNone(e.code)  # the binding refused it; C never saw it
        self.assertRegex(str(e), pattern)
        if status:
            self.assertEqual(e.status, status)
        return e

    def test_right_types_and_shapes_on_cpu_stop_at_the_device(self):
        e = self.refuse(ValueError, r"x: on cpu; the context runs on cuda:0")
        self.assertIsInstance(e, twt.TensorError)

    def test_meta_tensors(self):
        meta = {k: v.to("meta") for k, v in self.args().items()}
        self.refuse(ValueError, r"x: on meta", **meta)

    def test_dtypes(self):
        cases = [
            (dict(x=self.x.float()), r"x: dtype torch.float32; tilewave takes torch.bfloat16"),
            (dict(x=self.x.half()), r"x: dtype torch.float16"),
            (dict(topk_ids=self.ids.short()), r"topk_ids: dtype torch.int16; .*int32 or .*int64"),
            (dict(topk_ids=self.ids.float()), r"topk_ids: dtype torch.float32"),
            (dict(topk_weights=self.w.bfloat16()),
             r"topk_weights: dtype torch.bfloat16; .*float32"),
            (dict(topk_weights=self.w.double()), r"topk_weights: dtype torch.float64"),
            (dict(w13=self.w13.float()), r"w13: dtype torch.float32"),
            (dict(w2=self.w2.half()), r"w2: dtype torch.float16"),
        ]
        for kw, pattern in cases:
            with self.subTest(pattern):
                e = self.refuse(TypeError, pattern, "TW_ERR_UNSUPPORTED", **kw)
                self.assertIsInstance(e, twt.TensorTypeError)

    def test_int64_ids_pass_the_dtype_check(self):
        self.refuse(ValueError, r"x: on cpu", topk_ids=self.ids.long())

    def test_not_a_tensor(self):
        self.refuse(TypeError, r"x: expected a torch.Tensor, got list", x=self.x.tolist())
        self.refuse(TypeError, r"w2: expected a torch.Tensor, got NoneType", w2=None)

    def test_shapes(self):
        T, H, F, E, k = self.T, 256, 128, 8, 2
        bf = torch.bfloat16
        cases = [
            (dict(x=self.x.reshape(-1)), r"x: shape \(2560,\), expected \(any, 256\)"),
            (dict(x=torch.zeros(T, H + 8, dtype=bf)), r"x: shape \(10, 264\)"),
            (dict(topk_ids=self.ids[:, :1]), r"topk_ids: shape \(10, 1\), expected \(10, 2\)"),
            (dict(topk_ids=self.ids[:-1]), r"topk_ids: shape \(9, 2\), expected \(10, 2\)"),
            (dict(topk_weights=self.w[:, :1]),
             r"topk_weights: shape \(10, 1\), expected \(10, 2\)"),
            (dict(topk_weights=self.w.reshape(-1)), r"topk_weights: shape \(20,\)"),
            (dict(w13=torch.zeros(E + 1, 2 * F, H, dtype=bf)),
             r"w13: shape \(9, 256, 256\), expected \(8, 256, 256\)"),
            (dict(w13=torch.zeros(E, F, H, dtype=bf)), r"w13: shape \(8, 128, 256\)"),
            (dict(w2=torch.zeros(E, F, H, dtype=bf)),
             r"w2: shape \(8, 128, 256\), expected \(8, 256, 128\)"),
            (dict(w2=self.w2[0]), r"w2: shape \(256, 128\)"),
        ]
        for kw, pattern in cases:
            with self.subTest(pattern):
                self.refuse(ValueError, pattern, "TW_ERR_INVALID_SIZE", **kw)

    def test_out_shape(self):
        bad = torch.empty(self.T + 1, 256, dtype=torch.bfloat16)
        self.refuse(ValueError, r"out: shape \(11, 256\), expected \(10, 256\)",
                    fn=lambda **a: twt.moe_layer(context=self.ctx, out=bad, **a))

    def test_token_capacity(self):
        T = self.p.max_tokens + 1
        big = dict(x=torch.zeros(T, 256, dtype=torch.bfloat16),
                   topk_ids=torch.zeros(T, 2, dtype=torch.int32), topk_weights=torch.zeros(T, 2))
        self.refuse(ValueError, r"x: 65 tokens, more than the context's max_tokens 64",
                    "TW_ERR_CAPACITY", **big)

    def test_contiguity(self):
        xt = torch.zeros(256, self.T, dtype=torch.bfloat16).t()  # (T, H), strides (1, T)
        self.refuse(ValueError, r"x: not contiguous \(strides \(1, 10\)\); pass x.contiguous\(\)",
                    x=xt)
        w13t = self.w13.transpose(1, 2).contiguous().transpose(1, 2)
        self.refuse(ValueError, r"w13: not contiguous", x=self.x, w13=w13t)

    def test_options(self):
        self.refuse(tw.TilewaveError, r"mode 'fused': give one of overlap, unfused",
                    fn=lambda **a: twt.moe_layer(context=self.ctx, mode="fused", **a))
        self.refuse(tw.TilewaveError, r"comm_ctas = 4294967296 does not fit 32 bits",
                    fn=lambda **a: twt.moe_layer(context=self.ctx, comm_ctas=1 << 32, **a))

    def test_context_argument(self):
        self.refuse(tw.TilewaveError, r"context must be a tilewave.torch.Context, got int",
                    fn=lambda **a: twt.moe_layer(context=3, **a))
        closed = twt.Context._for_checks(self.p)
        closed._h = None
        self.refuse(tw.TilewaveError, r"the context is closed", "TW_ERR_STATE",
                    fn=lambda **a: twt.moe_layer(context=closed, **a))
        no_layer = twt.Context._for_checks(self.p, layer=False)
        self.refuse(tw.TilewaveError, r"layer=False", "TW_ERR_STATE",
                    fn=lambda **a: twt.moe_layer(context=no_layer, **a))

    def test_world_two_local_experts(self):
        # E_total 8 over 2 ranks: each rank's weights hold 4 experts.
        ctx = twt.Context._for_checks(_problem(world_size=2))
        self.refuse(ValueError, r"w13: shape \(8, 256, 256\), expected \(4, 256, 256\)",
                    fn=lambda **a: twt.moe_layer(context=ctx, **a))
        self.refuse(ValueError, r"x: on cpu", fn=lambda **a: twt.moe_layer(context=ctx, **a),
                    w13=self.w13[:4].contiguous(), w2=self.w2[:4].contiguous())

    def test_dispatch_checks(self):
        def run(**a):
            return twt.dispatch(a["x"], a["topk_ids"], a["topk_weights"], context=self.ctx)
        self.refuse(TypeError, r"x: dtype torch.float32", fn=run, x=self.x.float())
        self.refuse(ValueError, r"topk_ids: shape \(10, 3\)", fn=run,
                    topk_ids=torch.zeros(10, 3, dtype=torch.int32))
        self.refuse(ValueError, r"x: on cpu", fn=run)

    def test_combine_checks(self):
        def run(**a):
            return twt.combine(a["x"], a["w2"], context=self.ctx)
        self.refuse(tw.TilewaveError, r"no dispatch\(\) on this context", "TW_ERR_STATE", fn=run)
        self.ctx._tokens, self.ctx._rows = 10, 24  # as after a dispatch of 10 tokens, 24 rows
        self.refuse(ValueError, r"expert_out: shape \(10, 256\), expected \(24, 128\)", fn=run)
        self.refuse(ValueError, r"expert_out: on cpu", fn=run,
                    x=torch.zeros(24, 128, dtype=torch.bfloat16))
        self.refuse(ValueError, r"w2: shape \(8, 128, 256\)", fn=run,
                    x=torch.zeros(24, 128, dtype=torch.bfloat16),
                    w2=torch.zeros(8, 128, 256, dtype=torch.bfloat16))

    def test_module(self):
        layer = twt.MoELayer(self.w13, self.w2, context=self.ctx)
        self.assertFalse(layer.w13.requires_grad)
        self.assertIn("hidden=256, ffn=128, experts=8 (8 local), top_k=2", repr(layer))
        with self.assertRaisesRegex(ValueError, r"x: on cpu"):
            layer(self.x, self.ids, self.w)
        with self.assertRaisesRegex(ValueError, r"w13: 255 rows per expert"):
            twt.MoELayer(torch.zeros(8, 255, 256, dtype=torch.bfloat16), self.w2, context=self.ctx)
        with self.assertRaisesRegex(ValueError, r"w2: shape \(8, 128, 256\)"):
            twt.MoELayer(self.w13, self.w2.transpose(1, 2), context=self.ctx)
        with self.assertRaisesRegex(ValueError, r"the context is for 8 local experts, ffn 128"):
            twt.MoELayer(self.w13[:, :128].contiguous(), self.w2[:, :, :64].contiguous(),
                         context=self.ctx)
        with self.assertRaisesRegex(tw.TilewaveError, r"give top_k and max_tokens"):
            twt.MoELayer(self.w13, self.w2)


class _FakeC:
    """libtilewave's runtime functions as ctypes callbacks of the same prototypes
    (tilewave._runtime.SIGNATURES): a call goes through ctypes' argument conversion as it would
    into C, and lands here with what C would receive. `answers` fills out-parameters."""

    def __init__(self, answers):
        from tilewave import _runtime as rt
        self.calls, self._keep = {}, []
        for name, args in rt.SIGNATURES.items():
            def cb(*a, _name=name):
                # Structs the caller passed by pointer live only during the call: keep copies.
                self.calls[_name] = tuple(
                    type(v.contents).from_buffer_copy(v.contents)
                    if isinstance(v, ctypes._Pointer) and v and
                    isinstance(v.contents, ctypes.Structure) else v for v in a)
                answers.get(_name, lambda *_: None)(*a)
                return 0
            fn = ctypes.CFUNCTYPE(ctypes.c_int, *args)(cb)
            self._keep.append(fn)
            setattr(self, name, fn)
        rt.declare(self)


class TestMarshalling(unittest.TestCase):
    """What reaches C once every check has passed: moe_layer, dispatch and combine with the
    runtime replaced by _FakeC, the device-only steps (CUDA device, stream, output allocation,
    the device check) replaced by CPU ones. Every pointer, count, index type, option and the
    stream handle as C receives them."""

    STREAM = 0x5EED0

    def setUp(self):
        import ctypes as c
        from unittest import mock
        self.rows_mem = (c.c_int16 * (24 * 128))()
        self.base_mem = (c.c_int16 * 8)()
        answers = {
            "tw_moe_dispatch_ex": lambda *a: a[7].__setitem__(0, c.addressof(self.rows_mem)),
            "tw_device_plan_summary_get": lambda d, s: setattr(s.contents, "rows", 24),
            "tw_context_dispatch_buffer": lambda ctx, rows, n: rows.__setitem__(
                0, c.addressof(self.base_mem)),
        }
        self.fake = _FakeC(answers)
        self.p = _problem(hidden=128, ffn=128)  # hidden == ffn: dispatch's rows feed combine
        self.ctx = twt.Context._for_checks(self.p)
        self.ctx._h, self.ctx._dplan = c.c_void_p(0xC0), c.c_void_p(0xD0)
        H, T = 128, 10

        def out(ctx, given, n):
            return given if given is not None else torch.empty(n, H, dtype=torch.bfloat16)
        self.patches = [mock.patch.object(twt, "_runtime", self.fake),
                        mock.patch.object(twt, "_layout", lambda ctx, *t: None),
                        mock.patch.object(twt, "_stream", lambda ctx: self.STREAM),
                        mock.patch.object(twt, "_out", out),
                        mock.patch.object(twt, "_KDL_CUDA", twt._KDL_CPU),
                        mock.patch.object(torch.cuda, "device", lambda d: _Nothing())]
        for m in self.patches:
            m.start()
        g = torch.Generator().manual_seed(SEED)
        self.x = torch.randn(T, H, generator=g).bfloat16()
        self.ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(T)])
        self.w = torch.rand(T, 2, generator=g)
        self.w13 = torch.randn(8, 256, H, generator=g).bfloat16()
        self.w2 = torch.randn(8, H, 128, generator=g).bfloat16()

    def tearDown(self):
        for m in self.patches:
            m.stop()
        self.ctx._h = self.ctx._dplan = None  # its fake handles must never reach the library

    def test_layer(self):
        out = twt.moe_layer(self.x, self.ids, self.w, self.w13, self.w2, context=self.ctx,
                            mode="unfused", comm_ctas=7, sm_budget=66)
        a = self.fake.calls["tw_moe_layer_ex"]
        self.assertEqual(a[:4], (0xC0, 0xD0, self.x.data_ptr(), self.ids.data_ptr()))
        self.assertEqual(a[4], 1)  # TW_INDEX_INT64
        self.assertEqual(a[5:10], (self.w.data_ptr(), 10, self.w13.data_ptr(),
                                   self.w2.data_ptr(), out.data_ptr()))
        o = a[10]
        self.assertEqual((o.size, o.magic, o.version, bool(o.plan_config), o.mode, o.comm_ctas,
                          o.sm_budget), (40, 0x74774C79, 1, False, 1, 7, 66))
        self.assertEqual(a[11], self.STREAM)
        self.assertEqual((tuple(out.shape), out.dtype), ((10, 128), torch.bfloat16))
        # int32 ids, the caller's out, no tokens (out and x may be NULL then).
        given = torch.empty(10, 128, dtype=torch.bfloat16)
        self.assertIs(twt.moe_layer(self.x, self.ids.int(), self.w, self.w13, self.w2,
                                    context=self.ctx, out=given), given)
        a = self.fake.calls["tw_moe_layer_ex"]
        self.assertEqual((a[4], a[9], a[10].mode), (0, given.data_ptr(), 0))
        none = twt.moe_layer(self.x[:0], self.ids[:0], self.w[:0], self.w13, self.w2,
                             context=self.ctx)
        a = self.fake.calls["tw_moe_layer_ex"]
        self.assertEqual((a[6], a[9], tuple(none.shape)), (0, None, (0, 128)))

    def test_dispatch_then_combine(self):
        rows = twt.dispatch(self.x, self.ids, self.w, context=self.ctx, sm_budget=40)
        a = self.fake.calls["tw_moe_dispatch_ex"]
        self.assertEqual(a[:7], (0xC0, 0xD0, self.x.data_ptr(), self.ids.data_ptr(), 1,
                                 self.w.data_ptr(), 10))
        o = a[8]
        self.assertEqual((o.size, o.magic, bool(o.plan_config), o.sm_budget),
                         (32, 0x74774470, False, 40))
        self.assertEqual(a[9], self.STREAM)
        self.assertEqual((tuple(rows.shape), rows.dtype, rows.data_ptr()),
                         ((24, 128), torch.bfloat16, ctypes.addressof(self.rows_mem)))
        out = twt.combine(rows, self.w2, context=self.ctx, comm_ctas=3)
        a = self.fake.calls["tw_moe_combine_ex"]
        self.assertEqual(a[:5], (0xC0, 0xD0, rows.data_ptr(), self.w2.data_ptr(),
                                 out.data_ptr()))
        o = a[5]
        self.assertEqual((o.size, o.magic, o.mode, o.comm_ctas, o.sm_budget),
                         (32, 0x7477436F, 0, 3, 0))
        self.assertEqual((a[6], tuple(out.shape)), (self.STREAM, (10, 128)))
        # A layer call in between: combine() has no dispatch to follow.
        twt.moe_layer(self.x, self.ids, self.w, self.w13, self.w2, context=self.ctx)
        with self.assertRaisesRegex(tw.TilewaveError, r"no dispatch\(\)"):
            twt.combine(rows, self.w2, context=self.ctx)

    def test_combine_with_no_rows_passes_the_buffer(self):
        # A rank whose experts got no rows still joins, with a valid (non-NULL) pointer.
        self.ctx._tokens, self.ctx._rows, self.ctx._rows_base = 10, 0, 0xB0
        twt.combine(torch.empty(0, 128, dtype=torch.bfloat16), self.w2, context=self.ctx)
        self.assertEqual(self.fake.calls["tw_moe_combine_ex"][2], 0xB0)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class TestWithoutGpu(unittest.TestCase):
    """What needs torch but no GPU: refusals before C, and the NCCL this process has loaded."""

    @unittest.skipIf(torch.cuda.is_available(), "a GPU is present")
    def test_context_needs_a_gpu(self):
        with self.assertRaisesRegex(tw.TilewaveError, r"TW_ERR_NO_DEVICE: Context: "
                                    r"torch.cuda.is_available\(\) is False"):
            twt.Context(hidden=256, ffn=128, experts=8, top_k=2, max_tokens=64)
        with self.assertRaisesRegex(tw.TilewaveError, r"TW_ERR_NO_DEVICE"):
            twt.Team(1)

    def test_nccl_is_the_loaded_one(self):
        path = twt.nccl_library_path()
        self.assertTrue(os.path.basename(path).startswith("libnccl.so"), path)
        self.assertTrue(os.path.exists(path), path)
        maps = open("/proc/self/maps").read()
        self.assertEqual(maps.count("libnccl.so"), maps.count(path))  # one copy mapped
        self.assertGreaterEqual(twt.nccl_version(), 22800)

    def test_tensor_over_foreign_memory(self):
        # dispatch() returns its rows through this DLPack wrapper; on the CPU here: the tensor
        # reads the memory in place, and torch's deleter releases the wrapper's structs.
        import ctypes
        import gc
        vals = torch.randn(6, 40, generator=torch.Generator().manual_seed(SEED)).bfloat16()
        raw = (ctypes.c_int16 * vals.numel())(*vals.view(torch.int16).reshape(-1).tolist())
        before = len(twt._dl_alive)
        t = twt._wrap_bf16(ctypes.addressof(raw), (6, 40), twt._KDL_CPU, 0)
        self.assertEqual((t.dtype, tuple(t.shape), t.data_ptr()),
                         (torch.bfloat16, (6, 40), ctypes.addressof(raw)))
        self.assertTrue(torch.equal(t, vals))
        raw[0] = vals[1, 1].view(torch.int16).item()
        self.assertEqual(t[0, 0].item(), vals[1, 1].item())  # a view, not a copy
        empty = twt._wrap_bf16(ctypes.addressof(raw), (0, 40), twt._KDL_CPU, 0)
        self.assertEqual(tuple(empty.shape), (0, 40))
        del t, empty
        gc.collect()
        self.assertEqual(len(twt._dl_alive), before)

    def test_unique_id_over_a_process_group(self):
        # from_process_group's first half on CPU processes (gloo): three ranks, the world group
        # and a subgroup of ranks 1 and 2 (whose rank 0 is global rank 1); every member must
        # hold its group's rank 0's id.
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        code = (
            "import sys, ctypes, torch.distributed as dist, tilewave.torch as t\n"
            "r = int(sys.argv[1])\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:%d', rank=r, "
            "world_size=3)\n"
            "sub = dist.new_group([1, 2])\n"
            "uid, gr, gw = t._unique_id_from_group(None, None)\n"
            "out = [ctypes.string_at(ctypes.addressof(uid), 128).hex(), str(gr), str(gw)]\n"
            "if r > 0:\n"
            "    uid, gr, gw = t._unique_id_from_group(sub, None)\n"
            "    out += [ctypes.string_at(ctypes.addressof(uid), 128).hex(), str(gr), str(gw)]\n"
            "print(' '.join(out))\n"
            "dist.destroy_process_group()\n" % port)
        procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", code, str(r)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(3)]
        outs = []
        for p in procs:
            o, e = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 0, e)
            outs.append(o.split())
        world_ids = {o[0] for o in outs}
        self.assertEqual(len(world_ids), 1, "the ranks hold different world ids")
        self.assertNotEqual(world_ids.pop(), "00" * 128)
        self.assertEqual([o[1:3] for o in outs], [["0", "3"], ["1", "3"], ["2", "3"]])
        self.assertEqual(outs[1][3], outs[2][3], "the subgroup's ranks hold different ids")
        self.assertNotEqual(outs[1][3], outs[1][0], "the subgroup reused the world's id")
        self.assertEqual([outs[1][4:], outs[2][4:]], [["0", "2"], ["1", "2"]])

    def test_import_order(self):
        # torch first (as an engine does): the loader gives tilewave torch's libnccl.
        code = ("import torch, tilewave.torch as t, sys; p = t.nccl_library_path(); "
                "print(p); sys.exit(0 if 'torch' in sys.modules else 1)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)


# ------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------

def reference_layer(x, ids, weights, w13, w2):
    """The MoE layer in plain PyTorch, in double, with GEMM1's h and GEMM2's rows rounded to
    bf16 where tilewave rounds them: h = bf16(silu(x wg^T) * (x wu^T)), y = bf16(h w2^T),
    out = bf16(sum_j w_j y_j)."""
    T, H = x.shape
    E, F2, _ = w13.shape
    F = F2 // 2
    out = torch.zeros(T, H, dtype=torch.float64, device=x.device)
    xd = x.double()
    for e in range(E):
        tok, slot = (ids.long() == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = xd[tok]
        g = xe @ w13[e, :F].double().t()
        u = xe @ w13[e, F:].double().t()
        h = (torch.nn.functional.silu(g) * u).bfloat16().double()
        y = (h @ w2[e].double().t()).bfloat16().double()
        out.index_add_(0, tok, y * weights[tok, slot].double().unsqueeze(1))
    return out.bfloat16()


def reference_combine(x, ids, weights, w2):
    """combine(dispatch(x)) with hidden == ffn: out = bf16(sum_j w_j bf16(x w2[e_j]^T))."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(w2.shape[0]):
        tok, slot = (ids.long() == e).nonzero(as_tuple=True)
        if tok.numel():
            y = (x[tok].double() @ w2[e].double().t()).bfloat16().double()
            out.index_add_(0, tok, y * weights[tok, slot].double().unsqueeze(1))
    return out.bfloat16()


def routing(T, E, k, dtype, gen, device):
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.int64)
    w = torch.softmax(torch.randn(T, k, generator=gen), dim=1)
    return ids.to(dtype).to(device), w.to(device)


class TestGpu(unittest.TestCase):
    H, F, E, K, MAX_T = 1024, 512, 8, 2, 512

    @classmethod
    def setUpClass(cls):
        cls.dev = torch.device("cuda", torch.cuda.current_device())
        cls.ctx = twt.Context(hidden=cls.H, ffn=cls.F, experts=cls.E, top_k=cls.K,
                              max_tokens=cls.MAX_T)
        g = torch.Generator().manual_seed(SEED)
        cls.gen = g
        w13 = torch.randn(cls.E, 2 * cls.F, cls.H, generator=g) / cls.H ** 0.5
        w2 = torch.randn(cls.E, cls.H, cls.F, generator=g) / cls.F ** 0.5
        cls.w13, cls.w2 = w13.bfloat16().to(cls.dev), w2.bfloat16().to(cls.dev)

    @classmethod
    def tearDownClass(cls):
        cls.ctx.close()

    def inputs(self, T, dtype=torch.int32):
        x = torch.randn(T, self.H, generator=self.gen).bfloat16().to(self.dev)
        ids, w = routing(T, self.E, self.K, dtype, self.gen, self.dev)
        return x, ids, w

    def assert_close(self, got, ref, what):
        self.assertEqual(got.shape, ref.shape, what)
        self.assertEqual(got.dtype, torch.bfloat16, what)
        if ref.numel() == 0:
            return
        self.assertTrue(torch.isfinite(got.float()).all(), what)
        scale = ref.float().abs().max().item()
        err = (got.float() - ref.float()).abs()
        bound = 2e-2 * ref.float().abs() + 1e-2 * scale
        bad = int((err > bound).sum())
        self.assertEqual(bad, 0, "%s: %d of %d elements off (max error %.3g, scale %.3g)" % (
            what, bad, ref.numel(), err.max().item(), scale))

    def test_info(self):
        i = self.ctx.info()
        self.assertEqual((i["rank"], i["world_size"], i["in_process"]), (0, 1, 1))
        self.assertEqual(i["device"], self.dev.index)

    def test_layer_matches_reference(self):
        for T in (1, 37, 300, self.MAX_T):
            for dtype in (torch.int32, torch.int64):
                with self.subTest(T=T, ids=dtype):
                    x, ids, w = self.inputs(T, dtype)
                    out = twt.moe_layer(x, ids, w, self.w13, self.w2, context=self.ctx)
                    torch.cuda.synchronize()
                    self.assert_close(out, reference_layer(x, ids, w, self.w13, self.w2),
                                      "T %d %s" % (T, dtype))
        self.ctx.check()

    def test_zero_tokens(self):
        x, ids, w = self.inputs(0)
        out = twt.moe_layer(x, ids, w, self.w13, self.w2, context=self.ctx)
        self.assertEqual(tuple(out.shape), (0, self.H))
        self.ctx.check()

    def test_unfused_module_stream_and_out(self):
        x, ids, w = self.inputs(200)
        a = twt.moe_layer(x, ids, w, self.w13, self.w2, context=self.ctx)
        b = twt.moe_layer(x, ids, w, self.w13, self.w2, context=self.ctx, mode="unfused")
        layer = twt.MoELayer(self.w13, self.w2, context=self.ctx)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            c = layer(x, ids, w)
            d = torch.full((200, self.H), float("nan"), dtype=torch.bfloat16, device=self.dev)
            twt.moe_layer(x, ids, w, self.w13, self.w2, context=self.ctx, out=d)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(a, b), "unfused differs from overlap")
        self.assertTrue(torch.equal(a, c), "the module (on a side stream) differs")
        self.assertTrue(torch.equal(a, d), "out= differs")

    def test_layer_in_a_cuda_graph(self):
        # The capturable mode (dispatch_capacity: rows per expert and source, nothing read on
        # the host): torch.cuda.graph captures the layer once; every replay, on new inputs copied
        # into the captured tensors, equals an eager layer call on them bit for bit (the same
        # kernels, the same order of sums; test_capture.cu checks the same in C).
        T = 200
        ctx = twt.Context(hidden=self.H, ffn=self.F, experts=self.E, top_k=self.K,
                          max_tokens=self.MAX_T, dispatch_capacity=T)
        try:
            x, ids, w = self.inputs(T)
            out = torch.empty(T, self.H, dtype=torch.bfloat16, device=self.dev)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # a first call outside the capture, as torch advises
                twt.moe_layer(x, ids, w, self.w13, self.w2, context=ctx, out=out)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                twt.moe_layer(x, ids, w, self.w13, self.w2, context=ctx, out=out)
            for i in range(5):
                nx, nids, nw = self.inputs(T)
                x.copy_(nx)
                ids.copy_(nids)
                w.copy_(nw)
                out.fill_(float("nan"))
                graph.replay()
                eager = twt.moe_layer(nx, nids, nw, self.w13, self.w2, context=self.ctx)
                torch.cuda.synchronize()
                self.assertTrue(torch.equal(out, eager), "replay %d differs from the eager layer" % i)
            self.assert_close(out, reference_layer(nx, nids, nw, self.w13, self.w2), "last replay")
            ctx.check()
        finally:
            ctx.close()

    def test_library_refusals(self):
        x, ids, w = self.inputs(16)
        bad = ids.clone()
        bad[5, 1] = self.E  # out of range: the device checks it
        with self.assertRaises(tw.TilewaveError) as cm:
            twt.moe_layer(x, bad, w, self.w13, self.w2, context=self.ctx)
        self.assertEqual(cm.exception.status, "TW_ERR_EXPERT_ID")
        dup = ids.clone()
        dup[3, 1] = dup[3, 0]
        with self.assertRaises(tw.TilewaveError) as cm:
            twt.moe_layer(x, dup, w, self.w13, self.w2, context=self.ctx)
        self.assertEqual(cm.exception.status, "TW_ERR_DUPLICATE_EXPERT")
        # dispatch() refuses it alike, and combine() has no dispatch to follow.
        with self.assertRaises(tw.TilewaveError) as cm:
            twt.dispatch(x, bad, w, context=self.ctx)
        self.assertEqual(cm.exception.status, "TW_ERR_EXPERT_ID")
        with self.assertRaisesRegex(tw.TilewaveError, r"no dispatch\(\) on this context"):
            twt.combine(x, self.w2, context=self.ctx)
        # The context stays usable.
        out = twt.moe_layer(x, ids, w, self.w13, self.w2, context=self.ctx)
        torch.cuda.synchronize()
        self.assert_close(out, reference_layer(x, ids, w, self.w13, self.w2), "after refusals")

    def test_in_process_two_ranks(self):
        # Two ranks on this GPU (an in-process team), one thread and one stream each; rank r
        # holds experts [4r, 4r + 4) of the 8, its own tokens, and must get the reference
        # layer over all 8 experts for them.
        import threading
        W, T = 2, (150, 77)
        E_local = self.E // W
        inputs = [self.inputs(t, torch.int64) for t in T]
        results, errors = [None] * W, []
        team = twt.Team(W, self.dev)

        def rank_main(r):
            try:
                torch.cuda.set_device(self.dev)
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    ctx = twt.Context(hidden=self.H, ffn=self.F, experts=self.E, top_k=self.K,
                                      max_tokens=self.MAX_T, team=team, rank=r)
                    try:
                        mine = slice(r * E_local, (r + 1) * E_local)
                        x, ids, w = inputs[r]
                        out = twt.moe_layer(x, ids, w, self.w13[mine].contiguous(),
                                            self.w2[mine].contiguous(), context=ctx)
                        s.synchronize()
                        results[r] = out
                        ctx.check()
                    finally:
                        ctx.close()
            except Exception as e:  # reported by the main thread
                errors.append("rank %d: %r" % (r, e))

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        team.close()
        self.assertEqual(errors, [])
        for r in range(W):
            x, ids, w = inputs[r]
            self.assert_close(results[r], reference_layer(x, ids, w, self.w13, self.w2),
                              "rank %d of 2" % r)

    def test_dispatch_then_combine(self):
        # hidden == ffn: the dispatched rows are a valid GEMM2 input.
        H = 512
        with twt.Context(hidden=H, ffn=H, experts=self.E, top_k=self.K, max_tokens=256) as ctx:
            w2 = (torch.randn(self.E, H, H, generator=self.gen) / H ** 0.5).bfloat16().to(self.dev)
            for T in (1, 129, 256):
                with self.subTest(T=T):
                    x = torch.randn(T, H, generator=self.gen).bfloat16().to(self.dev)
                    ids, w = routing(T, self.E, self.K, torch.int64, self.gen, self.dev)
                    rows = twt.dispatch(x, ids, w, context=ctx)
                    self.assertEqual(rows.dtype, torch.bfloat16)
                    self.assertEqual(rows.shape[1], H)
                    self.assertGreaterEqual(rows.shape[0], T * self.K)
                    self.assertEqual(rows.shape[0], ctx.plan_summary()["rows"])
                    out = twt.combine(rows, w2, context=ctx)
                    torch.cuda.synchronize()
                    self.assert_close(out, reference_combine(x, ids, w, w2), "T %d" % T)
            ctx.check()


def main():
    print("seed %d (TW_TEST_SEED to repeat); torch %s" % (SEED, torch.__version__))
    loader = unittest.defaultTestLoader
    if MODE == "--gpu":
        why = missing_hopper(torch)
        if why is not None:
            print("skipped: " + why)
            return SKIP
        suite = loader.loadTestsFromTestCase(TestGpu)
    else:
        suite = unittest.TestSuite([loader.loadTestsFromTestCase(c) for c in
                                    (TestChecks, TestMarshalling, TestWithoutGpu)])
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped
    print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
