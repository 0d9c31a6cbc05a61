"""The fused norm ops (kernel_pytorch/ops/rms_norm.py, layer_norm.py): Triton kernels under Triton's
interpreter, the native path, autograd, custom-op registration and torch.compile; GPU numerics with -m gpu.

Triton's interpreter must be chosen before any ``@triton.jit`` function exists, Triton's own included
(``tl.sum`` is one): with ``TRITON_INTERPRET=1`` set later, a kernel wrapped by hand still fails inside
``tl.sum``. Setting it from this module would also leak into every test module collected after it (GPU
runs included). So the ``test_interp_*`` tests run in a child pytest started with ``TRITON_INTERPRET=1``
(``test_triton_kernels_in_a_subprocess``), and are deselected in a process without it; run them directly
with ``TRITON_INTERPRET=1 pytest tests/test_norm_ops.py -k interp``.

Under the interpreter, fp32 -> bf16 casts truncate (triton 3.9's interpreter) where the GPU rounds to
nearest even, so bf16 results there differ from PyTorch's by up to one bf16 ulp: within the tolerances
below, but not bitwise; the GPU tests check bitwise where it holds.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from .triton_interpreter import EAGER_OPCHECKS, INTERPRETED, cuda_device, interp, route_to_triton, run_interpreted_tests

# The modules, not the functions kernel_pytorch.ops exports under the same names.
L = importlib.import_module("kernel_pytorch.ops.layer_norm")
R = importlib.import_module("kernel_pytorch.ops.rms_norm")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Relative-norm error allowed against a float64 reference, per input dtype (rounding of the output).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}
HIDDENS = (1, 7, 64, 129, 1000)


def rel(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0) -> float:
    """||a - b|| / max(||b||, scale): ``scale`` for gradients that are ~0 by construction (hidden 1)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / max(float(expected.norm()), scale, 1e-12))


def _leaf(t):
    return t.detach().double().requires_grad_() if t is not None else None


def rms_reference(x, weight, residual, eps, cast_before_weight, dtype):
    """float64 RMSNorm of float64 leaves holding ``dtype`` values; ``h`` rounded to ``dtype`` as a
    model's ``x + residual`` is. Returns (y, h, rstd)."""
    h = (x + residual).to(dtype).double() if residual is not None else x
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = h * rstd
    if weight is not None:
        y = (y.to(dtype).double() if cast_before_weight else y) * weight
    return y, h, rstd.squeeze(-1)


def ln_reference(x, weight, bias, residual, eps, dtype):
    h = (x + residual).to(dtype).double() if residual is not None else x
    var, mean = torch.var_mean(h, -1, correction=0)
    return F.layer_norm(h, h.shape[-1:], weight, bias, eps), h, mean, torch.rsqrt(var + eps)


def _grads(outputs, cotangents, leaves):
    loss = sum((o * c.double()).sum() for o, c in zip(outputs, cotangents) if c is not None)
    wanted = [t for t in leaves if t is not None]
    return dict(zip([i for i, t in enumerate(leaves) if t is not None], torch.autograd.grad(loss, wanted)))


# ---------------------------------------------------------------------- Triton kernels, interpreter

def check_rms_kernels(x, weight=None, residual=None, cast_before_weight=False, n_programs=None, dy=None):
    dtype, eps = x.dtype, 1e-6
    tol = TOL[dtype]
    y, h, rstd, _ = R.rms_norm_fwd(x, weight, residual, eps, cast_before_weight)
    leaves = [_leaf(t) for t in (x, weight, residual)]
    y_ref, h_ref, rstd_ref = rms_reference(*leaves, eps, cast_before_weight, dtype)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert rstd.dtype == tu.acc_dtype(dtype) and rstd.shape == x.shape[:-1]
    assert rel(y, y_ref) < tol
    assert rel(rstd, rstd_ref) < tol
    if residual is not None:
        assert h.shape == x.shape and rel(h, h_ref) < tol
        if dtype != torch.bfloat16:  # bitwise, as eager's x + r (bf16: see the module docstring)
            assert torch.equal(h, x + residual)
    else:
        assert h is None

    dy = torch.randn_like(y) if dy is None else dy
    dh = torch.randn_like(y) if residual is not None else None
    dx, dw = R.rms_norm_bwd(dy, h if residual is not None else x, weight, rstd, dh, cast_before_weight,
                            n_programs=n_programs)
    grads = _grads([y_ref, h_ref if residual is not None else None], [dy, dh], leaves)
    scale = float((dy.double() * rstd_ref.detach().unsqueeze(-1)).norm())
    assert dx.dtype == dtype and dx.shape == x.shape
    assert rel(dx, grads[0], scale) < tol
    if weight is not None:
        assert dw.dtype == weight.dtype and rel(dw, grads[1]) < tol
    else:
        assert dw is None


