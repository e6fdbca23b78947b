"""Tests of the tilewave Python binding (plain unittest, no pytest).

Runs against the shared library named by TILEWAVE_LIBRARY (ctest sets it to the build's
libtilewave.so and PYTHONPATH to python/). Checks every wrapped call against values the test
computes itself from the same inputs, and that every failing status surfaces as TilewaveError
with the right status name. Prints "N passed, N failed"; exits non-zero on any failure.
"""

import ctypes
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
import unittest

import tilewave as tw

try:
    import numpy as np
except ImportError:
    np = None

SEED = int(os.environ.get("TW_TEST_SEED", random.SystemRandom().randrange(1 << 30)))


def f32(v):
    """v rounded to float32, as the C side stores gate weights."""
    return struct.unpack("f", struct.pack("f", v))[0]


def small_problem(**kw):
    args = dict(world_size=2, hidden=64, ffn=32, experts=8, top_k=2, max_tokens=64, tile_m=64,
                tile_n=64)
    args.update(kw)
    return tw.Problem(**args)


def random_arrays(problem, tokens, rng):
    ids, weights = [], []
    for r in range(problem.world_size):
        ids.append([rng.sample(range(problem.experts), problem.top_k) for _ in range(tokens[r])])
        weights.append([[rng.uniform(-1, 1) for _ in range(problem.top_k)]
                        for _ in range(tokens[r])])
    return ids, weights


class TestImport(unittest.TestCase):
    """The planning half stays free of torch: tilewave.torch is imported only when asked for."""

    def run_python(self, code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=os.environ.copy())

    def test_import_does_not_import_torch(self):
        out = self.run_python("import sys, tilewave; tilewave.version(); "
                              "sys.exit(1 if 'torch' in sys.modules else 0)")
        self.assertEqual(out.returncode, 0, out.stderr or "import tilewave imported torch")

    def test_torch_module_without_torch(self):
        probe = self.run_python("import torch")
        if probe.returncode == 0:
            self.skipTest("torch is installed here")
        out = self.run_python("import tilewave.torch")
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("ImportError: tilewave.torch needs PyTorch (pip install torch", out.stderr)


class TestStructLayout(unittest.TestCase):
    """Every ctypes struct of the binding (planning and runtime halves) against the header: a C
    program compiled here prints sizeof and the offset of each field, by the binding's field
    names (a renamed or missing field fails the compile)."""

    def test_structs_match_the_header(self):
        import shutil
        from tilewave import _runtime as rt
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if not cc:
            self.skipTest("no C compiler (CC, cc, gcc)")
        include = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "include")
        structs = {"tw_problem": tw._CProblem, "tw_routing_stats": tw._CRoutingStats,
                   "tw_hardware": tw._CHardware, "tw_plan_config": tw._CPlanConfig,
                   "tw_plan_summary": tw._CPlanSummary, "tw_tp_workload": tw._CTpWorkload,
                   "tw_context_config": rt._CContextConfig,
                   "tw_combine_options": rt._CCombineOptions,
                   "tw_dispatch_options": rt._CDispatchOptions,
                   "tw_layer_options": rt._CLayerOptions, "tw_context_info": rt._CContextInfo}
        lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "tilewave.h"',
                 "int main(void) {"]
        want = []
        for cname, py in structs.items():
            lines.append('printf("%%zu\\n", sizeof(%s));' % cname)
            want.append(("sizeof(%s)" % cname, ctypes.sizeof(py)))
            for field, _ in py._fields_:
                lines.append('printf("%%zu\\n", offsetof(%s, %s));' % (cname, field))
                want.append(("%s.%s" % (cname, field), getattr(py, field).offset))
        lines.append("return 0; }")
        with tempfile.TemporaryDirectory() as d:
            src, exe = os.path.join(d, "layout.c"), os.path.join(d, "layout")
            with open(src, "w") as f:
                f.write("\n".join(lines) + "\n")
            build = subprocess.run([cc, "-std=c11", "-I", include, src, "-o", exe],
                                   capture_output=True, text=True)
            self.assertEqual(build.returncode, 0, build.stderr)
            got = subprocess.run([exe], capture_output=True, text=True, check=True).stdout.split()
        self.assertEqual(len(got), len(want))
        bad = ["%s: C %s, binding %d" % (n, g, v) for (n, v), g in zip(want, got) if int(g) != v]
        self.assertEqual(bad, [])


