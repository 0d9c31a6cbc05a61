"""The activation ops (kernel_pytorch/ops/activations.py): Triton kernels under Triton's interpreter, the
native path, autograd, custom-op registration, torch.compile and linear_activation's dispatch; GPU
numerics with -m gpu.

As in tests/test_norm_ops.py, the ``test_interp_*`` tests need ``TRITON_INTERPRET=1`` from the start of the
process: they run in a child pytest (``test_triton_kernels_in_a_subprocess``) and are deselected in a
process without it; run them directly with ``TRITON_INTERPRET=1 pytest tests/test_activation_ops.py -k
interp``. Under the interpreter fp32 -> bf16 casts truncate where the GPU rounds to nearest even: bf16
results there are within the tolerances below, not bitwise.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .triton_interpreter import EAGER_OPCHECKS, INTERPRETED, cuda_device, interp, route_to_triton, run_interpreted_tests

# The module, not the functions kernel_pytorch.ops might export under the same names.
A = importlib.import_module("kernel_pytorch.ops.activations")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")


KINDS = tuple(A.ACTIVATION_KINDS)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ALL_DTYPES = DTYPES + (torch.float64,)
# Relative-norm error allowed against a float64 reference, per input dtype (rounding of the output).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}
SHAPES = ((1,), (7,), (129,), (1000,), (3, 5, 129), (2, 2500))  # the last: several programs of 1024
# The Triton launchers, by name.
LAUNCHERS = tuple(n for n in A.__all__ if n.endswith(("_fwd", "_bwd")))
EAGER = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def rel(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0) -> float:
    """||a - b|| / max(||b||, scale): ``scale`` floors the norm where the values may be ~0."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / max(float(expected.norm()), scale, 1e-12))