def check_ln_kernels(x, weight=None, bias=None, residual=None, n_programs=None):
    dtype, eps = x.dtype, 1e-5
    tol = TOL[dtype]
    y, h, mean, rstd = L.layer_norm_fwd(x, weight, bias, residual, eps)
    leaves = [_leaf(t) for t in (x, weight, bias, residual)]
    y_ref, h_ref, mean_ref, rstd_ref = ln_reference(*leaves, eps, dtype)
    assert y.dtype == dtype and y.shape == x.shape and mean.shape == rstd.shape == x.shape[:-1]
    scale = 1e-3 * y.numel() ** 0.5  # hidden 1 without bias: y is exactly 0
    assert rel(y, y_ref, scale) < tol
    assert rel(mean, mean_ref, 1e-3) < tol and rel(rstd, rstd_ref) < tol
    if residual is not None:
        assert rel(h, h_ref) < tol

    dy, dh = torch.randn_like(y), (torch.randn_like(y) if residual is not None else None)
    dx, dw, db = L.layer_norm_bwd(dy, h if residual is not None else x, weight, bias, mean, rstd, dh,
                                  n_programs=n_programs)
    grads = _grads([y_ref, h_ref if residual is not None else None], [dy, dh], leaves)
    assert rel(dx, grads[0], float((dy.double() * rstd_ref.detach().unsqueeze(-1)).norm())) < tol
    assert (dw is None) == (weight is None) and (db is None) == (bias is None)
    if weight is not None:
        assert dw.dtype == weight.dtype and rel(dw, grads[1], 1e-3) < tol
    if bias is not None:
        assert db.dtype == bias.dtype and rel(db, grads[2]) < tol


RMS_CASES = {  # name: (weight, residual, cast_before_weight)
    "plain": (False, False, False),
    "weight": (True, False, False),
    "weight-cast-first": (True, False, True),
    "residual-weight": (True, True, False),
    "residual-no-weight": (False, True, False),
}


@interp
@pytest.mark.parametrize("case", RMS_CASES)
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_rms_norm_kernels(dtype, hidden, case):
    torch.manual_seed(hidden)
    with_weight, with_residual, cast = RMS_CASES[case]
    x = torch.randn(3, 5, hidden, dtype=dtype)  # 3-D, 15 rows
    weight = torch.randn(hidden, dtype=dtype) if with_weight else None
    residual = torch.randn_like(x) if with_residual else None
    check_rms_kernels(x, weight, residual, cast)


LN_CASES = {  # name: (weight, bias, residual)
    "plain": (False, False, False),
    "weight": (True, False, False),
    "bias": (False, True, False),
    "weight-bias": (True, True, False),
    "residual-weight-bias": (True, True, True),
}
# At the widest hidden size (backward programs looping over several row tiles, the last one partial) the
# cases between the bare and the fullest one run no branch that the narrower sizes do not already run with
# every case, and they are the interpreter's slowest: LayerNorm's backward reduces its two row sums with a
# combine function, which the interpreter runs element by element (~3 s a case at hidden 1000).
LN_WIDEST_CASES = ("plain", "residual-weight-bias")
LN_HIDDEN_CASES = [pytest.param(hidden, case, id=f"{hidden}-{case}") for hidden in HIDDENS for case in LN_CASES
                   if hidden != max(HIDDENS) or case in LN_WIDEST_CASES]


@interp
@pytest.mark.parametrize("hidden, case", LN_HIDDEN_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_layer_norm_kernels(dtype, hidden, case):
    torch.manual_seed(hidden)
    with_weight, with_bias, with_residual = LN_CASES[case]
    x = torch.randn(3, 5, hidden, dtype=dtype) * 3 + 1  # a mean to remove
    weight = torch.randn(hidden, dtype=dtype) if with_weight else None
    bias = torch.randn(hidden, dtype=dtype) if with_bias else None
    residual = torch.randn_like(x) if with_residual else None
    check_ln_kernels(x, weight, bias, residual)


LAYOUTS = ("transposed", "row-slice", "3d-transposed")


def _strided(layout, dtype, hidden, device="cpu"):
    """Inputs the launchers must flatten: a transposed one (column stride != 1: copied), a row slice
    (row stride > hidden: read in place) and a 3-D transpose whose leading dims do not merge."""
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)  # noqa: E731
    if layout == "transposed":
        return make(hidden, 24).t()
    if layout == "row-slice":
        return make(24, hidden + 5)[:, :hidden]
    return make(4, 6, hidden).transpose(0, 1)


