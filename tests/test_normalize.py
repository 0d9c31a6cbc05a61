"""The normalization pass: every spelling of a family becomes the canonical one, numerics unchanged.

Each family is written as a tiny module with several spellings, captured both by TorchDynamo (the
product's capture path) and by ``torch.fx.symbolic_trace``; after the pass the canonical targets are
counted, the other spellings must be gone, and the graph must compute exactly what it did before.
"""

from __future__ import annotations

import operator
import warnings
from collections import Counter
from typing import Any, Callable

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.passes.shape_prop import ShapeProp

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.hardware import detect_hardware
from kernel_pytorch.passes.base import PassContext
from kernel_pytorch.passes.normalize import Normalize, is_call
from kernel_pytorch.passes.registry import get_pass

CTX = PassContext(hardware=detect_hardware("cpu"), config=OptimizeConfig(), training=False)
CAPTURES = ("dynamo", "symbolic_trace")


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


class Captured:
    """A graph module and how to call it with fresh user inputs (Dynamo adds parameters as inputs)."""

    def __init__(self, gm: torch.fx.GraphModule, call: Callable[..., Any]):
        self.gm = gm
        self.call = call


def capture_dynamo(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Captured:
    torch._dynamo.reset()
    box: dict[str, Any] = {}

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any]):
        box["gm"], box["example_inputs"] = gm, list(example_inputs)
        return gm.forward

    torch.compile(module, backend=capture, fullgraph=True)(*inputs)
    gm, example_inputs = box["gm"], box["example_inputs"]

    def call(*fresh: torch.Tensor) -> Any:
        # Dynamo passes the user's own tensors as example inputs; swap in the fresh ones.
        replacements = {id(old): new for old, new in zip(inputs, fresh)}
        return gm(*[replacements.get(id(arg), arg) for arg in example_inputs])

    return Captured(gm, call)