def reference(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The exact formulas, for float64 x."""
    if kind == "silu":
        return x * torch.sigmoid(x)
    if kind == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))  # GPT-2


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().requires_grad_()


def _forward_scale(y: torch.Tensor) -> float:
    # Elements of ~0.1 and below are near the activations' zeros (x ~ 0, gelu(x < -3)) where the
    # result is a difference of nearly equal values: absolute, not relative, error there.
    return 0.1 * y.numel() ** 0.5


# ------------------------------------------------------------------- checks shared by every path

def check_activation(fwd, bwd, x, kind, dy=None):
    """``fwd(x, kind)`` / ``bwd(dy, x, kind)`` (a launcher pair: Triton or native) against float64."""
    dtype, tol = x.dtype, TOL[x.dtype]
    y = fwd(x, kind)
    x64 = _leaf(x)
    y_ref = reference(x64, kind)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert rel(y, y_ref, _forward_scale(y)) < tol, (kind, dtype, tuple(x.shape))
    dy = torch.randn_like(y) if dy is None else dy
    dx = bwd(dy, x, kind)
    (grad,) = torch.autograd.grad(y_ref, x64, dy.double())
    assert dx.dtype == dtype and dx.shape == x.shape and dx.is_contiguous()
    assert rel(dx, grad, 0.5 * float(dy.double().norm())) < tol, (kind, dtype, tuple(x.shape))


def check_gated(fwd, bwd, gate, up, kind, dy=None):
    dtype, tol = gate.dtype, TOL[gate.dtype]
    y = fwd(gate, up, kind)
    g64, u64 = _leaf(gate), _leaf(up)
    y_ref = reference(g64, kind) * u64
    assert y.dtype == dtype and y.shape == gate.shape and y.is_contiguous()
    assert rel(y, y_ref, _forward_scale(y)) < tol
    dy = torch.randn_like(y) if dy is None else dy
    dgate, dup = bwd(dy, gate, up, kind)
    grads = torch.autograd.grad(y_ref, (g64, u64), dy.double())
    scale = 0.5 * float((dy.double() * u64.detach()).norm())
    assert dgate.dtype == dup.dtype == dtype and dgate.shape == dup.shape == gate.shape
    assert rel(dgate, grads[0], scale) < tol and rel(dup, grads[1], _forward_scale(dup)) < tol


def check_packed(fwd, bwd, gate_up, kind, gate_first, dy=None):
    dtype, tol = gate_up.dtype, TOL[gate_up.dtype]
    y = fwd(gate_up, kind, gate_first)
    gu64 = _leaf(gate_up)
    first, second = gu64.chunk(2, -1)
    gate, up = (first, second) if gate_first else (second, first)
    y_ref = reference(gate, kind) * up
    assert y.dtype == dtype and y.shape == y_ref.shape and y.is_contiguous()
    assert rel(y, y_ref, _forward_scale(y)) < tol
    dy = torch.randn_like(y) if dy is None else dy
    dgate_up = bwd(dy, gate_up, kind, gate_first)
    (grad,) = torch.autograd.grad(y_ref, gu64, dy.double())
    assert dgate_up.dtype == dtype and dgate_up.shape == gate_up.shape and dgate_up.is_contiguous()
    assert rel(dgate_up, grad, 0.5 * float(dy.double().norm())) < tol


TRITON = {"activation": (A.activation_fwd, A.activation_bwd),
          "gated": (A.gated_activation_fwd, A.gated_activation_bwd),
          "packed": (A.gated_activation_packed_fwd, A.gated_activation_packed_bwd)}
NATIVE = {"activation": (A._activation_fwd_native, A._activation_bwd_native),
          "gated": (A._gated_fwd_native, A._gated_bwd_native),
          "packed": (A._gated_packed_fwd_native, A._gated_packed_bwd_native)}


def check_all_forms(launchers, dtype, kind, shapes=SHAPES, device="cpu"):
    def make(*shape):
        return torch.randn(*shape, dtype=dtype, device=device) * 2

    for shape in shapes:
        check_activation(*launchers["activation"], make(*shape), kind)
        check_gated(*launchers["gated"], make(*shape), make(*shape), kind)
        for gate_first in (True, False):
            check_packed(*launchers["packed"], make(*shape[:-1], 2 * shape[-1]), kind, gate_first)


# Inputs the launchers must flatten or read with a row stride.
LAYOUTS = ("transposed", "row-slice", "3d-transposed", "column-step")


def _strided(layout, shape_last, dtype, device="cpu", rows=24):
    def make(*shape):
        return torch.randn(*shape, dtype=dtype, device=device) * 2

    if layout == "transposed":  # column stride != 1: copied
        return make(shape_last, rows).t()
    if layout == "row-slice":  # row stride > last dim: read in place
        return make(rows, shape_last + 5)[:, :shape_last]
    if layout == "3d-transposed":  # leading dims that do not merge: copied
        return make(4, rows // 4, shape_last).transpose(0, 1)
    return make(rows, 2 * shape_last)[:, ::2]  # column stride 2: copied


def check_strided(launchers, layout, dtype, hidden, kind="silu", device="cpu", rows=24):
    def strided(last):
        return _strided(layout, last, dtype, device, rows)

    x, dy = strided(hidden), strided(hidden)
    check_activation(*launchers["activation"], x, kind, dy=dy)
    check_activation(*launchers["activation"], x, kind)  # strided x, contiguous dy
    check_gated(*launchers["gated"], x, strided(hidden), kind, dy=dy)
    gate_up = strided(2 * hidden)
    check_packed(*launchers["packed"], gate_up, kind, True, dy=dy)
    check_packed(*launchers["packed"], gate_up, kind, False)
    # The chunks of one (rows, 2 * hidden) projection output: each a row-strided view.
    gate, up = torch.randn(rows, 2 * hidden, dtype=dtype, device=device).chunk(2, -1)
    check_gated(*launchers["gated"], gate, up, kind)
    # A gradient expanded from a scalar (every stride 0), as ``y.sum().backward()`` gives.
    ones = torch.ones((), dtype=dtype, device=device).expand(gate.shape)
    check_gated(*launchers["gated"], gate, up, kind, dy=ones)
    check_activation(*launchers["activation"], gate, kind, dy=ones)


# ---------------------------------------------------------------------- Triton kernels, interpreter

@interp
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_interp_kernels_match_float64(dtype, kind):
    torch.manual_seed(len(kind))
    check_all_forms(TRITON, dtype, kind)


@interp
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_non_contiguous_inputs(dtype, layout):
    torch.manual_seed(0)
    check_strided(TRITON, layout, dtype, 129, "gelu_tanh", rows=8)


@interp
def test_interp_rows_wider_than_a_tile():
    # 1500 > 1024 columns: two column blocks per row, each row read with its row stride.
    torch.manual_seed(0)
    check_strided(TRITON, "row-slice", torch.float32, 1500, "silu", rows=4)
    check_strided(TRITON, "transposed", torch.bfloat16, 1500, "gelu", rows=4)


@interp
@pytest.mark.parametrize("kind", KINDS)
def test_interp_kernels_match_eager_float32(kind):
    torch.manual_seed(0)
    x, dy = torch.randn(64, 1000) * 3, torch.randn(64, 1000)
    xe = x.clone().requires_grad_()
    ye = EAGER[kind](xe)
    (gx,) = torch.autograd.grad(ye, xe, dy)
    assert rel(A.activation_fwd(x, kind), ye) < 1e-5
    assert rel(A.activation_bwd(dy, x, kind), gx) < 1e-4


@interp
def test_interp_empty_and_scalar_inputs():
    for kind in KINDS:
        x = torch.randn(0, 7)
        assert A.activation_fwd(x, kind).shape == (0, 7) and A.activation_bwd(x, x, kind).shape == (0, 7)
        assert A.gated_activation_packed_fwd(torch.randn(3, 0), kind).shape == (3, 0)
        assert A.gated_activation_packed_bwd(torch.randn(0, 4), torch.randn(0, 8), kind).shape == (0, 8)
        s = torch.tensor(-0.75)
        assert A.activation_fwd(s, kind).shape == () and rel(A.activation_fwd(s, kind), EAGER[kind](s)) < 1e-6


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Route the ops' CPU tensors to the Triton launchers (interpreted kernels); counts the launches so a
    test can tell which path ran."""
    return route_to_triton(monkeypatch, A, LAUNCHERS, ("TRITON_MIN_ELEMENTS",))


def _gradcheck_cases(x, g, u, gu, xt):
    cases = []
    for kind in KINDS:
        cases += [
            (lambda x, kind=kind: A.activation(x, kind), (x,)),
            (lambda x, kind=kind: A.activation(x, kind), (xt,)),  # non-contiguous through the op
            (lambda g, u, kind=kind: A.gated_activation(g, u, kind), (g, u)),
            (lambda g, u, kind=kind: A.gated_activation(g, u, kind), (gu[:, :3], gu[:, 3:])),  # row-strided
            (lambda gu, kind=kind: A.gated_activation_packed(gu, kind), (gu,)),
            (lambda gu, kind=kind: A.gated_activation_packed(gu, kind, gate_first=False), (gu,)),
        ]
    return cases


def _float64_leaves():
    torch.manual_seed(0)
    def make(*shape):
        return (torch.randn(*shape, dtype=torch.float64) * 2).requires_grad_()

    x, g, u, gu = make(2, 3), make(2, 3), make(2, 3), make(2, 6)
    return x, g, u, gu, x.t()


@interp
def test_interp_ops_run_triton_and_gradcheck_in_float64(triton_on_cpu):
    # The kernels compute in float64 for float64 inputs, so gradcheck checks the Triton forward and
    # backward kernels through the custom ops.
    for fn, args in _gradcheck_cases(*_float64_leaves()):
        assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7)
    assert set(triton_on_cpu) == set(LAUNCHERS)


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_ops_triton_path_matches_native_path(triton_on_cpu, dtype, monkeypatch):
    torch.manual_seed(0)
    x, gu = torch.randn(2, 9, 129, dtype=dtype) * 2, torch.randn(2, 9, 258, dtype=dtype) * 2
    cotangents = torch.randn(9, 2, 9, 129)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, gu)]
        xx, gg = leaves
        outs = [A.activation(xx, kind) for kind in KINDS]
        outs += [A.gated_activation_packed(gg, kind, gate_first=kind != "gelu") for kind in KINDS]
        outs += [A.gated_activation(*gg.chunk(2, -1), kind) for kind in KINDS]
        sum((o.float() * c).sum() for o, c in zip(outs, cotangents, strict=True)).backward()
        return outs + [t.grad for t in leaves]

    triton_results = run()
    assert triton_on_cpu.get("gated_activation_bwd") and triton_on_cpu.get("gated_activation_packed_bwd")
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset({"cuda"}))
    for got, want in zip(triton_results, run(), strict=True):
        assert rel(got, want) < 2 * TOL[dtype]




