"""A Hugging Face transformers MoE model with its experts on tilewave's layer (plain unittest).

The client is code nobody here wrote: a transformers 5.x MoE causal LM (Qwen2-MoE, Mixtral,
GraniteMoe, DeepSeek-V2 classes) built from its config with random weights (nothing is
downloaded). In transformers 5.x every sparse MoE block calls
`self.experts(hidden_states, top_k_index, top_k_weights)` after its own router, and the experts
module holds fused 3-D parameters gate_up_proj (E, 2F, H) (gate rows, then up rows) and
down_proj (E, H, F): the layout of tilewave's w13 and w2. replace_experts() swaps each such
module for a TilewaveExperts that runs the routed experts through tilewave.torch (world 1)
on HF's own top-k ids and weights; the router, any shared expert and everything else stay
HF's.

  test_hf_model.py --mapping  on the CPU, in float32: the weight mapping and the block
                              replacement with a stand-in layer doing tilewave's math in
                              PyTorch (same w13 / w2 convention) reproduce every sparse block's
                              output and the logits of the unmodified model, for each model
                              family; the per-expert nn.Linear layout maps too; unsupported
                              experts are refused with a message. Needs torch and transformers.
  test_hf_model.py --gpu      on a Hopper GPU, bf16: the first sparse block against a float64
                              reference, then the logits of the model on tilewave against the
                              unmodified model (HF's default experts path, grouped_mm; and its
                              eager loop as the reference's own spread), and the prefill of each
                              timed; prints a markdown table. Needs torch with CUDA,
                              transformers and the library. TW_HF_SHAPES="1x512,4x4096" picks
                              the prefill shapes, TW_HF_MODELS="qwen2_moe,mixtral" the models.

Without torch or transformers (or, for --gpu, a Hopper GPU) it prints why and exits with 77,
which ctest counts as skipped. Otherwise it prints "N passed, N failed" and exits non-zero on
failure. TW_TEST_SEED repeats a run.
"""

import inspect
import os
import random
import sys
import time
import unittest

from hopper import missing_hopper

SKIP = 77
MODE = "--gpu" if "--gpu" in sys.argv[1:] else "--mapping"

try:
    import torch
except ImportError as e:
    print("skipped: torch is not importable (%s); pip install torch" % e)
    sys.exit(SKIP)
try:
    import transformers
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, GraniteMoeConfig,
                              GraniteMoeForCausalLM, MixtralConfig, MixtralForCausalLM,
                              Qwen2MoeConfig, Qwen2MoeForCausalLM)
except ImportError as e:
    print("skipped: transformers (5.x, with its MoE model classes) is not importable (%s); "
          "pip install transformers" % e)
    sys.exit(SKIP)

SEED = int(os.environ.get("TW_TEST_SEED", random.SystemRandom().randrange(1 << 30)))


# ------------------------------------------------------------------------------------------------
# The adapter: HF experts -> tilewave's w13 / w2, and the module that replaces them
# ------------------------------------------------------------------------------------------------

class UnsupportedExperts(TypeError):
    """An HF experts module this adapter cannot map onto tilewave's layer."""


def _linear_weight(lin, who):
    if not isinstance(lin, torch.nn.Linear):
        raise UnsupportedExperts("%s: expected an nn.Linear, got %s" % (who, type(lin).__name__))
    if lin.bias is not None:
        raise UnsupportedExperts("%s has a bias; tilewave's experts have none" % who)
    return lin.weight.detach()


def _check_silu(act, who):
    name = type(act).__name__
    if not (isinstance(act, torch.nn.SiLU) or name == "SiLUActivation" or act is
            torch.nn.functional.silu):
        raise UnsupportedExperts("%s: activation %s; tilewave's layer is SwiGLU (silu(gate) * up)"
                                 % (who, name))