class TestBasics(unittest.TestCase):
    def test_version_and_status(self):
        v = tw.version()
        self.assertRegex(v, r"^\d+\.\d+\.\d+$")
        self.assertTrue(tw.status_string(0).startswith("TW_SUCCESS"))
        self.assertTrue(tw.status_string(6).startswith("TW_ERR_TOPK_RANGE"))

    def test_presets(self):
        names = tw.presets()
        self.assertIn("deepseek-v2-lite", names)
        self.assertEqual(len(names), 10)
        self.assertIn("deepseek-v3", names)
        p = tw.Problem.preset("DeepSeek-V2-Lite", world_size=4, max_tokens=128)
        self.assertEqual((p.hidden, p.ffn, p.experts, p.top_k), (2048, 1408, 64, 6))
        self.assertEqual((p.world_size, p.max_tokens), (4, 128))
        p.validate()
        q = tw.Problem.preset("qwen1.5-moe-a2.7b")
        self.assertEqual((q.hidden, q.ffn, q.experts, q.top_k), (2048, 1408, 60, 4))
        with self.assertRaises(tw.TilewaveError) as cm:
            tw.Problem.preset("no-such-model")
        self.assertTrue(cm.exception.status.startswith("TW_ERR_"))
        self.assertNotEqual(cm.exception.code, 0)
        with self.assertRaises(TypeError):
            tw.Problem.preset("m-gpt", no_such_field=1)

    def test_problem_errors(self):
        with self.assertRaises(tw.TilewaveError) as cm:
            small_problem(top_k=9).validate()
        self.assertEqual(cm.exception.status, "TW_ERR_TOPK_RANGE")
        self.assertEqual(cm.exception.code, 6)
        self.assertIn("top_k", cm.exception.message)
        with self.assertRaises(tw.TilewaveError) as cm:
            small_problem(world_size=3).validate()
        self.assertEqual(cm.exception.status, "TW_ERR_INDIVISIBLE")
        with self.assertRaises(tw.TilewaveError) as cm:
            small_problem(tile_m=96).validate()
        self.assertEqual(cm.exception.status, "TW_ERR_INVALID_ARGUMENT")
        with self.assertRaises(tw.TilewaveError) as cm:
            small_problem(dtype="fp8").validate()
        self.assertEqual(cm.exception.status, "TW_ERR_UNSUPPORTED")
        # Generating a routing from an invalid problem fails the same way.
        with self.assertRaises(tw.TilewaveError) as cm:
            tw.Routing.generate(small_problem(top_k=9), "balanced", 8)
        self.assertEqual(cm.exception.status, "TW_ERR_TOPK_RANGE")

    def test_library_env_is_honoured(self):
        env = dict(os.environ, TILEWAVE_LIBRARY="/nonexistent/libtilewave.so")
        code = "import tilewave\ntry:\n tilewave.version()\nexcept OSError as e:\n print('OSError', e)"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        self.assertIn("OSError", out.stdout)
        self.assertIn("TILEWAVE_LIBRARY", out.stdout)


