"""LayerNorm, and the fused residual add + LayerNorm, as a ``torch.library`` custom op with Triton kernels.

    y = (x - mean(x)) * rsqrt(var(x) + eps) * weight + bias     statistics in fp32, y in x's dtype,
                                                                rounded once (F.layer_norm's semantics)
    y, h = layer_norm(x, weight, bias, residual=r)              h = x + r, y = layer_norm(h): one kernel

Weight and bias are each optional. Layers as every row norm's (:mod:`~kernel_pytorch.ops.row_norm`):
``_layer_norm_fwd_kernel`` / ``_layer_norm_bwd_kernel`` -> ``layer_norm_fwd`` / ``layer_norm_bwd`` ->
``kernel_pytorch::layer_norm`` / ``kernel_pytorch::layer_norm_backward`` -> :func:`layer_norm`,
:class:`LayerNorm`. Dispatch and statistics format as in :mod:`~kernel_pytorch.ops.rms_norm`; the native path
is ATen's ``native_layer_norm`` (what ``F.layer_norm`` runs) and its fused backward.
"""

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from kernel_pytorch.ops import row_norm
from kernel_pytorch.ops import triton_utils as tu
from kernel_pytorch.ops.triton_utils import (grad_row_indices, jit, load_grad_rows, load_rows, row_indices,
                                             store_grad_rows, tl)

__all__ = ["layer_norm", "LayerNorm", "layer_norm_fwd", "layer_norm_bwd", "TRITON_FWD_MIN_ELEMENTS",
           "TRITON_BWD_MIN_ELEMENTS", "TRITON_BWD_MIN_HIDDEN", "TRITON_BWD_MAX_HIDDEN"]

# Below these sizes (rows x hidden) the native path runs instead of Triton, as in rms_norm.py: where the
# threshold sweep found ATen faster (benchmarks/results/kernels.json, "suggested_thresholds"; docs/kernels.md).
TRITON_FWD_MIN_ELEMENTS = 0
TRITON_BWD_MIN_ELEMENTS = 1 << 24
TRITON_BWD_MIN_HIDDEN = 2048
# Wider rows take ATen's backward: ours spills registers there and lost to it
# (benchmarks/results/tune_row_kernels.json; docs/kernels.md, "Row norms").
TRITON_BWD_MAX_HIDDEN = 8192


# --------------------------------------------------------------------------------------------- kernels

@jit
def _layer_norm_fwd_kernel(
    X,  # (n_rows, n_cols) input, row stride stride_x, unit column stride
    R,  # (n_rows, n_cols) residual added to X before the norm; read only if HAS_RESIDUAL
    H,  # (n_rows, n_cols) output X + R in X's dtype, the norm's input; written only if HAS_RESIDUAL
    W,  # (n_cols,) weight, any float dtype; read only if HAS_WEIGHT
    B,  # (n_cols,) bias, any float dtype; read only if HAS_BIAS
    Y,  # (n_rows, n_cols) output in X's dtype
    MEAN,  # (n_rows,) output mean(h) in ACC, saved for the backward
    RSTD,  # (n_rows,) output 1 / sqrt(var(h) + eps) in ACC, saved for the backward
    stride_x, stride_r, stride_h, stride_y,
    n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACC: tl.constexpr,  # tl.float32, or tl.float64 for fp64 inputs
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):
    rows, cols, row_mask, col_mask, mask = row_indices(n_rows, n_cols, BLOCK_N, ROWS)
    x = load_rows(X, R, H, rows, cols, mask, stride_x, stride_r, stride_h, HAS_RESIDUAL, ACC)
    mean = tl.sum(x, axis=1) / n_cols
    # Two passes over the row in registers: no E[x²] - E[x]² cancellation.
    d = tl.where(mask, x - mean[:, None], 0.0)
    # .to(ACC): Inductor passes a Python-float eps as fp64 (eager Triton as fp32), which made the whole
    # tile fp64, and slower, inside compiled graphs (docs/kernels.md, "Row norms").
    rstd = tl.math.rsqrt(tl.sum(d * d, axis=1) / n_cols + eps).to(ACC)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    y = d * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(ACC)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@jit