def expert_weights(experts):
    """(w13 (E, 2F, H), w2 (E, H, F)) of an HF experts module in tilewave's convention (expert
    e's gate rows [0, F) then its up rows [F, 2F); w2 = the down projection), in the module's
    own dtype and device. Two layouts:
      * transformers 5.x fused experts (@use_experts_implementation): 3-D parameters
        gate_up_proj (E, 2F, H) and down_proj (E, H, F), or (E, H, 2F) and (E, F, H) with
        is_transposed; concatenated [gate; up], no bias, SiLU. Not transposed: w13 and w2 are
        the parameters themselves (no copy).
      * a per-expert nn.ModuleList of MLPs with bias-free nn.Linear gate_proj / up_proj /
        down_proj (or Mixtral's w1 / w3 / w2): stacked copies.
    Anything else raises UnsupportedExperts saying what was found."""
    who = type(experts).__name__
    if isinstance(experts, torch.nn.ModuleList):
        if len(experts) == 0:
            raise UnsupportedExperts("%s: no experts" % who)
        w13, w2 = [], []
        for i, mlp in enumerate(experts):
            names = next((n for n in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
                          if all(hasattr(mlp, a) for a in n)), None)
            if names is None:
                raise UnsupportedExperts(
                    "expert %d (%s) has neither gate_proj / up_proj / down_proj nor w1 / w3 / w2"
                    % (i, type(mlp).__name__))
            g, u, d = (_linear_weight(getattr(mlp, a), "expert %d %s" % (i, a)) for a in names)
            if hasattr(mlp, "act_fn"):
                _check_silu(mlp.act_fn, "expert %d" % i)
            w13.append(torch.cat([g, u], dim=0))
            w2.append(d)
        return torch.stack(w13).contiguous(), torch.stack(w2).contiguous()
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor):
        raise UnsupportedExperts(
            "%s: neither fused 3-D gate_up_proj / down_proj parameters (transformers 5.x) nor an "
            "nn.ModuleList of per-expert MLPs" % who)
    if not getattr(experts, "has_gate", True):
        raise UnsupportedExperts("%s: has_gate is False (no gate projection); tilewave's layer "
                                 "is SwiGLU" % who)
    if getattr(experts, "has_bias", False) or any(
            getattr(experts, b, None) is not None for b in ("gate_up_proj_bias", "down_proj_bias")):
        raise UnsupportedExperts("%s: expert biases; tilewave's experts have none" % who)
    if not getattr(experts, "is_concatenated", True):
        raise UnsupportedExperts("%s: interleaved gate / up rows (is_concatenated False); "
                                 "tilewave takes [gate; up] per expert" % who)
    if getattr(type(experts), "_apply_gate", _default_apply_gate()) is not _default_apply_gate():
        raise UnsupportedExperts("%s: a gating function of its own (_apply_gate); tilewave's is "
                                 "silu(gate) * up" % who)
    _check_silu(getattr(experts, "act_fn", None), who)
    gu, down = gu.detach(), down.detach()
    if gu.dim() != 3 or down.dim() != 3:
        raise UnsupportedExperts("%s: gate_up_proj %s, down_proj %s; expected 3-D" % (
            who, tuple(gu.shape), tuple(down.shape)))
    if getattr(experts, "is_transposed", False):
        gu, down = gu.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    E, F2, H = gu.shape
    if F2 % 2 or tuple(down.shape) != (E, H, F2 // 2):
        raise UnsupportedExperts("%s: gate_up_proj (as w13) %s and down_proj (as w2) %s do not "
                                 "make (E, 2F, H) and (E, H, F)" % (
                                     who, tuple(gu.shape), tuple(down.shape)))
    return gu.contiguous(), down.contiguous()


def _default_apply_gate():
    from transformers.integrations import moe
    return moe._default_apply_gate


def check_tilewave_shapes(hidden, ffn):
    """What tilewave's layer needs of the model (tw_context_create): hidden and ffn multiples
    of 64."""
    for name, v in (("hidden", hidden), ("ffn (the expert intermediate size)", ffn)):
        if v % 64:
            raise UnsupportedExperts("%s %d: tilewave's layer needs a multiple of 64" % (name, v))


class TilewaveExperts(torch.nn.Module):
    """Stands in for an HF experts module: forward(hidden_states (T, H), top_k_index (T, k),
    top_k_weights (T, k)) -> (T, H), the weighted sum of each token's experts, computed by
    `layer` (tilewave.torch.MoELayer, or anything with its forward(x, topk_ids, topk_weights)).
    HF's router gives the ids (int64) and weights (fp32, or bf16 for Qwen2-MoE and GraniteMoe:
    widened to fp32 exactly); tilewave takes them as they are."""

    def __init__(self, layer, num_experts):
        super().__init__()
        self.layer = layer
        self.num_experts = num_experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        x = hidden_states.contiguous()
        return self.layer(x, top_k_index.contiguous(), top_k_weights.float().contiguous())


def sparse_blocks(model):
    """[(name, block)] of every module holding an `experts` submodule (the sparse MoE blocks)."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(getattr(m, "experts", None), torch.nn.Module)
            and not isinstance(m, TilewaveExperts)]


class ExpertsSwap:
    """The experts of every sparse block of `model`, HF's and tilewave's side by side:
    use("tilewave") / use("hf") puts one set in place. make_layer(w13, w2) builds the layer of
    one block from its mapped weights (w13 and w2 share HF's storage: no second copy)."""

    def __init__(self, model, make_layer):
        self.model = model
        self.blocks = []
        for name, block in sparse_blocks(model):
            hf = block.experts
            if isinstance(hf, TilewaveExperts):
                raise UnsupportedExperts("%s.experts is already replaced; use('hf') on the swap "
                                         "that replaced it first" % name)
            if isinstance(hf, torch.nn.ModuleList):
                raise UnsupportedExperts(
                    "%s.experts is a per-expert nn.ModuleList: the block's forward calls each "
                    "expert itself (transformers < 5); only blocks that call "
                    "experts(hidden_states, top_k_index, top_k_weights) can be replaced" % name)
            params = list(inspect.signature(type(hf).forward).parameters)[1:]
            if len(params) != 3:
                raise UnsupportedExperts("%s.experts.forward%s: expected (hidden_states, "
                                         "top_k_index, top_k_weights)" % (name, tuple(params)))
            w13, w2 = expert_weights(hf)
            self.blocks.append((name, block, hf, TilewaveExperts(make_layer(w13, w2),
                                                                 w13.shape[0])))
        if not self.blocks:
            raise UnsupportedExperts("%s has no sparse MoE block (no module with an `experts` "
                                     "submodule)" % type(model).__name__)

    def use(self, which):
        if which not in ("hf", "tilewave"):
            raise ValueError("use(%r): 'hf' or 'tilewave'" % which)
        for _, block, hf, tw in self.blocks:
            block.experts = tw if which == "tilewave" else hf
        return self


# ------------------------------------------------------------------------------------------------
# tilewave's math in PyTorch (the CPU stand-in), and the float64 reference of the bf16 layer
# ------------------------------------------------------------------------------------------------

class PyTorchMoELayer(torch.nn.Module):
    """tilewave's layer written in PyTorch, same w13 / w2 convention: out[t] = sum_j w[t, j] *
    (silu(x wg^T) * (x wu^T)) w2^T for expert e = ids[t, j], wg = w13[e, :F], wu = w13[e, F:].
    precision: "native" computes in the input's dtype (float32 on the CPU check); "fp32"
    computes in float32 and rounds only the result to the input's dtype (the reference of the
    bf16 logits check); "bf16" computes in float32 and rounds h and each expert's row to bf16
    where tilewave's kernels do (a stand-in for them)."""

    def __init__(self, w13, w2, precision="native"):
        super().__init__()
        if precision not in ("native", "fp32", "bf16"):
            raise ValueError("precision %r: native, fp32 or bf16" % precision)
        self.w13, self.w2, self.precision = w13, w2, precision

    def forward(self, x, ids, w):
        F = self.w13.shape[1] // 2
        acc = x.dtype if self.precision == "native" else torch.float32
        rnd = self.precision == "bf16"
        out = torch.zeros(x.shape, dtype=acc, device=x.device)
        for e in range(self.w13.shape[0]):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            xe = x[tok].to(acc)
            g = xe @ self.w13[e, :F].to(acc).t()
            u = xe @ self.w13[e, F:].to(acc).t()
            h = torch.nn.functional.silu(g) * u
            if rnd:
                h = h.bfloat16().to(acc)
            y = h @ self.w2[e].to(acc).t()
            if rnd:
                y = y.bfloat16().to(acc)
            out.index_add_(0, tok, y * w[tok, slot].to(acc).unsqueeze(1))
        return out.to(x.dtype)


def reference_layer(x, ids, weights, w13, w2):
    """The layer in float64 with h and each expert's row rounded to bf16 where tilewave rounds
    them (as tests/python/test_torch.py's reference); returns bf16."""
    F = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    xd = x.double()
    for e in range(w13.shape[0]):
        tok, slot = (ids.long() == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = xd[tok]
        h = (torch.nn.functional.silu(xe @ w13[e, :F].double().t()) *
             (xe @ w13[e, F:].double().t())).bfloat16().double()
        y = (h @ w2[e].double().t()).bfloat16().double()
        out.index_add_(0, tok, y * weights[tok, slot].double().unsqueeze(1))
    return out.bfloat16()


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------

def _common(layers, vocab, hidden, heads, kv_heads, max_pos):
    return dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=max_pos, tie_word_embeddings=False)


def qwen2_moe(layers=4, vocab=4096, hidden=2048, ffn=1408, experts=60, top_k=4, shared=5632,
              heads=16, max_pos=8192):
    """Qwen1.5-MoE-A2.7B's layer (60 experts of 1408, top-4, a gated shared expert of 5632)."""
    return Qwen2MoeForCausalLM, Qwen2MoeConfig(
        moe_intermediate_size=ffn, num_experts=experts, num_experts_per_tok=top_k,
        shared_expert_intermediate_size=shared, intermediate_size=shared, norm_topk_prob=False,
        decoder_sparse_step=1, **_common(layers, vocab, hidden, heads, heads, max_pos))


def mixtral(layers=2, vocab=4096, hidden=4096, ffn=14336, experts=8, top_k=2, heads=32,
            kv_heads=8, max_pos=8192):
    """Mixtral-8x7B's layer (8 experts of 14336, top-2, hidden 4096, GQA 32 / 8)."""
    return MixtralForCausalLM, MixtralConfig(
        intermediate_size=ffn, num_local_experts=experts, num_experts_per_tok=top_k,
        **_common(layers, vocab, hidden, heads, kv_heads, max_pos))


def granitemoe(layers=2, vocab=4096, hidden=1024, ffn=512, experts=32, top_k=8, heads=16,
               max_pos=8192):
    return GraniteMoeForCausalLM, GraniteMoeConfig(
        intermediate_size=ffn, num_local_experts=experts, num_experts_per_tok=top_k,
        **_common(layers, vocab, hidden, heads, heads, max_pos))


def deepseek_v2(layers=3, vocab=4096, hidden=2048, ffn=1408, experts=64, top_k=6, heads=16,
                max_pos=8192):
    """DeepSeek-V2-Lite's layer (64 experts of 1408, top-6, 2 shared experts, MLA); layer 0
    dense as in the model (first_k_dense_replace = 1)."""
    return DeepseekV2ForCausalLM, DeepseekV2Config(
        intermediate_size=10944, moe_intermediate_size=ffn, n_routed_experts=experts,
        num_experts_per_tok=top_k, n_shared_experts=2, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, topk_method="greedy", routed_scaling_factor=1.0,
        **_common(layers, vocab, hidden, heads, heads, max_pos))


def tiny(family, **kw):
    """A small model of each family for the CPU check (float32, seconds)."""
    small = dict(vocab=256, hidden=128, ffn=64, heads=4, max_pos=256)
    if family is qwen2_moe:
        small.update(experts=8, top_k=2, shared=128)
    elif family is mixtral:
        small.update(experts=8, top_k=2, kv_heads=2)
    elif family is granitemoe:
        small.update(experts=8, top_k=3)
    else:
        small.update(experts=8, top_k=3)
    small.update(kw)
    cls, cfg = family(**small)
    if family is deepseek_v2:
        cfg.intermediate_size, cfg.kv_lora_rank = 256, 32
        cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim = 16, 16, 32
        cfg.head_dim = 16  # the rotary part (as the config derives it)
    return cls, cfg


FAMILIES = {"qwen2_moe": qwen2_moe, "mixtral": mixtral, "granitemoe": granitemoe,
            "deepseek_v2": deepseek_v2}


def build(cls, cfg, dtype, device, seed):
    """The model with random weights from `seed` (HF's own initialisation), in eval mode."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls._from_config(cfg, dtype=dtype)
    return model.eval()


def block_outputs(model):
    """A forward hook on each sparse block recording its output: (dict name -> list, handles)."""
    seen, handles = {}, []
    for name, block in sparse_blocks(model):
        def hook(mod, inp, out, _n=name):
            seen.setdefault(_n, []).append((out[0] if isinstance(out, tuple) else out).detach())
        handles.append(block.register_forward_hook(hook))
    return seen, handles


class Recorder:
    """Forward hooks on every experts module of every sparse block (HF's and each swap's
    replacement): each call's routing (the top-k ids, sorted within each token) and output, by
    block name."""

    def __init__(self, *swaps, outputs=True):
        self.calls, self.handles = {}, []
        mods = {}
        for swap in swaps:
            for name, _, hf, tw in swap.blocks:
                mods.setdefault(name, {})[id(hf)] = hf
                mods[name][id(tw)] = tw
        for name, ms in mods.items():
            for m in ms.values():
                self.handles.append(m.register_forward_hook(
                    lambda mod, args, out, _n=name: self.calls.setdefault(_n, []).append(
                        (args[1].sort(-1).values, out.detach() if outputs else None))))

    def take(self):
        calls, self.calls = self.calls, {}
        return calls

    def close(self):
        for h in self.handles:
            h.remove()


def routing_agreement(a, b):
    """Per block (in order), the fraction of tokens routed to the same expert set in two
    Recorder.take()s of one forward each."""
    return [(a[n][0][0] == b[n][0][0]).all(-1).float().mean().item() for n in a]


def logits_error(got, ref):
    """(max |got - ref| / max |ref|, fraction of positions with the same arg-max)."""
    g, r = got.float(), ref.float()
    rel = ((g - r).abs().max() / r.abs().max()).item()
    top1 = (g.argmax(-1) == r.argmax(-1)).float().mean().item()
    return rel, top1


def same_routing(a, b):
    """(T,) bool: the tokens routed to the same experts in every block, in two
    Recorder.take()s of one forward each."""
    same = None
    for n in a:
        s = (a[n][0][0] == b[n][0][0]).all(-1)
        same = s if same is None else same & s
    return same


def compare(got, ref, routes_got, routes_ref):
    """The logits check's numbers, got against ref: rel (max |got - ref| / max |ref| over every
    position), rel_same (the same over the positions whose tokens were routed alike in every
    layer), top1 (arg-max agreement), rerouted (fraction of tokens routed differently in some
    layer), route (per layer, the fraction routed alike)."""
    g, r = got.float().reshape(-1, got.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    rel, top1 = logits_error(g, r)
    same = same_routing(routes_got, routes_ref)
    err = (g - r).abs().amax(-1) / r.abs().max()
    return dict(rel=rel, top1=top1,
                rel_same=err[same].max().item() if bool(same.any()) else float("nan"),
                rerouted=1.0 - same.float().mean().item(),
                route=routing_agreement(routes_got, routes_ref))


# ------------------------------------------------------------------------------------------------
# On the CPU: the mapping and the replacement, exactly, in float32
# ------------------------------------------------------------------------------------------------

class TestMapping(unittest.TestCase):
    """Every family: the stand-in layer on the mapped weights reproduces each sparse block and
    the logits of the unmodified model in float32 (HF's eager experts loop as the reference)."""

    TOL = 2e-5  # float32, relative to the largest magnitude: summation order only

    def run_family(self, family, mapping=None):
        """Both models' logits, block outputs and experts calls: {"hf": (...), "tilewave": ...}."""
        cls, cfg = tiny(family)
        model = build(cls, cfg, torch.float32, "cpu", SEED)
        model.set_experts_implementation("eager")
        n_sparse = len(sparse_blocks(model))
        make = mapping or (lambda w13, w2: PyTorchMoELayer(w13, w2))
        swap = ExpertsSwap(model, make)
        self.assertEqual(len(swap.blocks), n_sparse)
        ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(
            SEED))
        outs, rec = {}, Recorder(swap)
        for which in ("hf", "tilewave"):
            swap.use(which)
            seen, handles = block_outputs(model)
            with torch.inference_mode():
                outs[which] = (model(ids, use_cache=False).logits, seen, rec.take())
            for h in handles:
                h.remove()
        rec.close()
        swap.use("hf")
        return swap, outs

    @staticmethod
    def rel(got, ref):
        return (got - ref).abs().max().item() / ref.abs().max().item()

    def check_family(self, family):
        swap, outs = self.run_family(family)
        for name, _, hf, tw in swap.blocks:
            # No copy: w13 and w2 are HF's parameters.
            self.assertEqual(tw.layer.w13.data_ptr(), hf.gate_up_proj.data_ptr(), name)
            self.assertEqual(tw.layer.w2.data_ptr(), hf.down_proj.data_ptr(), name)
            # The routed experts' output (the part replaced), then the whole block's (router,
            # shared expert and all), on the same inputs: the routing is the same.
            (ids_h, ref), = outs["hf"][2][name]
            (ids_t, got), = outs["tilewave"][2][name]
            self.assertTrue(torch.equal(ids_h, ids_t), name)
            err = self.rel(got, ref)
            self.assertLess(err, self.TOL, "%s: experts output off by %.3g" % (name, err))
            err = self.rel(outs["tilewave"][1][name][0], outs["hf"][1][name][0])
            self.assertLess(err, self.TOL, "%s: block output off by %.3g" % (name, err))
        rel, top1 = logits_error(outs["tilewave"][0], outs["hf"][0])
        self.assertLess(rel, self.TOL, "logits off by %.3g" % rel)
        self.assertEqual(top1, 1.0)

    def test_qwen2_moe(self):
        self.check_family(qwen2_moe)

    def test_mixtral(self):
        self.check_family(mixtral)

    def test_granitemoe(self):
        self.check_family(granitemoe)

    def test_deepseek_v2(self):
        self.check_family(deepseek_v2)  # layer 0 is dense: 2 of 3 layers replaced

    def test_a_wrong_mapping_fails(self):
        # The check can fail: with gate and up swapped (up rows first), or w2 from the wrong
        # expert, the logits are far off.
        def swapped(w13, w2):
            F = w13.shape[1] // 2
            return PyTorchMoELayer(torch.cat([w13[:, F:], w13[:, :F]], 1), w2)

        def shifted(w13, w2):
            return PyTorchMoELayer(w13, w2.roll(1, dims=0))
        for bad in (swapped, shifted):
            swap, outs = self.run_family(qwen2_moe, mapping=bad)
            name = swap.blocks[0][0]
            err = self.rel(outs["tilewave"][2][name][0][1], outs["hf"][2][name][0][1])
            # (silu(u) g is close to silu(g) u at these small activations: 0.2-0.3 apart, still
            # four orders of magnitude above TOL)
            self.assertGreater(err, 0.1, "%s: experts output off by only %.3g" % (
                bad.__name__, err))
            rel, _ = logits_error(outs["tilewave"][0], outs["hf"][0])
            self.assertGreater(rel, 100 * self.TOL, bad.__name__)

    def test_module_list_layout(self):
        # Per-expert nn.Linear MLPs (transformers 4.x): gate_proj / up_proj / down_proj (Qwen2)
        # and w1 / w3 / w2 (Mixtral), stacked into w13 / w2.
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP
        _, cfg = tiny(qwen2_moe)
        torch.manual_seed(SEED)
        mlps = torch.nn.ModuleList([Qwen2MoeMLP(cfg, intermediate_size=64) for _ in range(8)])
        w13, w2 = expert_weights(mlps)
        self.assertEqual((tuple(w13.shape), tuple(w2.shape)), ((8, 128, 128), (8, 128, 64)))
        g = torch.Generator().manual_seed(SEED)
        x = torch.randn(20, 128, generator=g)
        ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(20)])
        w = torch.rand(20, 2, generator=g)
        ref = torch.zeros(20, 128)
        with torch.no_grad():
            for t in range(20):
                for j in range(2):
                    ref[t] += w[t, j] * mlps[int(ids[t, j])](x[t:t + 1])[0]
        got = PyTorchMoELayer(w13, w2)(x, ids, w)
        self.assertLess((got - ref).abs().max().item(), 1e-5 * ref.abs().max().item() + 1e-7)

        class W(torch.nn.Module):  # Mixtral 4.x's names
            def __init__(self, mlp):
                super().__init__()
                self.w1, self.w3, self.w2, self.act_fn = (mlp.gate_proj, mlp.up_proj,
                                                          mlp.down_proj, mlp.act_fn)
        w13b, w2b = expert_weights(torch.nn.ModuleList([W(m) for m in mlps]))
        self.assertTrue(torch.equal(w13b, w13) and torch.equal(w2b, w2))

    def test_transposed_layout(self):
        # is_transposed experts store (E, H, 2F) and (E, F, H): mapped back to w13 / w2.
        cls, cfg = tiny(mixtral)
        hf = sparse_blocks(build(cls, cfg, torch.float32, "cpu", SEED))[0][1].experts
        w13, w2 = expert_weights(hf)
        hf.gate_up_proj = torch.nn.Parameter(hf.gate_up_proj.detach().transpose(1, 2)
                                             .contiguous())
        hf.down_proj = torch.nn.Parameter(hf.down_proj.detach().transpose(1, 2).contiguous())
        hf.is_transposed = True
        t13, t2 = expert_weights(hf)
        self.assertTrue(torch.equal(t13, w13) and torch.equal(t2, w2))

    def test_refusals(self):
        cls, cfg = tiny(qwen2_moe)
        cfg.hidden_act = "gelu"
        model = build(cls, cfg, torch.float32, "cpu", SEED)
        with self.assertRaisesRegex(UnsupportedExperts, r"activation GELU.*SwiGLU"):
            ExpertsSwap(model, PyTorchMoELayer)
        cls, cfg = tiny(mixtral)
        hf = sparse_blocks(build(cls, cfg, torch.float32, "cpu", SEED))[0][1].experts
        hf.has_bias = True
        with self.assertRaisesRegex(UnsupportedExperts, r"biases"):
            expert_weights(hf)
        hf.has_bias, hf.is_concatenated = False, False
        with self.assertRaisesRegex(UnsupportedExperts, r"interleaved"):
            expert_weights(hf)
        with self.assertRaisesRegex(UnsupportedExperts, r"neither fused 3-D"):
            expert_weights(torch.nn.Linear(4, 4))
        with self.assertRaisesRegex(UnsupportedExperts, r"per-expert nn.ModuleList"):
            m = torch.nn.Module()
            m.blk = torch.nn.Module()
            m.blk.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
            ExpertsSwap(m, PyTorchMoELayer)
        with self.assertRaisesRegex(UnsupportedExperts, r"no sparse MoE block"):
            ExpertsSwap(torch.nn.Linear(4, 4), PyTorchMoELayer)
        with self.assertRaisesRegex(UnsupportedExperts, r"ffn .* 1400: .*multiple of 64"):
            check_tilewave_shapes(2048, 1400)
        check_tilewave_shapes(2048, 1408)
        model = build(*tiny(mixtral), torch.float32, "cpu", SEED)
        swap = ExpertsSwap(model, PyTorchMoELayer)
        with self.assertRaisesRegex(ValueError, r"'hf' or 'tilewave'"):
            swap.use("tw")
        swap.use("tilewave")
        with self.assertRaisesRegex(UnsupportedExperts, r"already replaced"):
            ExpertsSwap(model, PyTorchMoELayer)

    def test_real_shapes_fit_tilewave(self):
        # The GPU run's models, by their configs alone: expert shapes tilewave accepts, and the
        # context problem host-validated by the library.
        import tilewave as tw
        for name, family in FAMILIES.items():
            _, cfg = family()
            H, F, E, k = gpu_problem(cfg)
            check_tilewave_shapes(H, F)
            tw.Problem(world_size=1, hidden=H, ffn=F, experts=E, top_k=k,
                       max_tokens=16384).validate()

    def test_bf16_rounding_stand_in(self):
        # The GPU comparison in miniature, bf16 on the CPU, through the same metrics and bounds,
        # with the stand-in (rounding where tilewave rounds) in tilewave's place.
        cls, cfg = tiny(qwen2_moe, hidden=256, ffn=128, experts=16, top_k=4, vocab=512)
        model = build(cls, cfg, torch.bfloat16, "cpu", SEED)
        swaps = {"tilewave": ExpertsSwap(model, lambda w13, w2: PyTorchMoELayer(w13, w2, "bf16")),
                 "fp32": ExpertsSwap(model, lambda w13, w2: PyTorchMoELayer(w13, w2, "fp32"))}
        ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(SEED))
        m = TestGpu.metrics(*TestGpu.variants(model, swaps, ids, ("grouped_mm", "eager",
                                                                  "tilewave", "fp32")))
        med = {"grouped_mm": 1.0, "eager": 1.0, "tilewave": 1.0}
        print("\n" + HEADER + "\n" + row("bf16 stand-in", 2, 128, m, med))
        TestGpu.assert_logits(self, m, "bf16 stand-in")
        self.assertLess(m["unmodified"]["rel_same"], LOGITS_REL / 2)


