"""RMSNorm, and the fused residual add + RMSNorm, as a ``torch.library`` custom op with Triton kernels.

    y = x * rsqrt(mean(x², -1) + eps) * weight          statistics in fp32, y in x's dtype
    y = ... * (weight + weight_offset)                  Gemma's ``1 + w``: the offset added in fp32 in the kernel
    y, h = rms_norm(x, weight, residual=r)              h = x + r (x's dtype), y = rms_norm(h): one kernel
                                                        reads x and r once and writes h and y

Rounding. ``F.rms_norm`` multiplies by the weight in fp32 and rounds once (``cast_before_weight=False``,
the default). Hugging Face's Llama RMSNorm rounds the normalized value to the input dtype first, then
multiplies by the weight in that dtype: ``weight * (x32 * rstd).to(dtype)``; ``cast_before_weight=True``
reproduces that, so the norm pass can keep each model's own rounding.

Layers as every row norm's (:mod:`~kernel_pytorch.ops.row_norm`): ``_rms_norm_fwd_kernel`` /
``_rms_norm_bwd_kernel`` (Triton) -> ``rms_norm_fwd`` / ``rms_norm_bwd`` (launch) ->
``kernel_pytorch::rms_norm`` and ``kernel_pytorch::rms_norm_backward`` (custom ops, fake implementations,
autograd) -> :func:`rms_norm` and :class:`RMSNorm`.

Dispatch, inside the ops: CUDA/ROCm tensors of at least ``TRITON_FWD_MIN_ELEMENTS`` /
``TRITON_BWD_MIN_ELEMENTS`` elements run the Triton kernels; everything else (CPU, other devices, small
problems, machines without Triton) runs ATen's fused RMSNorm (what ``F.rms_norm`` calls) or the exact
formula, with the same statistics format, so a forward on one path and a backward on the other agree.
"""

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from kernel_pytorch.ops import row_norm
from kernel_pytorch.ops import triton_utils as tu
from kernel_pytorch.ops.float8_cast import check_grad_amax_slot, tensor_abs_max
from kernel_pytorch.ops.triton_utils import (grad_row_indices, jit, load_grad_rows, load_rows, row_indices,
                                             store_grad_rows, tl)

__all__ = ["rms_norm", "RMSNorm", "rms_norm_fwd", "rms_norm_bwd", "TRITON_FWD_MIN_ELEMENTS",
           "TRITON_BWD_MIN_ELEMENTS", "TRITON_BWD_MIN_HIDDEN"]

# Below these sizes (rows x hidden) the native path (ATen's fused RMSNorm) runs instead of Triton: where
# the threshold sweep (benchmarks/kernels.py) found it faster, the backward's partial weight-gradient buffer
# and sum being fixed costs (benchmarks/results/kernels.json, "suggested_thresholds"; docs/kernels.md).
TRITON_FWD_MIN_ELEMENTS = 0
TRITON_BWD_MIN_ELEMENTS = 1 << 23
TRITON_BWD_MIN_HIDDEN = 2048


# --------------------------------------------------------------------------------------------- kernels