class TestRouting(unittest.TestCase):
    def setUp(self):
        self.rng = random.Random(SEED)

    def check_consistent(self, routing, problem):
        """stats() and expert_loads() agree with what rank() returns."""
        loads = [0] * problem.experts
        total = 0
        rows = [0] * problem.world_size
        el = problem.experts // problem.world_size
        for r in range(problem.world_size):
            ids, w = routing.rank(r)
            self.assertEqual(len(ids), routing.tokens[r])
            total += len(ids)
            for row in ids:
                self.assertEqual(len(row), problem.top_k)
                self.assertEqual(len(set(row)), problem.top_k)
                for e in row:
                    self.assertTrue(0 <= e < problem.experts)
                    loads[e] += 1
                    rows[e // el] += 1
        self.assertEqual(routing.expert_loads(), loads)
        s = routing.stats()
        self.assertEqual(s["total_tokens"], total)
        self.assertEqual(s["max_expert_load"], max(loads))
        self.assertEqual(s["min_expert_load"], min(loads))
        self.assertEqual(s["max_rank_rows"], max(rows))
        if total:
            self.assertAlmostEqual(s["r_expert"],
                                   max(loads) / (total * problem.top_k / problem.experts), 12)

    def test_generate_all_routers(self):
        p = small_problem(world_size=4, experts=16, top_k=3, max_tokens=100)
        for router in ("balanced", "moderate_skew", "stress_skew"):
            r = tw.Routing.generate(p, router, tokens_per_rank=100, seed=self.rng.randrange(1 << 30))
            self.assertEqual(r.tokens, [100] * 4)
            self.check_consistent(r, p)
            for rank in range(4):
                for ws in r.rank(rank)[1]:
                    self.assertAlmostEqual(sum(ws), 1.0, 5)
                    self.assertTrue(all(w > 0 for w in ws))
        # Same seed, same routing.
        a = tw.Routing.generate(p, "stress_skew", 50, seed=7)
        b = tw.Routing.generate(p, "stress_skew", 50, seed=7)
        self.assertEqual(a.rank(2), b.rank(2))
        # Skew raises R_expert; the target router hits its target roughly.
        bal = tw.Routing.generate(p, "balanced", 100, seed=1).stats()["r_expert"]
        skew = tw.Routing.generate(p, "stress_skew", 100, seed=1).stats()["r_expert"]
        self.assertGreater(skew, bal)
        tgt = tw.Routing.generate(p, "target", 100, seed=3, param=2.0).stats()["r_expert"]
        self.assertGreater(tgt, 1.2)
        self.assertLess(tgt, 3.0)
        with self.assertRaises(tw.TilewaveError) as cm:
            tw.Routing.generate(p, "no_such_router", 10)
        self.assertEqual(cm.exception.status, "TW_ERR_INVALID_ARGUMENT")

    def test_from_arrays_round_trip(self):
        p = small_problem(world_size=3, experts=9, top_k=3, max_tokens=40)
        tokens = [self.rng.randrange(1, 41), 0, self.rng.randrange(1, 41)]
        ids, w = random_arrays(p, tokens, self.rng)
        r = tw.Routing.from_arrays(p, ids, w)
        self.assertEqual(r.tokens, tokens)
        for rank in range(3):
            got_ids, got_w = r.rank(rank)
            self.assertEqual(got_ids, ids[rank])
            self.assertEqual(got_w, [[f32(v) for v in row] for row in w[rank]])
        self.check_consistent(r, p)
        # Flat lists work too.
        flat = tw.Routing.from_arrays(p, [sum(x, []) for x in ids], [sum(x, []) for x in w])
        self.assertEqual(flat.rank(2), r.rank(2))
        # Files round-trip exactly.
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "routing.txt")
            r.write(path)
            back = tw.Routing.read(p, path)
            for rank in range(3):
                self.assertEqual(back.rank(rank), r.rank(rank))
            with self.assertRaises(tw.TilewaveError) as cm:
                tw.Routing.read(p, os.path.join(d, "missing.txt"))
            self.assertEqual(cm.exception.status, "TW_ERR_IO")
        r.close()
        with self.assertRaises(tw.TilewaveError) as cm:
            r.stats()
        self.assertEqual(cm.exception.status, "TW_ERR_STATE")

    def test_from_arrays_errors(self):
        p = small_problem()
        good_ids = [[[0, 1]], [[2, 3]]]
        good_w = [[[0.5, 0.5]], [[0.5, 0.5]]]
        cases = [
            ([[[0, 0]], [[2, 3]]], good_w, "TW_ERR_DUPLICATE_EXPERT"),
            ([[[0, 8]], [[2, 3]]], good_w, "TW_ERR_EXPERT_ID"),
            ([[[0, -1]], [[2, 3]]], good_w, "TW_ERR_EXPERT_ID"),
            (good_ids, [[[float("nan"), 0.5]], [[0.5, 0.5]]], "TW_ERR_NONFINITE_WEIGHT"),
            (good_ids, [[[float("inf"), 0.5]], [[0.5, 0.5]]], "TW_ERR_NONFINITE_WEIGHT"),
            ([[[0, 1]]], [[[0.5, 0.5]]], "TW_ERR_INVALID_SIZE"),  # one rank missing
            ([[[0, 1, 2]], [[2, 3]]], good_w, "TW_ERR_INVALID_SIZE"),  # not tokens x top_k
        ]
        for ids, w, status in cases:
            with self.assertRaises(tw.TilewaveError, msg=status) as cm:
                tw.Routing.from_arrays(p, ids, w)
            self.assertEqual(cm.exception.status, status)
            self.assertTrue(cm.exception.message)
        # Explicit token counts beyond the arrays, or not one per rank.
        for tokens in ([2, 1], [1], [1, 1, 1]):
            with self.assertRaises(tw.TilewaveError, msg=str(tokens)) as cm:
                tw.Routing.from_arrays(p, good_ids, good_w, tokens=tokens)
            self.assertEqual(cm.exception.status, "TW_ERR_INVALID_SIZE")
        self.assertEqual(tw.Routing.from_arrays(p, good_ids, good_w, tokens=[0, 1]).tokens, [0, 1])
        # More tokens than the capacity.
        many = [[[0, 1]] * 65, [[2, 3]]]
        many_w = [[[0.5, 0.5]] * 65, [[0.5, 0.5]]]
        with self.assertRaises(tw.TilewaveError) as cm:
            tw.Routing.from_arrays(p, many, many_w)
        self.assertEqual(cm.exception.status, "TW_ERR_CAPACITY")

    @unittest.skipIf(np is None, "numpy not installed")
    def test_numpy_arrays(self):
        p = small_problem()
        ids = [np.array([[0, 1], [3, 2]], dtype=np.int64), np.array([[7, 6]], dtype=np.int32)]
        w = [np.array([[0.25, 0.75], [0.5, 0.5]]), np.array([[1.0, 0.0]], dtype=np.float32)]
        r = tw.Routing.from_arrays(p, ids, w)
        got_ids, got_w = r.rank(0, as_numpy=True)
        self.assertEqual(got_ids.tolist(), [[0, 1], [3, 2]])
        self.assertEqual(got_w.dtype, np.float32)
        self.assertEqual(list(r.expert_loads(as_numpy=True)), [1, 1, 1, 1, 0, 0, 1, 1])