# ------------------------------------------------------------------------------------------------
# On the GPU: tilewave's layer in the model
# ------------------------------------------------------------------------------------------------

# The logits check. A random-weight model has flat logits (the largest about 4.5 to 6 over a
# vocab of 4096) and carries every bf16 rounding difference through its layers; where a token's
# top-k nearly ties in a later layer, a rounding difference flips its routing and that token's
# logits move by a fifth of the largest (on the CPU, bf16, Mixtral's layers, 128 tokens: one
# token rerouted in layer 2, error 0.19 there, at most 0.011 at every other position). HF's own
# paths (eager: per-expert loop, bf16 index_add_; grouped_mm: fp32 sum) reroute tokens so too.
# So the model on tilewave is held against the unmodified model (HF's default, grouped_mm) where
# the routing is the same in every layer, and against a reference whose experts compute in fp32
# (then round to bf16) for the rerouted tokens: no more of them than HF's own default path has
# against the same reference. A mapping error is far outside all of these (and the block check
# before them, against a float64 reference on the HF router's own ids and weights, is sharp).
LOGITS_REL = 5e-2     # max |logits - ref| / max |ref| over the positions routed alike
REROUTED_MAX = 0.02   # tokens routed differently in some layer: this or 2 x HF's + 0.005
TOP1_MIN = 0.9        # arg-max agreement with the unmodified model
TOP1_SLACK = 0.03     # ... and with the fp32 reference, at most this below HF's own
# Over every position the max error is a rerouted token's (Mixtral, top-2 of 8: 0.42-0.58 of the
# largest logit against the unmodified model with 0.5-1.4% of the tokens rerouted, where the
# positions routed alike were within 0.014): it is held against the fp32 reference, at most
# twice HF's own paths' error there ("hf_rel"), or this.
REL_ANY_MAX = 0.5     # max |logits - ref| / max |ref| over every position


