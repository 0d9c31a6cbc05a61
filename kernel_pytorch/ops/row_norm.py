"""What the row norms (:mod:`~kernel_pytorch.ops.rms_norm`, :mod:`~kernel_pytorch.ops.layer_norm`) share
around their own kernels: the views, outputs and grid of a launch, the native path's residual sum, the
input the backward reads, and the argument checks.

Each op has the same layers (docs/design.md, "Kernels"): ``_<op>_fwd_kernel`` / ``_<op>_bwd_kernel`` (Triton,
built from the row helpers of :mod:`~kernel_pytorch.ops.triton_utils`) -> ``<op>_fwd`` / ``<op>_bwd`` (launch;
tiles from ``triton_utils.row_tile``, which raises past hidden 65536; views and grid from here) ->
``kernel_pytorch::<op>`` and ``kernel_pytorch::<op>_backward`` (``triton_op`` custom ops, autograd) -> the
functional and the module. Each op keeps its kernels, schema, native path and dispatch thresholds (tests and
benchmarks set those on the op's module; the op bodies read them per call).

``triton_op`` rather than ``custom_op``: under torch.compile (how ``optimize`` runs models) Inductor traces the
body and calls the Triton kernels from its generated code, instead of calling back into the op's Python per
launch, which made the forward dispatch-bound (docs/kernels.md, "Row norms"). Fake tensors: the same body,
traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from kernel_pytorch.ops import triton_utils as tu

__all__ = ["ForwardRows", "BackwardRows", "forward_rows", "backward_rows", "launch_forward", "tile_constexprs",
           "residual_sum", "saved_input", "check_norm_arguments"]


@dataclass(frozen=True)
class ForwardRows:
    """A forward launch's (rows, hidden) views and outputs: ``y``, and ``h = x + residual`` (None without a
    residual, whose pointers are then zero-size stand-ins)."""

    x2: Tensor
    r2: Tensor
    y: Tensor
    y2: Tensor
    h: Optional[Tensor]
    h2: Tensor
    tile: tu.RowTile

    @property
    def n_rows(self):
        return self.x2.shape[0]

    @property
    def programs(self):
        return tu.cdiv(self.n_rows, self.tile.rows)


def forward_rows(x: Tensor, residual: Optional[Tensor]) -> ForwardRows:
    """The views and outputs of a forward over ``x``'s rows (and ``residual``'s, fused)."""
    hidden = x.shape[-1]
    tile = tu.row_tile(hidden, x.numel() // max(hidden, 1))
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    return ForwardRows(
        x2=tu.as_rows(x), r2=tu.as_rows(residual) if residual is not None else tu.unused_pointer(x),
        y=y, y2=y.view(-1, hidden), h=h, h2=h.view(-1, hidden) if h is not None else tu.unused_pointer(x),
        tile=tile)


def launch_forward(kernel, rows: ForwardRows, x: Tensor, pointers: tuple, eps: float, **constexprs) -> None:
    """Launch a forward norm kernel, one program per row tile. Its arguments, in the order both kernels take
    them: ``X, R, H, *pointers, stride_x, stride_r, stride_h, stride_y, n_rows, n_cols, eps``, then the
    constexprs (``HAS_RESIDUAL`` and the tile's set here)."""
    with tu.device_guard(x):
        tu.launch(kernel)[(rows.programs,)](
            rows.x2, rows.r2, rows.h2, *pointers,
            rows.x2.stride(0), rows.r2.stride(0), rows.h2.stride(0), rows.y2.stride(0),
            rows.n_rows, x.shape[-1], eps,
            HAS_RESIDUAL=rows.h is not None, **constexprs, **tile_constexprs(rows.tile, x.dtype),
        )


@dataclass(frozen=True)
class BackwardRows:
    """A backward launch's (rows, hidden) views, its output ``dx``, and its persistent grid: ``programs``,
    each taking ``rows_per_program`` contiguous rows (both 0 without rows)."""

    dy2: Tensor
    x2: Tensor
    dh2: Tensor
    dx: Tensor
    dx2: Tensor
    tile: tu.RowTile
    programs: int
    rows_per_program: int

    @property
    def n_rows(self):
        return self.x2.shape[0]

    def strides(self) -> tuple:
        """``stride_dy, stride_x, stride_dh, stride_dx``, in the order both backward kernels take them."""
        return self.dy2.stride(0), self.x2.stride(0), self.dh2.stride(0), self.dx2.stride(0)


def backward_rows(dy: Tensor, x: Tensor, dh: Optional[Tensor], n_programs: Optional[int] = None) -> BackwardRows:
    """The views, ``dx`` and grid of a backward over ``x``'s rows; ``n_programs`` (default: sized from the SM
    count) programs each write one partial parameter gradient, summed by ``tu.sum_partials``."""
    hidden = x.shape[-1]
    x2, dy2 = tu.as_rows(x), tu.as_rows(dy)
    n_rows = x2.shape[0]
    tile = tu.row_tile(hidden, n_rows, backward=True)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    programs = rows_per_program = 0
    if n_rows != 0:
        n_tiles = tu.cdiv(n_rows, tile.rows)
        programs = n_programs or tu.reduction_programs(x.device, n_tiles, tile.num_warps)
        rows_per_program = tu.cdiv(n_tiles, programs) * tile.rows
        programs = tu.cdiv(n_rows, rows_per_program)
    return BackwardRows(dy2=dy2, x2=x2, dh2=tu.as_rows(dh) if dh is not None else tu.unused_pointer(x), dx=dx,
                        dx2=dx.view(-1, hidden), tile=tile, programs=programs, rows_per_program=rows_per_program)


def tile_constexprs(tile: tu.RowTile, dtype: torch.dtype) -> dict:
    """The launch arguments a row tile sets in every norm kernel, statistics in ``tu.acc_dtype(dtype)``."""
    return {"ACC": tu.triton_acc_dtype(dtype), "BLOCK_N": tile.block_n, "ROWS": tile.rows,
            "num_warps": tile.num_warps}


def residual_sum(x: Tensor, residual: Optional[Tensor]) -> tuple[Optional[Tensor], Tensor]:
    """The native path's ``(h, the norm's input)``: ``h = x + residual`` and h, or None and x. Contiguous like
    the Triton path's outputs (and the fake's): x + r follows a permuted x's layout."""
    h = (x + residual).contiguous() if residual is not None else None
    return h, (h if h is not None else x)


def saved_input(ctx, x: Tensor, h: Tensor, residual: Optional[Tensor]) -> Tensor:
    """What the backward reads as the norm's input: ``h`` when the residual was fused (the norm ran on h),
    else ``x``; ``ctx.has_residual`` records which, for the residual's gradient."""
    ctx.has_residual = residual is not None
    return h if residual is not None else x


def check_norm_arguments(op: str, x: Tensor, residual: Optional[Tensor], **params: Optional[Tensor]) -> None:
    """``ValueError`` naming what is wrong: ``x`` must be floating with a last (hidden) axis, each of
    ``params`` (weight, bias) one value per feature, ``residual`` x's shape and dtype."""
    if x.dim() == 0 or not x.is_floating_point():
        raise ValueError(f"{op} expects a floating tensor with a last (hidden) axis, "
                         f"got {x.dtype} {tuple(x.shape)}")
    for name, param in params.items():
        if param is not None and tuple(param.shape) != (x.shape[-1],):
            raise ValueError(f"{name} shape {tuple(param.shape)} is not ({x.shape[-1]},), one value per feature")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} must match x {x.dtype} {tuple(x.shape)}")