def check_strided(layout, dtype, hidden, device="cpu"):
    x, residual = _strided(layout, dtype, hidden, device), _strided(layout, dtype, hidden, device)
    weight = torch.randn(2 * hidden, dtype=dtype, device=device)[::2]  # a strided weight too
    dy = torch.randn(hidden, x.numel() // hidden, dtype=dtype, device=device).t().reshape(x.shape)
    check_rms_kernels(x, weight, residual, dy=dy)
    check_rms_kernels(x, weight, None, dy=dy)
    check_ln_kernels(x, weight, weight.flip(0), residual)


@interp
# Each layout once and each dtype once: the launchers' stride handling does not depend on the dtype, whose
# arithmetic the contiguous tests above check at every size (the GPU test below takes every pair).
@pytest.mark.parametrize("layout, dtype", list(zip(LAYOUTS, DTYPES)), ids=str)
def test_interp_non_contiguous_inputs(dtype, layout):
    torch.manual_seed(0)
    check_strided(layout, dtype, 129)


@interp
def test_interp_cast_before_weight_rounds_like_the_model():
    # Sub-tolerance, so the float64 checks cannot see it: in fp16 (the interpreter rounds fp16 to
    # nearest even, like PyTorch) cast_before_weight=True reproduces Llama's formula to a few elements
    # of 64000 (rsqrt's last bit; measured 2), while F.rms_norm's rounding differs in ~16600.
    torch.manual_seed(0)
    x, w = torch.randn(64, 1000, dtype=torch.float16), torch.randn(1000, dtype=torch.float16)
    x32 = x.float()
    hf = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.float16)
    assert (R.rms_norm_fwd(x, w, None, 1e-6, True)[0] != hf).sum() < 64
    assert (R.rms_norm_fwd(x, w, None, 1e-6, False)[0] != hf).sum() > 6400
    # The weight gradient takes the rounded value too (fp32 weight, so dw is not rounded away):
    # 8e-8 from the native formula with rounding, 2e-4 without.
    w32, dy = torch.randn(1000), torch.randn_like(x)
    _, _, rstd, _ = R.rms_norm_fwd(x, w32, None, 1e-6, True)
    _, dw_model = R._rms_norm_bwd_native(dy, x, w32, rstd, None, True, True)
    assert rel(R.rms_norm_bwd(dy, x, w32, rstd, None, True)[1], dw_model) < 1e-6
    assert rel(R.rms_norm_bwd(dy, x, w32, rstd, None, False)[1], dw_model) > 1e-5


@interp
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_interp_weight_offset_equals_the_offset_weight(residual):
    """Gemma's ``(1 + w.float())``: the kernels add the offset to the weight they load, in fp32, and compute what
    they compute given the summed fp32 weight, bit for bit; the weight's gradient is the sum's, rounded to w's dtype
    (float16: the interpreter rounds it to nearest even, as PyTorch does)."""
    torch.manual_seed(0)
    x, w = torch.randn(48, 96, dtype=torch.float16), (torch.randn(96) * 0.1).to(torch.float16)
    r = torch.randn_like(x) if residual else None
    summed = 1.0 + w.float()
    y, h, rstd, _ = R.rms_norm_fwd(x, w, r, 1e-6, weight_offset=1.0)
    y_ref, _, rstd_ref, _ = R.rms_norm_fwd(x, summed, r, 1e-6)
    assert torch.equal(y, y_ref) and torch.equal(rstd, rstd_ref)
    dy = torch.randn_like(x)
    dx, dw = R.rms_norm_bwd(dy, h if residual else x, w, rstd, None, weight_offset=1.0)
    dx_ref, dw_ref = R.rms_norm_bwd(dy, h if residual else x, summed, rstd, None)
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref.to(w.dtype))


@interp
@pytest.mark.parametrize("n_programs", [1, 3, 64])
def test_interp_backward_partial_sums_over_programs(n_programs):
    # The weight gradient is reduced over per-program partial sums; 1, several, and more programs than
    # row tiles (64 rows of 64 columns are 2 tiles of 32 rows) give the same result.
    torch.manual_seed(1)
    x, w, b = torch.randn(64, 64), torch.randn(64), torch.randn(64)
    check_rms_kernels(x, w, n_programs=n_programs)
    check_ln_kernels(x, w, b, n_programs=n_programs)


@interp
@pytest.mark.parametrize("sums, dtypes", [(1, (torch.bfloat16,)), (2, (torch.float16, torch.float32)),
                                          (2, (torch.float64, torch.float64))])
def test_interp_sum_partials_over_many_programs_and_odd_columns(sums, dtypes):
    # More partial rows than one load holds (64), and columns that are not a multiple of the block: the
    # masked loads add nothing, each sum is cast to its own dtype.
    torch.manual_seed(3)
    acc = torch.float64 if torch.float64 in dtypes else torch.float32
    partial = torch.randn(150, sums, 77, dtype=acc)
    got = tu.sum_partials(partial, dtypes)
    for index, (out, dtype) in enumerate(zip(got, dtypes)):
        want = partial[:, index].double().sum(0).to(dtype)
        assert out.dtype == dtype and out.shape == (77,)
        torch.testing.assert_close(out, want, rtol=1e-6 if dtype in (torch.float32, torch.float64) else 1e-2,
                                   atol=1e-5)
    with pytest.raises(ValueError, match="1 or 2 partial buffers"):
        tu.sum_partials(partial, dtypes * 2)