def _fracs(v):
    return "/".join("%.4f" % x for x in v)


def gpu_problem(cfg):
    """(hidden, ffn, experts, top_k) of a config's sparse blocks."""
    ffn = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    experts = next(getattr(cfg, a) for a in ("num_experts", "num_local_experts",
                                               "n_routed_experts") if getattr(cfg, a, None))
    return cfg.hidden_size, ffn, experts, cfg.num_experts_per_tok


def parse_shapes(text):
    shapes = []
    for part in text.split(","):
        b, s = part.lower().split("x")
        shapes.append((int(b), int(s)))
    return shapes


# check_block's token count: odd, so that tiles and bands end mid-way.
BLOCK_TOKENS = 777
SHAPES = parse_shapes(os.environ.get("TW_HF_SHAPES", "1x512,1x2048,4x1024,1x4096,4x4096"))
MODELS = [m for m in os.environ.get("TW_HF_MODELS", "qwen2_moe,mixtral").split(",") if m]
ROWS = []  # the table, filled by TestGpu


def time_ms(fn, reps):
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(start, end))


class TestGpu(unittest.TestCase):

    def run_model(self, name):
        import tilewave.torch as twt
        cls, cfg = FAMILIES[name]()
        H, F, E, k = gpu_problem(cfg)
        check_tilewave_shapes(H, F)
        dev = torch.device("cuda", torch.cuda.current_device())
        t0 = time.time()
        model = build(cls, cfg, torch.bfloat16, dev, SEED)
        # The shapes' largest batch, and check_block's BLOCK_TOKENS.
        max_t = max([BLOCK_TOKENS] + [b * s for b, s in SHAPES])
        ctx = twt.Context(hidden=H, ffn=F, experts=E, top_k=k, max_tokens=max_t, device=dev)
        try:
            # One context for every block (same shapes; the blocks run one after another on one
            # stream); each block's MoELayer holds its own experts (HF's storage).
            swaps = {"tilewave": ExpertsSwap(model, lambda w13, w2: twt.MoELayer(
                         w13, w2, context=ctx)),
                     "fp32": ExpertsSwap(model, lambda w13, w2: PyTorchMoELayer(w13, w2, "fp32"))}
            print("\n  %s: %d layers, %d sparse, H %d, F %d, %d experts, top-%d, built in %.1f s"
                  % (name, cfg.num_hidden_layers, len(swaps["tilewave"].blocks), H, F, E, k,
                     time.time() - t0))
            self.check_block(swaps["tilewave"], cfg, dev)
            for b, s in SHAPES:
                with self.subTest(model=name, batch=b, seq=s):
                    self.check_shape(name, model, swaps, cfg, b, s, dev)
        finally:
            ctx.close()
            del model
            torch.cuda.empty_cache()

    def check_block(self, swap, cfg, dev):
        # The first sparse block on its real inputs (the HF router's ids and weights) against
        # the float64 reference: a sharp check of the mapping, before any model-level noise.
        name, block, hf, tw = swap.blocks[0]
        got = {}

        def grab(mod, args):
            got["args"] = [a.detach().clone() for a in args]
        handle = hf.register_forward_pre_hook(grab)
        ids = torch.randint(0, cfg.vocab_size, (1, BLOCK_TOKENS), device=dev)
        with torch.inference_mode():
            swap.use("hf").model(ids, use_cache=False)
        handle.remove()
        x, top_ids, top_w = got["args"]
        with torch.inference_mode():
            out = tw(x, top_ids, top_w)
            torch.cuda.synchronize()
            ref = reference_layer(x, top_ids, top_w.float(), tw.layer.w13, tw.layer.w2)
        scale = ref.float().abs().max().item()
        err = (out.float() - ref.float()).abs()
        bad = int((err > 2e-2 * ref.float().abs() + 1e-2 * scale).sum())
        print("  %s: the first sparse block (%d tokens) against float64: max error %.3g of %.3g"
              % (name, BLOCK_TOKENS, err.max().item(), scale))
        self.assertEqual(bad, 0, "%s: %d of %d elements off the reference (max error %.3g, "
                         "scale %.3g)" % (name, bad, ref.numel(), err.max().item(), scale))
        tw.layer.context.check()

    @staticmethod
    def select(model, swaps, which):
        """Puts one variant's experts in place: HF's ("grouped_mm", the default, or "eager"),
        or a swap's replacement ("tilewave", "fp32")."""
        if which in swaps:
            swaps[which].use("tilewave")
        else:
            next(iter(swaps.values())).use("hf")
            model.set_experts_implementation(which)

    @classmethod
    def variants(cls, model, swaps, ids, which):
        """Each variant's logits and routing for one forward of ids."""
        out, routes, rec = {}, {}, Recorder(*swaps.values(), outputs=False)
        try:
            with torch.inference_mode():
                for w in which:
                    cls.select(model, swaps, w)
                    out[w] = model(ids, use_cache=False).logits
                    routes[w] = rec.take()
        finally:
            rec.close()
            cls.select(model, swaps, "grouped_mm")
        return out, routes

    @staticmethod
    def metrics(out, routes):
        """compare()s: the model on tilewave against the unmodified model ("unmodified"), and
        tilewave, HF grouped_mm and HF eager against the fp32-experts reference."""
        m = {"unmodified": compare(out["tilewave"], out["grouped_mm"], routes["tilewave"],
                                   routes["grouped_mm"])}
        for w in ("tilewave", "grouped_mm", "eager"):
            m[w] = compare(out[w], out["fp32"], routes[w], routes["fp32"])
        m["hf_rel"] = max(m["grouped_mm"]["rel"], m["eager"]["rel"])  # HF's own, every position
        return m

    def assert_logits(self, m, where):
        u, t, g = m["unmodified"], m["tilewave"], m["grouped_mm"]
        # The first sparse block sees the same input in every variant: the same routing.
        self.assertEqual((u["route"][0], t["route"][0]), (1.0, 1.0),
                         "%s: the first block's routing differs" % where)
        for what, c in (("the unmodified model", u), ("the fp32 reference", t)):
            self.assertLess(c["rel_same"], LOGITS_REL, "%s: logits max err / max logit %.4f "
                            "against %s, where the tokens were routed alike" % (
                                where, c["rel_same"], what))
        self.assertLessEqual(t["rerouted"], max(REROUTED_MAX, 2 * g["rerouted"] + 0.005),
                             "%s: %.4f of the tokens routed differently from the fp32 reference "
                             "(HF grouped_mm: %.4f)" % (where, t["rerouted"], g["rerouted"]))
        self.assertGreater(u["top1"], TOP1_MIN, "%s: top-1 agreement %.4f with the unmodified "
                           "model" % (where, u["top1"]))
        self.assertGreater(t["top1"], g["top1"] - TOP1_SLACK, "%s: top-1 agreement %.4f with "
                           "the fp32 reference (HF grouped_mm: %.4f)" % (where, t["top1"],
                                                                         g["top1"]))
        self.assertLess(t["rel"], max(REL_ANY_MAX, 2 * m["hf_rel"]), "%s: logits max err / max "
                        "logit %.4f over every position against the fp32 reference (HF: %.4f)" % (
                            where, t["rel"], m["hf_rel"]))

    def check_shape(self, name, model, swaps, cfg, b, s, dev):
        g = torch.Generator(device=dev).manual_seed(SEED + b * 100003 + s)
        ids = torch.randint(0, cfg.vocab_size, (b, s), device=dev, generator=g)
        out, routes = self.variants(model, swaps, ids, ("grouped_mm", "eager", "tilewave", "fp32"))
        m = self.metrics(out, routes)
        del out, routes
        # Timing: HF grouped_mm, HF eager and tilewave interleaved, 2 warm-ups each, then the
        # median of 5 (3 for the largest shapes) of each.
        timed = ("grouped_mm", "eager", "tilewave")
        reps = 5 if b * s <= 8192 else 3
        times = {w: [] for w in timed}
        with torch.inference_mode():
            for i in range(2 + reps):
                for w in timed:
                    self.select(model, swaps, w)
                    t = time_ms(lambda: model(ids, use_cache=False).logits, 1)
                    if i >= 2:
                        times[w] += t
        self.select(model, swaps, "grouped_mm")
        med = {w: sorted(v)[len(v) // 2] for w, v in times.items()}
        ROWS.append((name, b, s, m, med))
        print("  " + row(name, b, s, m, med))
        self.assert_logits(m, "%s %dx%d" % (name, b, s))

    def test_models(self):
        for name in MODELS:
            with self.subTest(model=name):
                self.run_model(name)


HEADER = ("| model | batch x seq | tokens | vs unmodified: logits max err / max logit | same, "
          "routed alike | top-1 agree | tokens rerouted | vs fp32 experts: logits max err / max "
          "logit, tilewave (HF) | rerouted, tilewave (HF) | top-1, tilewave (HF) | prefill ms HF "
          "grouped_mm (default) | prefill ms HF eager | prefill ms tilewave | speedup vs default "
          "| vs eager |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
          "---: | ---: | ---: |")


def row(name, b, s, m, med):
    u, t, g = m["unmodified"], m["tilewave"], m["grouped_mm"]
    return ("| %s | %d x %d | %d | %.4f | %.4f | %.4f | %.4f | %.4f (%.4f) | %.4f (%.4f) | "
            "%.4f (%.4f) | %.2f | %.2f | %.2f | %.2fx | %.2fx |" % (
                name, b, s, b * s, u["rel"], u["rel_same"], u["top1"], u["rerouted"], t["rel"],
                m["hf_rel"], t["rerouted"], g["rerouted"], t["top1"], g["top1"], med["grouped_mm"],
                med["eager"], med["tilewave"], med["grouped_mm"] / med["tilewave"],
                med["eager"] / med["tilewave"]))


def table():
    return HEADER + "\n" + "\n".join(row(*r) for r in ROWS) + (
        "\n\nvs unmodified: the model on tilewave against the unmodified model (HF's default "
        "experts path, grouped_mm); max err over every position, then over the positions whose "
        "tokens were routed alike in every layer; rerouted: tokens whose top-k experts differ in "
        "some layer. vs fp32 experts: each against the model whose experts compute in fp32, "
        "tilewave's then HF's (the larger of grouped_mm's and eager's error; grouped_mm's rerouted "
        "and top-1): HF's own spread. Prefill: model(ids, use_cache="
        "False), medians of interleaved runs.")


def main():
    print("seed %d (TW_TEST_SEED to repeat); torch %s, transformers %s" % (
        SEED, torch.__version__, transformers.__version__))
    if int(transformers.__version__.split(".")[0]) < 5:
        print("skipped: transformers %s; the fused experts interface is 5.x's" %
              transformers.__version__)
        return SKIP
    loader = unittest.defaultTestLoader
    if MODE == "--gpu":
        why = missing_hopper(torch)
        if why is not None:
            print("skipped: " + why)
            return SKIP
        print("GPU %s; models %s; shapes %s" % (torch.cuda.get_device_name(), ",".join(MODELS),
                                                ",".join("%dx%d" % s for s in SHAPES)))
        suite = loader.loadTestsFromTestCase(TestGpu)
    else:
        suite = loader.loadTestsFromTestCase(TestMapping)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    if ROWS:
        print("\n" + table() + "\n")
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped
    print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
