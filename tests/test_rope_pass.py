"""The RoPE pass on a zoo of rotary-embedding spellings, each captured by TorchDynamo, normalized and
rewritten: rewrite and call counts, q/k pairing, float32 values and gradients against the original
module; what must not be rewritten, with its reason; Hugging Face Llama (rotate-half) and GPT-J
(interleaved, partial rotary) end to end through ``optimize``, the attention pass still matching after it.

cos and sin are random tensors, not real tables: the op computes ``x * cos + rot(x) * sin`` for any
tensors, and a rewrite that relied on the tables' structure would fail here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
import torch.nn as nn
import transformers
from transformers.models.gptj import modeling_gptj as gptj

from kernel_pytorch import optimize, report_of
from kernel_pytorch.backends import CpuBackend, TpuBackend
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.hardware import detect_hardware
from kernel_pytorch.passes.base import PassContext
from kernel_pytorch.passes.normalize import Normalize
from kernel_pytorch.passes.rope import RopePass, _rope_op

from .conftest import capture_graph, rel_err, twin
from .hf_models import llama as _llama

B, H, HK, L, D = 2, 4, 2, 5, 12  # GQA (4 query heads, 2 key heads), head dim 12 (not a power of two)
R = 8  # partial rotary dim


def _ctx() -> PassContext:
    return PassContext(hardware=detect_hardware("cpu"), config=OptimizeConfig(), training=True)


class Rewritten:
    """``module`` captured by dynamo (one graph), normalized and passed through the RoPE pass."""

    def __init__(self, module: nn.Module, inputs: tuple[torch.Tensor, ...]):
        self.gm, self.example_inputs = capture_graph(module, inputs)
        self.user_inputs = inputs
        Normalize().run(self.gm, _ctx())
        self.result = RopePass().run(self.gm, _ctx())
        self.gm.graph.lint()
        self.gm.recompile()

    def __call__(self, *fresh: torch.Tensor) -> tuple[torch.Tensor, ...]:
        replacements = {id(old): new for old, new in zip(self.user_inputs, fresh)}
        return tuple(self.gm(*[replacements.get(id(a), a) for a in self.example_inputs]))

    @property
    def calls(self) -> list[torch.fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "call_function" and n.target is _rope_op()]

    @property
    def descriptions(self) -> list[str]:
        return [r.replacement for r in self.result.rewrites]

    @property
    def reasons(self) -> list[str]:
        return [s.reason for s in self.result.skipped]


def _inputs(q_shape=(B, H, L, D), k_shape=(B, HK, L, D), table_shape=(B, L, D), dtype=torch.float32):
    return (torch.randn(q_shape, dtype=dtype), torch.randn(k_shape, dtype=dtype), torch.randn(table_shape),
            torch.randn(table_shape))


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def check_numerics(module: nn.Module, rewritten: Rewritten, make_inputs=_inputs) -> None:
    """Values (rel err < 1e-5) and gradients of every input (< 1e-4; bf16 inputs' gradients, which eager
    code rounds per branch and the op once, within 1e-2) on fresh inputs, vs the module."""
    fresh = make_inputs()
    ours = [t.clone().requires_grad_() for t in fresh]
    theirs = [t.clone().requires_grad_() for t in fresh]
    out, expected = rewritten(*ours), _as_tuple(module(*theirs))
    assert len(out) == len(expected)
    for a, e in zip(out, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert rel_err(a, e) < 1e-5
    seeds = [torch.randn_like(e) for e in expected]
    grads = torch.autograd.grad(out, ours, seeds, allow_unused=True)
    expected_grads = torch.autograd.grad(expected, theirs, seeds, allow_unused=True)
    for i, (g, e) in enumerate(zip(grads, expected_grads)):
        assert (g is None) == (e is None), i
        if e is not None:
            assert rel_err(g, e) < (1e-2 if e.dtype == torch.bfloat16 else 1e-4), i


# --------------------------------------------------------------------------------------------------
# the zoo
# --------------------------------------------------------------------------------------------------


def rotate_half(x):  # Hugging Face's, verbatim
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaStyle(nn.Module):  # HF apply_rotary_pos_emb: cos/sin unsqueezed on the heads dim
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def rotate_half_chunk(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x2.neg(), x1], -1)


def rotate_half_split(x):
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.concat((x2 * -1, x1), dim=x.ndim - 1)


class ChunkAndSplit(nn.Module):  # other rotate_half spellings, operands of + and * in other orders
    def forward(self, q, k, cos, sin):
        cos, sin = cos[:, None], sin[:, None]
        return sin * rotate_half_chunk(q) + cos * q, torch.add(torch.mul(k, cos), rotate_half_split(k) * sin)


class HeadsLast(nn.Module):  # (B, L, H, D) layout, index-spelled halves, tables (1, L, 1, D)
    def forward(self, q, k, cos, sin):
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = cos[:1, :, None, :], sin[:1, :, None, :]
        h = D // 2

        def rot(x):
            return torch.cat((-x[:, :, :, h:], x[:, :, :, :h]), dim=3)

        return q * cos + rot(q) * sin, k * cos + rot(k) * sin


class PartialRotary(nn.Module):  # GPT-NeoX rotary_pct / Phi partial_rotary_factor
    def forward(self, q, k, cos, sin):
        cos, sin = cos[..., :R].unsqueeze(1), sin[..., :R].unsqueeze(1)
        q_rot, q_pass = q[..., :R], q[..., R:]
        k_rot, k_pass = k[..., :R], k[..., R:]
        q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
        k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
        return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)


class PartialPassFirst(nn.Module):  # not exactly cat((rotated, pass), -1): only the rotation is rewritten
    def forward(self, q, k, cos, sin):
        cos, sin = cos[..., :R].unsqueeze(1), sin[..., :R].unsqueeze(1)
        q_rot, q_pass = q[..., :R], q[..., R:]
        k_rot, k_pass = k[..., :R], k[..., R:]
        q_embed = q_rot * cos + rotate_half(q_rot) * sin
        k_embed = k_rot * cos + rotate_half(k_rot) * sin
        return torch.cat((q_pass, q_embed), dim=-1), torch.cat((k_pass, k_embed), dim=-1)


class GPTJStyle(nn.Module):  # transformers' GPT-J functions: interleaved, tables repeat_interleave'd per call
    def forward(self, q, k, cos, sin):
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # GPT-J's (B, L, H, D)
        sin, cos = sin[..., : R // 2], cos[..., : R // 2]
        k_rot, k_pass = k[:, :, :, :R], k[:, :, :, R:]
        q_rot, q_pass = q[:, :, :, :R], q[:, :, :, R:]
        k_rot = gptj.apply_rotary_pos_emb(k_rot, sin, cos)
        q_rot = gptj.apply_rotary_pos_emb(q_rot, sin, cos)
        return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)


def rotate_every_two_reshape(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x2.neg(), x1), -1).reshape(x.shape)


class InterleavedFull(nn.Module):  # interleaved over the whole head, merged back by reshape
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_every_two_reshape(q) * sin, k * cos + rotate_every_two_reshape(k) * sin


class QOnly(nn.Module):  # a lone rotation: one call, its second slot given q again
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * 2.0


class SwappedTables(nn.Module):  # x * a + rot(x) * b is the op's formula whatever a and b are
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * sin + rotate_half(q) * cos, k * sin + rotate_half(k) * cos


class DifferentTables(nn.Module):  # k rotated with other tables than q: two lone calls, not one pair
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        k_cos, k_sin = cos * 0.5, sin + 1.0
        return q * cos + rotate_half(q) * sin, k * k_cos + rotate_half(k) * k_sin


class UsedBeforePartner(nn.Module):  # q's result is read before k is rotated: no pairing across that use
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = q * cos + rotate_half(q) * sin
        k = k + q_embed.mean()
        return q_embed, k * cos + rotate_half(k) * sin


class RotatedTwice(nn.Module):  # rope(rope(q)): the second rotation reads the first call's output
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        once = q * cos + rotate_half(q) * sin
        return once * cos + rotate_half(once) * sin, k * 3.0


ZOO = {
    # module: (rewrites, paired calls, words each description contains)
    LlamaStyle: (1, 1, ["rotate-half", "q+k paired", "rotary dim 12"]),
    ChunkAndSplit: (1, 1, ["rotate-half", "q+k paired"]),
    HeadsLast: (1, 1, ["rotate-half", "q+k paired"]),
    PartialRotary: (1, 1, ["rotate-half", "q+k paired", f"partial rotary {R}/{D}"]),
    PartialPassFirst: (1, 1, ["q+k paired", f"rotary dim {R}", "partial rotary not folded"]),
    GPTJStyle: (1, 1, ["interleaved", "q+k paired", f"partial rotary {R}/{D}"]),
    InterleavedFull: (1, 1, ["interleaved", "q+k paired", f"rotary dim {D}"]),
    QOnly: (1, 0, ["rotate-half", "single tensor"]),
    SwappedTables: (1, 1, ["rotate-half", "q+k paired"]),
    DifferentTables: (2, 0, ["single tensor"]),
    UsedBeforePartner: (2, 0, ["single tensor"]),
    RotatedTwice: (2, 0, ["single tensor"]),
}


@pytest.mark.parametrize("module_type", ZOO, ids=lambda t: t.__name__)
def test_zoo_rewrites_and_numerics(module_type):
    torch.manual_seed(0)
    module = module_type()
    rewritten = Rewritten(module, _inputs())
    count, paired, words = ZOO[module_type]
    assert len(rewritten.result.rewrites) == count, (rewritten.descriptions, rewritten.reasons)
    assert not rewritten.result.skipped, rewritten.reasons
    calls = rewritten.calls
    assert len(calls) == count
    assert sum(call.args[0] is not call.args[1] for call in calls) == paired
    assert all(w in d for d in rewritten.descriptions for w in words), rewritten.descriptions
    # The written-out rotation is gone: no cat/stack of halves left (PartialPassFirst keeps its own cat).
    leftover = [n for n in rewritten.gm.graph.nodes if n.target in (torch.stack,) or
                (n.target is torch.cat and module_type is not PartialPassFirst)]
    assert not leftover, leftover
    check_numerics(module, rewritten)


def test_promoting_tables_cast_q_and_k_first():
    # bf16 q and k times fp32 tables give fp32 in eager code; the op returns q's dtype, so the rewrite
    # casts q and k to fp32 (exact) and the op computes what eager did.
    torch.manual_seed(0)
    make = lambda: _inputs(dtype=torch.bfloat16)
    module = LlamaStyle()
    rewritten = Rewritten(module, make())
    assert len(rewritten.calls) == 1, rewritten.reasons
    assert "x cast to float32" in rewritten.descriptions[0]
    check_numerics(module, rewritten, make)


def test_dynamic_sizes_are_rewritten():
    torch.manual_seed(0)
    module = LlamaStyle()
    torch._dynamo.reset()
    graphs, symbolic = [], []

    def backend(gm, example_inputs):
        symbolic.append(any(isinstance(a, torch.SymInt) for a in example_inputs))
        Normalize().run(gm, _ctx())
        graphs.append(RopePass().run(gm, _ctx()))
        gm.graph.lint()
        gm.recompile()
        return gm.forward

    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=True)
    inputs = _inputs(q_shape=(3, H, 7, D), k_shape=(3, HK, 7, D), table_shape=(3, 7, D))
    for t in inputs:  # batch and length symbolic; the head dim static, as a model's view(..., head_dim) makes it
        torch._dynamo.mark_static(t, t.dim() - 1)
    out = compiled(*inputs)
    assert symbolic == [True] and len(graphs[0].rewrites) == 1, graphs
    for a, e in zip(out, module(*inputs)):
        assert rel_err(a, e) < 1e-5


# --------------------------------------------------------------------------------------------------
# what is not RoPE (or not provably what the op computes)
# --------------------------------------------------------------------------------------------------


class OtherDim(nn.Module):  # halves of the heads dim rotated: rotate-half, but not over the features
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + torch.cat((-q[:, H // 2:], q[:, :H // 2]), dim=1) * sin


class Subtracted(nn.Module):  # x * cos - rot(x) * sin
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos - rotate_half(q) * sin


class NoNegation(nn.Module):  # cat(x2, x1): a swap
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        h = D // 2
        return q * cos + torch.cat((q[..., h:], q[..., :h]), -1) * sin


class WrongHalfNegated(nn.Module):  # cat(x2, -x1) is -rot(x)
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        h = D // 2
        return q * cos + torch.cat((q[..., h:], -q[..., :h]), -1) * sin


class OtherTensorRotated(nn.Module):  # q * cos + rot(k) * sin
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(k.repeat_interleave(H // HK, dim=1)) * sin


class TablesBroadcastUp(nn.Module):  # one batch of q, tables of two batches: the result is larger than q
    def forward(self, q, k, cos, sin):
        q1, cos, sin = q[:1], cos.unsqueeze(1), sin.unsqueeze(1)
        return q1 * cos + rotate_half(q1) * sin


class ScalarPerPosition(nn.Module):  # cos/sin one value per position, broadcast over the features
    def forward(self, q, k, cos, sin):
        cos, sin = cos[..., :1].unsqueeze(1), sin[..., :1].unsqueeze(1)
        return q * cos + rotate_half(q) * sin


class MixedProductDtypes(nn.Module):  # x * cos rounded to fp32, rot(x) * sin computed in fp64
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin.double()


class NoGradBetweenReads(nn.Module):  # half of the formula under no_grad: moving it would add a gradient
    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        a = q * cos
        with torch.no_grad():
            b = rotate_half(q) * sin
        return a + b


class WrittenBetweenReads(nn.Module):  # x changes in place after its products were taken
    def forward(self, q, k, cos, sin):
        # detached tables: the products then save no x for backward, so eager autograd allows the add_
        cos, sin = cos.unsqueeze(1).detach(), sin.unsqueeze(1).detach()
        x = q * 2.0
        a, b = x * cos, rotate_half(x) * sin
        x.add_(1.0)
        return a + b, x


NEGATIVES = {
    OtherDim: "not the last (feature) dim",
    Subtracted: "subtracted",
    NoNegation: "no negation",
    WrongHalfNegated: "slices and negation are not rotate_half",
    OtherTensorRotated: "rotated tensor is not the one multiplied",
    TablesBroadcastUp: "broadcast",
    ScalarPerPosition: "one value per rotated feature",
    WrittenBetweenReads: "in-place",
    NoGradBetweenReads: "grad/autocast mode switch",
    MixedProductDtypes: "op would round differently",
}


@pytest.mark.parametrize("module_type", NEGATIVES, ids=lambda t: t.__name__)
def test_lookalikes_are_skipped_with_reasons(module_type):
    torch.manual_seed(0)
    module = module_type()
    rewritten = Rewritten(module, _inputs())
    assert not rewritten.result.rewrites and not rewritten.calls, rewritten.descriptions
    assert len(rewritten.reasons) == 1 and NEGATIVES[module_type] in rewritten.reasons[0], rewritten.reasons
    check_numerics(module, rewritten)


def test_unrelated_products_are_not_candidates():
    class Gelu(nn.Module):  # a sum of two products with no rotation anywhere
        def forward(self, q, k, cos, sin):
            return q * 0.5 + q * torch.tanh(q), k * cos.unsqueeze(1) + k * sin.unsqueeze(1)

    rewritten = Rewritten(Gelu(), _inputs())
    assert not rewritten.result.rewrites and not rewritten.result.skipped


# --------------------------------------------------------------------------------------------------
# backends and end to end
# --------------------------------------------------------------------------------------------------


def test_backends_run_rope_between_norms_and_attention():
    passes = list(CpuBackend.graph_passes)
    assert passes.index("norms") < passes.index("rope") < passes.index("attention")
    assert "rope" not in TpuBackend.graph_passes  # opaque to XLA, which fuses it itself


def _end_to_end(model: nn.Module, inputs: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor], layers: int,
                words: list[str]) -> None:
    model.train()
    reference = twin(model)
    optimize(model, example_inputs=inputs, compile=False)
    report = report_of(model)
    rope = [r for r in report.rewrites if r.pass_name == "rope"]
    attention = [r for r in report.rewrites if r.pass_name == "attention"]
    assert len(rope) == layers and all(w in r.replacement for r in rope for w in words), rope
    assert len(attention) == layers, [s for s in report.skipped if s.pass_name == "attention"]
    assert not [s for s in report.skipped if s.pass_name == "rope"]
    assert not report.rollbacks
    out, expected = model(**fresh).logits, reference(**fresh).logits
    assert rel_err(out, expected) < 1e-5
    seed = torch.randn_like(out)
    out.backward(seed)
    expected.backward(seed)
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        if p_ref.grad is not None:
            assert rel_err(p.grad, p_ref.grad) < 1e-4, name


def test_hf_llama_end_to_end():
    torch.manual_seed(0)
    model, inputs, _ = _llama()
    fresh = {"input_ids": torch.randint(0, 101, inputs["input_ids"].shape)}
    _end_to_end(model, inputs, fresh, layers=2, words=["rotate-half", "q+k paired", "rotary dim 16"])


def test_hf_gptj_end_to_end():
    torch.manual_seed(0)
    config = transformers.GPTJConfig(vocab_size=101, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    model = transformers.GPTJForCausalLM(config)
    inputs = {"input_ids": torch.randint(0, 101, (2, 10))}
    fresh = {"input_ids": torch.randint(0, 101, (2, 10))}
    _end_to_end(model, inputs, fresh, layers=2, words=["interleaved", "q+k paired", "partial rotary 8/16"])
