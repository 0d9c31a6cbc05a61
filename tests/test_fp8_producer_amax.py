"""Quantization fused into the producing kernels: ``rms_norm`` and ``gated_activation*`` with ``fp8_amax=True``
return ``max |y|`` from their own kernels, and ``float8_linear(..., x_amax=)`` takes it instead of reading x.

The maximum must be exact, not close: it sets the FP8 scale, so an FP8 linear fed by a producer's amax must
give the unfused result bit for bit. Triton kernels run interpreted on the CPU (``test_interp_*``, in a child
process) and on the GPU with ``-m gpu``; the native path on the CPU.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from .triton_interpreter import INTERPRETED, cuda_device, interp, route_to_triton, run_interpreted_tests

A = importlib.import_module("kernel_pytorch.ops.activations")
R = importlib.import_module("kernel_pytorch.ops.rms_norm")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")
from kernel_pytorch.ops.float8_linear import float8_linear  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16)


def _producers(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, gate_up: torch.Tensor):
    """(name, y, amax) of each producer in its fp8_amax form, on fresh inputs."""
    n = gate_up.shape[-1] // 2
    y, amax = R.rms_norm(x, w, fp8_amax=True)
    yield "rms_norm", y, amax
    y, _h, amax = R.rms_norm(x, w, 1e-6, r, cast_before_weight=True, fp8_amax=True)
    yield "residual rms_norm", y, amax
    y, amax = A.gated_activation_packed(gate_up, "silu", fp8_amax=True)
    yield "packed swiglu", y, amax
    y, amax = A.gated_activation_packed(gate_up[::2], "gelu_tanh", gate_first=False, fp8_amax=True)
    yield "packed geglu, strided rows", y, amax
    y, amax = A.gated_activation(gate_up[..., :n], gate_up[..., n:], "silu", fp8_amax=True)
    yield "swiglu of two chunks", y, amax


def _inputs(dtype, device, rows=37, hidden=96):
    x = torch.randn(rows, hidden, dtype=dtype, device=device) * 3
    x[rows // 2, hidden // 3] = 40.0  # an outlier that must be the maximum's source, not lost in a tile's reduction
    return (x, torch.randn(hidden, dtype=dtype, device=device), torch.randn_like(x),
            torch.randn(rows, 2 * hidden, dtype=dtype, device=device))


def check_amax_is_exact(dtype, device):
    torch.manual_seed(0)
    for name, y, amax in _producers(*_inputs(dtype, device)):
        assert amax.shape == (1,) and amax.dtype == torch.float32, name
        assert torch.equal(amax, y.detach().abs().float().amax().reshape(1)), name


def check_fp8_linear_with_producer_amax_equals_unfused(device, emulate):
    """The FP8 linear given the norm's maximum: the unfused result, forward and gradients, bit for bit."""
    torch.manual_seed(1)
    x, w, _, _ = _inputs(torch.bfloat16, device, rows=64, hidden=128)
    weight = torch.randn(48, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
    results = []
    for fused in (False, True):
        xi = x.clone().requires_grad_()
        y, amax = R.rms_norm(xi, w, fp8_amax=True)
        out = float8_linear(y, weight, emulate=emulate, x_amax=amax if fused else None)
        out.float().square().sum().backward()
        results.append((out.detach(), xi.grad, weight.grad.clone()))
        weight.grad = None
    for a, b in zip(*results):
        assert torch.equal(a, b)


def check_backward_amax_is_exact(dtype, device, rows=37):
    """The packed gated backward's max |d gate_up|, handed to the slot's gradient: exact, and d gate_up the
    same as without it."""
    torch.manual_seed(6)
    gate_up = torch.randn(2 * rows, 192, dtype=dtype, device=device)
    dy = torch.randn(rows, 96, dtype=dtype, device=device)
    dy[rows - 1, 95] = -50.0  # in the last program, at its last element
    for kind, gate_first in (("silu", True), ("gelu_tanh", False)):
        grads = []
        for slot in (None, torch.zeros(1, device=device, requires_grad=True)):
            gu = gate_up[::2].clone().requires_grad_()  # strided rows, as a row slice of a projection
            A.gated_activation_packed(gu, kind, gate_first, grad_amax_slot=slot).backward(dy)
            grads.append(gu.grad)
        assert torch.equal(grads[0], grads[1]), kind
        assert torch.equal(slot.grad, grads[1].abs().float().amax().reshape(1)), kind
    # The RMSNorm backward's max |dx|, plain and residual-fused (dx then also takes the sum's gradient).
    x = torch.randn(rows, 160, dtype=dtype, device=device)
    residual, weight = torch.randn_like(x), torch.randn(160, dtype=dtype, device=device)
    dy = torch.randn_like(x)
    dy[rows - 1, 159] = 60.0
    for fused in (False, True):
        grads = []
        for slot in (None, torch.zeros(1, device=device, requires_grad=True)):
            xi = x.clone().requires_grad_()
            out = R.rms_norm(xi, weight, 1e-6, residual if fused else None, grad_amax_slot=slot)
            y, h = out if fused else (out, None)
            (y * dy).sum().backward() if h is None else ((y * dy).sum() + (h * dy.flip(0)).sum()).backward()
            grads.append(xi.grad)
        assert torch.equal(grads[0], grads[1]), fused
        assert torch.equal(slot.grad, grads[1].abs().float().amax().reshape(1)), fused


def check_fp8_linear_with_consumer_grad_amax_equals_unfused(device, emulate):
    """The FP8 gate/up projection given its gradient's maximum by the SwiGLU backward: the unfused result,
    forward and gradients, bit for bit."""
    torch.manual_seed(7)
    x = torch.randn(64, 128, dtype=torch.bfloat16, device=device)
    weight = torch.randn(96, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
    results = []
    for fused in (False, True):
        xi = x.clone().requires_grad_()
        if fused:
            gate_up, slot = float8_linear(xi, weight, emulate=emulate, grad_amax_slot=True)
        else:
            gate_up, slot = float8_linear(xi, weight, emulate=emulate), None
        out = A.gated_activation_packed(gate_up, "silu", grad_amax_slot=slot)
        out.float().square().sum().backward()
        results.append((out.detach(), xi.grad, weight.grad.clone()))
        weight.grad = None
    for a, b in zip(*results):
        assert torch.equal(a, b)


def check_fp8_linear_with_norm_grad_amax_equals_unfused(device, emulate):
    """The FP8 output projection feeding the residual-fused RMSNorm (o_proj / down_proj into the next norm),
    given its gradient's maximum by the norm's backward: the unfused gradients, bit for bit."""
    torch.manual_seed(10)
    x, stream = torch.randn(64, 128, dtype=torch.bfloat16, device=device), torch.randn(64, 96, dtype=torch.bfloat16,
                                                                                     device=device)
    weight = torch.randn(96, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
    norm_weight = torch.randn(96, dtype=torch.bfloat16, device=device)
    results = []
    for fused in (False, True):
        xi = x.clone().requires_grad_()
        out, slot = float8_linear(xi, weight, emulate=emulate, grad_amax_slot=True) if fused else (
            float8_linear(xi, weight, emulate=emulate), None)
        y, h = R.rms_norm(out, norm_weight, 1e-6, stream, grad_amax_slot=slot)
        (y.float().square().sum() + h.float().sum()).backward()
        results.append((xi.grad, weight.grad.clone()))
        weight.grad = None
    for a, b in zip(*results):
        assert torch.equal(a, b)


def check_empty_inputs_give_a_zero_maximum():
    zero = torch.zeros(1)
    assert torch.equal(R.rms_norm(torch.randn(0, 8), torch.ones(8), fp8_amax=True)[1], zero)
    assert torch.equal(A.gated_activation_packed(torch.randn(0, 16), "silu", fp8_amax=True)[1], zero)
    assert torch.equal(A.gated_activation(torch.randn(0, 8), torch.randn(0, 8), "silu", fp8_amax=True)[1], zero)


def test_native_path_empty_inputs_give_a_zero_maximum():
    check_empty_inputs_give_a_zero_maximum()


def test_native_path_amax_is_exact():
    check_amax_is_exact(torch.float32, "cpu")
    check_amax_is_exact(torch.bfloat16, "cpu")
    check_backward_amax_is_exact(torch.float32, "cpu")
    check_backward_amax_is_exact(torch.bfloat16, "cpu")


def test_emulated_fp8_linear_with_producer_amax_equals_unfused():
    check_fp8_linear_with_producer_amax_equals_unfused("cpu", emulate=True)


def test_emulated_fp8_linear_with_consumer_grad_amax_equals_unfused():
    check_fp8_linear_with_consumer_grad_amax_equals_unfused("cpu", emulate=True)
    check_fp8_linear_with_norm_grad_amax_equals_unfused("cpu", emulate=True)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_slot_without_its_consumer_leaves_the_backward_to_find_the_maximum(compiled):
    # Its gradient must reach the backward as None, not as a zero maximum (a zero would scale d out to inf).
    torch.manual_seed(8)
    x, weight = torch.randn(32, 64, requires_grad=True), torch.randn(48, 64, requires_grad=True)
    out, slot = float8_linear(x, weight, emulate=True, grad_amax_slot=True)
    assert slot.shape == (1,) and slot.dtype == torch.float32 and slot.requires_grad

    def slot_unused(x):
        return float8_linear(x, weight, emulate=True, grad_amax_slot=True)[0]

    run = torch.compile(slot_unused, fullgraph=True, backend="aot_eager") if compiled else slot_unused
    run(x).square().sum().backward()
    fused_grads = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    float8_linear(x, weight, emulate=True).square().sum().backward()
    assert torch.equal(fused_grads[0], x.grad) and torch.equal(fused_grads[1], weight.grad)


def test_grad_amax_slot_is_for_the_tensorwise_recipe_only():
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="tensorwise"):
        float8_linear(x, w, recipe="rowwise", emulate=True, grad_amax_slot=True)
    with pytest.raises(ValueError, match="grad_amax_slot must be the"):
        A.gated_activation_packed(torch.randn(4, 8), "silu", grad_amax_slot=torch.zeros(2))
    with pytest.raises(ValueError, match="grad_amax_slot must be the"):
        R.rms_norm(torch.randn(4, 8), grad_amax_slot=torch.zeros(1, dtype=torch.float64))


def test_amax_output_takes_no_gradient_and_leaves_the_gradients_alone():
    torch.manual_seed(2)
    x, w, r, gate_up = (t.requires_grad_() for t in _inputs(torch.float64, "cpu", rows=5, hidden=8))
    for fn, args in ((lambda x, w: R.rms_norm(x, w, fp8_amax=True)[0], (x, w)),
                     (lambda x, r, w: R.rms_norm(x, w, 1e-6, r, fp8_amax=True)[:2], (x, r, w)),
                     (lambda gu: A.gated_activation_packed(gu, "silu", fp8_amax=True)[0], (gate_up,))):
        assert torch.autograd.gradcheck(fn, args)
    assert not R.rms_norm(x, w, fp8_amax=True)[1].requires_grad


def test_x_amax_is_for_the_tensorwise_recipe_only():
    x, w = torch.randn(16, 32), torch.randn(16, 32)
    with pytest.raises(ValueError, match="tensorwise"):
        float8_linear(x, w, recipe="rowwise", emulate=True, x_amax=x.abs().amax().reshape(1))


def test_compile_fullgraph_traces_the_amax_outputs():
    torch.manual_seed(3)
    x, w, _, gate_up = _inputs(torch.float32, "cpu")
    weight = torch.randn(32, 96)

    def fn(x, gate_up):
        y, amax = R.rms_norm(x, w, fp8_amax=True)
        h, h_amax = A.gated_activation_packed(gate_up, "silu", fp8_amax=True)
        return float8_linear(y, weight, emulate=True, x_amax=amax), h_amax

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(x, gate_up), fn(x, gate_up)):
        assert torch.equal(a, b)


def test_compile_fullgraph_trains_through_the_grad_amax_slot():
    torch.manual_seed(9)
    x, weight = torch.randn(32, 64), torch.randn(96, 64, requires_grad=True)

    def fn(x):
        gate_up, slot = float8_linear(x, weight, emulate=True, grad_amax_slot=True)
        return A.gated_activation_packed(gate_up, "silu", grad_amax_slot=slot)

    grads = []
    for run in (torch.compile(fn, fullgraph=True, backend="aot_eager"), fn):
        xi = x.clone().requires_grad_()
        run(xi).square().sum().backward()
        grads.append((xi.grad, weight.grad.clone()))
        weight.grad = None
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ Triton, interpreted

@pytest.fixture
def triton_on_cpu(monkeypatch):
    calls = route_to_triton(monkeypatch, R, ("rms_norm_fwd", "rms_norm_bwd"),
                            ("TRITON_FWD_MIN_ELEMENTS", "TRITON_BWD_MIN_ELEMENTS", "TRITON_BWD_MIN_HIDDEN"))
    return route_to_triton(monkeypatch, A, ("gated_activation_fwd", "gated_activation_packed_fwd",
                                            "gated_activation_packed_bwd"), ("TRITON_MIN_ELEMENTS",), calls)


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_kernel_amax_is_exact(triton_on_cpu, dtype):
    check_amax_is_exact(dtype, "cpu")
    assert set(triton_on_cpu) == {"rms_norm_fwd", "gated_activation_fwd", "gated_activation_packed_fwd"}


@interp
def test_interp_empty_inputs_give_a_zero_maximum(triton_on_cpu):
    check_empty_inputs_give_a_zero_maximum()
    assert set(triton_on_cpu) == {"rms_norm_fwd", "gated_activation_fwd", "gated_activation_packed_fwd"}


@interp
def test_interp_kernel_amax_over_many_programs(triton_on_cpu):
    # 3000 rows: hundreds of programs (partial maxima) for the norm and the flat gated tiles alike.
    torch.manual_seed(4)
    x, w, gate_up = torch.randn(3000, 64), torch.randn(64), torch.randn(3000, 128)
    x[2999, 63] = -77.0  # in the last program, at its last element
    y, amax = R.rms_norm(x, w, fp8_amax=True)
    assert torch.equal(amax, y.abs().amax().reshape(1))
    y, amax = A.gated_activation_packed(gate_up, "silu", fp8_amax=True)
    assert torch.equal(amax, y.abs().amax().reshape(1))


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_backward_amax_is_exact(triton_on_cpu, dtype):
    check_backward_amax_is_exact(dtype, "cpu")
    # Tens of programs' partial maxima (the packed gated backward: 19 programs of 16 rows, the last one partial),
    # and RMSNorm backward programs that loop over ten row tiles each (the last tile partial). The partial maxima
    # are reduced on the host, so more programs run no other code: 1500 rows took 46 s here, 300 rows 9 s.
    check_backward_amax_is_exact(dtype, "cpu", rows=300)
    check_fp8_linear_with_consumer_grad_amax_equals_unfused("cpu", emulate=True)
    check_fp8_linear_with_norm_grad_amax_equals_unfused("cpu", emulate=True)
    assert "gated_activation_packed_bwd" in triton_on_cpu and "rms_norm_bwd" in triton_on_cpu


@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_* tests itself")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to interpret")
def test_triton_kernels_in_a_subprocess(interpreted_tests):
    run_interpreted_tests(__file__, interpreted_tests)


