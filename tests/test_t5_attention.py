"""T5's attention through the attention pass: unscaled scores (scale 1.0), a trainable relative position bias
added as the mask (it must receive its gradient), and the spelling of transformers' T5 before its attention
interface, ``scores += position_bias; softmax(scores.float()).type_as(scores)``, whose dtype read of the
scores is not a use of their values. Also the normalize rules it relies on: ``x += y`` out of place where
nobody can see the write, and SDPA's one spelling."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

from kernel_pytorch import optimize, report_of
from kernel_pytorch.passes.normalize import Normalize, is_call

from .conftest import capture_graph, rel_err, twin
from .test_attention_pass import B, H, L, Rewritten, _ctx, check, kwargs_of
from .test_sdpa_call_pass import _kernel_for


class T5AttentionBefore5_2x(nn.Module):
    """The core of transformers' T5Attention as it was written before the attention interface (what the GPU
    image's transformers may still run): the bias from a bucketed relative position embedding plus the
    padding mask, added in place; softmax in float32 cast back with ``type_as(scores)``; dropout."""

    def __init__(self, buckets: int = 8, dropout: float = 0.0):
        super().__init__()
        self.relative_attention_bias = nn.Embedding(2 * buckets, H)
        self.buckets, self.dropout = buckets, dropout

    def forward(self, q, k, v, mask):
        scores = torch.matmul(q, k.transpose(3, 2))
        relative = torch.arange(k.shape[2])[None, :] - torch.arange(q.shape[2])[:, None]
        buckets = relative.clamp(-self.buckets, self.buckets - 1) + self.buckets
        position_bias = self.relative_attention_bias(buckets).permute([2, 0, 1]).unsqueeze(0)
        position_bias = position_bias + mask[:, :, :, : k.shape[2]]
        scores += position_bias
        attn_weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = F.dropout(attn_weights, p=self.dropout, training=self.training)
        return torch.matmul(attn_weights, v)


class ScoresDtypeReadAfter(nn.Module):
    """The scores' dtype also read outside the attention: the reader gets the dtype, the scores go."""

    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1)
        out = torch.softmax(scores, -1) @ v
        return out.type_as(scores) * 2


def _t5_inputs(dtype=torch.float32):
    q, k, v = (torch.randn(B, H, L, 8, dtype=dtype) for _ in range(3))
    mask = torch.zeros(B, 1, 1, L, dtype=dtype)
    mask[1, ..., L - 2:] = torch.finfo(dtype).min  # T5's extended padding mask
    return q, k, v, mask


def _products(rewritten: Rewritten) -> list:
    return [n for n in rewritten.gm.graph.nodes if is_call(n, operator.matmul)]


@pytest.mark.parametrize("training", [True, False])
def test_t5_spelling_before_the_attention_interface_is_rewritten(training):
    rewritten = check(T5AttentionBefore5_2x(), _t5_inputs, training=training,
                      contains=("scale 1.0", "mask additive"), absent=("causal",))
    assert kwargs_of(rewritten)["scale"] == 1.0 and kwargs_of(rewritten)["mask"] is not None
    assert not _products(rewritten) and not rewritten.reasons  # Q·Kᵀ and ·V both gone; no skip line


def test_t5_position_bias_gets_a_kernel_with_a_mask_gradient_when_training():
    torch.manual_seed(0)
    rewritten = Rewritten(T5AttentionBefore5_2x().train(), _t5_inputs(), training=True)
    [call] = rewritten.calls
    assert _kernel_for(call, training=True) == "efficient"  # not cuDNN: it returns no gradient for the bias
    assert _kernel_for(call, training=False) == "cudnn"


def test_t5_spelling_in_bfloat16_upcasts_only_the_softmax():
    torch.manual_seed(0)
    module = T5AttentionBefore5_2x().to(torch.bfloat16).eval()
    inputs = _t5_inputs(torch.bfloat16)
    rewritten = Rewritten(module, inputs)
    assert len(rewritten.calls) == 1, rewritten.reasons
    fresh = _t5_inputs(torch.bfloat16)
    assert rel_err(rewritten(*fresh), module(*fresh)) < 2e-2


