"""Soft-capped attention (Gemma-2's ``cap * tanh(scores / cap)`` before the mask and softmax): matched by the
attention pass with the cap, its windows and causal masks recognized as for any attention, and handed to the
kernels that compute a cap: FlexAttention (a ``score_mod``) and, everywhere else, PyTorch's ops. Gemma-2 in
transformers 5.x runs eager attention by default (its SDPA path is refused: SDPA has no soft cap)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers

from kernel_pytorch import optimize, report_of
from kernel_pytorch.attention.dispatch import choose_kernel
from kernel_pytorch.attention.kernels.problem import AttentionProblem
from kernel_pytorch.attention.kernels.registry import eligible_kernels
from kernel_pytorch.attention.kernels.softcap import softcapped_attention_math
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.hardware import detect_hardware
from kernel_pytorch.ops.attention import attention
from kernel_pytorch.passes.attention import AttentionPass, _attention_op
from kernel_pytorch.passes.base import PassContext
from kernel_pytorch.passes.context_parallel import _unshardable_attention
from kernel_pytorch.passes.normalize import Normalize

from .conftest import capture_graph, rel_err, twin
from .test_attention_pass import _qkv, check, kwargs_of
from .test_sdpa_call_pass import _NVIDIA


class Gemma2Attention(nn.Module):
    """Gemma-2's eager attention: scaled scores, divided by the cap, tanh, times the cap, then the mask."""

    def __init__(self, cap: float = 50.0, window: int | None = None):
        super().__init__()
        self.cap, self.window = cap, window

    def forward(self, q, k, v):
        i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
        allowed = (j <= i) if self.window is None else (j <= i) & (j > i - self.window)
        mask = torch.where(allowed, 0.0, torch.finfo(q.dtype).min)
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.125
        scores = torch.tanh(scores / self.cap) * self.cap + mask
        return torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype) @ v


def _large_scores():
    q, k, v = _qkv()
    return q * 8, k * 8, v  # scores of order 50: the cap changes them


@pytest.mark.parametrize("window, contains", [(None, ("causal", "no mask")), (3, ("causal sliding window 3",))])
def test_soft_capped_attention_is_rewritten_with_equal_values_and_gradients(window, contains):
    rewritten = check(Gemma2Attention(cap=5.0, window=window), _large_scores, training=True,
                      contains=("soft cap 5.0", "scale 0.125", *contains))
    assert kwargs_of(rewritten)["softcap"] == 5.0
    assert not [n for n in rewritten.gm.graph.nodes if n.target is torch.tanh]


def test_a_call_without_a_cap_gets_no_softcap_argument():
    class Plain(nn.Module):
        def forward(self, q, k, v):
            return torch.softmax(q @ k.mT * 0.125, -1) @ v

    assert "softcap" not in kwargs_of(check(Plain(), _qkv))


def test_soft_capped_attention_keeps_its_cap_for_context_parallelism_to_refuse():
    """The attention pass rewrites it as anywhere else; the context-parallel pass then refuses the call by its
    cap (ring attention has none), as it refuses any call it cannot shard."""
    gm, inputs = capture_graph(Gemma2Attention(), _qkv())
    config = OptimizeConfig().model_copy(update={"context_parallel": "a process group"})
    ctx = PassContext(hardware=detect_hardware("cpu"), config=config, training=False)
    Normalize().run(gm, ctx)
    result = AttentionPass().run(gm, ctx)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _attention_op()]
    assert len(result.rewrites) == 1 and len(calls) == 1 and calls[0].kwargs["softcap"] == 50.0
    assert _unshardable_attention(calls[0], result) == "soft-capped attention (cap 50.0): ring attention has no cap"


# --------------------------------------------------------------------------------------------------
# the kernels
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["causal", "band"])
def test_flex_applies_the_cap_as_its_score_mod(how):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 40, 16) * 3, torch.randn(2, 2, 40, 16) * 3, torch.randn(2, 2, 40, 16)
    distance = torch.arange(40)[:, None] - torch.arange(40)[None, :]
    band = (distance >= 0) & (distance <= 7)
    options = {"is_causal": True} if how == "causal" else {"pattern": ("band", 0, 7)}
    expected = softcapped_attention_math(q, k, v, None if how == "causal" else band, 0.0, how == "causal",
                                         scale=0.25, enable_gqa=True, softcap=5.0)
    out = attention(q, k, v, scale=0.25, enable_gqa=True, kernel="flex", softcap=5.0, **options)  # forward: CPU
    assert rel_err(out, expected) < 1e-5


def test_kernels_without_a_cap_refuse_it():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="has no soft cap; use one of flex or 'sdpa'"):
        attention(q, k, v, is_causal=True, kernel="cpu_flash", softcap=5.0)


def test_only_flex_and_pytorchs_ops_are_eligible_for_a_cap():
    q, k, v = (torch.empty(2, 8, 1024, 128, dtype=torch.bfloat16, device="meta") for _ in range(3))
    problem = AttentionProblem.from_tensors(q, k, v, None, is_causal=True, dropout_p=0.0, enable_gqa=False,
                                            training=True, softcap=50.0)
    eligible, rejected = eligible_kernels(problem, _NVIDIA)
    assert eligible == ["flex", "sdpa"], rejected
    assert rejected["cudnn"] == "cudnn has no soft-capping of the scores"
    kernel, why = choose_kernel(q, k, v, None, is_causal=True, dropout_p=0.0, enable_gqa=False, hardware=_NVIDIA,
                                training=True, softcap=50.0)
    assert kernel == "sdpa" and "flex: eligible, but taken only when measured fastest on a GPU" in why


# --------------------------------------------------------------------------------------------------
# Gemma-2 from transformers, its default (eager) attention
# --------------------------------------------------------------------------------------------------


def _gemma2(padded: bool):
    config = transformers.Gemma2Config(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=64, sliding_window=4, attn_logit_softcapping=5.0)
    inputs = {"input_ids": torch.randint(0, 101, (2, 10))}
    if padded:
        inputs["attention_mask"] = torch.ones(2, 10, dtype=torch.long)
        inputs["attention_mask"][1, 7:] = 0
    return transformers.Gemma2ForCausalLM(config), inputs


@pytest.mark.parametrize("training, padded", [(True, False), (False, True)])
def test_gemma2_soft_capped_layers_are_rewritten_and_match(training, padded):
    torch.manual_seed(0)
    model, inputs = _gemma2(padded)  # eager attention: transformers' default for Gemma-2 (5.24)
    model.train(training)
    reference = twin(model)
    optimize(model, example_inputs=inputs)
    report = report_of(model)
    lines = [r.replacement for r in report.rewrites if r.pass_name == "attention"]
    assert len(lines) == 2 and all("soft cap 5.0" in line and "gqa 4/2" in line for line in lines), lines
    if not padded:  # layer 0 slides a window of 4, layer 1 is global
        assert "causal sliding window 4" in lines[0] and "causal" in lines[1] and "no mask" in lines[1], lines
    assert report.rollbacks == [] and report.verification.passed, report.verification
    fresh = {**inputs, "input_ids": torch.randint(0, 101, (2, 10))}
    with torch.set_grad_enabled(training):
        out, expected = model(**fresh).logits, reference(**fresh).logits
    assert rel_err(out, expected) < 1e-5
    if training:
        seed = torch.randn_like(expected)
        (out * seed).sum().backward()
        (expected * seed).sum().backward()
        errors = {name: rel_err(p.grad, p_ref.grad) for (name, p), p_ref in zip(model.named_parameters(),
                                                                               reference.parameters())}
        assert not {name: e for name, e in errors.items() if not e < 1e-4}, errors