# --------------------------------------------------------------------------------------------- GPU

@pytest.fixture
def cuda():
    return cuda_device()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_kernel_amax_is_exact(cuda, dtype):
    check_amax_is_exact(dtype, cuda)
    torch.manual_seed(5)
    x, w = torch.randn(8192, 2048, dtype=dtype, device=cuda), torch.randn(2048, dtype=dtype, device=cuda)
    y, amax = R.rms_norm(x, w, fp8_amax=True)
    assert torch.equal(amax, y.abs().float().amax().reshape(1))


@pytest.mark.gpu
def test_gpu_fp8_linear_with_producer_amax_equals_unfused(cuda):
    from kernel_pytorch.ops.float8_linear import float8_hardware_reason

    if float8_hardware_reason(cuda) is not None:
        pytest.fail(f"-m gpu FP8 tests need an FP8 GPU: {float8_hardware_reason(cuda)}")
    check_fp8_linear_with_producer_amax_equals_unfused(cuda, emulate=False)
    check_fp8_linear_with_consumer_grad_amax_equals_unfused(cuda, emulate=False)
    check_fp8_linear_with_norm_grad_amax_equals_unfused(cuda, emulate=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_backward_amax_is_exact(cuda, dtype):
    check_backward_amax_is_exact(dtype, cuda)
    check_backward_amax_is_exact(dtype, cuda, rows=8192)
