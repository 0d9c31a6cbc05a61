"""The norm pass matches the mathematics of RMSNorm and LayerNorm, not one spelling: each spelling counted,
equal to the original in float32 (forward and gradients) and, in bfloat16, rounded where the original
rounds; spellings whose roundings the kernels do not make are skipped with a one-line reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernel_pytorch import optimize, report_of

from .conftest import assert_same_values_and_gradients, rel_err, twin

H = 40  # hidden size, odd on purpose
EPS = 1e-6


class _Norm(nn.Module):
    def __init__(self, weight: bool = True, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(H)) if weight else None
        self.bias = nn.Parameter(0.1 * torch.randn(H)) if bias else None


class T5Style(_Norm):  # statistic in float32, x in its own dtype, weight after a cast to the weight's dtype
    def forward(self, x):
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + EPS)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class StatisticUpcastOnly(_Norm):  # the cast back after normalizing, then the weight in x's dtype
    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(var + EPS)).to(x.dtype) * self.weight


class FloatOutput(_Norm):  # never cast back: a float32 output, which the kernel writes from x upcast
    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + EPS) * self.weight.float()


class GemmaOnePlus(_Norm):
    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class PowerMinusHalf(_Norm):
    def forward(self, x):
        x32 = x.float()
        return (x32 * (x32.pow(2).mean(-1, keepdim=True) + EPS) ** -0.5).to(x.dtype) * self.weight


class DivideBySqrtOfSquare(nn.Module):  # no weight; torch.square; a division
    def forward(self, x):
        x32 = x.to(torch.float32)
        return (x32 / torch.sqrt(torch.square(x32).mean(dim=-1, keepdim=True) + EPS)).type_as(x)


class TorchRMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(H, eps=EPS)

    def forward(self, x):
        return self.norm(x)


class ResidualT5(nn.Module):  # the residual add before the norm is fused
    def __init__(self):
        super().__init__()
        self.f, self.norm, self.g = nn.Linear(H, H), T5Style(), nn.Linear(H, H)

    def forward(self, x):
        h = x + self.f(x)
        return h + self.g(self.norm(h))


class LayerNormSquares(_Norm):  # ((x - mean) ** 2).mean, weight and bias, in float32 with a cast back
    def forward(self, x):
        x32 = x.float()
        mean = x32.mean(-1, keepdim=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdim=True)
        return ((x32 - mean) / torch.sqrt(var + EPS) * self.weight + self.bias).to(x.dtype)


class LayerNormVariance(_Norm):  # x.var(unbiased=False), no weight, no bias
    def forward(self, x):
        x32 = x.float()
        centered = x32 - x32.mean(-1, keepdim=True)
        return (centered / torch.sqrt(x32.var(-1, unbiased=False, keepdim=True) + EPS)).to(x.dtype)


class LayerNormCorrectionZero(_Norm):  # torch.var(correction=0), weight only
    def forward(self, x):
        x32 = x.float()
        variance = torch.var(x32, -1, correction=0, keepdim=True)
        normed = (x32 - torch.mean(x32, -1, keepdim=True)) * torch.rsqrt(variance + EPS)
        return (self.weight.float() * normed).to(x.dtype)


class CohereStyle(_Norm):  # the centered value computed twice
    def forward(self, x):
        x32 = x.to(torch.float32)
        mean = x32.mean(-1, keepdim=True)
        variance = (x32 - mean).pow(2).mean(-1, keepdim=True)
        x32 = (x32 - mean) * torch.rsqrt(variance + EPS)
        return (self.weight.to(torch.float32) * x32).to(x.dtype)


class OlmoStyle(nn.Module):  # F.layer_norm on x upcast, cast back
    def forward(self, x):
        return F.layer_norm(x.to(dtype=torch.float32), (H,), None, None, eps=1e-5).to(x.dtype)


# module -> (norms rewritten, words of the report line, the constructor's keyword arguments)
SPELLINGS = {
    T5Style: (1, ["RMSNorm", "weight"], {}),
    StatisticUpcastOnly: (1, ["RMSNorm", "weight"], {}),
    FloatOutput: (1, ["RMSNorm", "weight"], {}),
    GemmaOnePlus: (1, ["RMSNorm", "weight + 1 in the kernel"], {}),
    PowerMinusHalf: (1, ["RMSNorm", "weight"], {}),
    DivideBySqrtOfSquare: (1, ["RMSNorm"], {}),
    TorchRMSNorm: (1, ["RMSNorm", "weight"], {}),
    ResidualT5: (1, ["RMSNorm", "residual add fused"], {}),
    LayerNormSquares: (1, ["LayerNorm", "weight", "bias"], {"bias": True}),
    LayerNormVariance: (1, ["LayerNorm"], {"weight": False}),
    LayerNormCorrectionZero: (1, ["LayerNorm", "weight"], {}),
    CohereStyle: (1, ["LayerNorm", "weight"], {}),
    OlmoStyle: (1, ["LayerNorm"], {}),
}
# Where bf16 rounds before the weight, the rewrite keeps that rounding (cast_before_weight).
CAST_BEFORE_WEIGHT_IN_BF16 = {T5Style, StatisticUpcastOnly, PowerMinusHalf, ResidualT5}


def _build(module_type):
    torch.manual_seed(0)
    return module_type(**SPELLINGS[module_type][2])


def _norm_rewrites(model):
    return [r.replacement for r in report_of(model).rewrites if r.pass_name == "norms"]


@pytest.mark.parametrize("module_type", SPELLINGS, ids=lambda t: t.__name__)
def test_spelling_is_rewritten_with_equal_values_and_gradients(module_type):
    model = _build(module_type).train()
    reference = twin(model)
    optimize(model, example_inputs=(torch.randn(3, 5, H),))
    rewrites = _norm_rewrites(model)
    count, words, _ = SPELLINGS[module_type]
    assert len(rewrites) == count, report_of(model).skipped
    assert all(word in " ".join(rewrites) for word in words), rewrites
    assert not report_of(model).rollbacks
    assert_same_values_and_gradients(model, reference, torch.randn(2, 7, H))


@pytest.mark.parametrize("module_type", SPELLINGS, ids=lambda t: t.__name__)
def test_bf16_spelling_keeps_the_original_rounding(module_type):
    model = _build(module_type).to(torch.bfloat16).eval()
    reference = twin(model)
    optimize(model, example_inputs=(torch.randn(3, 5, H, dtype=torch.bfloat16),))
    rewrites = _norm_rewrites(model)
    assert len(rewrites) == SPELLINGS[module_type][0], report_of(model).skipped
    assert ("cast before weight" in " ".join(rewrites)) == (module_type in CAST_BEFORE_WEIGHT_IN_BF16), rewrites
    x = torch.randn(64, H, dtype=torch.bfloat16)
    with torch.no_grad():
        out, expected = model(x), reference(x)
    assert out.dtype == expected.dtype
    # Same rounding points: only the float32 sum order differs, which moves a bf16 rounding rarely;
    # a rounding moved (before the weight or not) changes about a third of the elements.
    assert (out == expected).float().mean() > 0.97, rel_err(out, expected)


class Bf16Statistic(_Norm):  # the mean of squares rounded to bf16: the kernel would compute it in float32
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


class SquareRoundedThenUpcast(_Norm):  # the squares rounded to bf16 before the float32 mean
    def forward(self, x):
        var = x.pow(2).float().mean(-1, keepdim=True)
        return (x * torch.rsqrt(var + EPS)).to(x.dtype) * self.weight


class LayerNormRoundedBeforeWeight(_Norm):  # the fused LayerNorm rounds once, after weight and bias
    def forward(self, x):
        x32 = x.float()
        mean = x32.mean(-1, keepdim=True)
        normed = (x32 - mean) * torch.rsqrt(((x32 - mean) ** 2).mean(-1, keepdim=True) + EPS)
        return normed.to(x.dtype) * self.weight + self.bias


class UnbiasedVariance(nn.Module):  # divides by n - 1: not LayerNorm
    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + EPS)


# module -> (dtype, words of the skip reason)
SKIPPED = {
    Bf16Statistic: (torch.bfloat16, "rounding points"),
    SquareRoundedThenUpcast: (torch.bfloat16, "rounding points"),
    LayerNormRoundedBeforeWeight: (torch.bfloat16, "rounds once"),
    UnbiasedVariance: (torch.float32, "unbiased"),
}


@pytest.mark.parametrize("module_type", SKIPPED, ids=lambda t: t.__name__)
def test_roundings_the_kernel_does_not_make_are_skipped_with_a_reason(module_type):
    dtype, words = SKIPPED[module_type]
    torch.manual_seed(0)
    model = (module_type(bias=True) if issubclass(module_type, _Norm) else module_type()).to(dtype)
    reference = twin(model)
    optimize(model, example_inputs=(torch.randn(3, 5, H, dtype=dtype),))
    assert not _norm_rewrites(model)
    reasons = [s.reason for s in report_of(model).skipped if s.pass_name == "norms"]
    assert len(reasons) == 1 and words in reasons[0] and "\n" not in reasons[0], reasons
    x = torch.randn(4, H, dtype=dtype)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


class NormOfASum(nn.Module):  # x + f(x) feeds only the norm (T5's reads it twice): fused all the same
    def __init__(self):
        super().__init__()
        self.f, self.norm = nn.Linear(H, H), T5Style()

    def forward(self, x):
        return self.norm(x + self.f(x))


def test_a_sum_read_only_by_the_norm_is_fused_too():
    model = NormOfASum()
    reference = twin(model)
    optimize(model, example_inputs=(torch.randn(3, 5, H),))
    rewrites = _norm_rewrites(model)
    assert len(rewrites) == 1 and "residual add fused" in rewrites[0], rewrites
    assert_same_values_and_gradients(model, reference, torch.randn(2, 7, H))
