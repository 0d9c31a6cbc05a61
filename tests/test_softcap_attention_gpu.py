"""On an NVIDIA GPU (``pytest -m gpu``): soft-capped attention on FlexAttention (its ``score_mod``), compiled,
forward and backward against PyTorch's ops in float32; and Gemma-2 (eager attention, soft cap 50, sliding and
global layers) through optimize in bf16, where the dispatcher measures FlexAttention against PyTorch's ops."""

from __future__ import annotations

import pytest
import torch
import transformers

import kernel_pytorch.attention.kernels.flex as flex
from kernel_pytorch import optimize, report_of
from kernel_pytorch.attention.kernels.softcap import softcapped_attention_math
from kernel_pytorch.ops.attention import attention

from .conftest import rel_err, twin

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("gpu tests were selected (-m gpu) but torch.cuda.is_available() is False")


def _soft_cap_inputs(batch: int, length: int) -> tuple[torch.Tensor, ...]:
    """q (8 heads) and k, v (4 heads) of head dim 64 on the GPU, q and k scaled so that the cap of 20 bites."""
    torch.manual_seed(0)
    q = (torch.randn(batch, 8, length, 64, device="cuda") * 4).requires_grad_()
    k = (torch.randn(batch, 4, length, 64, device="cuda") * 4).requires_grad_()
    v = torch.randn(batch, 4, length, 64, device="cuda", requires_grad=True)
    return q, k, v


def _window(length: int, hi: int) -> torch.Tensor:
    """The bool mask of the band ("band", 0, hi): query i sees keys i - hi .. i."""
    distance = torch.arange(length, device="cuda")[:, None] - torch.arange(length, device="cuda")[None, :]
    return (distance >= 0) & (distance <= hi)


def _assert_matches_with_gradients(out: torch.Tensor, expected: torch.Tensor, inputs: tuple[torch.Tensor, ...]):
    assert rel_err(out, expected) < 1e-3
    seed = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, seed)
    expected_grads = torch.autograd.grad(expected, inputs, seed)
    for got, want in zip(grads, expected_grads):
        assert rel_err(got, want) < 1e-3


@pytest.mark.parametrize("length", [1024, 1000])  # 1000: the last tiles cut short (band_blocks' partial edges)
@pytest.mark.parametrize("how", ["causal", "window"])
def test_flex_soft_cap_forward_and_backward_compiled(how, length):
    q, k, v = _soft_cap_inputs(2, length)
    options = {"is_causal": True} if how == "causal" else {"pattern": ("band", 0, 255)}

    def flex(q, k, v):
        return attention(q, k, v, scale=0.125, enable_gqa=True, kernel="flex", softcap=20.0, **options)

    out = torch.compile(flex, fullgraph=True)(q, k, v)
    expected = softcapped_attention_math(q, k, v, None if how == "causal" else _window(length, 255), 0.0,
                                         how == "causal", scale=0.125, enable_gqa=True, softcap=20.0)
    _assert_matches_with_gradients(out, expected, (q, k, v))


def test_flex_called_outside_compile_runs_fused_and_matches_the_math(recwarn):
    """A rewritten graph run eagerly (the verification's runs) gets FlexAttention's fused kernel, not the unfused
    reference that warns and materializes the scores; same numbers, gradients included."""
    q, k, v = _soft_cap_inputs(1, 2048)
    out = attention(q, k, v, scale=0.125, enable_gqa=True, kernel="flex", softcap=20.0, pattern=("band", 0, 511))
    expected = softcapped_attention_math(q, k, v, _window(2048, 511), 0.0, False, scale=0.125, enable_gqa=True,
                                         softcap=20.0)
    assert not [w for w in recwarn.list if "without torch.compile" in str(w.message)]
    _assert_matches_with_gradients(out, expected, (q, k, v))


def test_gemma2_trains_on_flex_with_its_soft_cap_in_bf16(monkeypatch):
    # The verification runs the rewritten graphs eagerly inside optimize's Dynamo backend: there FlexAttention must
    # still be the fused kernel, compiled on its own (until 2026-11-27 it ran the unfused reference there).
    fused_calls = []
    fused = flex._fused_flex_attention
    monkeypatch.setattr(flex, "_fused_flex_attention", lambda: fused_calls.append(1) or fused())
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                       max_position_embeddings=4096, sliding_window=512)
    # eager: the attention that soft-caps (transformers 5.17 on a GPU defaults Gemma-2 to SDPA, which does not)
    config._attn_implementation = "eager"
    model = transformers.Gemma2ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).train()
    reference = twin(model)
    tokens = {"input_ids": torch.randint(0, 512, (2, 2048), device="cuda")}
    optimize(model, example_inputs=tokens)
    lines = [r.replacement for r in report_of(model).rewrites if r.pass_name == "attention"]
    assert len(lines) == 2 and all("soft cap 50.0" in line for line in lines), lines
    assert "causal sliding window 512" in lines[0], lines
    assert all(line.startswith("attention[flex]") for line in lines), lines  # measured against PyTorch's ops
    assert fused_calls, "the verification's FlexAttention calls did not run fused"
    fresh = {"input_ids": torch.randint(0, 512, (2, 2048), device="cuda")}
    out, expected = model(**fresh).logits, reference(**fresh).logits
    assert rel_err(out, expected) < 2e-2
    out.float().square().mean().backward()
    expected.float().square().mean().backward()
    errors = {name: rel_err(p.grad, p_ref.grad) for (name, p), p_ref in zip(model.named_parameters(),
                                                                           reference.parameters())}
    assert not {name: e for name, e in errors.items() if not e < 4e-2}, errors
