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

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernel_pytorch.ops import triton_utils as tu
from kernel_pytorch.ops.programmatic_launch import pdl_arguments, read_weights_early, wait_for_previous_grid
from kernel_pytorch.ops.activations import ACTIVATION_KINDS, _act  # _act: the activations' formulas, one copy
from kernel_pytorch.ops.triton_utils import tl

__all__ = ["grouped_linear", "grouped_gemv", "grouped_linear_native", "use_triton_kernel", "GemvTile", "gemv_tile",
           "NormInput", "MAX_ROWS", "MAX_WEIGHTS"]

MAX_ROWS = 16  # token rows one program holds (batch x new tokens of a decode step)
MAX_WEIGHTS = 3


@dataclass(frozen=True)
class GemvTile:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Tiles by token rows, the fastest in all over the weight shapes of benchmarks/decode.py's 1b and 7b models, each weight
# read from memory as in a decode step (benchmarks/tune_decode_linear.py --cold; docs/kernels.md, "Decode GEMV").
_TILE_ONE_ROW = GemvTile(block_n=8, block_k=512, num_warps=4, num_stages=3)
_TILE_ROWS = GemvTile(block_n=32, block_k=512, num_warps=4, num_stages=5)
# One plain launch of one token row on at most this many programs (the o and down projections): 8 warps a program
# keep more loads in flight per SM; with more programs (q/k/v of a 7B model, the head), or fused (normed or gated),
# 4 warps read faster.
_FEW_PROGRAMS = 512
# The K tile of a fused launch of several rows: tl.dot tiles of the input, its residual and one or two weights spilled
# 2-21 KB per thread at K 512 for sm_90a (benchmarks/kernel_resources.py), none at 128 with half the rows for a gated
# one (which read slower than the unfused launches at 8 rows, results/tune_decode_linear_cold.json).
_FUSED_DOT_BLOCK_K = 128


def gemv_tile(rows: int, outputs: int, *, gated: bool = False, normed: bool = False,
              element_size: int = 2) -> GemvTile:
    """The tile for ``rows`` token rows and ``outputs`` weight rows in all (a gated launch: the gate's) of
    ``element_size``-byte operands."""
    tile = _TILE_ONE_ROW if rows == 1 else _TILE_ROWS
    if element_size > 2:  # 32-bit tiles of 5 stages took 393 KB of shared memory, over the H100's 227 KB
        tile = replace(tile, num_stages=min(tile.num_stages, 3))
    fused = gated or normed
    if rows == 1 and not fused and tu.cdiv(outputs, tile.block_n) <= _FEW_PROGRAMS:
        tile = replace(tile, num_warps=8)
    if rows > 1 and fused:
        tile = replace(tile, block_k=min(tile.block_k, _FUSED_DOT_BLOCK_K),
                       block_n=tile.block_n // 2 if gated else tile.block_n)
    return tile


@tu.jit
def _input_chunk(X, R, H, NW, x_offsets, r_offsets, h_offsets, kk, K, mask, write_h,
                 NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM_OFFSET: tl.constexpr):
    """A chunk of the GEMV's input and its squares (float32): x, or with NORM h * (norm_weight + NORM_OFFSET) where
    h = x (+ r) rounded to X's dtype (program ``write_h`` stores h); the norm's statistic is applied after the
    products.
    1-D (one token row) or 2-D (rows x K) by the shape of the offsets."""
    x = tl.load(X + x_offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + r_offsets, mask=mask, other=0.0).to(tl.float32)).to(X.dtype.element_ty)
        if write_h:
            tl.store(H + h_offsets, x, mask=mask)
    h = x.to(tl.float32)
    if NORM:
        weight = tl.load(NW + kk, mask=kk < K, other=0.0).to(tl.float32)
        if NORM_OFFSET != 0.0:  # Gemma's 1 + w, as the norm op adds it
            weight = weight + NORM_OFFSET
        x = h * weight
    return x, h * h


