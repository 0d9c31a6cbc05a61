"""The activations pass on a zoo of SiLU / GELU / gated-MLP spellings: rewrite counts, numerics and gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernel_pytorch import optimize, report_of

from .conftest import assert_same_values_and_gradients, capture_graph, rel_err, twin

D, F_DIM = 24, 40  # model and MLP widths


class _MLP(nn.Module):
    def __init__(self, packed: bool = False, bias: bool = False):
        super().__init__()
        if packed:
            self.gate_up = nn.Linear(D, 2 * F_DIM, bias=bias)
        else:
            self.gate, self.up = nn.Linear(D, F_DIM, bias=bias), nn.Linear(D, F_DIM, bias=bias)
        self.down = nn.Linear(F_DIM, D, bias=bias)


class SwiGLU(_MLP):  # Llama, Mistral, Qwen
    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SwiGLUSigmoid(_MLP):  # SiLU written out, product operands swapped
    def forward(self, x):
        g = self.gate(x)
        return self.down(self.up(x) * (g * torch.sigmoid(g)))


class GeGLUTanh(_MLP):
    def forward(self, x):
        return self.down(F.gelu(self.gate(x), approximate="tanh") * self.up(x))


class PackedSwiGLU(_MLP):  # one concatenated projection (Phi-3)
    def __init__(self):
        super().__init__(packed=True)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class PackedUpFirst(_MLP):  # the other half order
    def __init__(self):
        super().__init__(packed=True)

    def forward(self, x):
        up, gate = torch.chunk(self.gate_up(x), 2, -1)
        return self.down(F.gelu(gate) * up)


class GPT2Gelu(nn.Module):  # transformers' NewGELUActivation, written out, with biases
    def __init__(self):
        super().__init__()
        self.fc, self.proj = nn.Linear(D, F_DIM), nn.Linear(F_DIM, D)

    def forward(self, x):
        h = self.fc(x)
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.proj(h)


class ErfGeluRegrouped(nn.Module):  # BERT's old gelu, constants grouped differently
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, F_DIM)

    def forward(self, x):
        h = self.fc(x)
        return h * (1.0 + torch.erf(h / math.sqrt(2.0))) * 0.5


class PlainActivations(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        return F.silu(h) + F.gelu(h) + nn.functional.gelu(h * 2, approximate="tanh")


class UsedTwice(_MLP):  # the activation is also read elsewhere: activation alone, product stays
    def forward(self, x):
        a = F.silu(self.gate(x))
        return self.down(a * self.up(x)) + self.down(a)


class Broadcast(nn.Module):  # act(gate) * a per-feature scale: not gated (shapes differ)
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(F_DIM))
        self.fc = nn.Linear(D, F_DIM)

    def forward(self, x):
        return F.silu(self.fc(x)) * self.scale


# module -> (rewrite count, words every description has)
ZOO = {
    SwiGLU: (1, ("gated silu", "separate")),
    SwiGLUSigmoid: (1, ("gated silu", "separate")),
    GeGLUTanh: (1, ("gated gelu_tanh",)),
    PackedSwiGLU: (1, ("gated silu", "packed")),
    PackedUpFirst: (1, ("gated gelu", "packed")),
    GPT2Gelu: (1, ("gelu_tanh",)),
    ErfGeluRegrouped: (1, ("gelu",)),
    PlainActivations: (3, ()),
    UsedTwice: (1, ("silu",)),
    Broadcast: (1, ("silu",)),
}


def _optimized(model: nn.Module, *inputs):
    optimize(model, example_inputs=inputs, extra_passes=())
    return [r for r in report_of(model).rewrites if r.pass_name == "activations"]


@pytest.mark.parametrize("module_type", ZOO, ids=lambda t: t.__name__)
def test_zoo_rewrites_and_numerics(module_type):
    torch.manual_seed(0)
    model = module_type().train()
    reference = twin(model)
    rewrites = _optimized(model, torch.randn(3, 5, D))
    count, words = ZOO[module_type]
    assert len(rewrites) == count, (rewrites, report_of(model).skipped)
    described = " ".join(r.replacement for r in rewrites)
    assert all(word in described for word in words), described
    assert not report_of(model).rollbacks
    assert_same_values_and_gradients(model, reference, torch.randn(2, 7, D))


class WrongConstant(nn.Module):  # looks like GELU, is not: 0.5 instead of 0.044715
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.5 * torch.pow(x, 3.0))))


class SigmoidOfAnother(nn.Module):  # x * sigmoid(y): a gate, not SiLU
    def forward(self, x):
        return x * torch.sigmoid(x * 2.0)


def test_lookalikes_are_left_alone_with_reasons():
    torch.manual_seed(0)
    model = WrongConstant()
    assert _optimized(model, torch.randn(4, D)) == []
    skipped = [s.reason for s in report_of(model).skipped if s.pass_name == "activations"]
    assert len(skipped) == 1 and "not gelu_tanh's argument" in skipped[0], skipped
    other = SigmoidOfAnother()
    assert _optimized(other, torch.randn(4, D)) == []
    x = torch.randn(3, D)
    assert rel_err(other(x), SigmoidOfAnother.forward(other, x)) == 0.0


def test_gelu_tanh_after_a_biased_linear_becomes_linear_activation():
    from kernel_pytorch.ops.activations import linear_activation

    torch.manual_seed(0)
    model = GPT2Gelu()
    reference = twin(model)
    example = torch.randn(3, D)
    rewritten, inputs = _capture_rewritten(model, example)
    calls = [n for n in rewritten.graph.nodes if n.target is linear_activation]
    assert len(calls) == 1 and calls[0].args[3] == "gelu_tanh"
    assert not [n for n in rewritten.graph.nodes if n.target is F.linear and n.users and
                all(u.target is linear_activation for u in n.users)]
    x = torch.randn(3, D)
    assert rel_err(rewritten(*[x if a is example else a for a in inputs])[0], reference(x)) < 1e-5


def _capture_rewritten(model: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list]:
    """``model``'s Dynamo graph after normalize + the activations pass, and its example arguments."""
    from kernel_pytorch.config import OptimizeConfig
    from kernel_pytorch.hardware import detect_hardware
    from kernel_pytorch.passes.activations import ActivationPass
    from kernel_pytorch.passes.base import PassContext
    from kernel_pytorch.passes.normalize import Normalize

    gm, inputs = capture_graph(model, (x,))
    ctx = PassContext(hardware=detect_hardware("cpu"), config=OptimizeConfig(), training=False)
    Normalize().run(gm, ctx)
    ActivationPass().run(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    return gm, inputs


def test_bf16_gated_mlp_within_bf16_tolerance():
    torch.manual_seed(0)
    model = SwiGLU().to(torch.bfloat16)
    reference = twin(model)
    assert len(_optimized(model, torch.randn(3, 5, D, dtype=torch.bfloat16))) == 1
    x = torch.randn(4, 9, D, dtype=torch.bfloat16)
    assert rel_err(model(x), reference(x)) < 1e-2  # one rounding instead of two


def test_hugging_face_llama_and_gpt2_mlps():
    from .hf_models import gpt2, llama

    for factory, words in ((llama, "gated silu"), (gpt2, "gelu_tanh")):
        torch.manual_seed(0)
        model, inputs, key = factory()
        model.eval()
        reference = twin(model)
        optimize(model, example_inputs=inputs, extra_passes=())
        rewrites = [r for r in report_of(model).rewrites if r.pass_name == "activations"]
        layers = model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer
        assert len(rewrites) == layers and all(words in r.replacement for r in rewrites), rewrites
        assert not report_of(model).rollbacks
        with torch.no_grad():
            assert rel_err(getattr(model(**inputs), key), getattr(reference(**inputs), key)) < 1e-5


def test_transformers_activation_classes_are_matched():
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    for name, kind in (("silu", "silu"), ("gelu", "gelu"), ("gelu_new", "gelu_tanh"),
                       ("gelu_pytorch_tanh", "gelu_tanh")):
        act = ACT2FN[name]
        model = nn.Sequential(nn.Linear(D, D), act)
        reference = twin(model)
        rewrites = _optimized(model, torch.randn(2, D))
        expected = "linear + gelu_tanh (GEMM epilogue in inference)" if kind == "gelu_tanh" else kind
        assert [r.replacement for r in rewrites] == [expected], (name, rewrites)
        x = torch.randn(5, D)
        assert rel_err(model(x), reference(x)) < 1e-5