@jit
def _rms_norm_fwd_kernel(
    X,  # (n_rows, n_cols) input, row stride stride_x, unit column stride
    R,  # (n_rows, n_cols) residual added to X before the norm; read only if HAS_RESIDUAL
    H,  # (n_rows, n_cols) output X + R in X's dtype, the norm's input; written only if HAS_RESIDUAL
    W,  # (n_cols,) weight, any float dtype; read only if HAS_WEIGHT
    Y,  # (n_rows, n_cols) output in X's dtype
    RSTD,  # (n_rows,) output 1 / sqrt(mean(h²) + eps) in ACC, saved for the backward
    AMAX,  # (n_programs,) fp32 output: each program's max |y| (as rounded to Y's dtype); only if FP8_AMAX
    stride_x, stride_r, stride_h, stride_y,
    n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr,
    ACC: tl.constexpr,  # tl.float32, or tl.float64 for fp64 inputs
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, FP8_AMAX: tl.constexpr,
    W_OFFSET: tl.constexpr = 0.0,  # added to the weight as loaded (Gemma's 1 + w)
):
    rows, cols, row_mask, col_mask, mask = row_indices(n_rows, n_cols, BLOCK_N, ROWS)
    x = load_rows(X, R, H, rows, cols, mask, stride_x, stride_r, stride_h, HAS_RESIDUAL, ACC)
    # .to(ACC): Inductor passes a Python-float eps as fp64 (eager Triton as fp32), which made the whole
    # tile fp64, and slower, inside compiled graphs (docs/kernels.md, "Row norms").
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps).to(ACC)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
        if W_OFFSET != 0.0:
            w = w + W_OFFSET
        if CAST_BEFORE_WEIGHT:
            y = y.to(Y.dtype.element_ty).to(ACC)
        y = y * w[None, :]
    y = y.to(Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
    if FP8_AMAX:  # masked elements are 0, and |y| >= 0
        tl.store(AMAX + tl.program_id(0), tl.max(tl.max(tl.abs(y.to(tl.float32)), axis=1), axis=0))


@jit
def _rms_norm_bwd_kernel(
    DY,  # (n_rows, n_cols) gradient of Y
    X,  # (n_rows, n_cols) the norm's input: x, or h = x + residual when fused
    W,  # (n_cols,) weight; read only if HAS_WEIGHT
    RSTD,  # (n_rows,) from the forward, in ACC
    DH,  # (n_rows, n_cols) gradient of the residual-sum output h, added to DX; read only if HAS_DH
    DX,  # (n_rows, n_cols) output in X's dtype (also the residual's gradient)
    DW_PARTIAL,  # (n_programs, n_cols) output in ACC: this program's sum of dy * normalized over its
                 # rows; written only if WEIGHT_GRAD, summed over programs by the launcher
    DX_AMAX,  # (n_programs,) fp32 output: this program's max |dx| as stored; written only if FP8_AMAX
    stride_dy, stride_x, stride_dh, stride_dx,
    n_rows, n_cols, rows_per_program,
    HAS_WEIGHT: tl.constexpr, HAS_DH: tl.constexpr, WEIGHT_GRAD: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    FP8_AMAX: tl.constexpr, W_OFFSET: tl.constexpr = 0.0,
):
    # n = x * rstd, g = dy * w:  dx = rstd * (g - n * mean(g * n)),  dw = sum over rows of dy * n
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
        if W_OFFSET != 0.0:
            w = w + W_OFFSET
    dw = tl.zeros((BLOCK_N,), ACC)
    dx_max = tl.zeros((BLOCK_N,), tl.float32)  # per column, reduced once at the end
    rows, row_mask, mask = grad_row_indices(row_start, row_end, col_mask, ROWS)
    x, dy = load_grad_rows(X, DY, rows, cols, mask, stride_x, stride_dy, ACC)
    for start in range(row_start, row_end, ROWS):
        # The next tile's reads go out before this one is reduced: software pipelining by hand, faster than
        # loading each tile where it is used (docs/kernels.md, "Row norms"). Past row_end all masked.
        next_rows, next_row_mask, next_mask = grad_row_indices(start + ROWS, row_end, col_mask, ROWS)
        next_x, next_dy = load_grad_rows(X, DY, next_rows, cols, next_mask, stride_x, stride_dy, ACC)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        n = x * rstd[:, None]
        g = dy
        if HAS_WEIGHT:
            g = dy * w[None, :]
        if WEIGHT_GRAD:
            if CAST_BEFORE_WEIGHT:  # the weight multiplied the rounded value
                dw += tl.sum(dy * n.to(X.dtype.element_ty).to(ACC), axis=0)
            else:
                dw += tl.sum(dy * n, axis=0)
        dx = rstd[:, None] * (g - n * (tl.sum(g * n, axis=1) / n_cols)[:, None])
        stored = store_grad_rows(DX, DH, dx, rows, cols, mask, stride_dx, stride_dh, HAS_DH)
        if FP8_AMAX:  # masked rows and columns are 0 (x, dy, rstd and dh load as 0 there)
            dx_max = tl.maximum(dx_max, tl.max(tl.abs(stored.to(tl.float32)), axis=0))
        rows, row_mask, mask, x, dy = next_rows, next_row_mask, next_mask, next_x, next_dy
    if WEIGHT_GRAD:
        tl.store(DW_PARTIAL + pid * n_cols + cols, dw, mask=col_mask)
    if FP8_AMAX:
        tl.store(DX_AMAX + pid, tl.max(dx_max, axis=0))


# -------------------------------------------------------------------------------------------- launches

def rms_norm_fwd(x: Tensor, weight: Optional[Tensor] = None, residual: Optional[Tensor] = None,
                 eps: float = 1e-6, cast_before_weight: bool = False, fp8_amax: bool = False,
                 weight_offset: float = 0.0):
    """Triton forward: ``(y, h, rstd, amax)``; ``h = x + residual`` or None, rstd of shape ``x.shape[:-1]``,
    ``amax`` = max |y| as a (1,) fp32 tensor with ``fp8_amax`` (else None): each program writes its tile's
    maximum and one small reduction takes theirs, so an FP8 linear fed by y need not read y to scale it.

    Any device Triton can launch on, CPU tensors included under ``TRITON_INTERPRET=1``.
    """
    rows = row_norm.forward_rows(x, residual)
    rstd = torch.empty(x.shape[:-1], dtype=tu.acc_dtype(x.dtype), device=x.device)
    if rows.n_rows == 0:
        return rows.y, rows.h, rstd, (tensor_abs_max(rows.y) if fp8_amax else None)  # the maximum of nothing: 0
    partial = torch.empty(rows.programs, dtype=torch.float32, device=x.device) if fp8_amax else None
    w = weight.contiguous() if weight is not None else tu.unused_pointer(x)
    pointers = (w, rows.y2, rstd, partial if fp8_amax else tu.unused_pointer(x))
    row_norm.launch_forward(_rms_norm_fwd_kernel, rows, x, pointers, eps, HAS_WEIGHT=weight is not None,
                            CAST_BEFORE_WEIGHT=cast_before_weight, FP8_AMAX=fp8_amax, W_OFFSET=float(weight_offset))
    return rows.y, rows.h, rstd, (partial.amax().reshape(1) if fp8_amax else None)


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor, dh: Optional[Tensor] = None,
                 cast_before_weight: bool = False, weight_grad: bool = True, n_programs: Optional[int] = None,
                 fp8_amax: bool = False, weight_offset: float = 0.0):
    """Triton backward: ``(dx, dweight)``; ``x`` is the norm's input (``h`` when the residual was fused),
    ``dh`` the gradient of ``h``, added into ``dx``; dweight is None without a weight or ``weight_grad``.
    With ``fp8_amax``, ``(dx, dweight, max |dx|)``: the (1,) fp32 maximum an FP8 linear whose output is
    this norm's input would otherwise read dx for.

    Each of ``n_programs`` programs (default: sized from the SM count) takes a contiguous block of rows
    and writes its partial dweight to an (n_programs, hidden) fp32 buffer, summed by ``tu.sum_partials``.
    """
    hidden = x.shape[-1]
    rows = row_norm.backward_rows(dy, x, dh, n_programs)
    weight_grad = weight_grad and weight is not None
    dx = rows.dx
    if rows.n_rows == 0:
        dw = torch.zeros_like(weight) if weight_grad else None
        return (dx, dw, tensor_abs_max(dx)) if fp8_amax else (dx, dw)  # the maximum of nothing: 0
    programs = rows.programs
    acc = tu.acc_dtype(x.dtype)
    partial = torch.empty((programs, hidden), dtype=acc, device=x.device) if weight_grad else tu.unused_pointer(rstd)
    dx_amax = torch.empty(programs, dtype=torch.float32, device=x.device) if fp8_amax else tu.unused_pointer(rstd)
    with tu.device_guard(x):
        tu.launch(_rms_norm_bwd_kernel)[(programs,)](
            rows.dy2, rows.x2, weight.contiguous() if weight is not None else tu.unused_pointer(x),
            rstd.reshape(-1).contiguous(), rows.dh2, rows.dx2, partial, dx_amax,
            *rows.strides(),
            rows.n_rows, hidden, rows.rows_per_program,
            HAS_WEIGHT=weight is not None, HAS_DH=dh is not None, WEIGHT_GRAD=weight_grad,
            CAST_BEFORE_WEIGHT=cast_before_weight, FP8_AMAX=fp8_amax, W_OFFSET=float(weight_offset),
            **row_norm.tile_constexprs(rows.tile, x.dtype),
        )
    dw = tu.sum_partials(partial[:, None], (weight.dtype,))[0] if weight_grad else None
    return (dx, dw, dx_amax.amax().reshape(1)) if fp8_amax else (dx, dw)