def _opcheck_all(device="cpu", test_utils=None):
    torch.manual_seed(0)
    def make(*shape, grad=True):
        return torch.randn(*shape, device=device, requires_grad=grad)

    x, g, u, gu, dy = make(6, 33), make(6, 33), make(6, 33), make(12, 66), make(6, 33, grad=False)
    ops = torch.ops.kernel_pytorch
    kwargs = {} if test_utils is None else {"test_utils": test_utils}
    for kind in KINDS:
        torch.library.opcheck(ops.activation.default, (x, kind), **kwargs)
        torch.library.opcheck(ops.gated_activation.default, (g, u, kind, kind == "silu"), **kwargs)
        torch.library.opcheck(ops.gated_activation_packed.default, (gu, kind, kind != "gelu", kind == "gelu", None),
                              **kwargs)
    # Strided inputs, and the backward ops called directly, for one kind (the layout code is shared).
    cases = [
        (ops.activation.default, (x.t(), "silu")),
        (ops.gated_activation.default, (gu[:, :33], gu[:, 33:], "silu", True)),
        (ops.gated_activation_packed.default, (gu[::2], "silu", False, True, None)),
        (ops.gated_activation_packed.default, (gu[::2], "silu", True, False, make(1))),  # the slot gets d gate_up's max
        (ops.activation_backward.default, (dy, x.detach(), "silu")),
        (ops.gated_activation_backward.default, (dy.t(), g.detach().t(), u.detach().t(), "silu")),
        (ops.gated_activation_packed_backward.default, (dy, gu.detach()[::2], "silu", False, False)),
        (ops.gated_activation_packed_backward.default, (dy, gu.detach()[::2], "silu", True, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, **kwargs)


@interp
def test_interp_opcheck_triton_path(triton_on_cpu):
    _opcheck_all(test_utils=EAGER_OPCHECKS)
    assert set(triton_on_cpu) == set(LAUNCHERS)


# ----------------------------------------------------------------------------- run the above, on CPU

@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_* tests itself")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to interpret")
def test_triton_kernels_in_a_subprocess(interpreted_tests):
    run_interpreted_tests(__file__, interpreted_tests)


# --------------------------------------------------------------------------------- the native path

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_native_matches_float64(dtype, kind):
    torch.manual_seed(len(kind))
    check_all_forms(NATIVE, dtype, kind, shapes=SHAPES[:5])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_non_contiguous_inputs(layout):
    torch.manual_seed(0)
    check_strided(NATIVE, layout, torch.bfloat16, 129, "gelu")


@pytest.mark.parametrize("kind", KINDS)
def test_native_matches_torch_functional_float32(kind):
    torch.manual_seed(0)
    x, gu, dy = torch.randn(8, 300) * 3, torch.randn(8, 600) * 3, torch.randn(8, 300)

    def fwd_and_grads(fn, *inputs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        return [y] + list(torch.autograd.grad(y, leaves, dy))

    pairs = [
        (lambda x: A.activation(x, kind), EAGER[kind], (x,)),
        (lambda g, u: A.gated_activation(g, u, kind), lambda g, u: EAGER[kind](g) * u, gu.chunk(2, -1)),
        (lambda gu: A.gated_activation_packed(gu, kind), lambda gu: EAGER[kind](gu[:, :300]) * gu[:, 300:], (gu,)),
        (lambda gu: A.gated_activation_packed(gu, kind, False), lambda gu: EAGER[kind](gu[:, 300:]) * gu[:, :300],
         (gu,)),
    ]
    for ours, eager, inputs in pairs:
        (y, *grads), (y_ref, *grads_ref) = fwd_and_grads(ours, *inputs), fwd_and_grads(eager, *inputs)
        assert rel(y, y_ref) < 1e-5
        for got, want in zip(grads, grads_ref, strict=True):
            assert rel(got, want) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_native_rounds_once(dtype):
    # fp32 math, one rounding: bitwise what the fp32 formula rounded to the dtype gives, and for the
    # gated form not the model's two roundings (act(gate) rounded, then the product).
    torch.manual_seed(0)
    g, u = torch.randn(64, 256, dtype=dtype) * 2, torch.randn(64, 256, dtype=dtype)
    for kind in KINDS:
        act32 = EAGER[kind](g.float())
        assert torch.equal(A.activation(g, kind), act32.to(dtype))
        once = (act32 * u.float()).to(dtype)
        assert torch.equal(A.gated_activation(g, u, kind), once)
        assert torch.equal(A.gated_activation_packed(torch.cat([g, u], -1), kind), once)
        assert (once != EAGER[kind](g) * u).sum() > 100  # the rounding differs: the check can tell


def test_native_gradcheck_float64():
    for fn, args in _gradcheck_cases(*_float64_leaves()):
        assert torch.autograd.gradcheck(fn, args)


def test_opcheck_native_path():
    _opcheck_all()


def test_compile_fullgraph_with_backward_has_no_graph_break():
    torch.manual_seed(0)

    def block(x, gu, w, b):
        h = A.linear_activation(x, w, b, "gelu_tanh")  # training: F.linear + the activation op
        z = A.gated_activation_packed(torch.cat([h, A.activation(h, "silu")], -1), "silu")
        g, u = F.linear(z, w.t()[:16]).chunk(2, -1)
        return A.gated_activation(g, u, "gelu") + A.gated_activation_packed(gu, "gelu_tanh", False)

    args = [torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 5, 16, requires_grad=True),
            torch.randn(32, 16, requires_grad=True), torch.randn(32, requires_grad=True)]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    clones = [a.detach().clone().requires_grad_() for a in args]
    out, ref = compiled(*args), block(*clones)
    assert counter.frame_count == 1 and rel(out, ref) < 1e-6
    out.square().sum().backward()
    ref.square().sum().backward()
    for got, want in zip(args, clones, strict=True):
        assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_native_empty_and_scalar_inputs():
    for kind in KINDS:
        x = torch.randn(0, 7, requires_grad=True)
        A.activation(x, kind).sum().backward()
        assert x.grad.shape == (0, 7)
        s = torch.tensor(-0.75, requires_grad=True)
        y = A.activation(s, kind)
        y.backward()
        assert y.shape == () and rel(y, EAGER[kind](s)) < 1e-6 and s.grad.shape == ()
        gu = torch.randn(4, 0, requires_grad=True)
        A.gated_activation_packed(gu, kind).sum().backward()
        assert gu.grad.shape == (4, 0)


# ---------------------------------------------------------------------- dispatch, errors, modules

def test_cpu_tensors_take_the_native_path(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("Triton launcher called for a CPU tensor")

    for name in LAUNCHERS:
        monkeypatch.setattr(A, name, no_triton)
    x, gu = torch.randn(4, 8, requires_grad=True), torch.randn(4, 16, requires_grad=True)
    (A.activation(x).sum() + A.gated_activation_packed(gu).sum() + A.gated_activation(x, x).sum()).backward()
    assert x.grad is not None and gu.grad is not None
    assert not tu.use_triton(torch.randn(4, 8))


def test_below_triton_min_elements_takes_the_native_path(monkeypatch):
    # With CPU routed to Triton, the threshold alone decides (no kernel runs: the launchers are stubs).
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    calls = []

    def recorded(x, kind):
        calls.append(x.numel())
        return A._activation_fwd_native(x, kind)

    monkeypatch.setattr(A, "activation_fwd", recorded)
    monkeypatch.setattr(A, "TRITON_MIN_ELEMENTS", 100)
    A.activation(torch.randn(99))
    assert calls == []
    A.activation(torch.randn(100))
    assert calls == [100]


def test_bad_arguments_are_named():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="unknown activation kind 'relu'"):
        A.activation(x, "relu")
    with pytest.raises(ValueError, match="unknown activation kind"):
        A.gated_activation_packed(x, "swish")
    with pytest.raises(ValueError, match="unknown activation kind"):
        torch.ops.kernel_pytorch.activation(x, "tanh")  # the op itself checks too
    with pytest.raises(ValueError, match="unknown activation kind"):
        A.Activation("relu")
    with pytest.raises(ValueError, match="same shape"):
        A.gated_activation(x, torch.randn(2, 4))
    with pytest.raises(ValueError, match="same shape, dtype"):
        A.gated_activation(x, x.double())
    with pytest.raises(ValueError, match="last dim must be even"):
        A.gated_activation_packed(torch.randn(2, 7))
    with pytest.raises(ValueError, match="last dim must be even"):
        A.gated_activation_packed(torch.tensor(1.0))
    with pytest.raises(ValueError, match="floating tensor"):
        A.activation(torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="floating tensor"):
        A.gated_activation(x, torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="in_features"):
        A.linear_activation(x, torch.randn(4, 7))
    with pytest.raises(ValueError, match="bias shape"):
        A.linear_activation(x, torch.randn(4, 8), torch.randn(5))


def test_modules_are_drop_ins():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 32)
    for ours, theirs in [(A.Activation("silu"), nn.SiLU()), (A.Activation("gelu"), nn.GELU()),
                         (A.Activation("gelu_tanh"), nn.GELU(approximate="tanh"))]:
        assert torch.equal(ours(x), theirs(x)) and not list(ours.parameters())
    glu = A.GatedActivation("silu")
    assert torch.equal(glu(x), A.gated_activation_packed(x, "silu"))
    assert torch.equal(glu(x, x), A.gated_activation(x, x, "silu"))
    assert torch.equal(A.GatedActivation("gelu", gate_first=False)(x), F.gelu(x[..., 16:]) * x[..., :16])