def _layer_norm_bwd_kernel(
    DY,  # (n_rows, n_cols) gradient of Y
    X,  # (n_rows, n_cols) the norm's input: x, or h = x + residual when fused
    W,  # (n_cols,) weight; read only if HAS_WEIGHT
    MEAN,  # (n_rows,) from the forward, in ACC
    RSTD,  # (n_rows,) from the forward, in ACC
    DH,  # (n_rows, n_cols) gradient of the residual-sum output h, added to DX; read only if HAS_DH
    DX,  # (n_rows, n_cols) output in X's dtype (also the residual's gradient)
    PARTIAL,  # (n_programs, WEIGHT_GRAD + BIAS_GRAD, n_cols) output in ACC: per program, the sum of dy * xhat
    #           (if WEIGHT_GRAD), then that of dy (if BIAS_GRAD); one buffer, summed by one launch
    stride_dy, stride_x, stride_dh, stride_dx, stride_partial,
    n_rows, n_cols, rows_per_program,
    HAS_WEIGHT: tl.constexpr, HAS_DH: tl.constexpr, WEIGHT_GRAD: tl.constexpr, BIAS_GRAD: tl.constexpr,
    ACC: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):
    # xhat = (x - mean) * rstd, g = dy * w:  dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),
    # dw = sum over rows of dy * xhat, db = sum over rows of dy
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(ACC)
    dw = tl.zeros((BLOCK_N,), ACC)
    db = tl.zeros((BLOCK_N,), ACC)
    rows, row_mask, mask = grad_row_indices(row_start, row_end, col_mask, ROWS)
    x, dy = load_grad_rows(X, DY, rows, cols, mask, stride_x, stride_dy, ACC)
    for start in range(row_start, row_end, ROWS):
        # The next tile's reads go out before this one is reduced: software pipelining by hand, faster than
        # loading each tile where it is used (docs/kernels.md, "Row norms"). Past row_end all masked.
        next_rows, next_row_mask, next_mask = grad_row_indices(start + ROWS, row_end, col_mask, ROWS)
        next_x, next_dy = load_grad_rows(X, DY, next_rows, cols, next_mask, stride_x, stride_dy, ACC)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        # Padding columns hold -mean * rstd here, but only ever meet dy = 0 and g = 0: no mask needed.
        xhat = (x - mean[:, None]) * rstd[:, None]
        g = dy
        if HAS_WEIGHT:
            g = dy * w[None, :]
        if WEIGHT_GRAD:
            dw += tl.sum(dy * xhat, axis=0)
        if BIAS_GRAD:
            db += tl.sum(dy, axis=0)
        # Both row sums in one reduction: one round of cross-warp exchanges instead of two (docs/kernels.md).
        sum_g, sum_gx = tl.reduce((g, g * xhat), 1, _add_pair)
        dx = rstd[:, None] * (g - (sum_g / n_cols)[:, None] - xhat * (sum_gx / n_cols)[:, None])
        store_grad_rows(DX, DH, dx, rows, cols, mask, stride_dx, stride_dh, HAS_DH)
        rows, row_mask, mask, x, dy = next_rows, next_row_mask, next_mask, next_x, next_dy
    partial = PARTIAL + pid * stride_partial + cols
    if WEIGHT_GRAD:
        tl.store(partial, dw, mask=col_mask)
        partial += n_cols
    if BIAS_GRAD:
        tl.store(partial, db, mask=col_mask)


# -------------------------------------------------------------------------------------------- launches

def layer_norm_fwd(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                   residual: Optional[Tensor] = None, eps: float = 1e-5):
    """Triton forward: ``(y, h, mean, rstd)``; ``h = x + residual`` or None, statistics of shape
    ``x.shape[:-1]``. CPU tensors too under ``TRITON_INTERPRET=1``."""
    rows = row_norm.forward_rows(x, residual)
    acc = tu.acc_dtype(x.dtype)
    mean = torch.empty(x.shape[:-1], dtype=acc, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=acc, device=x.device)
    if rows.n_rows == 0:
        return rows.y, rows.h, mean, rstd
    unused = tu.unused_pointer
    pointers = (weight.contiguous() if weight is not None else unused(x),
                bias.contiguous() if bias is not None else unused(x), rows.y2, mean, rstd)
    row_norm.launch_forward(_layer_norm_fwd_kernel, rows, x, pointers, eps,
                            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None)
    return rows.y, rows.h, mean, rstd


