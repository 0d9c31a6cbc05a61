"""Dynamic float8 quantization of a 2-D tensor: the amax reduction and the scaled, saturating cast, in
two Triton kernels that each read the tensor once, with a PyTorch path of identical numerics elsewhere.

    scale  = fp8_max / max(amax, EPS)            fp32, rounded to nearest (div_rn)
    q      = saturate(t * scale) as float8       rounded to nearest even, clamped to +-fp8_max
    inv    = 1 / scale                           what torch._scaled_mm takes, rounded to nearest

``amax`` is one of three reductions of ``|t|`` for a 2-D ``t`` of shape (R, C): the whole tensor
("tensorwise"), each row (over C), or each column (over R). A float8 matmul wants each operand's scales
along its *reduction* dimension, and an operand is used both ways in training (x is reduced over K in
the forward and over M in the weight gradient), so one :func:`abs_max` pass can produce the row and the
column maxima together, and one :func:`cast` pass can write both layouts: ``rows`` (R, C) scaled per row
and ``cols`` = the transpose (C, R) scaled per column, ready for ``_scaled_mm`` without another transpose.
Tensorwise uses the one scalar for both.

Why two kernels and not one: a scale depends on a maximum over the whole row/column/tensor, which a
tiled kernel only knows after every tile has been read. Both kernels are tiled (64 x 128 elements per
program, grid over both dimensions) so that any (R, C) fills the GPU; the maxima meet through fp32
``atomic_max`` on a buffer the caller zeroes (|t| >= 0, so 0 is the identity). Bytes moved for a bf16
(R, C) operand cast to both layouts: 2 reads + 2 one-byte writes = 6 bytes per element; the eager
chain it replaces (abs, amax, float, mul, clamp, to, transpose, contiguous) moved ~30.

One launch per tensor, though a forward casts two (x and W): a version whose grid's third axis picked the
tensor (one amax and one cast launch per forward, branching on ``program_id(2)``) saved host time per
forward, but its quantization took more GPU time at the model's shapes (docs/kernels.md, "FP8 cast"): the
GPU time is what a compiled model pays every step.

Both launch through :func:`~kernel_pytorch.ops.triton_utils.launch` (``wrap_triton``): they run inside the
``triton_op`` bodies of :mod:`kernel_pytorch.ops.float8_linear`, which Inductor traces into direct calls of
the kernels from its generated code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from kernel_pytorch.ops.triton_utils import cdiv, device_guard, jit, launch, tl, unused_pointer, use_triton

__all__ = ["Float8Cast", "Amax", "abs_max", "tensor_abs_max", "check_grad_amax_slot", "cast", "EPS", "FLOAT8_DTYPES",
           "padded"]

# Lower bound on amax, so scale = fp8_max / amax stays finite for all-zero tensors/rows (the value
# torchao and PyTorch's own _scaled_mm tests use: fp8_max / 1e-12 ~ 4.5e14 is far inside fp32's range).
EPS = 1e-12
FLOAT8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                      if hasattr(torch, n))
_BLOCK_R, _BLOCK_C = 64, 128  # cast: 8192 elements (16 KB of bf16) per program, 8 warps
# amax: 8192-element tiles, several per program (see _abs_max_kernel): one tile per program made 1.5M
# atomics for a bf16 8192^2, which the steps cut. Tiles, warps and programs (2 per SM) from a sweep of 37
# settings, benchmarks/tune_float8_amax.py (benchmarks/results/tune_float8_amax.json, "best"; docs/kernels.md).
_AMAX_BLOCK_R, _AMAX_BLOCK_C = 64, 128
_AMAX_MIN_PROGRAMS = 264
_AMAX_NUM_WARPS = 4
# Each float8 dtype's largest finite value, looked up once: torch.finfo ran in every cast, 4-6 per layer
# step, on the per-call host path FP8 loses on (see abs_max).
_FP8_MAX = {dtype: torch.finfo(dtype).max for dtype in FLOAT8_DTYPES}


def padded(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple (``_scaled_mm`` wants its reduction dimension a multiple of 16)."""
    return cdiv(n, multiple) * multiple


@dataclass(frozen=True)
class Amax:
    """fp32 maxima of ``|t|``: ``tensor`` (shape (1,)) for tensorwise scaling, else ``rows`` (R,) and/or
    ``cols`` (C,) for rowwise scaling along the columns / the rows."""

    tensor: Optional[Tensor] = None
    rows: Optional[Tensor] = None
    cols: Optional[Tensor] = None

    @property
    def tensorwise(self) -> bool:
        return self.tensor is not None