@interp
def test_interp_zero_rows():
    x, w = torch.randn(0, 7), torch.randn(7)
    y, _, rstd, _ = R.rms_norm_fwd(x, w)
    dx, dw = R.rms_norm_bwd(torch.randn(0, 7), x, w, rstd)
    assert y.shape == dx.shape == (0, 7) and torch.equal(dw, torch.zeros(7))
    y, _, mean, rstd = L.layer_norm_fwd(x, w, w)
    _, dw, db = L.layer_norm_bwd(torch.randn(0, 7), x, w, w, mean, rstd)
    assert y.shape == (0, 7) and torch.equal(db, torch.zeros(7))


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Route the ops' CPU tensors to the Triton kernels (interpreted), small problems included; counts
    the launches so a test can tell which path ran."""
    calls = {}
    for module in (R, L):
        launchers = [n for n in module.__all__ if n.endswith(("_fwd", "_bwd"))]
        thresholds = ("TRITON_FWD_MIN_ELEMENTS", "TRITON_BWD_MIN_ELEMENTS", "TRITON_BWD_MIN_HIDDEN")
        route_to_triton(monkeypatch, module, launchers, thresholds, calls)
    return calls


@interp
def test_interp_ops_run_triton_and_gradcheck_in_float64(triton_on_cpu):
    # The interpreter computes in float64 when given float64 (the kernels' ACC dtype follows the
    # input), so gradcheck checks the Triton forward and backward kernels through the custom ops.
    torch.manual_seed(0)
    # 3 rows of 7: one tile of 4 rows of 8, masked in both directions. gradcheck launches the kernels for
    # every perturbed input element and every output element (5 rows took 30 s interpreted, 3 rows 18 s).
    x, r = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    w, b = torch.randn(7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    x, r, w, b = (t.requires_grad_() for t in (x, r, w, b))
    checks = [
        lambda x, w: R.rms_norm(x, w),
        lambda x, w: R.rms_norm(x, w, cast_before_weight=True),
        lambda x, r: R.rms_norm(x, None, 1e-6, r),
        lambda x, r, w: R.rms_norm(x, w, 1e-6, r),
        lambda x, w, b: L.layer_norm(x, w, b),
        lambda x: L.layer_norm(x),
        lambda x, r, w, b: L.layer_norm(x, w, b, 1e-5, r),
    ]
    inputs = [(x, w), (x, w), (x, r), (x, r, w), (x, w, b), (x,), (x, r, w, b)]
    for fn, args in zip(checks, inputs):
        assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7)
    assert set(triton_on_cpu) == {"rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd"}


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_ops_triton_path_matches_native_path(triton_on_cpu, dtype, monkeypatch):
    torch.manual_seed(0)
    x, r = torch.randn(2, 9, 129, dtype=dtype), torch.randn(2, 9, 129, dtype=dtype)
    w, b = torch.randn(129, dtype=dtype), torch.randn(129, dtype=dtype)

    def run():
        leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
        xx, rr, ww, bb = leaves
        y1, h1 = R.rms_norm(xx, ww, 1e-6, rr, cast_before_weight=True)
        y2, h2 = L.layer_norm(h1, ww, bb, 1e-5, rr)
        (y1.float().sum() + y2.float().square().sum() + h2.float().sum()).backward()
        return [y1, h1, y2, h2] + [t.grad for t in leaves]

    triton_results = run()
    assert triton_on_cpu.get("rms_norm_bwd") and triton_on_cpu.get("layer_norm_bwd")
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset({"cuda"}))
    for got, want in zip(triton_results, run()):
        assert rel(got, want) < 2 * TOL[dtype]




@interp
def test_interp_opcheck_triton_path(triton_on_cpu):
    torch.manual_seed(0)
    x = torch.randn(6, 33, requires_grad=True)
    r, w, b = torch.randn(6, 33), torch.randn(33, requires_grad=True), torch.randn(33, requires_grad=True)
    torch.library.opcheck(torch.ops.kernel_pytorch.rms_norm.default, (x, w, r, 1e-6, True, True, None),
                          test_utils=EAGER_OPCHECKS)
    slot = torch.zeros(1, requires_grad=True)  # its gradient: the backward kernel's max |dx|
    torch.library.opcheck(torch.ops.kernel_pytorch.rms_norm.default, (x, w, r, 1e-6, False, False, slot),
                          test_utils=EAGER_OPCHECKS)
    torch.library.opcheck(torch.ops.kernel_pytorch.layer_norm.default, (x, w, b, r, 1e-5), test_utils=EAGER_OPCHECKS)
    assert triton_on_cpu.get("rms_norm_fwd") and triton_on_cpu.get("layer_norm_fwd")


# ----------------------------------------------------------------------------- run the above, on CPU

@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_* tests itself")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to interpret")
def test_triton_kernels_in_a_subprocess(interpreted_tests):
    run_interpreted_tests(__file__, interpreted_tests)


# --------------------------------------------------------------------------------- the native path

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_rms_norm_is_f_rms_norm_or_hf_bitwise(dtype):
    torch.manual_seed(0)
    x, w, r = torch.randn(4, 6, 96, dtype=dtype), torch.randn(96, dtype=dtype), torch.randn(4, 6, 96, dtype=dtype)
    assert torch.equal(R.rms_norm(x, w, 1e-6), F.rms_norm(x, (96,), w, 1e-6))
    assert torch.equal(R.rms_norm(x, None, 1e-5), F.rms_norm(x, (96,), None, 1e-5))
    x32 = x.float()
    hf = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)  # LlamaRMSNorm
    assert torch.equal(R.rms_norm(x, w, 1e-6, cast_before_weight=True), hf)
    y, h = R.rms_norm(x, w, 1e-6, r)
    assert torch.equal(h, x + r) and torch.equal(y, F.rms_norm(x + r, (96,), w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_layer_norm_is_f_layer_norm_bitwise(dtype):
    torch.manual_seed(0)
    x, r = torch.randn(4, 6, 96, dtype=dtype), torch.randn(4, 6, 96, dtype=dtype)
    w, b = torch.randn(96, dtype=dtype), torch.randn(96, dtype=dtype)
    for weight, bias in [(w, b), (w, None), (None, b), (None, None)]:
        assert torch.equal(L.layer_norm(x, weight, bias, 1e-5), F.layer_norm(x, (96,), weight, bias, 1e-5))
    y, h = L.layer_norm(x, w, b, 1e-5, r)
    assert torch.equal(h, x + r) and torch.equal(y, F.layer_norm(x + r, (96,), w, b, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_gradients_match_eager(dtype):
    """Same gradients as autograd through F.rms_norm / F.layer_norm / the HF formula."""
    torch.manual_seed(0)
    base = [torch.randn(3, 7, 129, dtype=dtype), torch.randn(129, dtype=dtype), torch.randn(129, dtype=dtype)]
    dy = torch.randn(3, 7, 129, dtype=dtype)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in base]
        (fn(*leaves).float() * dy.float()).sum().backward()
        return [t.grad for t in leaves[:2]] + [leaves[2].grad]

    def hf(x, w, _):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    pairs = [
        (lambda x, w, b: R.rms_norm(x, w, 1e-6) + 0 * b, lambda x, w, b: F.rms_norm(x, (129,), w, 1e-6) + 0 * b),
        (lambda x, w, b: R.rms_norm(x, w, 1e-6, cast_before_weight=True) + 0 * b, lambda x, w, b: hf(x, w, b) + 0 * b),
        (lambda x, w, b: L.layer_norm(x, w, b), lambda x, w, b: F.layer_norm(x, (129,), w, b)),
    ]
    for ours, eager in pairs:
        for got, want in zip(grads(ours), grads(eager)):
            assert rel(got, want) < 2 * TOL[dtype]


def test_native_gradcheck_float64():
    torch.manual_seed(0)
    x, r = torch.randn(3, 4, 6, dtype=torch.float64), torch.randn(3, 4, 6, dtype=torch.float64)
    w, b = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    x, r, w, b = (t.requires_grad_() for t in (x, r, w, b))
    xt = x.transpose(0, 1)  # non-contiguous through the op
    cases = [
        (lambda x, w: R.rms_norm(x, w), (x, w)),
        (lambda x: R.rms_norm(x), (xt,)),
        (lambda x, w: R.rms_norm(x, w, cast_before_weight=True), (x, w)),
        (lambda x, r, w: R.rms_norm(x, w, 1e-6, r), (x, r, w)),
        (lambda x, w, b: L.layer_norm(x, w, b), (xt, w, b)),
        (lambda x, b: L.layer_norm(x, None, b), (x, b)),
        (lambda x, r, w, b: L.layer_norm(x, w, b, 1e-5, r), (x, r, w, b)),
    ]
    for fn, args in cases:
        assert torch.autograd.gradcheck(fn, args)


def test_frozen_weight_gets_no_gradient_and_residual_gets_dx():
    torch.manual_seed(0)
    x, r, w = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True), torch.randn(8)
    y, h = R.rms_norm(x, w, 1e-6, r)
    (y.sum() + h.square().sum()).backward()
    assert w.grad is None and torch.equal(x.grad, r.grad)


def test_opcheck_native_path():
    torch.manual_seed(0)
    x = torch.randn(6, 33, requires_grad=True)
    r, w, b = torch.randn(6, 33), torch.randn(33, requires_grad=True), torch.randn(33, requires_grad=True)
    rstd, mean = torch.rand(6) + 0.5, torch.randn(6)
    ops = torch.ops.kernel_pytorch
    slot = torch.zeros(1, requires_grad=True)
    for args in [(x, w, r, 1e-6, False, False, None), (x, None, None, 1e-6, False, True, None),
                 (x.t(), None, None, 1e-6, True, True, None), (x, w, r, 1e-6, False, False, slot)]:
        torch.library.opcheck(ops.rms_norm.default, args)
    for args in [(x, w, b, r, 1e-5), (x, None, None, None, 1e-5), (x, None, b, None, 1e-5)]:
        torch.library.opcheck(ops.layer_norm.default, args)
    dy = torch.randn(6, 33)
    for fp8_amax in (False, True):
        torch.library.opcheck(ops.rms_norm_backward.default, (dy, x.detach(), w.detach(), rstd, dy, False, True, fp8_amax))
    torch.library.opcheck(ops.layer_norm_backward.default,
                          (dy, x.detach(), w.detach(), b.detach(), mean, rstd, None, True, True))


def test_compile_fullgraph_with_backward_has_no_graph_break():
    torch.manual_seed(0)

    def block(x, r, w, b):
        y, h = R.rms_norm(x, w, 1e-6, r, cast_before_weight=True)
        z = L.layer_norm(y, w, b) + R.rms_norm(h)
        z2, _ = L.layer_norm(z, None, b, 1e-5, h)
        return z2

    args = [torch.randn(2, 5, 16, requires_grad=True), torch.randn(2, 5, 16, requires_grad=True),
            torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    clones = [a.detach().clone().requires_grad_() for a in args]
    compiled(*args).square().sum().backward()
    block(*clones).square().sum().backward()
    for got, want in zip(args, clones):
        assert torch.allclose(got.grad, want.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- limits, dispatch, modules

def test_row_tile_table():
    assert tu.row_tile(4096) == tu.RowTile(4096, 1, 8)
    assert tu.row_tile(4096, n_rows=16384, backward=True, hip=False) == tu.RowTile(4096, 2, 16)  # measured table
    assert tu.row_tile(4096, n_rows=1, backward=True, hip=False) == tu.RowTile(4096, 1, 16)
    assert tu.row_tile(2048, backward=True, hip=True).num_warps == 8  # the rule: no table on ROCm
    assert tu.row_tile(1000, n_rows=64) == tu.RowTile(1024, 2, 4)
    assert tu.row_tile(64, n_rows=1000).rows == 32
    assert tu.row_tile(64, n_rows=5).rows == 8  # no more rows per tile than the problem has
    assert tu.row_tile(65536, backward=True, hip=False).num_warps == 32
    assert tu.row_tile(65536, backward=True, hip=True).num_warps == 16
    assert tu.row_tile(16384).num_warps == 16  # forward: measured best at 16 warps


def test_hidden_above_limit_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="65537 exceeds 65536"):
        tu.row_tile(tu.MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match="exceeds 65536"):
        R.rms_norm_fwd(torch.randn(2, tu.MAX_HIDDEN + 1))  # before any launch: no Triton run needed
    with pytest.raises(ValueError, match="exceeds 65536"):
        L.layer_norm_bwd(torch.randn(2, 70000), torch.randn(2, 70000), None, None, torch.zeros(2), torch.ones(2))
    # At trace time too, wherever the Triton path would run: the op body, traced on fake tensors, checks.
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset({"cuda", "meta"}))
    x = torch.empty(4, 70000, device="meta")
    for op in (lambda: R.rms_norm(x), lambda: L.layer_norm(x)):
        with pytest.raises(ValueError, match="exceeds 65536"):
            op()
    tu.row_tile(tu.MAX_HIDDEN)  # the limit itself is fine
    assert R.rms_norm(torch.randn(2, 70000)).shape == (2, 70000)  # the native path (CPU) has no limit


def test_cpu_tensors_take_the_native_path(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("Triton launcher called for a CPU tensor")

    for name in ("rms_norm_fwd", "rms_norm_bwd"):
        monkeypatch.setattr(R, name, no_triton)
    for name in ("layer_norm_fwd", "layer_norm_bwd"):
        monkeypatch.setattr(L, name, no_triton)
    x = torch.randn(4, 8, requires_grad=True)
    (R.rms_norm(x, torch.ones(8)).sum() + L.layer_norm(x).square().sum()).backward()
    assert x.grad is not None
    assert not tu.use_triton(torch.randn(4, 8))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="weight shape"):
        R.rms_norm(torch.randn(2, 8), torch.ones(4))
    with pytest.raises(ValueError, match="residual"):
        L.layer_norm(torch.randn(2, 8), residual=torch.randn(2, 4))
    with pytest.raises(ValueError, match="floating"):
        R.rms_norm(torch.ones(2, 8, dtype=torch.long))


def test_modules_are_drop_ins():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 32)
    ours, theirs = R.RMSNorm(32, eps=1e-6), nn.RMSNorm(32, eps=1e-6)
    nn.init.normal_(theirs.weight)
    ours.load_state_dict(theirs.state_dict())
    assert torch.equal(ours(x), theirs(x)) and ours.state_dict().keys() == theirs.state_dict().keys()
    ours, theirs = L.LayerNorm(32), nn.LayerNorm(32)
    nn.init.normal_(theirs.weight), nn.init.normal_(theirs.bias)
    ours.load_state_dict(theirs.state_dict())
    assert torch.equal(ours(x), theirs(x)) and ours.state_dict().keys() == theirs.state_dict().keys()
    assert L.LayerNorm(32, bias=False).bias is None and R.RMSNorm(32, elementwise_affine=False).weight is None
    y, h = ours(x, residual=x)
    assert torch.equal(h, x + x)


# ---------------------------------------------------------------------------------------------- GPU

GPU_HIDDENS = (2048, 4096, 8192, 16384)


@pytest.fixture
def cuda():
    return cuda_device()


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", GPU_HIDDENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_kernels_match_float64(cuda, dtype, hidden):
    torch.manual_seed(hidden)
    x = torch.randn(4096, hidden, dtype=dtype, device=cuda)
    r = torch.randn_like(x)
    w, b = torch.randn(hidden, dtype=dtype, device=cuda), torch.randn(hidden, dtype=dtype, device=cuda)
    check_rms_kernels(x, w)
    check_rms_kernels(x, w, r, cast_before_weight=True)
    check_rms_kernels(x, None, r)
    check_ln_kernels(x, w, b, r)
    check_ln_kernels(x)
    # On the GPU, fp32 -> bf16 rounds to nearest even: the residual sum is eager's, bit for bit.
    _, h, _, _ = R.rms_norm_fwd(x, w, r)
    assert torch.equal(h, x + r)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_non_contiguous_inputs(cuda, dtype, layout):
    torch.manual_seed(0)
    check_strided(layout, dtype, 4096, cuda)


@pytest.mark.gpu
def test_gpu_weight_offset_equals_the_offset_weight(cuda):
    """As the interpreted test: the offset added in the kernels equals the summed fp32 weight, bit for bit."""
    torch.manual_seed(0)
    x, w = torch.randn(4096, 2048, dtype=torch.bfloat16, device=cuda), torch.randn(2048, device=cuda).bfloat16()
    summed, dy = 1.0 + w.float(), torch.randn_like(x)
    y, _, rstd, _ = R.rms_norm_fwd(x, w, None, 1e-6, weight_offset=1.0)
    y_ref, _, rstd_ref, _ = R.rms_norm_fwd(x, summed, None, 1e-6)
    assert torch.equal(y, y_ref) and torch.equal(rstd, rstd_ref)
    dx, dw = R.rms_norm_bwd(dy, x, w, rstd, None, weight_offset=1.0)
    dx_ref, dw_ref = R.rms_norm_bwd(dy, x, summed, rstd, None)
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref.to(w.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_forward_close_to_aten(cuda, dtype):
    torch.manual_seed(0)
    x, w = torch.randn(4096, 4096, dtype=dtype, device=cuda), torch.randn(4096, dtype=dtype, device=cuda)
    y, _, _, _ = R.rms_norm_fwd(x, w)
    assert rel(y, F.rms_norm(x, (4096,), w, 1e-6)) < TOL[dtype]
    y, _, _, _ = L.layer_norm_fwd(x, w, w)
    assert rel(y, F.layer_norm(x, (4096,), w, w, 1e-5)) < TOL[dtype]


@pytest.mark.gpu
def test_gpu_small_problems_take_the_native_path_with_the_same_result(cuda, monkeypatch):
    torch.manual_seed(0)
    x, w = torch.randn(64, 1024, device=cuda, requires_grad=True), torch.randn(1024, device=cuda, requires_grad=True)

    def grads():
        x.grad = w.grad = None
        R.rms_norm(x, w).square().sum().backward()
        L.layer_norm(x, w, w).square().sum().backward()
        return x.grad.clone(), w.grad.clone()

    native = grads()  # 64 x 1024 is below TRITON_BWD_MIN_ELEMENTS and TRITON_BWD_MIN_HIDDEN
    for module in (R, L):
        monkeypatch.setattr(module, "TRITON_BWD_MIN_ELEMENTS", 0)
        monkeypatch.setattr(module, "TRITON_BWD_MIN_HIDDEN", 0)
    for got, want in zip(grads(), native):
        assert rel(got, want) < 1e-5


@pytest.mark.gpu
def test_gpu_opcheck_triton_path(cuda):
    torch.manual_seed(0)
    x = torch.randn(64, 1000, device=cuda, requires_grad=True)
    r = torch.randn(64, 1000, device=cuda)
    w, b = (torch.randn(1000, device=cuda, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.kernel_pytorch.rms_norm.default, (x, w, r, 1e-6, True, False, None))
    torch.library.opcheck(torch.ops.kernel_pytorch.layer_norm.default, (x, w, b, r, 1e-5))


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gpu_compile_dynamic_rows(cuda, dynamic):
    # Inductor calls the kernels from its own code (triton_op); with symbolic row counts too.
    torch.manual_seed(0)
    w = torch.randn(1024, device=cuda, dtype=torch.bfloat16)
    compiled = torch.compile(lambda x: R.rms_norm(x, w) + L.layer_norm(x, w, w), fullgraph=True, dynamic=dynamic)
    for rows in (8, 300, 4097):
        x = torch.randn(rows, 1024, device=cuda, dtype=torch.bfloat16)
        assert rel(compiled(x), R.rms_norm(x, w) + L.layer_norm(x, w, w)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_compile_fullgraph_inductor(cuda, dtype):
    torch.manual_seed(0)

    def block(x, r, w, b):
        y, h = R.rms_norm(x, w, 1e-6, r)
        z = L.layer_norm(y, w, b) + R.rms_norm(h, w, cast_before_weight=True)
        z2, _ = L.layer_norm(z, None, b, 1e-5, h)
        return z2

    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=cuda, requires_grad=True)  # noqa: E731
    args = [make(8, 512, 2048), make(8, 512, 2048), make(2048), make(2048)]
    clones = [a.detach().clone().requires_grad_() for a in args]
    out = torch.compile(block, fullgraph=True)(*args)
    ref = block(*clones)
    assert rel(out, ref) < TOL[dtype]
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    for got, want in zip(args, clones):
        assert rel(got.grad, want.grad) < 2 * TOL[dtype]


# ------------------------------------------------------------- LayerNorm with parameters in another dtype

MIXED_PARAMETERS = [(torch.float32, None), (None, torch.float32), (torch.float32, torch.float32),
                    (torch.bfloat16, torch.float32)]


def check_layer_norm_with_mixed_parameters(device, weight_dtype, bias_dtype, rows=64, hidden=1000,
                                           output_tolerance=4e-3):
    """A bf16 LayerNorm whose weight / bias are float32 (Cohere's, written out in float32): the op computes
    in float32 and rounds once, as the model's float32 formula cast back does; gradients in each dtype."""
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=device, requires_grad=True)
    params = [torch.randn(hidden, dtype=d, device=device, requires_grad=True) if d else None
              for d in (weight_dtype, bias_dtype)]
    leaves = [x, *[p for p in params if p is not None]]
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    w_ref, b_ref = (copies.pop(1) if p is not None else None for p in params)
    x32 = copies[0].float()
    centered = x32 - x32.mean(-1, keepdim=True)
    expected = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-5)
    expected = expected * w_ref.float() if w_ref is not None else expected
    expected = (expected + b_ref.float() if b_ref is not None else expected).to(torch.bfloat16)
    y = L.layer_norm(x, *params, eps=1e-5)
    assert y.dtype == torch.bfloat16 and rel(y, expected) < output_tolerance
    projection = torch.randn(rows, hidden, device=device)
    (y.float() * projection).sum().backward()
    (expected.float() * projection).sum().backward()
    references = [copies[0], *[r for r in (w_ref, b_ref) if r is not None]]
    for leaf, reference in zip(leaves, references):
        assert leaf.grad.dtype == leaf.dtype and rel(leaf.grad, reference.grad) < 2e-2