def layer_norm_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                   rstd: Tensor, dh: Optional[Tensor] = None, weight_grad: bool = True, bias_grad: bool = True,
                   n_programs: Optional[int] = None):
    """Triton backward: ``(dx, dweight, dbias)``, each parameter gradient None when not asked for or
    without that parameter (``bias`` is read for its dtype only). ``x`` is the norm's input (``h`` when
    fused), ``dh`` the gradient of ``h``. Partial dweight/dbias per program, as in ``rms_norm_bwd``."""
    hidden = x.shape[-1]
    rows = row_norm.backward_rows(dy, x, dh, n_programs)
    weight_grad = weight_grad and weight is not None
    bias_grad = bias_grad and bias is not None
    if rows.n_rows == 0:
        return (rows.dx, (torch.zeros_like(weight) if weight_grad else None),
                (torch.zeros_like(bias) if bias_grad else None))
    unused = tu.unused_pointer
    sums = [p.dtype for p, wanted in ((weight, weight_grad), (bias, bias_grad)) if wanted]
    partial = (torch.empty((rows.programs, len(sums), hidden), dtype=tu.acc_dtype(x.dtype), device=x.device)
               if sums else unused(rstd))
    with tu.device_guard(x):
        tu.launch(_layer_norm_bwd_kernel)[(rows.programs,)](
            rows.dy2, rows.x2, weight.contiguous() if weight is not None else unused(x),
            mean.reshape(-1).contiguous(), rstd.reshape(-1).contiguous(), rows.dh2, rows.dx2, partial,
            *rows.strides(), len(sums) * hidden,
            rows.n_rows, hidden, rows.rows_per_program,
            HAS_WEIGHT=weight is not None, HAS_DH=dh is not None, WEIGHT_GRAD=weight_grad, BIAS_GRAD=bias_grad,
            **row_norm.tile_constexprs(rows.tile, x.dtype),
        )
    grads = iter(tu.sum_partials(partial, tuple(sums)) if sums else ())
    return rows.dx, (next(grads) if weight_grad else None), (next(grads) if bias_grad else None)


# ---------------------------------------------------------------------------------- native (non-Triton)

def _aten_stats_dtype(x: Tensor) -> torch.dtype:
    # ATen keeps LayerNorm statistics in the input dtype on CPU (and MTIA), in fp32 elsewhere
    # (torch._refs.native_layer_norm spells out the same rule); its backward wants them back that way.
    return x.dtype if x.device.type in ("cpu", "mtia") else tu.acc_dtype(x.dtype)


def _aten_takes(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> bool:
    """Whether ATen's LayerNorm takes these dtypes: its CPU kernels refuse some mixes (a float32 bias
    without weight, a bf16 weight with a float32 bias), so any parameter not in x's dtype takes the formula
    (a float32 weight on a bf16 LayerNorm written out in float32, as Cohere's)."""
    return all(p is None or p.dtype == x.dtype for p in (weight, bias))


def _layer_norm_fwd_native(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                           residual: Optional[Tensor], eps: float):
    h, inp = row_norm.residual_sum(x, residual)
    acc, shape = tu.acc_dtype(x.dtype), inp.shape[:-1]
    if not _aten_takes(x, weight, bias):  # the formula, in ACC, rounded once as the kernels do
        x32 = inp.to(acc)
        mean = x32.mean(-1, keepdim=True)
        rstd = torch.rsqrt((x32 - mean).pow(2).mean(-1, keepdim=True) + eps)
        y = (x32 - mean) * rstd
        y = y * weight.to(acc) if weight is not None else y
        y = y + bias.to(acc) if bias is not None else y
        return y.to(x.dtype).contiguous(), h, mean.reshape(shape), rstd.reshape(shape)
    y, mean, rstd = torch.ops.aten.native_layer_norm(inp, [inp.shape[-1]], weight, bias, eps)
    return y.to(x.dtype).contiguous(), h, mean.reshape(shape).to(acc), rstd.reshape(shape).to(acc)


def _layer_norm_bwd_native(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                           rstd: Tensor, dh: Optional[Tensor], weight_grad: bool, bias_grad: bool):
    weight_grad = weight_grad and weight is not None
    bias_grad = bias_grad and bias is not None
    if not _aten_takes(x, weight, bias):
        return _layer_norm_bwd_formula(dy, x, weight, bias, mean, rstd, dh, weight_grad, bias_grad)
    stats = _aten_stats_dtype(x)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        dy, x, [x.shape[-1]], mean.unsqueeze(-1).to(stats), rstd.unsqueeze(-1).to(stats), weight, bias,
        [True, weight_grad, bias_grad])
    if dh is not None:
        dx = dx + dh
    return dx.contiguous(), (dw if weight_grad else None), (db if bias_grad else None)


