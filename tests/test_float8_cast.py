"""The float8 quantization kernels (``kernel_pytorch.ops.float8_cast``) against their PyTorch path.

Maxima and inverse scales must match exactly. The float8 values must match bit for bit on the GPU. Under
Triton's interpreter (``test_interp_*``, run in a child process by
``test_triton_kernels_in_a_subprocess``) the fp32 -> float8 conversion is numpy's emulation, which
rounds differently from the hardware in three ways (measured with Triton 3.9): ties go away from zero,
subnormals truncate, and a value that rounds up past the top of its binade loses the carry (31.8 -> 16
in e4m3). There each mismatch must be one of those three, and they must stay rare.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._library.triton import is_wrap_triton_enabled

from .triton_interpreter import EAGER_OPCHECKS, INTERPRETED, cuda_device, interp, run_interpreted_tests

FC = importlib.import_module("kernel_pytorch.ops.float8_cast")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SHAPES = ((70, 130), (16, 16), (3, 200), (129, 65))  # partial tiles in both dimensions


def _source(seed: int, shape: tuple[int, int], dtype: torch.dtype, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen) * 3
    t[1, :] = 0  # an all-zero row: EPS keeps its scale finite
    t[0, 0] = 1e4  # an outlier
    return t.to(device=device, dtype=dtype)


def _both_paths(t: torch.Tensor, tensorwise: bool, fp8: torch.dtype, monkeypatch, kernel_devices):
    """(kernel outputs, reference outputs), each as (Amax, Float8Cast) with both layouts."""
    results = []
    for devices in (kernel_devices, frozenset()):
        monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", devices)
        amax = FC.abs_max(t, tensorwise, rows=True, cols=True)
        results.append((amax, FC.cast(t, amax, fp8, rows=True, cols=True, cols_multiple=16)))
    return results


def _prequantized(t: torch.Tensor, amax: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    fmax = torch.finfo(fp8).max
    return (t.float() * FC._scale_of(amax, fmax)).clamp(-fmax, fmax)


def _assert_casts_match(kernel, reference, t, tensorwise, fp8, exact: bool):
    (k_amax, k_cast), (r_amax, r_cast) = kernel, reference
    for name in ("tensor", "rows", "cols"):
        k, r = getattr(k_amax, name), getattr(r_amax, name)
        assert (k is None) == (r is None) and (k is None or torch.equal(k, r)), name
    padded_t = torch.nn.functional.pad(t.float().t(), (0, FC.padded(t.shape[0], 16) - t.shape[0]))
    for name, source, amax in (("rows", t, r_amax.tensor if tensorwise else r_amax.rows[:, None]),
                               ("cols", padded_t, r_amax.tensor if tensorwise else r_amax.cols[:, None])):
        k, r = getattr(k_cast, name), getattr(r_cast, name)
        assert k.dtype == r.dtype == fp8 and k.shape == r.shape, name
        assert torch.equal(getattr(k_cast, name + "_inv"), getattr(r_cast, name + "_inv")), name + "_inv"
        pre = _prequantized(source, amax.reshape(()) if tensorwise else amax, fp8)
        _assert_fp8_equal(k, r, pre, exact)


def _assert_fp8_equal(k: torch.Tensor, r: torch.Tensor, pre: torch.Tensor, exact: bool) -> None:
    """Kernel float8 ``k`` equal to reference ``r`` (``pre``: the fp32 values both rounded); off the GPU,
    up to the interpreter's three rounding differences."""
    kf, rf = k.float(), r.float()
    if exact:
        assert torch.equal(kf, rf)
        return
    power_of_two = rf.abs() == 2.0 ** torch.log2(rf.abs()).round()
    tie = pre == (kf + rf) / 2
    subnormal = pre.abs() < torch.finfo(k.dtype).smallest_normal
    allowed = (kf == rf) | (power_of_two & (kf == rf / 2)) | tie | (subnormal & (kf.abs() <= rf.abs()))
    assert allowed.all(), (kf[~allowed][:6], rf[~allowed][:6], pre[~allowed][:6])
    assert (kf != rf).float().mean() < 0.15  # 0.6-6% seen (most with the outlier, tensorwise)


@interp
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("tensorwise", (True, False))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", SHAPES)
def test_interp_kernels_match_reference(shape, dtype, tensorwise, fp8, monkeypatch):
    monkeypatch.setattr(FC, "_AMAX_MIN_PROGRAMS", 1)  # several tiles per amax program, the last one partial
    t = _source(hash((shape, str(dtype))) % 1000, shape, dtype)
    kernel, reference = _both_paths(t, tensorwise, fp8, monkeypatch, frozenset({"cpu"}))
    _assert_casts_match(kernel, reference, t, tensorwise, fp8, exact=False)


@interp
def test_interp_strided_input_and_one_layout(monkeypatch):
    t = _source(3, (64, 96), torch.float32).t()  # column-major view: stride (1, 64)
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset({"cpu"}))
    amax = FC.abs_max(t, False, cols=True)
    assert amax.rows is None and torch.equal(amax.cols, t.abs().amax(0))
    out = FC.cast(t, amax, torch.float8_e4m3fn, rows=False, cols=True)
    assert out.rows is None and out.cols.shape == (64, 96)  # t is (96, 64)
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset())
    reference = FC.cast(t, amax, torch.float8_e4m3fn, rows=False, cols=True)
    assert torch.equal(out.cols_inv, reference.cols_inv)
    _assert_fp8_equal(out.cols, reference.cols, _prequantized(t.t(), amax.cols[:, None], torch.float8_e4m3fn),
                      exact=False)