def test_a_dtype_read_outside_the_attention_keeps_its_dtype_and_frees_the_scores():
    rewritten = check(ScoresDtypeReadAfter(), lambda: tuple(torch.randn(B, H, L, 8) for _ in range(3)))
    assert not _products(rewritten)
    assert not [n for n in rewritten.gm.graph.nodes if is_call(n, "type_as")]


def test_t5_model_eager_attention_trains_with_its_bias_gradient():
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=101, d_model=48, d_kv=12, d_ff=80, num_layers=1, num_decoder_layers=1,
                                   num_heads=4, dropout_rate=0.0, attn_implementation="eager")
    model = transformers.T5Model(config).train()
    reference = twin(model)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    inputs = {"input_ids": torch.randint(0, 101, (2, 9)), "attention_mask": mask,
              "decoder_input_ids": torch.randint(0, 101, (2, 7))}
    optimize(model, example_inputs=inputs)
    report = report_of(model)
    lines = [r.replacement for r in report.rewrites if r.pass_name == "attention"]
    assert len(lines) == 3 and all("scale 1.0" in line and "mask additive" in line for line in lines), lines
    assert report.rollbacks == [] and report.verification.passed
    fresh = {**inputs, "input_ids": torch.randint(0, 101, (2, 9))}
    out, expected = model(**fresh).last_hidden_state, reference(**fresh).last_hidden_state
    assert rel_err(out, expected) < 1e-5
    seed = torch.randn_like(expected)
    (out * seed).sum().backward()
    (expected * seed).sum().backward()
    errors = {name: rel_err(p.grad, p_ref.grad) for (name, p), p_ref in zip(model.named_parameters(),
                                                                           reference.parameters())}
    assert any("relative_attention_bias" in name for name in errors)
    assert not {name: e for name, e in errors.items() if not e < 1e-4}, errors


# --------------------------------------------------------------------------------------------------
# the normalize rules
# --------------------------------------------------------------------------------------------------


class InPlace(nn.Module):
    def forward(self, a, b, c, half):
        fresh = a @ b
        fresh += c  # respelt: nobody else sees the product
        seen = a @ b
        view = seen.t()
        seen += c  # left: the write shows through the view
        cast = a.float()  # a is float32: .float() returns a itself, so the write would reach the input
        cast += 1
        narrow = half * 2
        narrow += c  # left: fp16 += fp32 stays fp16, fp16 + fp32 would be fp32
        return fresh, seen, view, cast, narrow


def _normalized(module: nn.Module, inputs: tuple) -> torch.fx.GraphModule:
    gm, example = capture_graph(module, inputs)
    Normalize().run(gm, _ctx())
    gm.recompile()
    return gm


def test_in_place_arithmetic_is_respelt_only_where_the_write_is_unseen():
    a, b, c = torch.randn(3, 4), torch.randn(4, 3), torch.randn(3, 3)
    inputs = (a, b, c, torch.randn(3, 3, dtype=torch.float16))
    gm = _normalized(InPlace(), inputs)
    in_place = [n for n in gm.graph.nodes if is_call(n, operator.iadd)]
    added = [n for n in gm.graph.nodes if is_call(n, operator.add)]
    assert len(added) == 1 and len(in_place) == 3, gm.code
    expected = InPlace()(*(t.clone() for t in inputs))
    for got, want in zip(gm(*(t.clone() for t in inputs)), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sdpa_has_one_spelling():
    class Spellings(nn.Module):
        def forward(self, q, k, v):
            return (F.scaled_dot_product_attention(q, k, v, None, 0.0, True),
                    F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True),
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=None))

    gm = _normalized(Spellings(), tuple(torch.randn(B, H, L, 8) for _ in range(3)))
    calls = [n for n in gm.graph.nodes if is_call(n, F.scaled_dot_product_attention)]
    assert len(calls) == 3
    assert {(tuple(n.args[3:]), tuple(sorted(n.kwargs.items()))) for n in calls} == {
        ((None, 0.0, True), (("enable_gqa", False), ("scale", None)))}
