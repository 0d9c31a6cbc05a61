"""The norm pass on a zoo of RMSNorm / LayerNorm spellings: rewrite counts, numerics and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernel_pytorch import optimize, report_of
from kernel_pytorch.testing import RMSNorm

from .conftest import assert_same_values_and_gradients, rel_err, twin

H = 40  # hidden size, odd on purpose


class LlamaRMS(nn.Module):  # upcast, rsqrt, cast back, then weight (HF rounding; a no-op cast in float32)
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(H)

    def forward(self, x):
        return self.norm(x)


class SqrtDivide(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H))

    def forward(self, x):
        return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6) * self.weight


class NoWeight(nn.Module):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class GemmaStyle(nn.Module):  # (1 + w) computed in the graph is still one value per feature
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H) * 0.1)

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(H))
        self.b = nn.Parameter(torch.randn(H))

    def forward(self, x):
        return F.rms_norm(x, (H,), self.w, 1e-6) + F.layer_norm(x, (H,), self.w, self.b, 1e-5)


class Modules(nn.Module):
    def __init__(self):
        super().__init__()
        self.rms = nn.RMSNorm(H, eps=1e-6)
        self.ln = nn.LayerNorm(H)
        self.ln_no_affine = nn.LayerNorm(H, elementwise_affine=False)

    def forward(self, x):
        return self.rms(x) * self.ln(x) + self.ln_no_affine(x)


class HandLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H))
        self.bias = nn.Parameter(torch.randn(H))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        centered = x - mean
        var = (centered ** 2).mean(-1, keepdim=True)
        return centered / torch.sqrt(var + 1e-5) * self.weight + self.bias


class ResidualBlock(nn.Module):  # h = x + f(x) feeds the norm and continues as the residual stream
    def __init__(self):
        super().__init__()
        self.f = nn.Linear(H, H)
        self.norm = RMSNorm(H)
        self.g = nn.Linear(H, H)

    def forward(self, x):
        h = x + self.f(x)
        return h + self.g(self.norm(h))


ZOO = {
    LlamaRMS: ["RMSNorm", "weight"],
    SqrtDivide: ["RMSNorm", "weight"],
    NoWeight: ["RMSNorm"],
    GemmaStyle: ["RMSNorm", "weight + 1 in the kernel"],
    Functional: ["RMSNorm", "LayerNorm"],
    Modules: ["RMSNorm", "LayerNorm", "LayerNorm"],
    HandLayerNorm: ["LayerNorm"],
    ResidualBlock: ["RMSNorm", "residual add fused"],
}
EXPECTED_COUNTS = {LlamaRMS: 1, SqrtDivide: 1, NoWeight: 1, GemmaStyle: 1, Functional: 2, Modules: 3,
                   HandLayerNorm: 1, ResidualBlock: 1}


@pytest.mark.parametrize("module_type", ZOO, ids=lambda t: t.__name__)
def test_zoo_rewrites_and_numerics(module_type):
    torch.manual_seed(0)
    model = module_type().train()
    reference = twin(model)
    optimize(model, example_inputs=(torch.randn(3, 5, H),))
    rewrites = [r for r in report_of(model).rewrites if r.pass_name == "norms"]
    assert len(rewrites) == EXPECTED_COUNTS[module_type], report_of(model).skipped
    described = " ".join(r.replacement for r in rewrites)
    assert all(word in described for word in ZOO[module_type]), described
    assert not report_of(model).rollbacks
    assert_same_values_and_gradients(model, reference, torch.randn(2, 7, H))


def test_bf16_gemma_norm_adds_its_one_in_the_kernel_bit_for_bit():
    """Gemma's ``(1 + w.float())`` is the kernel's weight offset: the sum and its cast leave the graph (a kernel each
    per norm, forward and backward, once compiled), and the result is the model's to the bit."""
    torch.manual_seed(0)
    model = GemmaStyle().to(torch.bfloat16).eval()
    reference = twin(model)
    optimize(model, example_inputs=(torch.randn(3, 5, H, dtype=torch.bfloat16),))
    rewrites = [r.replacement for r in report_of(model).rewrites if r.pass_name == "norms"]
    assert rewrites == ["RMSNorm(eps=1e-06, weight + 1 in the kernel)"], rewrites
    x = torch.randn(4, 9, H, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_bf16_llama_norm_keeps_its_rounding():
    torch.manual_seed(0)
    model = LlamaRMS().to(torch.bfloat16).eval()
    reference = twin(model)
    optimize(model, example_inputs=(torch.randn(3, 5, H, dtype=torch.bfloat16),))
    rewrites = [r.replacement for r in report_of(model).rewrites if r.pass_name == "norms"]
    assert len(rewrites) == 1 and "cast before weight" in rewrites[0], rewrites
    x = torch.randn(4, 9, H, dtype=torch.bfloat16)
    with torch.no_grad():
        assert rel_err(model(x), reference(x)) < 1e-2


class NotANorm(nn.Module):
    def forward(self, x):
        over_rows = x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-5)  # wrong axis
        no_keepdim = torch.rsqrt(x.pow(2).mean(-1) + 1e-5).unsqueeze(-1) * x  # mean without keepdim
        other = x * torch.rsqrt(x.abs().mean(-1, keepdim=True) + 1e-5)  # not a mean of squares
        return over_rows + no_keepdim + other


def test_lookalikes_are_skipped_with_reasons():
    torch.manual_seed(0)
    model = NotANorm()
    reference = twin(model)
    optimize(model, example_inputs=(torch.randn(6, H),))
    report = report_of(model)
    assert not [r for r in report.rewrites if r.pass_name == "norms"]
    reasons = [s.reason for s in report.skipped if s.pass_name == "norms"]
    assert len(reasons) == 3 and all("statistic" in r or "variance" in r or "rsqrt" in r for r in reasons), reasons
    x = torch.randn(6, H)
    assert rel_err(model(x), reference(x)) < 1e-6


def test_mixed_precision_weight_is_skipped():
    model = LlamaRMS()
    model.norm.weight.data = model.norm.weight.data.double()
    optimize(model, example_inputs=(torch.randn(2, 3, H),))
    reasons = [s.reason for s in report_of(model).skipped if s.pass_name == "norms"]
    assert any("dtype" in r for r in reasons), reasons