# ------------------------------------------------------------------------------- linear_activation

@pytest.mark.parametrize("kind", KINDS)
def test_linear_activation_is_act_of_linear_and_trains(kind, monkeypatch):
    def no_epilogue(*args, **kwargs):
        raise AssertionError("torch._addmm_activation called off CUDA (its CPU GELU is the erf one)")

    monkeypatch.setattr(torch, "_addmm_activation", no_epilogue)
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 5, 16), torch.randn(24, 16), torch.randn(24)
    for bias in (b, None):
        leaves = [t.clone().requires_grad_() for t in (x, w) + ((bias,) if bias is not None else ())]
        refs = [t.detach().clone().requires_grad_() for t in leaves]
        y = A.linear_activation(*leaves[:2], leaves[2] if bias is not None else None, kind)
        y_ref = EAGER[kind](F.linear(*refs))
        assert y.shape == (2, 5, 24) and rel(y, y_ref) < 1e-5
        y.square().sum().backward()
        y_ref.square().sum().backward()
        for got, want in zip(leaves, refs, strict=True):
            assert rel(got.grad, want.grad) < 1e-4
        with torch.no_grad():  # inference on CPU: still F.linear + the op
            assert rel(A.linear_activation(x, w, bias, kind), y_ref) < 1e-5