@dataclass(frozen=True)
class Float8Cast:
    """The outputs of :func:`cast`: ``rows`` (R, C) float8 with ``rows_inv`` ((R, 1), or 0-dim for
    tensorwise), and ``cols`` (C, R padded) float8, the transpose, with ``cols_inv`` ((C, 1) or 0-dim).
    Either pair is None when it was not asked for."""

    rows: Optional[Tensor] = None
    rows_inv: Optional[Tensor] = None
    cols: Optional[Tensor] = None
    cols_inv: Optional[Tensor] = None


def abs_max(t: Tensor, tensorwise: bool, rows: bool = False, cols: bool = False) -> Amax:
    """The maxima of ``|t|`` a cast needs: the tensor's (``tensorwise``), or those of its rows and/or columns."""
    if tensorwise:
        rows = cols = False
    if t.dim() != 2:
        raise ValueError(f"float8 casts take 2-D tensors, got shape {tuple(t.shape)}")
    if not use_triton(t):
        a = t.detach().abs().float()
        return Amax(tensor=a.amax().reshape(1) if tensorwise else None, rows=a.amax(1) if rows else None,
                    cols=a.amax(0) if cols else None)
    # One zero-filled buffer, [tensor | rows | columns], for the maxima asked for: one memset launch, not one
    # per kind (rowwise asks for rows and columns: a layer's forward + backward made 6 fills, now 3). Host
    # time per FP8 layer step is what FP8 loses on at small shapes (benchmarks/results/fp8.json, "sweep").
    # The kernel gets it as one pointer and offsets, not as views: no two written kernel
    # arguments may alias (triton_utils.unused_pointer says what Inductor does with aliased ones).
    sizes = [1 if tensorwise else 0, t.shape[0] if rows else 0, t.shape[1] if cols else 0]
    maxima = torch.zeros(sum(sizes), device=t.device, dtype=torch.float32)
    row_tiles, col_tiles = cdiv(t.shape[0], _AMAX_BLOCK_R), cdiv(t.shape[1], _AMAX_BLOCK_C)
    steps = _amax_steps(row_tiles * col_tiles)
    with device_guard(t):
        launch(_abs_max_kernel)[(cdiv(row_tiles, steps), col_tiles)](
            t, maxima, t.shape[0], t.shape[1], t.stride(0), t.stride(1), sizes[0], sizes[0] + sizes[1],
            TENSOR=tensorwise, ROWS=rows, COLS=cols, STEPS=steps, BLOCK_R=_AMAX_BLOCK_R, BLOCK_C=_AMAX_BLOCK_C,
            num_warps=_AMAX_NUM_WARPS)
    if tensorwise:
        return Amax(tensor=maxima)
    # slices, not maxima.split(sizes): Tensor.split's Python wrapper costs host time (docs/kernels.md)
    return Amax(rows=maxima[:sizes[1]] if rows else None, cols=maxima[sizes[1]:] if cols else None)


def check_grad_amax_slot(slot) -> None:
    """A consumer's ``grad_amax_slot`` must be the (1,) fp32 slot ``float8_linear(..., grad_amax_slot=True)``
    returns (or None): its gradient is the maximum the consumer's backward computes."""
    if slot is not None and (not isinstance(slot, Tensor) or slot.shape != (1,) or slot.dtype != torch.float32):
        got = f"{slot.dtype} {tuple(slot.shape)}" if isinstance(slot, Tensor) else type(slot).__name__
        raise ValueError(f"grad_amax_slot must be the (1,) float32 slot float8_linear(..., grad_amax_slot=True) "
                         f"returns, got {got}")


def tensor_abs_max(t: Tensor) -> Tensor:
    """``max |t|`` of a tensor of any shape, as the (1,) fp32 tensor a tensorwise cast takes (the fallback of
    the kernels that compute it while producing ``t``: ``rms_norm`` / ``gated_activation*`` with ``fp8_amax``)."""
    if t.numel() == 0:
        return torch.zeros(1, device=t.device, dtype=torch.float32)
    return abs_max(t.reshape(-1, t.shape[-1]), tensorwise=True).tensor


def _amax_steps(tiles: int) -> int:
    """Tiles per amax program: as many as keep at least _AMAX_MIN_PROGRAMS programs (a power of two <= 32)."""
    steps = 1
    while steps < 32 and tiles // (2 * steps) >= _AMAX_MIN_PROGRAMS:
        steps *= 2
    return steps