# ---------------------------------------------------------------------------------- native (non-Triton)

def _fused_rms_norm_available(device_type: str, backward: bool) -> bool:
    name = "aten::_fused_rms_norm_backward" if backward else "aten::_fused_rms_norm"
    # ATen's fused RMSNorm (torch >= 2.8) has CPU and CUDA forwards but a CUDA-only backward.
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


def _rms_norm_fwd_native(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], eps: float,
                         cast_before_weight: bool, fp8_amax: bool = False, weight_offset: float = 0.0):
    h, inp = row_norm.residual_sum(x, residual)
    acc = tu.acc_dtype(x.dtype)
    fused = (not cast_before_weight and not weight_offset and (weight is None or weight.dtype == x.dtype)
             and _fused_rms_norm_available(x.device.type, backward=False))
    if fused:  # the kernel F.rms_norm itself runs
        y, rstd = torch.ops.aten._fused_rms_norm(inp, [inp.shape[-1]], weight, eps)
    else:
        x32 = inp.to(acc)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        y = x32 * rstd
        if weight is not None and weight_offset:  # the kernel's arithmetic: the offset added in ACC
            y = (y.to(x.dtype).to(acc) if cast_before_weight else y) * (weight.to(acc) + weight_offset)
        elif weight is not None:
            y = y.to(x.dtype) * weight if cast_before_weight else y * weight.to(acc)
        y = y.to(x.dtype)
    amax = tensor_abs_max(y) if fp8_amax else None
    return y.contiguous(), h, rstd.reshape(inp.shape[:-1]).to(acc), amax


