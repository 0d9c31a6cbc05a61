"""Linears of a few token rows (decode steps) as one Triton GEMV launch, several weights in one launch.

    out = cat([x @ W0ᵀ + b0, x @ W1ᵀ + b1, x @ W2ᵀ + b2], -1)        x: (M, K), M <= MAX_ROWS, Wi: (Ni, K)

At batch 1 a decode step reads every weight once, and its time is the weights' bytes over the achieved
bandwidth. A vendor GEMM library tiles for many rows: a small weight (a GQA model's 2 MB k/v projections)
runs at a fraction of the bandwidth, and each projection is its own launch. Here each program reduces
``BLOCK_N`` weight rows over all of K, the rows of up to three weights (q/k/v, gate/up) are programs of the
same grid, so they share one launch without being copied into one tensor (the weights stay the model's
parameters, wherever they are).

Numerics: products and sums in float32, one rounding of each output to x's dtype (as cuBLAS does).
Inference only (no autograd formula): the pass that inserts it leaves training graphs alone. Off CUDA, or
for shapes without a kernel, ``F.linear`` per weight and a ``cat``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernel_pytorch.ops import triton_utils as tu
from kernel_pytorch.ops.triton_utils import tl

__all__ = ["grouped_linear", "GemvTile", "gemv_tile", "MAX_ROWS", "MAX_WEIGHTS"]

MAX_ROWS = 16  # token rows one program holds (batch x new tokens of a decode step)
MAX_WEIGHTS = 3


@dataclass(frozen=True)
class GemvTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Tiles by token rows, the fastest on average over the weight shapes of benchmarks/decode.py's 1b and 7b models
# (benchmarks/tune_decode_linear.py; the sweep's results: docs/kernels.md, "Decode GEMV").
_TILE_ONE_ROW = GemvTile(block_n=8, block_k=512, num_warps=4, num_stages=3)
_TILE_ROWS = GemvTile(block_n=32, block_k=512, num_warps=4, num_stages=3)


def gemv_tile(rows: int) -> GemvTile:
    """The tile for ``rows`` token rows."""
    return _TILE_ONE_ROW if rows == 1 else _TILE_ROWS


@tu.jit
def _grouped_gemv_kernel(
    X, W0, W1, W2, B0, B1, B2, OUT, M, K, N0, N1, N2, sx_m, so_m, blocks0, blocks01,
    NUM_W: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One program: ``BLOCK_N`` rows of one weight (programs [0, blocks0) are W0's, then W1's, then W2's),
    reduced over all of K for the M token rows. USE_DOT: tensor cores (M > 1); else FMAs into a
    (BLOCK_N, BLOCK_K) float32 partial, summed once at the end. IEEE: float32 products without TF32.
    UPCAST: 16-bit dot operands in float32 (Triton's interpreter, whose 16-bit ``dot`` is wrong)."""
    pid = tl.program_id(0)
    w_ptr = W0
    b_ptr = B0
    first = pid * BLOCK_N
    n_size = N0
    column = 0
    if NUM_W > 1:
        if pid >= blocks0:
            w_ptr = W1
            b_ptr = B1
            first = (pid - blocks0) * BLOCK_N
            n_size = N1
            column = N0
    if NUM_W > 2:
        if pid >= blocks01:
            w_ptr = W2
            b_ptr = B2
            first = (pid - blocks01) * BLOCK_N
            n_size = N2
            column = N0 + N1
    rows = first + tl.arange(0, BLOCK_N)
    row_ok = rows < n_size
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        partial = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        w = tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            x = tl.load(X + m[:, None] * sx_m + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:
                x, w = x.to(tl.float32), w.to(tl.float32)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        else:
            x = tl.load(X + kk, mask=k_ok, other=0.0)
            partial += w.to(tl.float32) * x.to(tl.float32)[None, :]
    if USE_DOT:
        out = acc
    else:
        out = tl.sum(partial, 1)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + m[:, None] * so_m + (column + rows)[None, :], out.to(OUT.dtype.element_ty),
             mask=m_ok[:, None] & row_ok[None, :])


def grouped_gemv(x: Tensor, weights: list[Tensor], biases: Optional[list[Tensor]], tile: GemvTile | None = None) -> Tensor:
    """The Triton launch: x (M, K) contiguous rows, weights (Ni, K) contiguous."""
    rows, k = x.shape
    sizes = [w.shape[0] for w in weights]
    tile = tile or gemv_tile(rows)
    out = x.new_empty((rows, sum(sizes)))
    blocks = [tu.cdiv(n, tile.block_n) for n in sizes]
    padded = weights + [weights[0]] * (MAX_WEIGHTS - len(weights))
    bias_args = (biases + [biases[0]] * (MAX_WEIGHTS - len(biases))) if biases else [tu.unused_pointer(x)] * MAX_WEIGHTS
    counts = sizes + [0] * (MAX_WEIGHTS - len(sizes))
    with tu.device_guard(x):
        tu.launch(_grouped_gemv_kernel)[(sum(blocks),)](
            x, *padded, *bias_args, out, rows, k, *counts, x.stride(0), out.stride(0), blocks[0], sum(blocks[:2]),
            NUM_W=len(weights), HAS_BIAS=bool(biases), USE_DOT=rows > 1, IEEE=x.dtype == torch.float32,
            UPCAST=x.device.type != "cuda", BLOCK_M=max(16, tu.next_power_of_2(rows)),
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages)
    return out


def grouped_linear_native(x: Tensor, weights: list[Tensor], biases: Optional[list[Tensor]]) -> Tensor:
    outs = [F.linear(x, w, biases[i] if biases else None) for i, w in enumerate(weights)]
    return torch.cat(outs, -1) if len(outs) > 1 else outs[0]


def _use_triton(x: Tensor, weights: list[Tensor]) -> bool:
    return (tu.use_triton(x) and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.stride(-1) == 1
            and all(w.dtype == x.dtype and w.is_contiguous() for w in weights))


@torch.library.triton_op("kernel_pytorch::grouped_linear", mutates_args=())
def _grouped_linear_op(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    """``biases``: one per weight, or empty for none (the schema has no optional lists)."""
    if _use_triton(x, weights):
        return grouped_gemv(x, weights, biases or None)
    return grouped_linear_native(x, weights, biases or None)


def grouped_linear(x: Tensor, weights: list[Tensor], biases: Optional[list[Tensor]] = None) -> Tensor:
    """``cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)`` for a few token rows, one launch
    (module docstring). ``x`` (..., K) with at most MAX_ROWS rows in all; 1 to MAX_WEIGHTS weights (Ni, K) of
    x's dtype; ``biases`` None or one per weight. Inference only.

    >>> x = torch.randn(1, 1, 64)
    >>> wq, wk, wv = torch.randn(64, 64), torch.randn(16, 64), torch.randn(16, 64)
    >>> grouped_linear(x, [wq, wk, wv]).shape          # q, k and v of one decode token
    torch.Size([1, 1, 96])
    """
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"grouped_linear takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
    if biases is not None and len(biases) != len(weights):
        raise ValueError(f"grouped_linear: {len(biases)} biases for {len(weights)} weights")
    lead = x.shape[:-1]
    out = _grouped_linear_op(x.reshape(-1, x.shape[-1]), list(weights), list(biases) if biases is not None else [])
    return out.view(*lead, out.shape[-1])