def capture_symbolic(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Captured:
    gm = torch.fx.symbolic_trace(module)
    return Captured(gm, gm)


def capture(how: str, module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Captured:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # implicit softmax dim, deprecated F.sigmoid/F.tanh
        return (capture_dynamo if how == "dynamo" else capture_symbolic)(module, inputs)


def spellings(gm: torch.fx.GraphModule) -> Counter:
    """How many nodes call each (op, target); call_module targets are replaced by the module type."""
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            counts[(node.op, node.target)] += 1
        elif node.op == "call_module":
            counts[("call_module", type(gm.get_submodule(node.target)))] += 1
    return counts


def fn(target: Any) -> tuple[str, Any]:
    return ("call_function", target)


def method(name: str) -> tuple[str, str]:
    return ("call_method", name)


def module(cls: type) -> tuple[str, type]:
    return ("call_module", cls)


def run_pass(gm: torch.fx.GraphModule) -> int:
    result = Normalize().run(gm, CTX)
    assert result.rewrites == [] and result.skipped == []
    gm.graph.lint()
    gm.recompile()
    return result.changed


def assert_outputs_equal(expected: Any, actual: Any) -> None:
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
        assert actual.dtype == expected.dtype
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for e, a in zip(expected, actual):
            assert_outputs_equal(e, a)
    else:
        assert actual == expected


def check_family(
    how: str,
    model: nn.Module,
    make_inputs: Callable[[], tuple[torch.Tensor, ...]],
    canonical: dict[tuple[str, Any], int],
    gone: list[tuple[str, Any]],
    seed: int | None = None,
) -> Captured:
    """Capture, normalize and check counts and numerics; returns the normalized capture."""
    torch.manual_seed(0)
    captured = capture(how, model, make_inputs())
    fresh = make_inputs()

    def outputs() -> Any:
        if seed is not None:
            torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return captured.call(*fresh)

    expected = outputs()
    changed = run_pass(captured.gm)
    assert changed > 0
    counts = spellings(captured.gm)
    for spelling, count in canonical.items():
        assert counts[spelling] == count, (spelling, counts)
    for spelling in gone:
        assert counts[spelling] == 0, (spelling, captured.gm.graph)
    assert_outputs_equal(expected, outputs())
    if how == "symbolic_trace":  # same output structure as the module: compare with eager too
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if seed is not None:
                torch.manual_seed(seed)
            assert_outputs_equal(model(*fresh), outputs())
    assert run_pass(captured.gm) == 0  # idempotent
    return captured


def calls_of(gm: torch.fx.GraphModule, *targets: Any) -> list[torch.fx.Node]:
    return [node for node in gm.graph.nodes if is_call(node, *targets)]


# --------------------------------------------------------------------------------------------------
# families
# --------------------------------------------------------------------------------------------------


class Arithmetic(nn.Module):
    def forward(self, a, b):
        r = torch.add(a, b) + a.add(b)  # 3 adds
        r = r - torch.sub(a, b) - a.sub(b) - a.__rsub__(1.5)  # 6 subs
        r = r * torch.mul(a, b) * a.mul(b) * a.__mul__(b) * a.__rmul__(3.0)  # 8 muls
        r = r / torch.div(a, 2.0) / a.div(3.0) / torch.true_divide(a, 5.0) / a.__truediv__(7.0)  # 8 divs
        r = r + torch.matmul(a, b) + a.matmul(b) + (a @ b)  # 3 matmuls, 3 adds
        r = r + torch.pow(a, 2) + a.pow(3) + a**2  # 3 pows, 3 adds
        return r + torch.neg(a) + a.neg() + (-a)  # 3 negs, 3 adds


@pytest.mark.parametrize("how", CAPTURES)
def test_arithmetic(how):
    check_family(
        how,
        Arithmetic(),
        lambda: (torch.randn(5, 5), torch.randn(5, 5)),
        canonical={
            fn(operator.add): 12,
            fn(operator.sub): 6,
            fn(operator.mul): 8,
            fn(operator.truediv): 8,
            fn(operator.matmul): 3,
            fn(operator.pow): 3,
            fn(operator.neg): 3,
        },
        gone=[fn(t) for t in (torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.matmul,
                              torch.pow, torch.neg)]
        + [method(m) for m in ("add", "sub", "mul", "div", "matmul", "pow", "neg", "__mul__", "__rmul__",
                               "__rsub__", "__truediv__")],
    )


class Softmaxes(nn.Module):
    def __init__(self):
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)
        self.log_softmax = nn.LogSoftmax(dim=1)

    def forward(self, x):
        return (
            x.softmax(-1),
            torch.softmax(x, -1),
            F.softmax(x, dim=-1),
            F.softmax(x, 1, _stacklevel=3, dtype=torch.float64),
            torch.special.softmax(x, 0),
            self.softmax(x),
            x.log_softmax(dim=-1),
            F.log_softmax(x, dim=1),
            torch.special.log_softmax(x, 1, dtype=torch.float64),
            self.log_softmax(x),
        )


@pytest.mark.parametrize("how", CAPTURES)
def test_softmax(how):
    captured = check_family(
        how,
        Softmaxes(),
        lambda: (torch.randn(3, 4, 5),),
        canonical={fn(torch.softmax): 6, fn(torch.log_softmax): 4},
        gone=[fn(F.softmax), fn(torch.special.softmax), method("softmax"), fn(F.log_softmax),
              fn(torch.special.log_softmax), method("log_softmax"), module(nn.Softmax), module(nn.LogSoftmax)],
    )
    softmaxes = calls_of(captured.gm, torch.softmax, torch.log_softmax)
    assert sorted(len(node.args) for node in softmaxes) == [2] * 10  # dim always positional
    assert sum(node.kwargs == {"dtype": torch.float64} for node in softmaxes) == 2
    assert all(node.kwargs in ({}, {"dtype": torch.float64}) for node in softmaxes)


class Linears(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 5)
        self.no_bias = nn.Linear(5, 4, bias=False)
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.bias = nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = self.no_bias(self.proj(x))
        return F.linear(h, self.weight, self.bias) + torch.nn.functional.linear(input=h, weight=self.weight)


@pytest.mark.parametrize("how", CAPTURES)
def test_linear(how):
    model = Linears()
    keys_before = list(model.state_dict())
    captured = check_family(
        how,
        model,
        lambda: (torch.randn(2, 7, 6),),
        canonical={fn(F.linear): 4},
        gone=[module(nn.Linear)],
    )
    linears = calls_of(captured.gm, F.linear)
    assert all(len(node.args) == 3 and not node.kwargs for node in linears)
    assert sum(node.args[2] is None for node in linears) == 2
    if how == "symbolic_trace":
        # nn.Linear became get_attr reads of its parameters; the node kept its name and module meta.
        proj = next(node for node in linears if node.name == "proj")
        assert [a.op for a in proj.args[1:]] == ["get_attr", "get_attr"]
        assert [a.target for a in proj.args[1:]] == ["proj.weight", "proj.bias"]
        assert "proj" in str(proj.meta["nn_module_stack"])
        assert list(captured.gm.state_dict()) == keys_before  # no parameter moved or vanished


def test_linear_module_with_hook_is_kept():
    model = Linears()
    model.proj.register_forward_hook(lambda mod, args, out: out * 2)
    gm = torch.fx.symbolic_trace(model)
    run_pass(gm)
    assert spellings(gm)[module(nn.Linear)] == 1  # the hooked one; calling it runs the hook
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["proj"]
    x = torch.randn(2, 6)
    assert_outputs_equal(model(x), gm(x))


class Casts(nn.Module):
    def forward(self, x):
        return (
            x.double(),
            x.half(),
            x.bfloat16(),
            x.float(),
            x.to(dtype=torch.float16),
            x.type(torch.float64),
            x.to(torch.bfloat16),
        )


@pytest.mark.parametrize("how", CAPTURES)
def test_casts(how):
    captured = check_family(
        how,
        Casts(),
        lambda: (torch.randn(4, 3),),
        canonical={method("to"): 7},
        gone=[method(m) for m in ("float", "half", "bfloat16", "double", "type")],
    )
    casts = calls_of(captured.gm, "to")
    assert [node.args[1] for node in casts] == [
        torch.float64, torch.float16, torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.bfloat16,
    ]
    assert all(len(node.args) == 2 and not node.kwargs for node in casts)


class Unary(nn.Module):
    def __init__(self):
        super().__init__()
        self.silu, self.gelu, self.gelu_tanh = nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh")
        self.relu, self.sigmoid, self.tanh = nn.ReLU(), nn.Sigmoid(), nn.Tanh()

    def forward(self, x):
        return (
            x.sigmoid(), F.sigmoid(x), self.sigmoid(x),  # 3 sigmoid
            x.tanh(), F.tanh(x), self.tanh(x),  # 3 tanh
            x.relu(), F.relu(x), F.relu(x, inplace=False), self.relu(x),  # 4 relu
            x.exp(), x.abs().rsqrt(), x.abs().sqrt(), x.erf(), x.reciprocal(),
            F.silu(x), F.silu(x, inplace=False), self.silu(x),  # 3 silu
            F.gelu(x), F.gelu(x, approximate="none"), self.gelu(x),  # 3 gelu
            F.gelu(x, approximate="tanh"), self.gelu_tanh(x),  # 2 gelu tanh
        )


@pytest.mark.parametrize("how", CAPTURES)
def test_unary(how):
    captured = check_family(
        how,
        Unary(),
        lambda: (torch.randn(4, 9),),
        canonical={
            fn(torch.sigmoid): 3,
            fn(torch.tanh): 3,
            fn(torch.relu): 4,
            fn(torch.exp): 1,
            fn(torch.rsqrt): 1,
            fn(torch.sqrt): 1,
            fn(torch.erf): 1,
            fn(torch.abs): 2,
            fn(torch.reciprocal): 1,
            fn(F.silu): 3,
            fn(F.gelu): 5,
        },
        gone=[fn(F.sigmoid), fn(F.tanh), fn(F.relu)]
        + [method(m) for m in ("sigmoid", "tanh", "relu", "exp", "rsqrt", "sqrt", "erf", "abs", "reciprocal")]
        + [module(m) for m in (nn.SiLU, nn.GELU, nn.ReLU, nn.Sigmoid, nn.Tanh)],
    )
    assert all(not node.kwargs for node in calls_of(captured.gm, F.silu))  # inplace=False dropped
    assert sorted(str(node.kwargs) for node in calls_of(captured.gm, F.gelu)) == [
        "{'approximate': 'tanh'}"] * 2 + ["{}"] * 3


class Reductions(nn.Module):
    def forward(self, x):
        return (
            x.mean(-1, keepdim=True),
            x.mean(),
            torch.mean(x, 1),
            x.sum(dim=0),
            x.sum(-1, dtype=torch.float64),
        )


@pytest.mark.parametrize("how", CAPTURES)
def test_reductions(how):
    captured = check_family(
        how,
        Reductions(),
        lambda: (torch.randn(3, 5),),
        canonical={fn(torch.mean): 3, fn(torch.sum): 2},
        gone=[method("mean"), method("sum")],
    )
    kwargs = [dict(node.kwargs) for node in calls_of(captured.gm, torch.mean, torch.sum)]
    assert {"keepdim": True} in kwargs and {"dim": 0} in kwargs and {"dtype": torch.float64} in kwargs


class Transposes(nn.Module):
    def forward(self, x, m):
        # `+ 0` makes each a graph computation (Dynamo returns a bare view of an input from outside
        # the graph, as an attribute access on the input).
        return tuple(t + 0 for t in (
            x.transpose(1, 2),
            x.transpose(-1, -2),
            x.swapaxes(0, 1),
            x.swapdims(0, 2),
            torch.swapaxes(x, 1, 0),
            torch.swapdims(x, 2, 1),
            x.mT,
            m.t(),
            torch.t(m),
            m.T,
        ))


def _transpose_inputs():
    return torch.randn(2, 3, 4), torch.randn(5, 6)


def test_transpose_dynamo():
    captured = check_family(
        "dynamo",
        Transposes(),
        _transpose_inputs,
        canonical={fn(torch.transpose): 10},
        gone=[method(m) for m in ("transpose", "swapaxes", "swapdims", "t")]
        + [fn(torch.swapaxes), fn(torch.swapdims), fn(torch.t), fn(getattr)],
    )
    dims = [node.args[1:] for node in calls_of(captured.gm, torch.transpose)]
    assert dims == [(1, 2), (-2, -1), (0, 1), (0, 2), (0, 1), (1, 2), (-2, -1), (0, 1), (0, 1), (0, 1)]


def test_transpose_symbolic_trace_needs_rank_for_t():
    # Without shape metadata, x.t() / x.T might be 1-D (identity) or n-D (.T reverses): left alone.
    gm = torch.fx.symbolic_trace(Transposes())
    run_pass(gm)
    counts = spellings(gm)
    assert counts[fn(torch.transpose)] == 7
    assert counts[method("t")] == 1 and counts[fn(torch.t)] == 1 and counts[fn(getattr)] == 1

    # With ShapeProp's tensor_meta they are known to be 2-D and respelt.
    gm = torch.fx.symbolic_trace(Transposes())
    inputs = _transpose_inputs()
    ShapeProp(gm).propagate(*inputs)
    expected = gm(*inputs)
    run_pass(gm)
    counts = spellings(gm)
    assert counts[fn(torch.transpose)] == 10
    assert counts[method("t")] == counts[fn(torch.t)] == counts[fn(getattr)] == 0
    assert_outputs_equal(expected, gm(*inputs))


class Permutes(nn.Module):
    def forward(self, x):
        return (
            x.permute(0, 2, 1, 3),
            x.permute([3, 2, 1, 0]),
            x.permute((1, 0, 2, 3)),
            x.permute(dims=(0, 1, 3, 2)),
            torch.permute(x, [2, 0, 1, 3]),
        )


@pytest.mark.parametrize("how", CAPTURES)
def test_permute(how):
    captured = check_family(
        how,
        Permutes(),
        lambda: (torch.randn(2, 3, 4, 5),),
        canonical={fn(torch.permute): 5},
        gone=[method("permute")],
    )
    dims = [node.args[1] for node in calls_of(captured.gm, torch.permute)]
    assert dims == [(0, 2, 1, 3), (3, 2, 1, 0), (1, 0, 2, 3), (0, 1, 3, 2), (2, 0, 1, 3)]
    assert all(type(d) is tuple for d in dims)


class ShapeFunctions(nn.Module):
    def forward(self, x, mask):
        first, second = x.chunk(2, dim=-1)
        a, b = x.split(3, dim=1)
        c, d = x.split([2, 4], 1)
        return (
            x.unsqueeze(1),
            x.unsqueeze(0).squeeze(0),
            x.flatten(1),
            x.repeat_interleave(2, dim=1),
            x.masked_fill(mask, -1.0),
            torch.cat((first, second), dim=-1),
            torch.cat([a, b]),
            torch.concat([c, d], dim=1),
            torch.concatenate([x, x], axis=1),
        )


@pytest.mark.parametrize("how", CAPTURES)
def test_shape_functions(how):
    captured = check_family(
        how,
        ShapeFunctions(),
        lambda: (torch.randn(4, 6), torch.rand(4, 6) > 0.5),
        canonical={
            fn(torch.unsqueeze): 2,
            fn(torch.squeeze): 1,
            fn(torch.flatten): 1,
            fn(torch.repeat_interleave): 1,
            fn(torch.masked_fill): 1,
            fn(torch.chunk): 1,
            fn(torch.split): 2,
            fn(torch.cat): 4,
        },
        gone=[method(m) for m in ("unsqueeze", "squeeze", "flatten", "repeat_interleave", "masked_fill",
                                  "chunk", "split")]
        + [fn(torch.concat), fn(torch.concatenate)],
    )
    cats = calls_of(captured.gm, torch.cat)
    assert [node.args[1] for node in cats] == [-1, 0, 1, 1]
    assert all(isinstance(node.args[0], list) and not node.kwargs for node in cats)


def test_split_keyword_is_renamed():
    # Tensor.split calls its size `split_size`; torch.split calls it `split_size_or_sections`.
    class SplitKeyword(nn.Module):
        def forward(self, x):
            return x.split(split_size=2)

    check_family("dynamo", SplitKeyword(), lambda: (torch.randn(5, 2),),
                 canonical={fn(torch.split): 1}, gone=[method("split")])


class Dropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.dropout = nn.Dropout(0.3)

    def forward(self, x):
        return (
            self.dropout(x),
            F.dropout(x, p=0.2, training=self.training),
            torch.dropout(x, 0.1, self.training),
            F.dropout(x, 0.4, self.training, False),
            F.dropout(x, training=self.training, inplace=False),
        )


@pytest.mark.parametrize("how", CAPTURES)
@pytest.mark.parametrize("training", [False, True])
def test_dropout(how, training):
    model = Dropouts().train(training)
    captured = check_family(
        how,
        model,
        lambda: (torch.randn(8, 16),),
        canonical={fn(F.dropout): 5},
        gone=[fn(torch.dropout), module(nn.Dropout)],
        seed=1234,  # same RNG draws before and after: the respelt dropouts consume it identically
    )
    calls = calls_of(captured.gm, F.dropout)
    assert [node.args[1:] for node in calls] == [
        (0.3, training, False), (0.2, training, False), (0.1, training, False), (0.4, training, False),
        (0.5, training, False),
    ]
    assert all(not node.kwargs for node in calls)


class Views(nn.Module):
    def forward(self, x):
        return (
            x.view((6, 4)),
            x.view([4, 6]),
            x.view(x.shape[0], -1),
            x.reshape((3, 8)),
            torch.reshape(x, (8, 3)),
            torch.reshape(x, [-1]),
            x.unsqueeze(0).expand((2, 2, 3, 4)),
            x.transpose(0, 1).contiguous(),
        )


@pytest.mark.parametrize("how", CAPTURES)
def test_view_reshape_expand(how):
    captured = check_family(
        how,
        Views(),
        lambda: (torch.randn(2, 3, 4),),
        canonical={method("view"): 3, method("reshape"): 3, method("expand"): 1, method("contiguous"): 1},
        gone=[fn(torch.reshape)],
    )
    for node in calls_of(captured.gm, "view", "reshape", "expand"):
        assert not any(isinstance(a, (list, tuple)) for a in node.args), node.format_node()


# --------------------------------------------------------------------------------------------------
# unchanged on purpose
# --------------------------------------------------------------------------------------------------


class Untouchable(nn.Module):
    def forward(self, a, b):
        y = b.clone()
        return (
            torch.add(a, b, alpha=2),
            a.sub(b, alpha=0.5),
            torch.div(a, b, rounding_mode="floor"),
            a.to("cpu"),
            a.to(b),
            a.to(torch.float64, copy=True),
            a.float(memory_format=torch.contiguous_format),
            F.softmax(a, dim=None),
            F.relu(y, inplace=True),
            torch.bmm(a, b),
            a.mH,
        )


@pytest.mark.parametrize("how", CAPTURES)
def test_semantics_changing_spellings_are_left_alone(how):
    model = Untouchable()
    inputs = (torch.randn(2, 3, 3), torch.randn(2, 3, 3))
    captured = capture(how, model, inputs)
    before = [(n.op, n.target, n.args, dict(n.kwargs)) for n in captured.gm.graph.nodes]
    assert run_pass(captured.gm) == 0
    after = [(n.op, n.target, n.args, dict(n.kwargs)) for n in captured.gm.graph.nodes]
    assert after == before
    counts = spellings(captured.gm)
    assert counts[fn(torch.add)] == 1 and counts[fn(torch.div)] == 1 and counts[fn(F.softmax)] == 1
    assert counts[method("to")] == 3 and counts[method("float")] == 1 and counts[fn(torch.bmm)] == 1


def test_reflected_division_by_tensor_is_left_alone():
    # Tensor.__rtruediv__ computes x.reciprocal() * other; respelling it as other / x would round
    # differently, so only Python-number operands are respelt.
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    by_tensor = graph.call_method("__rtruediv__", (x, y))
    by_number = graph.call_method("__rtruediv__", (x, 3.0))
    graph.output((by_tensor, by_number))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    args = (torch.randn(7), torch.randn(7))
    expected = gm(*args)
    assert run_pass(gm) == 1
    assert by_tensor.op == "call_method"
    assert (by_number.op, by_number.target, by_number.args) == ("call_function", operator.truediv, (3.0, x))
    assert_outputs_equal(expected, gm(*args))


# --------------------------------------------------------------------------------------------------
# the pass as a whole
# --------------------------------------------------------------------------------------------------


def test_tensor_methods_called_as_functions():
    # torch.Tensor.add(x, y) etc., as hand-built graphs and other tracers record them.
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    nodes = {
        "add": graph.call_function(torch.Tensor.add, (x, y)),
        "softmax": graph.call_function(torch.Tensor.softmax, (x, -1)),
        "float": graph.call_function(torch.Tensor.float, (x,)),
        "sigmoid": graph.call_function(torch.Tensor.sigmoid, (x,)),
        "mean": graph.call_function(torch.Tensor.mean, (x, -1), {"keepdim": True}),
        "transpose": graph.call_function(torch.Tensor.transpose, (x, 1, 0)),
        "permute": graph.call_function(torch.Tensor.permute, (x, 1, 0)),
        "view": graph.call_function(torch.Tensor.view, (x, (12,))),
        "contiguous": graph.call_function(torch.Tensor.contiguous, (x,)),
    }
    graph.output(tuple(nodes.values()))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    args = (torch.randn(3, 4), torch.randn(3, 4))
    expected = gm(*args)
    assert run_pass(gm) == len(nodes)
    spelt = {name: (node.op, node.target, node.args, dict(node.kwargs)) for name, node in nodes.items()}
    assert spelt == {
        "add": ("call_function", operator.add, (x, y), {}),
        "softmax": ("call_function", torch.softmax, (x, -1), {}),
        "float": ("call_method", "to", (x, torch.float32), {}),
        "sigmoid": ("call_function", torch.sigmoid, (x,), {}),
        "mean": ("call_function", torch.mean, (x, -1), {"keepdim": True}),
        "transpose": ("call_function", torch.transpose, (x, 0, 1), {}),
        "permute": ("call_function", torch.permute, (x, (1, 0)), {}),
        "view": ("call_method", "view", (x, 12), {}),
        "contiguous": ("call_method", "contiguous", (x,), {}),
    }
    assert_outputs_equal(expected, gm(*args))


class Attention(nn.Module):
    """A hand-written attention block: the hand-counted example (respellings counted per line)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(16, dim=-1)  # .split -> torch.split                         1 (+1)
        q = q.view(b, t, 2, 8).transpose(1, 2)  # .transpose (view is canonical)                  1
        k = k.view((b, t, 2, 8)).permute(0, 2, 1, 3)  # view's tuple unpacked; .permute          2
        v = v.reshape(b, t, 2, 8).transpose(1, 2)  # .transpose                                   1
        scores = torch.matmul(q, k.mT) * 8**-0.5  # torch.matmul -> @; .mT -> transpose           2
        probs = F.softmax(scores.float(), dim=-1).to(q.dtype)  # F.softmax; .float(); .to kept    2
        y = (probs @ v).transpose(1, 2).reshape(b, t, 16)  # .transpose                           1
        return self.out(y)  #                                                                  0 (+1)
        # Dynamo: 10. symbolic_trace: the two nn.Linear call_module nodes (+1 each) make 12; Dynamo
        # already records them as F.linear(x, w, b).


def test_changed_counts_respelt_nodes_and_meta_is_kept():
    captured = capture("dynamo", Attention(), (torch.randn(2, 5, 16),))
    gm = captured.gm
    meta_before = {node.name: dict(node.meta) for node in gm.graph.nodes}
    fresh = torch.randn(2, 5, 16)
    expected = captured.call(fresh)
    assert run_pass(gm) == 10  # hand-counted in Attention.forward
    assert run_pass(gm) == 0
    meta_after = {node.name: node.meta for node in gm.graph.nodes}
    assert meta_after.keys() == meta_before.keys()  # same nodes, same names: edited in place
    for name, meta in meta_before.items():
        for key, value in meta.items():
            assert meta_after[name][key] is value, (name, key)
    softmax = calls_of(gm, torch.softmax)[0]
    assert softmax.meta["example_value"].shape == (2, 2, 5, 5)
    assert "F.softmax(scores.float(), dim=-1)" in softmax.meta["stack_trace"]
    linears = calls_of(gm, F.linear)
    assert ["qkv" in str(node.meta["nn_module_stack"]) for node in linears] == [True, False]
    assert_outputs_equal(expected, captured.call(fresh))


def test_symbolic_trace_counts():
    gm = torch.fx.symbolic_trace(Attention().float())
    # symbolic_trace spells `self.qkv(x)`/`self.out(y)` as call_module: 2 more respellings (their
    # 4 new get_attr reads are not counted).
    assert run_pass(gm) == 12
    assert sum(node.op == "get_attr" for node in gm.graph.nodes) == 4


def test_is_call():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    mul = graph.call_function(operator.mul, (x, 2))
    view = graph.call_method("view", (mul, -1))
    graph.output(view)
    assert is_call(mul, operator.mul)
    assert is_call(mul, torch.softmax, operator.mul)
    assert not is_call(mul, operator.add)
    assert not is_call(mul, "mul")  # a method name does not match a function
    assert is_call(view, "view", "reshape")
    assert not is_call(view, torch.Tensor.view)
    assert not is_call(x, "x")
    assert not is_call(None, operator.mul)
    assert not is_call(mul)


def test_registered():
    normalize = get_pass("normalize")
    assert isinstance(normalize, Normalize)
    assert normalize.description


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_transpose_and_permute_spellings_agree(data):
    """Random ranks, dims and spellings: the normalized graph equals the original, bit for bit."""
    rank = data.draw(st.integers(2, 4), label="rank")
    shape = data.draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank), label="shape")
    d0, d1 = data.draw(st.lists(st.integers(-rank, rank - 1), min_size=2, max_size=2), label="dims")
    order = data.draw(st.permutations(range(rank)), label="order")
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    spelling = data.draw(st.sampled_from(["transpose", "swapaxes", "swapdims"]), label="spelling")
    transposed = graph.call_method(spelling, (x, d0, d1))
    permuted = graph.call_method("permute", (transposed, *order) if data.draw(st.booleans()) else (transposed, order))
    graph.output(graph.call_method("contiguous", (permuted,)))
    gm = torch.fx.GraphModule(nn.Module(), graph)
    inp = torch.randn(shape)
    expected = gm(inp)
    assert run_pass(gm) == 2
    assert transposed.target is torch.transpose and permuted.target is torch.permute
    assert_outputs_equal(expected, gm(inp))