def _rms_norm_bwd_native(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor, dh: Optional[Tensor],
                         cast_before_weight: bool, weight_grad: bool, weight_offset: float = 0.0):
    weight_grad = weight_grad and weight is not None
    fused = (not cast_before_weight and not weight_offset and (weight is None or weight.dtype == x.dtype)
             and _fused_rms_norm_available(x.device.type, backward=True))
    if fused:
        dx, dw = torch.ops.aten._fused_rms_norm_backward(
            dy, x, [x.shape[-1]], rstd.unsqueeze(-1), weight, [True, weight_grad])
        if dh is not None:
            dx = dx + dh
        return dx.contiguous(), (dw if weight_grad else None)
    acc = tu.acc_dtype(x.dtype)
    x32, dy32, r = tu.as_rows(x).to(acc), tu.as_rows(dy).to(acc), rstd.reshape(-1, 1).to(acc)
    n = x32 * r
    g = dy32 * (weight.to(acc) + weight_offset) if weight is not None else dy32
    dx = r * (g - n * (g * n).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + tu.as_rows(dh).to(acc)
    dw = None
    if weight_grad:
        normed = n.to(x.dtype).to(acc) if cast_before_weight else n
        dw = (dy32 * normed).sum(0).to(weight.dtype)
    return dx.to(x.dtype).reshape(x.shape), dw


# ------------------------------------------------------------------------------------------ custom ops
# ``triton_op``, as every row norm (row_norm.py says why). Fake tensors: the same body, traced.

@torch.library.triton_op("kernel_pytorch::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Optional[Tensor], residual: Optional[Tensor], eps: float,
                 cast_before_weight: bool, fp8_amax: bool, grad_amax_slot: Optional[Tensor],
                 weight_offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # Returns (y, h, rstd, amax). A custom op's outputs cannot be optional: without a residual, h is an
    # empty tensor that nothing reads, and so is amax without fp8_amax. grad_amax_slot is not read: its
    # gradient carries max |dx| (see _backward).
    triton = tu.use_triton(x, TRITON_FWD_MIN_ELEMENTS)
    forward = rms_norm_fwd if triton else _rms_norm_fwd_native
    y, h, rstd, amax = forward(x, weight, residual, eps, cast_before_weight, fp8_amax, weight_offset=weight_offset)
    return (y, (h if h is not None else x.new_empty(0)), rstd,
            (amax if amax is not None else x.new_empty(0, dtype=torch.float32)))


@torch.library.triton_op("kernel_pytorch::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor, dh: Optional[Tensor],
                          cast_before_weight: bool, weight_grad: bool, fp8_amax: bool,
                          weight_offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    # Returns (dx, dweight, max |dx|); dweight is empty when not asked for, and so is the maximum.
    triton = tu.use_triton(x, TRITON_BWD_MIN_ELEMENTS) and x.shape[-1] >= TRITON_BWD_MIN_HIDDEN
    if triton:
        dx, dw, *amax = rms_norm_bwd(dy, x, weight, rstd, dh, cast_before_weight, weight_grad, fp8_amax=fp8_amax,
                                     weight_offset=weight_offset)
    else:
        dx, dw = _rms_norm_bwd_native(dy, x, weight, rstd, dh, cast_before_weight, weight_grad, weight_offset)
        amax = [tensor_abs_max(dx)] if fp8_amax else []
    return dx, (dw if dw is not None else x.new_empty(0)), (amax[0] if amax else x.new_empty(0, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    x, weight, residual, _eps, cast_before_weight, _fp8_amax, grad_amax_slot, weight_offset = inputs
    _y, h, rstd, amax = output
    ctx.cast_before_weight, ctx.weight_offset = cast_before_weight, weight_offset
    ctx.grad_amax = grad_amax_slot is not None
    ctx.mark_non_differentiable(amax)
    ctx.save_for_backward(row_norm.saved_input(ctx, x, h, residual), weight, rstd)


def _backward(ctx, dy, dh, _drstd, _damax):
    """dx (for x, and for the residual when fused); and, where ``grad_amax_slot`` was given, ``max |dx|`` as
    the slot's "gradient": how the FP8 linear whose output is x (``float8_linear(..., grad_amax_slot=True)``)
    receives its output gradient's maximum from this kernel instead of reading dx again."""
    x, weight, rstd = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[1]
    dx, dw, amax = _rms_norm_backward_op(dy, x, weight, rstd, dh if ctx.has_residual else None,
                                         ctx.cast_before_weight, weight_grad, ctx.grad_amax, ctx.weight_offset)
    return (dx, (dw if weight_grad else None), (dx if ctx.has_residual else None), None, None, None,
            (amax if ctx.grad_amax else None), None)


_rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------- public API

def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, residual: Optional[Tensor] = None,
             *, cast_before_weight: bool = False, fp8_amax: bool = False, grad_amax_slot: Optional[Tensor] = None,
             weight_offset: float = 0.0):
    """RMSNorm over the last axis; with ``residual``, the fused add + norm returning ``(normed, x + residual)``.

    Statistics in fp32, output in ``x``'s dtype; ``cast_before_weight=True`` rounds the normalized value
    to that dtype before the weight multiply (Hugging Face Llama) instead of once at the end
    (``F.rms_norm``). Differentiable, and traceable by ``torch.compile(fullgraph=True)``.
    ``fp8_amax=True`` also returns ``max |normed|`` (a (1,) fp32 tensor, last), computed by the norm's
    own kernel: what :func:`~kernel_pytorch.ops.float8_linear.float8_linear` takes as ``x_amax``.
    ``grad_amax_slot``: the slot ``float8_linear(..., grad_amax_slot=True)`` returned with x (or with the
    residual, whose gradient is the same); the backward computes ``max |dx|`` in its kernel and hands it to
    that linear's backward through it. ``weight_offset`` multiplies by ``weight + weight_offset`` instead, the sum
    made in fp32 by the kernels as they load the weight (Gemma's RMSNorm, ``(1 + w.float())``), not by a kernel
    of its own; the weight's gradient is the same.

    >>> x, r, w = torch.randn(2, 8, 64), torch.randn(2, 8, 64), torch.ones(64)
    >>> y = rms_norm(x, w)
    >>> y, h = rms_norm(x, w, residual=r)        # h = x + r, y = rms_norm(h, w)
    >>> y, amax = rms_norm(x, w, fp8_amax=True)  # amax == y.abs().amax()
    """
    row_norm.check_norm_arguments("rms_norm", x, residual, weight=weight)
    check_grad_amax_slot(grad_amax_slot)
    if weight_offset and weight is None:
        raise ValueError("rms_norm: weight_offset needs a weight")
    y, h, _, amax = _rms_norm_op(x, weight, residual, float(eps), bool(cast_before_weight), bool(fp8_amax),
                                 grad_amax_slot, float(weight_offset))
    outputs = (y, h) if residual is not None else (y,)
    outputs += (amax,) if fp8_amax else ()
    return outputs if len(outputs) > 1 else y


class RMSNorm(nn.Module):
    """Drop-in for ``nn.RMSNorm`` (and Hugging Face's ``LlamaRMSNorm`` with ``cast_before_weight=True``):
    same ``weight`` parameter, so state dicts load both ways. ``forward(x, residual=None)``.

    >>> norm = RMSNorm(64)
    >>> y = norm(torch.randn(4, 64))
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, elementwise_affine: bool = True,
                 cast_before_weight: bool = False, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps, self.cast_before_weight = hidden_size, eps, cast_before_weight
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype)) if elementwise_affine else None

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        return rms_norm(x, self.weight, self.eps, residual, cast_before_weight=self.cast_before_weight)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, cast_before_weight={self.cast_before_weight}"