def test_linear_activation_epilogue_dispatch_on_fake_cuda_tensors(monkeypatch):
    # Which path linear_activation takes for CUDA tensors, decided without a GPU (fake tensors carry the
    # device; _addmm_activation's meta function gives the shape).
    original, calls = torch._addmm_activation, []

    def recorded(bias, mat1, mat2, **kwargs):
        calls.append((tuple(mat1.shape), tuple(mat2.shape), kwargs))
        return original(bias, mat1, mat2, **kwargs)

    monkeypatch.setattr(torch, "_addmm_activation", recorded)
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset())  # the rest on the native path
    with FakeTensorMode():
        def make(*shape):
            return torch.empty(*shape, device="cuda", dtype=torch.bfloat16)

        x, w, b = make(2, 5, 16), make(24, 16), make(24)
        with torch.no_grad():
            y = A.linear_activation(x, w, b, "gelu_tanh")
        assert y.shape == (2, 5, 24) and y.device.type == "cuda"
        assert calls == [((10, 16), (16, 24), {"use_gelu": True})]
        y = A.linear_activation(x, w, b, "gelu_tanh")  # nothing requires grad: the epilogue too
        assert len(calls) == 2
        not_taken = [
            lambda: A.linear_activation(x, w, None, "gelu_tanh"),  # no bias
            lambda: A.linear_activation(x, w, b, "gelu"),  # erf GELU: no epilogue computes it
            lambda: A.linear_activation(x, w, b.float(), "gelu_tanh"),  # mixed dtypes
        ]
        for fn in not_taken:
            assert fn().shape == (2, 5, 24)
        assert len(calls) == 2
        # Training (asked of the decision itself: autograd on fake CUDA tensors needs a CUDA build).
        w_trained = make(24, 16).requires_grad_()
        assert not A._use_gelu_epilogue(x, w_trained, b, "gelu_tanh")
        with torch.no_grad():
            assert A._use_gelu_epilogue(x, w_trained, b, "gelu_tanh")
        monkeypatch.setattr(A, "CUBLASLT_GELU_EPILOGUE", False)
        with torch.no_grad():
            A.linear_activation(x, w, b, "gelu_tanh")
        assert len(calls) == 2