class TestPlanAndModel(unittest.TestCase):
    def setUp(self):
        self.rng = random.Random(SEED + 1)

    def test_plan_summary(self):
        p = small_problem(world_size=4, hidden=256, ffn=128, experts=8, top_k=2, max_tokens=300)
        routing = tw.Routing.generate(p, "moderate_skew", 300, seed=self.rng.randrange(1 << 30))
        el = p.experts // p.world_size
        tm, tn = 64, 64
        col_tiles = -(-p.hidden // tn)
        for rank in range(p.world_size):
            plan = tw.Plan(p, routing, rank, comm_ctas=3, coalesce=2)
            s = plan.summary
            self.assertEqual(s["rank"], rank)
            self.assertEqual((s["comm_ctas"], s["coalesce"]), (3, 2))
            # Rows: the assignments routed to this rank's experts, plus bounded padding.
            assigned = 0
            remote_rows = 0
            for owner in range(p.world_size):
                for row in routing.rank(owner)[0]:
                    mine = sum(1 for e in row if e // el == rank)
                    assigned += mine
                    remote_rows += mine if owner != rank else 0
            self.assertEqual(s["rows"] - s["padding_rows"], assigned)
            self.assertLessEqual(s["padding_rows"], el * (p.world_size - 1) * (tm - 1))
            self.assertEqual(s["tiles"], s["bands"] * col_tiles)
            self.assertLessEqual(s["remote_tiles"], s["tiles"])
            self.assertEqual(s["send_bytes"], remote_rows * p.hidden * 2)
            self.assertGreater(s["segments"], 0)
            t = plan.predict(3, 2)
            self.assertGreater(t, 0.0)
            self.assertAlmostEqual(t, s["predicted_us"], delta=1e-9 * max(1.0, t))
            self.assertGreater(plan.predict(1, 1), 0.0)
            with self.assertRaises(tw.TilewaveError):
                plan.predict(0, 2)
        # The model's own choice is one of its candidates and no worse than a fixed default.
        plan = tw.Plan(p, routing, 0)
        s = plan.summary
        self.assertGreaterEqual(s["comm_ctas"], 1)
        self.assertLessEqual(s["predicted_us"],
                             plan.predict(tw.Plan(p, routing, 0, use_model=False).summary["comm_ctas"],
                                          s["coalesce"]) + 1e-9)
        fixed = tw.Plan(p, routing, 0, use_model=False).summary
        self.assertEqual((fixed["comm_ctas"], fixed["coalesce"]), (8, 2))
        with self.assertRaises(tw.TilewaveError) as cm:
            tw.Plan(p, routing, 4)
        self.assertTrue(cm.exception.status.startswith("TW_ERR_"))

    def test_plan_dataflow(self):
        p = small_problem(world_size=2, hidden=256, ffn=128, experts=8, top_k=2, max_tokens=200)
        routing = tw.Routing.generate(p, "balanced", 200, seed=self.rng.randrange(1 << 30))
        reduce_plan = tw.Plan(p, routing, 0, comm_ctas=4, coalesce=1, schedule="remote-first",
                              dataflow="reduce")
        add_plan = tw.Plan(p, routing, 0, comm_ctas=4, coalesce=1, schedule="remote-first",
                           dataflow="add")
        r, a = reduce_plan.summary, add_plan.summary
        self.assertEqual((r["dataflow"], a["dataflow"]), (1, 2))
        # The sequential baseline is the same; ours differs (no reduction, slower adds).
        self.assertEqual(r["sequential_us"], a["sequential_us"])
        self.assertNotEqual(r["predicted_us"], a["predicted_us"])
        with self.assertRaises(ValueError):
            tw.Plan(p, routing, 0, dataflow="sum")

    def test_hardware_round_trip(self):
        hw = tw.Hardware.default()
        self.assertGreater(hw.sm_count, 0)
        self.assertGreater(hw.c_max, 0)
        # The fields after the ones set here must land where the C struct has them.
        self.assertAlmostEqual(hw.refetch_exposure, 0.30, 12)
        self.assertAlmostEqual(hw.rho_ref, 10.05, 12)
        self.assertAlmostEqual(hw.l2_mib, 60.0, 12)
        self.assertAlmostEqual(hw.tile_floor_us, 2.8, 12)
        hw.link_cta_gbps = 41.25
        hw.refetch_exposure = 0.125
        hw.c_max = 24
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "hw.txt")
            hw.write(path)
            back = tw.Hardware.read(path)
            self.assertEqual(back.c_max, 24)
            self.assertAlmostEqual(back.link_cta_gbps, 41.25, 9)
            self.assertEqual(back.refetch_exposure, 0.125)
            with open(path, "a") as f:
                f.write("no_such_key = 1\n")
            with self.assertRaises(tw.TilewaveError) as cm:
                tw.Hardware.read(path)
            self.assertIn("no_such_key", cm.exception.message)
        # A plan with explicit hardware uses it.
        p = small_problem()
        r = tw.Routing.generate(p, "balanced", 64, seed=5)
        slow = tw.Hardware.default()
        slow.link_cta_gbps /= 10
        slow.link_peak_gbps /= 10
        fast_t = tw.Plan(p, r, 0, comm_ctas=2, coalesce=1).predict(2, 1)
        slow_t = tw.Plan(p, r, 0, comm_ctas=2, coalesce=1, hardware=slow).predict(2, 1)
        self.assertGreater(slow_t, fast_t)

    def test_no_silent_truncation(self):
        # ctypes keeps the low 32 bits of an int: 2**32 + 3 would have become expert 3, and
        # hidden 2**40 "hidden (0)".
        p = tw.Problem(world_size=2, hidden=256, ffn=128, experts=8, top_k=2, max_tokens=4)
        with self.assertRaises(tw.TilewaveError) as e:
            tw.Routing.from_arrays(p, [[0, 2**32 + 3], [1, 2]], [[0.5, 0.5], [0.5, 0.5]])
        self.assertIn("32 bits", str(e.exception))
        for field, value in (("hidden", 2**40), ("max_tokens", -2**33), ("experts", 2**31)):
            with self.assertRaises(tw.TilewaveError) as e:
                tw.Problem(**{**p.__dict__, field: value}).validate()
            self.assertIn(field, str(e.exception))
        with self.assertRaises(tw.TilewaveError):
            tw.Problem(**{**p.__dict__, "hidden": 256.5}).validate()

    def test_routing_keeps_its_problem(self):
        # The routing and the plan were sized by the problem they were built from: changing the
        # caller's problem afterwards must not change what they read (it segfaulted before).
        p = tw.Problem(world_size=2, hidden=256, ffn=128, experts=8, top_k=2, max_tokens=16)
        r = tw.Routing.generate(p, seed=1)
        plan = tw.Plan(p, r, 0)
        loads = r.expert_loads()
        p.experts, p.top_k = 4096, 64
        self.assertEqual(r.expert_loads(), loads)
        self.assertEqual(len(r.rank(0)[0][0]), 2)
        self.assertEqual(plan.problem.experts, 8)

    def test_tp_select(self):
        hw = tw.Hardware.default()
        rows = [self.rng.randrange(100, 2000) for _ in range(8)]
        best, t = tw.tp_select(m=4096, n=4096, k=1024, splits=4, ranks=4, expert_rows=rows,
                               tm=128, tn=128)
        self.assertEqual(len(t), hw.c_max)
        self.assertTrue(1 <= best <= hw.c_max)
        self.assertEqual(t[best - 1], min(t))
        self.assertTrue(all(v > 0 for v in t))
        with self.assertRaises(tw.TilewaveError):
            tw.tp_select(m=4096, n=4096, k=1024, splits=0, ranks=4, expert_rows=rows, tm=128,
                         tn=128)


def main():
    print("seed %d (TW_TEST_SEED to repeat)" % SEED)
    suite = unittest.defaultTestLoader.loadTestsFromModule(sys.modules[__name__])
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    passed = result.testsRun - failed - len(result.skipped)
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