def _exactly_quantized(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Integers in [-7, 7] with a 7 or -7 in every row and column: every maximum (tensor, row, column) is 7,
    so each scale is exact (448 / 7 = 64 for e4m3, 57344 / 7 = 8192 for e5m2), every scaled value is
    representable, and no rounding happens, in the kernels (interpreted or not) or in the PyTorch path."""
    t = torch.randint(-7, 8, (rows, cols), generator=gen).float()
    t[torch.arange(rows), torch.arange(rows) % cols] = 7.0
    t[torch.arange(cols) % rows, torch.arange(cols)] = -7.0
    return t


@interp
@pytest.mark.parametrize("recipe", ("tensorwise", "rowwise"))
def test_interp_float8_linear_through_the_kernels(recipe, monkeypatch):
    """The float8_linear ops' bodies launching the interpreted kernels (through triton_utils.launch): on
    values FP8 holds exactly (the interpreter's own float8 rounding differs from the GPU's, see the module
    docstring), forward and both gradients equal the exact products, as the PyTorch path does; the eager op
    checks pass. M = 40 is padded to 48 for the weight gradient's reduction."""
    f8 = importlib.import_module("kernel_pytorch.ops.float8_linear")
    launches = {"n": 0}
    wrapping = []  # whether each launch could have been traced: never in these plain eager calls
    real_launch = FC.launch

    def counted(kernel):
        launches["n"] += 1
        wrapping.append(is_wrap_triton_enabled())
        return real_launch(kernel)

    monkeypatch.setattr(FC, "launch", counted)
    gen = torch.Generator().manual_seed(0)
    x, w, dy = _exactly_quantized(40, 64, gen), _exactly_quantized(32, 64, gen), _exactly_quantized(40, 32, gen)
    b = torch.randint(-5, 6, (32,), generator=gen).float()
    exact = (x @ w.t() + b, dy @ w, dy.t() @ x, dy.sum(0))
    for devices in (frozenset({"cpu"}), frozenset()):
        monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", devices)
        xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
        y = f8.float8_linear(xi, wi, bi, recipe, emulate=True)
        y.backward(dy)
        for name, value, expected in zip(("y", "dx", "dw", "db"), (y.detach(), xi.grad, wi.grad, bi.grad), exact):
            assert torch.equal(value, expected), (sorted(devices), name, float((value - expected).abs().max()))
        # forward: maxima and cast (both layouts) of x and of W; backward: of dy; none off the kernels
        assert launches["n"] == (6 if devices else 0)
        assert not any(wrapping)
        launches["n"] = 0
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset({"cpu"}))
    # tensorwise with the input's maximum given, as a producing kernel gives it
    x_amax = x.detach().abs().amax().reshape(1) if recipe == "tensorwise" else None
    torch.library.opcheck(torch.ops.kernel_pytorch.float8_linear.default,
                          (x, w.requires_grad_(), b, x_amax, recipe, True, torch.float8_e4m3fn, torch.float8_e5m2, True, True,
                           recipe == "tensorwise"),
                          test_utils=EAGER_OPCHECKS)


def test_reference_formulas():
    t = torch.tensor([[1.0, -4.0], [0.0, 0.0], [2.0, 0.5]])
    fmax = torch.finfo(torch.float8_e4m3fn).max
    amax = FC.abs_max(t, False, rows=True, cols=True)
    assert torch.equal(amax.rows, torch.tensor([4.0, 0.0, 2.0])) and torch.equal(amax.cols, torch.tensor([2.0, 4.0]))
    out = FC.cast(t, amax, torch.float8_e4m3fn, rows=True, cols=True, cols_multiple=16)
    assert out.cols.shape == (2, 16) and (out.cols[:, 3:].float() == 0).all()  # zero padding
    torch.testing.assert_close(out.rows_inv.squeeze(1), torch.tensor([4 / fmax, FC.EPS / fmax, 2 / fmax]))
    torch.testing.assert_close(out.rows.float() * out.rows_inv, t)
    torch.testing.assert_close(out.cols.float()[:, :3] * out.cols_inv, t.t())
    with pytest.raises(ValueError, match="float8 dtype"):
        FC.cast(t, amax, torch.bfloat16)
    with pytest.raises(ValueError, match="2-D"):
        FC.abs_max(t[0], True)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter's kernels are not JITFunctions: launch() has its own path")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to launch")
def test_launch_skips_the_tracing_wrapper_where_triton_op_bodies_run_eagerly():
    from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper
    from torch._library.triton import set_wrap_triton_enabled

    kernel = FC._cast_kernel
    assert isinstance(tu.launch(kernel), TraceableTritonKernelWrapper)  # tracing: Inductor sees the kernel
    with set_wrap_triton_enabled(False):  # what a triton_op body runs under eagerly
        assert tu.launch(kernel) is kernel
    with tu.eager_launches():  # an op body called through its autograd.Function (plain eager)
        assert tu.launch(kernel) is kernel


@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_* tests itself")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to interpret")
def test_triton_kernels_in_a_subprocess(interpreted_tests):
    run_interpreted_tests(__file__, interpreted_tests)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("tensorwise", (True, False))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("shape", SHAPES + ((4096, 2048),))
def test_gpu_kernels_match_reference_bitwise(shape, dtype, tensorwise, fp8, monkeypatch):
    t = _source(7, shape, dtype, device=cuda_device())
    kernel, reference = _both_paths(t, tensorwise, fp8, monkeypatch, frozenset({"cuda"}))
    _assert_casts_match(kernel, reference, t, tensorwise, fp8, exact=True)