# ---------------------------------------------------------------------------------------------- GPU

@pytest.fixture
def cuda():
    return cuda_device()


GPU_SHAPES = ((4096, 4096), (4096, 11008), (8, 512, 2048), (3, 1000, 129), (1,), (100003,))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_kernels_match_float64(cuda, dtype, kind):
    torch.manual_seed(0)
    check_all_forms(TRITON, dtype, kind, shapes=GPU_SHAPES, device=cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_non_contiguous_inputs(cuda, dtype, layout):
    torch.manual_seed(0)
    for kind, hidden in zip(KINDS, (4096, 11008, 129), strict=True):
        check_strided(TRITON, layout, dtype, hidden, kind, device=cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_triton_close_to_aten(cuda, dtype):
    # The Triton forward and backward against ATen's (what the native path runs); on the GPU fp32 -> 16-bit
    # casts round to nearest even, so the 16-bit results are within one ulp of the native path's.
    torch.manual_seed(0)
    x, dy = torch.randn(4096, 4096, dtype=dtype, device=cuda) * 3, torch.randn(4096, 4096, dtype=dtype, device=cuda)
    for kind in KINDS:
        assert rel(A.activation_fwd(x, kind), A._activation_fwd_native(x, kind)) < TOL[dtype] / 4
        assert rel(A.activation_bwd(dy, x, kind), A._activation_bwd_native(dy, x, kind)) < TOL[dtype] / 4
        got, want = A.gated_activation_bwd(dy, x, dy, kind), A._gated_bwd_native(dy, x, dy, kind)
        assert all(rel(a, b) < TOL[dtype] / 4 for a, b in zip(got, want, strict=True))


@pytest.mark.gpu
def test_gpu_opcheck_triton_path(cuda):
    _opcheck_all(device=cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_compile_fullgraph_inductor(cuda, dtype, dynamic):
    torch.manual_seed(0)

    def block(x, w_gu, w_up):
        gate_up = F.linear(x, w_gu)
        h = A.gated_activation_packed(gate_up, "silu") + A.gated_activation(*gate_up.chunk(2, -1), "gelu_tanh")
        return A.activation(F.linear(h, w_up), "gelu")

    def make(*shape, scale=1.0):
        return (torch.randn(*shape, dtype=dtype, device=cuda) * scale).requires_grad_()

    compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
    for rows in (512, 300, 4097):
        args = [make(rows, 1024), make(2 * 2816, 1024, scale=1 / 32), make(1024, 2816, scale=1 / 53)]
        clones = [a.detach().clone().requires_grad_() for a in args]
        out, ref = compiled(*args), block(*clones)
        assert rel(out, ref) < TOL[dtype]
        out.float().square().sum().backward()
        ref.float().square().sum().backward()
        for got, want in zip(args, clones, strict=True):
            assert rel(got.grad, want.grad) < 2 * TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_linear_activation_epilogue(cuda, dtype, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(4, 512, 1024, dtype=dtype, device=cuda)
    w, b = torch.randn(4096, 1024, dtype=dtype, device=cuda) / 32, torch.randn(4096, dtype=dtype, device=cuda)
    x64 = x.double()
    tanh_ref = reference(F.linear(x64, w.double(), b.double()), "gelu_tanh")
    erf_ref = reference(F.linear(x64, w.double(), b.double()), "gelu")
    original, calls = torch._addmm_activation, []
    monkeypatch.setattr(torch, "_addmm_activation", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        y = A.linear_activation(x, w, b, "gelu_tanh")
    assert calls == [1] and y.shape == (4, 512, 4096) and y.dtype == dtype
    # ATen's CUDA _addmm_activation(use_gelu=True) is the tanh GELU (its CPU kernel is the erf one).
    assert rel(y, tanh_ref) < TOL[dtype] and rel(y, tanh_ref) < rel(y, erf_ref)
    with torch.no_grad():
        monkeypatch.setattr(A, "CUBLASLT_GELU_EPILOGUE", False)
        assert rel(A.linear_activation(x, w, b, "gelu_tanh"), tanh_ref) < TOL[dtype]
    assert calls == [1]
    # Training: F.linear + the op, gradients through both.
    w.requires_grad_()
    A.linear_activation(x, w, b, "gelu_tanh").float().square().sum().backward()
    assert calls == [1] and w.grad is not None and torch.isfinite(w.grad).all()


@pytest.mark.gpu
def test_gpu_small_problems_take_the_native_path_with_the_same_result(cuda, monkeypatch):
    torch.manual_seed(0)
    gu = torch.randn(64, 1024, device=cuda, requires_grad=True)

    def run():
        gu.grad = None
        y = A.gated_activation_packed(gu, "silu")
        y.square().sum().backward()
        return y.detach().clone(), gu.grad.clone()

    triton = run()
    monkeypatch.setattr(A, "TRITON_MIN_ELEMENTS", 1 << 30)
    for got, want in zip(run(), triton, strict=True):
        assert rel(got, want) < 1e-5
