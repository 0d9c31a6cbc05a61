"""Memory layouts that kernels hand on: an output laid out in its input's dimension order, and a tensor
copied into another's exact strides.

Why layouts matter beyond speed: PyTorch's cuDNN attention caches its backward plan under q/k/v's strides
alone, while the plan also fixes the output gradient's strides (torch 2.11; docs/attention.md, "cuDNN's
backward plan cache"). A rewrite that changes a layout can therefore change which plan later calls reuse.
So kernels keep the layout eager PyTorch would give (:func:`empty_in_order_of`), and the cuDNN backward
gets its output gradient in the output's own strides (:func:`in_strides_of`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["empty_in_order_of", "in_strides_of"]


def empty_in_order_of(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialized dense tensor of ``x``'s shape whose dims lie in memory in ``x``'s order (outermost
    = largest stride), as eager elementwise ops lay out their result: a (B, L, H, D) projection viewed as
    (B, H, L, D), or sliced out of a fused qkv projection, gives a (B, H, L, D) tensor with (B, L, H, D)
    memory, without the slice's gaps. Symbolic strides (dynamic shapes) give ``torch.empty_like``'s
    layout: ordering them would add guards."""
    dtype = x.dtype if dtype is None else dtype
    strides = x.stride()
    if not all(isinstance(s, int) for s in strides):
        return torch.empty_like(x, dtype=dtype)
    order = sorted(range(x.dim()), key=lambda d: -strides[d])  # stable: ties keep the logical order
    dense = torch.empty([x.shape[d] for d in order], dtype=dtype, device=x.device)
    return dense.permute([order.index(d) for d in range(x.dim())])


def in_strides_of(x: Tensor, like: Tensor) -> Tensor:
    """``x`` (of ``like``'s shape) with exactly ``like``'s strides: ``x`` itself when they already agree,
    else a copy (``like`` must be dense, as every kernel output is)."""
    if x.stride() == like.stride():
        return x
    return torch.empty_like(like, dtype=x.dtype).copy_(x)