@pytest.mark.parametrize("weight_dtype, bias_dtype", MIXED_PARAMETERS, ids=str)
def test_native_layer_norm_takes_parameters_in_another_dtype(weight_dtype, bias_dtype):
    check_layer_norm_with_mixed_parameters("cpu", weight_dtype, bias_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("triton", [False, True], ids=["native", "triton"])
@pytest.mark.parametrize("weight_dtype, bias_dtype", MIXED_PARAMETERS, ids=str)
def test_gpu_layer_norm_takes_parameters_in_another_dtype(cuda, weight_dtype, bias_dtype, triton, monkeypatch):
    if triton:  # route every size to the Triton kernels
        for name in ("TRITON_FWD_MIN_ELEMENTS", "TRITON_BWD_MIN_ELEMENTS", "TRITON_BWD_MIN_HIDDEN"):
            monkeypatch.setattr(L, name, 0)
    check_layer_norm_with_mixed_parameters(cuda, weight_dtype, bias_dtype, rows=4096, hidden=2048)


@interp
@pytest.mark.parametrize("weight_dtype, bias_dtype", MIXED_PARAMETERS, ids=str)
def test_interp_layer_norm_takes_parameters_in_another_dtype(triton_on_cpu, weight_dtype, bias_dtype):
    # the interpreter's float32 -> bf16 conversion does not round to nearest even as the GPU does
    check_layer_norm_with_mixed_parameters("cpu", weight_dtype, bias_dtype, rows=8, hidden=33,
                                           output_tolerance=TOL[torch.bfloat16])
    assert triton_on_cpu.get("layer_norm_fwd") and triton_on_cpu.get("layer_norm_bwd")