def _layer_norm_bwd_formula(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                            mean: Tensor, rstd: Tensor, dh: Optional[Tensor], weight_grad: bool, bias_grad: bool):
    """The backward kernel's formula in ACC: xhat = (x - mean) * rstd, g = dy * w,
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), dw = sum(dy * xhat), db = sum(dy)."""
    acc = tu.acc_dtype(x.dtype)
    x32, dy32 = tu.as_rows(x).to(acc), tu.as_rows(dy).to(acc)
    xhat = (x32 - mean.reshape(-1, 1).to(acc)) * rstd.reshape(-1, 1).to(acc)
    g = dy32 * weight.to(acc) if weight is not None else dy32
    dx = rstd.reshape(-1, 1).to(acc) * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if dh is not None:
        dx = dx + tu.as_rows(dh).to(acc)
    dw = (dy32 * xhat).sum(0).to(weight.dtype) if weight_grad else None
    db = dy32.sum(0).to(bias.dtype) if bias_grad else None
    return dx.to(x.dtype).reshape(x.shape).contiguous(), dw, db


# ------------------------------------------------------------------------------------------ custom ops
# ``triton_op``, as every row norm (row_norm.py says why). Fake tensors: the same body, traced.

@torch.library.triton_op("kernel_pytorch::layer_norm", mutates_args=())
def _layer_norm_op(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], residual: Optional[Tensor],
                   eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # Returns (y, h, mean, rstd); without a residual, h is an empty tensor (outputs cannot be optional).
    triton = tu.use_triton(x, TRITON_FWD_MIN_ELEMENTS)
    forward = layer_norm_fwd if triton else _layer_norm_fwd_native
    y, h, mean, rstd = forward(x, weight, bias, residual, eps)
    return y, (h if h is not None else x.new_empty(0)), mean, rstd


@torch.library.triton_op("kernel_pytorch::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                            rstd: Tensor, dh: Optional[Tensor], weight_grad: bool, bias_grad: bool
                            ) -> tuple[Tensor, Tensor, Tensor]:
    # Returns (dx, dweight, dbias); a gradient not asked for is an empty tensor. ``bias`` gives db's dtype.
    triton = tu.use_triton(x, TRITON_BWD_MIN_ELEMENTS) and \
        TRITON_BWD_MIN_HIDDEN <= x.shape[-1] <= TRITON_BWD_MAX_HIDDEN
    backward = layer_norm_bwd if triton else _layer_norm_bwd_native
    dx, dw, db = backward(dy, x, weight, bias, mean, rstd, dh, weight_grad, bias_grad)
    empty = x.new_empty(0)
    return dx, (dw if dw is not None else empty), (db if db is not None else empty.clone())


def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, _eps = inputs
    _y, h, mean, rstd = output
    ctx.save_for_backward(row_norm.saved_input(ctx, x, h, residual), weight, bias, mean, rstd)


def _backward(ctx, dy, dh, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    weight_grad = weight is not None and ctx.needs_input_grad[1]
    bias_grad = bias is not None and ctx.needs_input_grad[2]
    dx, dw, db = _layer_norm_backward_op(dy, x, weight, bias, mean, rstd, dh if ctx.has_residual else None,
                                         weight_grad, bias_grad)
    return (dx, dw if weight_grad else None, db if bias_grad else None,
            dx if ctx.has_residual else None, None)


_layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------- public API

def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5,
               residual: Optional[Tensor] = None):
    """LayerNorm over the last axis (``F.layer_norm(x, (x.shape[-1],), weight, bias, eps)``); with
    ``residual``, the fused add + norm returning ``(normed, x + residual)``.

    Statistics in fp32, output in ``x``'s dtype, rounded once. Differentiable, and traceable by
    ``torch.compile(fullgraph=True)``.

    >>> x, r = torch.randn(2, 8, 64), torch.randn(2, 8, 64)
    >>> w, b = torch.ones(64), torch.zeros(64)
    >>> y = layer_norm(x, w, b)
    >>> y, h = layer_norm(x, w, b, residual=r)      # h = x + r, y = layer_norm(h, w, b)
    """
    row_norm.check_norm_arguments("layer_norm", x, residual, weight=weight, bias=bias)
    y, h, _, _ = _layer_norm_op(x, weight, bias, residual, float(eps))
    return (y, h) if residual is not None else y


class LayerNorm(nn.Module):
    """Drop-in for ``nn.LayerNorm`` over the last axis: same ``weight``/``bias`` parameters, so state
    dicts load both ways. ``forward(x, residual=None)``.

    >>> norm = LayerNorm(64)
    >>> y = norm(torch.randn(4, 64))
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(hidden_size, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size, **factory)) if elementwise_affine and bias else None

    def forward(self, x: Tensor, residual: Optional[Tensor] = None):
        return layer_norm(x, self.weight, self.bias, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, bias={self.bias is not None}"