def cast(t: Tensor, amax: Amax, fp8_dtype: torch.dtype, rows: bool = True, cols: bool = False,
         cols_multiple: int = 1) -> Float8Cast:
    """``t`` (R, C) scaled and cast to ``fp8_dtype``: ``rows`` in its own layout, ``cols`` transposed to
    (C, R) with R zero-padded to a multiple of ``cols_multiple`` (zeros add nothing to a reduction over R)."""
    fp8_max = _FP8_MAX.get(fp8_dtype)
    if fp8_max is None:
        raise ValueError(f"not a float8 dtype: {fp8_dtype}")
    if not use_triton(t):
        return _cast_reference(t, amax, fp8_dtype, fp8_max, rows, cols, cols_multiple)
    tensorwise = amax.tensorwise
    if not tensorwise and ((rows and amax.rows is None) or (cols and amax.cols is None)):
        raise ValueError("rowwise cast needs the row maxima for `rows` and the column maxima for `cols`")
    r, c = t.shape
    r_pad = padded(r, cols_multiple)
    out = _cast_outputs(t, fp8_dtype, tensorwise, rows, cols, r_pad)
    row_amax = amax.tensor if tensorwise else amax.rows
    col_amax = amax.tensor if tensorwise else amax.cols
    with device_guard(t):
        launch(_cast_kernel)[_grid(t)](
            t, _pointer(out.rows, t), _pointer(out.cols, t), _pointer(row_amax, t), _pointer(col_amax, t),
            _pointer(out.rows_inv, t), _pointer(out.cols_inv, t),
            r, c, t.stride(0), t.stride(1), c, r_pad,
            FP8_MAX=fp8_max, EPS=EPS, TENSORWISE=tensorwise, ROWS=rows, COLS=cols,
            BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, num_warps=8)
    return out


def _cast_outputs(t: Tensor, fp8_dtype: torch.dtype, tensorwise: bool, rows: bool, cols: bool,
                  r_pad: int) -> Float8Cast:
    """The kernel's outputs, allocated: the transposed layout zero-filled only where it has padding rows."""
    r, c = t.shape
    scale_shape = (lambda n: ()) if tensorwise else (lambda n: (n, 1))
    fp32 = {"device": t.device, "dtype": torch.float32}
    transposed = torch.zeros if r_pad != r else torch.empty
    return Float8Cast(
        rows=torch.empty(r, c, device=t.device, dtype=fp8_dtype) if rows else None,
        rows_inv=torch.empty(scale_shape(r), **fp32) if rows else None,
        cols=transposed(c, r_pad, device=t.device, dtype=fp8_dtype) if cols else None,
        cols_inv=torch.empty(scale_shape(c), **fp32) if cols else None)


def _pointer(tensor: Optional[Tensor], like: Tensor) -> Tensor:
    """``tensor``, or a fresh empty one for a kernel argument the constexpr flags say is never touched: an
    alias of another argument would count as written (triton_utils.unused_pointer)."""
    return tensor if tensor is not None else unused_pointer(like)


def _grid(t: Tensor) -> tuple[int, int]:
    return cdiv(t.shape[0], _BLOCK_R), cdiv(t.shape[1], _BLOCK_C)


def _scale_of(amax: Tensor, fp8_max: float) -> Tensor:
    # Tensor / tensor: ``fp8_max / amax`` with a Python scalar numerator is computed as
    # ``amax.reciprocal() * fp8_max``, one rounding off from the kernels' correctly rounded division.
    amax = amax.float().clamp(min=EPS)
    return torch.full_like(amax, fp8_max) / amax


def _cast_reference(t: Tensor, amax: Amax, fp8_dtype: torch.dtype, fp8_max: float, rows: bool, cols: bool,
                    cols_multiple: int) -> Float8Cast:
    """The PyTorch path: the same formulas as the kernels, on any device."""
    x = t.detach().float()

    def quantized(values: Tensor, scale: Tensor) -> Tensor:
        return (values * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)

    def scales(per: Optional[Tensor]) -> Tensor:
        return _scale_of(amax.tensor.reshape(()) if amax.tensorwise else per.reshape(-1, 1), fp8_max)

    out: dict[str, Tensor] = {}
    if rows:
        scale = scales(amax.rows)
        out.update(rows=quantized(x, scale), rows_inv=scale.reciprocal())
    if cols:
        scale = scales(amax.cols)
        pad = padded(x.shape[0], cols_multiple) - x.shape[0]
        transposed = torch.nn.functional.pad(x.t(), (0, pad)) if pad else x.t()
        out.update(cols=quantized(transposed, scale).contiguous(), cols_inv=scale.reciprocal())
    return Float8Cast(**out)


# --------------------------------------------------------------------------------------------- kernels