@tu.jit(do_not_specialize=["early_weights"])  # 0 or 1: one compiled kernel for both, not one specialized to 1
def _grouped_gemv_kernel(
    X, R, H, NW, W0, W1, W2, B0, B1, B2, OUT, M, K, N0, N1, N2, sx_m, sr_m, sh_m, so_m, blocks0, blocks01, eps,
    early_weights,
    NUM_W: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
    KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM_OFFSET: tl.constexpr = 0.0, PDL: tl.constexpr = False,
):
    """One program: ``BLOCK_N`` rows of one weight (programs [0, blocks0) are W0's, then W1's, then W2's),
    reduced over all of K for the M token rows. USE_DOT: tensor cores (M > 1); else FMAs into a
    (BLOCK_N, BLOCK_K) float32 partial, summed once at the end. IEEE: float32 products without TF32.
    UPCAST: 16-bit dot operands in float32 (Triton's interpreter, whose 16-bit ``dot`` is wrong).
    NORM: the input is RMSNorm(x (+ R)) with weight NW, in one pass: the products take h * NW, each row's sum
    of squares accumulates beside them, and 1 / sqrt(mean(h²) + eps) scales the sums at the end; program 0
    stores h = x + R to H. GATED: W0 (gate) and W1 (up) rows of the same index in one program, the output
    act(gate) * up (KIND as in ops/activations.py), each projection rounded as the unfused ops round it.
    PDL (ops/programmatic_launch.py): the wait for the previous grid. With one row and ``early_weights``, the first
    chunk of the weights is read before that wait (:func:`~kernel_pytorch.ops.programmatic_launch.read_weights_early`:
    the grid before never writes them), else after it."""
    pid = tl.program_id(0)
    w_ptr = W0
    b_ptr = B0
    first = pid * BLOCK_N
    n_size = N0
    column = 0
    if NUM_W > 1 and not GATED:
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
    k_step = tl.arange(0, BLOCK_K)
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        squares = tl.zeros([BLOCK_M], tl.float32)  # reduced per chunk: a (BLOCK_M, BLOCK_K) sum spilled registers
    else:  # acc, up: (BLOCK_N, BLOCK_K) float32 partials, summed once after the loop
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        squares = tl.zeros([BLOCK_K], tl.float32)
        # several rows (tl.dot) keep their loop: a chunk held over the wait spilled the gated tile's registers
        early = tl.full([BLOCK_N], early_weights, tl.int32) != 0
        w, w_up = _weight_chunk(w_ptr, W1, rows, row_ok & early, k_step, K, GATED)
    wait_for_previous_grid(PDL)
    k_start = 0
    if not USE_DOT:  # masked loads move no bytes: each chunk element is read once, before or after the wait
        late, late_up = _weight_chunk(w_ptr, W1, rows, row_ok & ~early, k_step, K, GATED)
        acc, up, squares = _accumulate_chunk(acc, up, squares, w + late, w_up + late_up, k_step, X, R, H, NW, m, m_ok,
                                             sx_m, sr_m, sh_m, K, pid == 0, USE_DOT, IEEE, UPCAST, NORM, HAS_RESIDUAL,
                                             GATED, NORM_OFFSET)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        kk = k0 + k_step
        w, w_up = _weight_chunk(w_ptr, W1, rows, row_ok, kk, K, GATED)
        acc, up, squares = _accumulate_chunk(acc, up, squares, w, w_up, kk, X, R, H, NW, m, m_ok, sx_m, sr_m, sh_m,
                                             K, pid == 0, USE_DOT, IEEE, UPCAST, NORM, HAS_RESIDUAL, GATED,
                                             NORM_OFFSET)
    if not USE_DOT:
        acc = tl.sum(acc, 1)[None, :]
        up = tl.sum(up, 1)[None, :]
    if NORM:
        # .to: Inductor passes a Python-float eps as float64, which would make the sums float64
        if USE_DOT:
            rstd = tl.math.rsqrt(squares / K + eps).to(tl.float32)[:, None]
        else:
            rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps).to(tl.float32)
        acc = acc * rstd
        up = up * rstd
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(B1 + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(OUT.dtype.element_ty)
    if GATED:
        gate = out.to(tl.float32)
        out = (_act(gate, KIND) * up.to(OUT.dtype.element_ty).to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + m[:, None] * so_m + (column + rows)[None, :], out, mask=m_ok[:, None] & row_ok[None, :])


@tu.jit
def _weight_chunk(w_ptr, W1, rows, row_ok, kk, K, GATED: tl.constexpr):
    """Columns ``kk`` of the program's weight rows, and of W1's (the up projection) when GATED (else w again)."""
    w_mask = row_ok[:, None] & (kk < K)[None, :]
    w = tl.load(w_ptr + rows[:, None] * K + kk[None, :], mask=w_mask, other=0.0)
    w_up = w
    if GATED:
        w_up = tl.load(W1 + rows[:, None] * K + kk[None, :], mask=w_mask, other=0.0)
    return w, w_up


@tu.jit
def _accumulate_chunk(acc, up, squares, w, w_up, kk, X, R, H, NW, m, m_ok, sx_m, sr_m, sh_m, K, write_h,
                      USE_DOT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, NORM: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, NORM_OFFSET: tl.constexpr):
    """The products of input columns ``kk`` with a weight chunk, added to the kernel's accumulators."""
    k_ok = kk < K
    if USE_DOT:
        x, sq = _input_chunk(X, R, H, NW, m[:, None] * sx_m + kk[None, :], m[:, None] * sr_m + kk[None, :],
                             m[:, None] * sh_m + kk[None, :], kk[None, :], K, m_ok[:, None] & k_ok[None, :], write_h,
                             NORM, HAS_RESIDUAL, NORM_OFFSET)
        x = x.to(X.dtype.element_ty)
        if NORM:
            squares += tl.sum(sq, axis=1)
        acc = _dot(acc, x, w, IEEE, UPCAST)
        if GATED:
            up = _dot(up, x, w_up, IEEE, UPCAST)
    else:
        x, sq = _input_chunk(X, R, H, NW, kk, kk, kk, kk, K, k_ok, write_h, NORM, HAS_RESIDUAL, NORM_OFFSET)
        x = x.to(tl.float32)
        if NORM:
            squares += sq
        acc += w.to(tl.float32) * x[None, :]
        if GATED:
            up += w_up.to(tl.float32) * x[None, :]
    return acc, up, squares


@tu.jit
def _dot(acc, x, w, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        x, w = x.to(tl.float32), w.to(tl.float32)
    if IEEE:
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        acc += tl.dot(x, tl.trans(w))
    return acc


@dataclass(frozen=True)
class NormInput:
    """The RMSNorm a fused GEMV applies to its input first: ``rms_norm(x, weight, eps, residual)`` of
    ops/rms_norm.py (``h = x + residual`` is also returned). ``cast_before_weight`` is the unfused ops'
    rounding; the kernel, which applies the statistic after the products, rounds neither way. ``weight_offset``:
    the norm multiplies by ``weight + weight_offset`` (Gemma's ``1 + w``), as the norm op's."""

    weight: Tensor
    eps: float
    cast_before_weight: bool
    residual: Optional[Tensor] = None
    weight_offset: float = 0.0


def grouped_gemv(x: Tensor, weights: list[Tensor], biases: Optional[list[Tensor]], tile: GemvTile | None = None,
                 norm: Optional[NormInput] = None, activation: Optional[str] = None,
                 block_n: int = 0) -> tuple[Tensor, Optional[Tensor]]:
    """The Triton launch: x (M, K) contiguous rows, weights (Ni, K) contiguous; with ``norm`` the input is
    normed first (and h = x + residual returned second, else None); with ``activation`` two weights (gate, up)
    give act(gate) * up. ``tile``: :func:`gemv_tile`'s for the launch, unless given; ``block_n`` (a power of two),
    unless 0: the weight rows a program reduces, in place of the tile's."""
    rows, k = x.shape
    sizes = [w.shape[0] for w in weights]
    gated = activation is not None
    tile = tile or gemv_tile(rows, sizes[0] if gated else sum(sizes), gated=gated, normed=norm is not None,
                             element_size=x.element_size())
    tile = replace(tile, block_n=block_n) if block_n else tile
    out = x.new_empty((rows, sizes[0] if gated else sum(sizes)))
    blocks = [tu.cdiv(n, tile.block_n) for n in sizes]
    unused = tu.unused_pointer(x)
    padded = weights + [weights[0]] * (MAX_WEIGHTS - len(weights))
    bias_args = (biases + [biases[0]] * (MAX_WEIGHTS - len(biases))) if biases else [unused] * MAX_WEIGHTS
    counts = sizes + [0] * (MAX_WEIGHTS - len(sizes))
    residual = norm.residual if norm is not None else None
    h = torch.empty_like(x) if residual is not None else None
    launch = pdl_arguments(x)
    with tu.device_guard(x):
        tu.launch(_grouped_gemv_kernel)[(blocks[0] if gated else sum(blocks),)](
            x, residual if residual is not None else unused, h if h is not None else unused,
            norm.weight if norm is not None else unused, *padded, *bias_args, out, rows, k, *counts, x.stride(0),
            residual.stride(0) if residual is not None else 0, h.stride(0) if h is not None else 0, out.stride(0),
            blocks[0], sum(blocks[:2]), float(norm.eps) if norm is not None else 0.0, int(read_weights_early(launch)),
            NUM_W=len(weights), HAS_BIAS=bool(biases), USE_DOT=rows > 1, IEEE=x.dtype == torch.float32,
            UPCAST=x.device.type != "cuda", NORM=norm is not None, HAS_RESIDUAL=residual is not None,
            GATED=gated, NORM_OFFSET=float(norm.weight_offset) if norm is not None else 0.0,
            KIND=ACTIVATION_KINDS[activation] if gated else 0, BLOCK_M=max(16, tu.next_power_of_2(rows)),
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages, **launch)
    return out, h


def grouped_linear_native(x: Tensor, weights: list[Tensor], biases: Optional[list[Tensor]]) -> Tensor:
    outs = [F.linear(x, w, biases[i] if biases else None) for i, w in enumerate(weights)]
    return torch.cat(outs, -1) if len(outs) > 1 else outs[0]


def use_triton_kernel(x: Tensor, weights: list[Tensor], max_rows: int = MAX_ROWS) -> bool:
    """Whether the Triton GEMV serves ``x`` (M, K) and ``weights``: a GPU, at most ``max_rows`` rows, contiguous
    operands, one dtype. A symbolic row count (a fake run of a graph whose batch is symbolic) is not served:
    comparing it would guard the graph to one side, and the output's shape is the same either way."""
    return (tu.use_triton(x) and x.dim() == 2 and isinstance(x.shape[0], int) and x.shape[0] <= max_rows
            and x.stride(-1) == 1 and all(w.dtype == x.dtype and w.is_contiguous() for w in weights))


@torch.library.triton_op("kernel_pytorch::grouped_linear", mutates_args=())
def _grouped_linear_op(x: Tensor, weights: list[Tensor], biases: list[Tensor], max_rows: int = MAX_ROWS) -> Tensor:
    """``biases``: one per weight, or empty for none (the schema has no optional lists)."""
    if use_triton_kernel(x, weights, max_rows):
        return grouped_gemv(x, weights, biases or None)[0]
    return grouped_linear_native(x, weights, biases or None)


def grouped_linear(x: Tensor, weights: list[Tensor], biases: Optional[list[Tensor]] = None,
                   max_rows: int = MAX_ROWS) -> Tensor:
    """``cat([F.linear(x, w, b) for w, b in zip(weights, biases)], -1)`` for a few token rows, one launch
    (module docstring). ``x`` (..., K); 1 to MAX_WEIGHTS weights (Ni, K) of x's dtype; ``biases`` None or one per
    weight. Calls of more than ``max_rows`` (at most MAX_ROWS) rows in all run ``F.linear`` per weight instead
    (a graph whose batch is symbolic serves several). Inference only.

    >>> x = torch.randn(1, 1, 64)
    >>> wq, wk, wv = torch.randn(64, 64), torch.randn(16, 64), torch.randn(16, 64)
    >>> grouped_linear(x, [wq, wk, wv]).shape          # q, k and v of one decode token
    torch.Size([1, 1, 96])
    """
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"grouped_linear takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
    if biases is not None and len(biases) != len(weights):
        raise ValueError(f"grouped_linear: {len(biases)} biases for {len(weights)} weights")
    if not 1 <= max_rows <= MAX_ROWS:
        raise ValueError(f"grouped_linear: max_rows={max_rows} is outside 1 to {MAX_ROWS}")
    lead = x.shape[:-1]
    out = _grouped_linear_op(x.reshape(-1, x.shape[-1]), list(weights), list(biases) if biases is not None else [],
                             max_rows)
    return out.view(*lead, out.shape[-1])