@jit
def _abs_max_kernel(
    X,  # (n_rows, n_cols) input
    AMAX,  # fp32, zeroed: at 0 max |x| over the tensor (if TENSOR), from rows_at the max |x| of each of the
           # n_rows rows (if ROWS), from cols_at that of each of the n_cols columns (if COLS)
    n_rows, n_cols, stride_r, stride_c, rows_at, cols_at,
    TENSOR: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, STEPS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Each program walks STEPS tiles down one column strip, so the column (and tensor) maxima cost one
    atomic per STEPS tiles; each row's maximum costs one atomic per strip.

    The strip's maxima are kept elementwise (a (BLOCK_R, BLOCK_C) register tile) and reduced across rows
    once, after the walk: reducing each step's tile over its rows (a cross-warp reduction through shared
    memory per step) made this kernel several times slower than reading the tensor (docs/kernels.md, "FP8
    cast")."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    col_offsets = cols.to(tl.int64)[None, :] * stride_c
    strip_max = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for step in range(STEPS):
        rows = (tl.program_id(0) * STEPS + step) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        a = tl.abs(tl.load(X + rows.to(tl.int64)[:, None] * stride_r + col_offsets, mask=mask, other=0.0)
                   .to(tl.float32))
        if ROWS:
            tl.atomic_max(AMAX + rows_at + rows, tl.max(a, axis=1), mask=row_mask)
        strip_max = tl.maximum(strip_max, a)
    col_max = tl.max(strip_max, axis=0)
    if TENSOR:
        tl.atomic_max(AMAX, tl.max(col_max, axis=0))
    if COLS:
        tl.atomic_max(AMAX + cols_at + cols, col_max, mask=col_mask)


@jit
def _scale(AMAX, index, mask, FP8_MAX: tl.constexpr, EPS: tl.constexpr):
    """fp8_max / max(amax, EPS), correctly rounded like PyTorch's fp32 division."""
    amax = tl.load(AMAX + index, mask=mask, other=1.0)
    return tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), tl.maximum(amax, EPS))


@jit
def _quantize_tile(x, AMAX, INV, index, index_mask, writes_inv, AXIS: tl.constexpr, TENSORWISE: tl.constexpr,
                   FP8_MAX: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
    """The fp32 tile ``x`` scaled along AXIS (0: one scale per row, 1: per column; TENSORWISE: one scale)
    and clamped to the float8 range; the program with ``writes_inv`` also stores the inverse scales."""
    if TENSORWISE:
        first = tl.arange(0, 1)
        scale = _scale(AMAX, first, first < 1, FP8_MAX, EPS)
        if writes_inv:
            tl.store(INV + first, tl.math.div_rn(tl.full((1,), 1.0, tl.float32), scale))
        scaled = x * tl.reshape(scale, (1, 1))
    else:
        scale = _scale(AMAX, index, index_mask, FP8_MAX, EPS)
        if writes_inv:
            tl.store(INV + index, tl.math.div_rn(tl.full((BLOCK,), 1.0, tl.float32), scale), mask=index_mask)
        if AXIS == 0:
            scaled = x * scale[:, None]
        else:
            scaled = x * scale[None, :]
    return tl.clamp(scaled, -FP8_MAX, FP8_MAX)


@jit
def _cast_kernel(
    X,  # (n_rows, n_cols) input
    OUT,  # (n_rows, n_cols) float8, row stride stride_out: x scaled per row (if ROWS)
    OUT_T,  # (n_cols, >= n_rows) float8, row stride stride_out_t: x transposed, scaled per column (if COLS)
    ROW_AMAX,  # (n_rows,) fp32, or (1,) if TENSORWISE
    COL_AMAX,  # (n_cols,) fp32, or (1,) if TENSORWISE
    ROW_INV,  # (n_rows,) fp32 out: 1 / row scale (one value if TENSORWISE)
    COL_INV,  # (n_cols,) fp32 out: 1 / column scale (one value if TENSORWISE)
    n_rows, n_cols, stride_r, stride_c, stride_out, stride_out_t,
    FP8_MAX: tl.constexpr, EPS: tl.constexpr, TENSORWISE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask, col_mask = rows < n_rows, cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_r + cols64[None, :] * stride_c, mask=mask, other=0.0).to(tl.float32)
    if TENSORWISE:  # one inverse scale, written by the first program
        row_inv_writer = (pid_r == 0) & (pid_c == 0)
        col_inv_writer = row_inv_writer
    else:  # each row's by the programs of the first column tile, each column's by those of the first row tile
        row_inv_writer = pid_c == 0
        col_inv_writer = pid_r == 0
    if ROWS:
        q = _quantize_tile(x, ROW_AMAX, ROW_INV, rows, row_mask, row_inv_writer, 0, TENSORWISE, FP8_MAX, EPS, BLOCK_R)
        tl.store(OUT + rows64[:, None] * stride_out + cols64[None, :], q.to(OUT.dtype.element_ty), mask=mask)
    if COLS:
        q = _quantize_tile(x, COL_AMAX, COL_INV, cols, col_mask, col_inv_writer, 1, TENSORWISE, FP8_MAX, EPS, BLOCK_C)
        # The transposed tile: contiguous along the rows of x, which Triton's coalescing turns into
        # wide stores through shared memory.
        q_t = tl.trans(q.to(OUT_T.dtype.element_ty))
        tl.store(OUT_T + cols64[:, None] * stride_out_t + rows64[None, :], q_t,
                 mask=col_mask[:, None] & row_mask[None, :])
