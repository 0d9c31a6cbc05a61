"""What every row-wise Triton kernel in ``ops/`` shares: the import guard, the one tile-size helper, the
device guard and the size of a persistent grid.

Row-wise kernels (norms, and anything that reduces over the last axis) hold a whole row in registers, so
one helper, :func:`row_tile`, chooses the tile for all of them and raises a clear error past the largest
hidden size they support (:data:`MAX_HIDDEN`), rather than letting a launch fail or spill to nonsense.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
from torch._subclasses.fake_tensor import is_fake

__all__ = ["row_indices", "load_rows", "grad_row_indices", "load_grad_rows", "store_grad_rows", "HAS_TRITON",
           "MAX_HIDDEN", "TRITON_DEVICE_TYPES", "RowTile", "row_tile", "use_triton", "jit", "launch",
           "next_power_of_2", "unused_pointer", "acc_dtype", "triton_acc_dtype", "reduction_programs", "sum_partials",
           "device_guard", "as_rows", "plain_eager", "eager_launches", "cdiv", "triton", "tl"]

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # macOS / Windows wheels: the ops run their native PyTorch path only
    HAS_TRITON = False
    triton = None
    # Just enough for kernel signatures (``BLOCK: tl.constexpr``) to be defined; the kernels are then
    # plain functions that nothing calls, since every op checks HAS_TRITON before launching one.
    tl = types.SimpleNamespace(constexpr=Any)


def jit(fn=None, **options):
    """``triton.jit`` (with its ``options``, e.g. ``do_not_specialize``), or the plain function where Triton is not
    installed (it is then never launched)."""
    if fn is None:
        return lambda function: jit(function, **options)
    return triton.jit(fn, **options) if HAS_TRITON else fn


def launch(kernel):
    """The kernel to index with a grid inside a ``torch.library.triton_op`` body: ``wrap_triton(kernel)``,
    which lets Inductor call it from generated code. Where wrapping is off (a ``triton_op`` body running
    eagerly, where PyTorch turns it off, or an op's body called under :func:`eager_launches`), the wrapper
    would only forward to ``kernel[grid]``: the kernel itself then, since building the wrapper and indexing
    it cost far more host time per launch than the kernel's own call (docs/kernels.md, "Host time"), 6
    launches per FP8 linear forward + backward. Under Triton's interpreter (an
    ``InterpretedFunction``, which ``wrap_triton`` refuses) the kernel itself, skipped on fake tensors: the
    body's outputs are allocated before the launch, so tracing it for shapes needs no kernel run."""
    if isinstance(kernel, triton.runtime.jit.JITFunction):
        return torch.library.wrap_triton(kernel) if is_wrap_triton_enabled() else kernel
    return _InterpretedLaunch(kernel)


_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_eager(*tensors: torch.Tensor | None) -> bool:
    """Whether an op called now runs in plain eager PyTorch, where nothing needs to see it as a
    ``torch.library`` op: not under torch.compile's tracing, no ``TorchDispatchMode`` (fake tensors, AOT
    tracing, selective activation checkpointing, FLOP counters), no functorch transform (vmap, grad), and
    only plain tensors (no DTensor or other subclass). There an op module may call its body through an
    ``autograd.Function`` instead, under :func:`eager_launches`, skipping the op's Python dispatch (custom-op
    autograd wrapper, redispatch, schema handling): an FP8 linear's forward took less host time that way
    than through the op (benchmarks/profile_float8_linear.py; docs/kernels.md, "Host time"), host time the
    GPU waits for when a call starts from an idle GPU."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._functorch.peek_interpreter_stack() is None
            and all(t is None or type(t) in _PLAIN_TENSOR_TYPES for t in tensors))


def eager_launches():
    """The context an op's body runs in when called outside its op (:func:`plain_eager`): ``wrap_triton``
    off, as PyTorch sets it for a ``triton_op`` body run eagerly, so :func:`launch` gives the kernels
    themselves."""
    return set_wrap_triton_enabled(False)


class _InterpretedLaunch:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            if not any(isinstance(arg, torch.Tensor) and is_fake(arg) for arg in args):
                self.kernel[grid](*args, **kwargs)
        return run


# The row helpers below are split so that Inductor sees exactly which tensors a norm kernel writes. Under
# torch.compile, functionalization asks Inductor's TTIR analysis (torch/_higher_order_ops/
# triton_kernel_wrap.py, identify_accessed_tensors) which pointer arguments each Triton kernel stores
# to. It walks every store's pointer back through the ops that computed it, and through a call to a
# helper it follows *all* the helper's arguments: when the row indices came out of a helper that also
# took X and R (the loads), X and R counted as written. The graph then cloned them before each norm and
# copied the "result" back into the graph's input (an input mutation: Inductor skipped CUDA graphs,
# "skipping cudagraphs due to mutated inputs", and paid two extra copies per norm). So the indices and
# masks come from helpers that take no pointer (row_indices, grad_row_indices), and the helpers that
# take pointers return loaded values only, which never reach a store's pointer.
# tests/test_cudagraph_safety.py runs that analysis on every kernel of ops/.

@jit
def row_indices(n_rows, n_cols, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """The forward norm kernels' tile: this program's ROWS rows (int64: rows * stride overflows int32
    past 2**31 elements) and BLOCK_N columns. Returns (rows, cols, row mask, col mask, tile mask)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    return rows.to(tl.int64), cols, row_mask, col_mask, mask


@jit
def load_rows(
    X,  # (n_rows, n_cols) input, row stride stride_x, unit column stride
    R,  # (n_rows, n_cols) residual added to X; read only if HAS_RESIDUAL
    H,  # (n_rows, n_cols) output X + R in X's dtype; written only if HAS_RESIDUAL
    rows, cols, mask,  # from row_indices
    stride_x, stride_r, stride_h,
    HAS_RESIDUAL: tl.constexpr, ACC: tl.constexpr,
):
    """The forward norm kernels' shared start: the tile's rows of x as ACC, with the residual added
    (and stored to H, rounded as eager's ``x + r`` is) when there is one."""
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(ACC) + r.to(ACC)).to(X.dtype.element_ty)
        tl.store(H + rows[:, None] * stride_h + cols[None, :], x, mask=mask)
    return x.to(ACC)


@jit
def grad_row_indices(start, row_end, col_mask, ROWS: tl.constexpr):
    """The backward norm kernels' per-tile rows ``start .. start + ROWS`` (below ``row_end``).
    Returns (rows as int64, row mask, tile mask)."""
    rows = start + tl.arange(0, ROWS)
    row_mask = rows < row_end
    mask = row_mask[:, None] & col_mask[None, :]
    return rows.to(tl.int64), row_mask, mask


@jit
def load_grad_rows(
    X,  # (n_rows, n_cols) the norm's input, row stride stride_x
    DY,  # (n_rows, n_cols) gradient of its output, row stride stride_dy
    rows, cols, mask, stride_x, stride_dy, ACC: tl.constexpr,
):
    """The backward norm kernels' per-tile loads: the tile's rows of x and dy as ACC. Returns (x, dy)."""
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(ACC)
    return x, dy


@jit
def store_grad_rows(
    DX,  # (n_rows, n_cols) output: the input's gradient, row stride stride_dx
    DH,  # (n_rows, n_cols) gradient of the fused residual sum, added to dx; read only if HAS_DH
    dx, rows, cols, mask, stride_dx, stride_dh, HAS_DH: tl.constexpr,
):
    """The backward norm kernels' per-tile end: dx (plus the residual sum's gradient) stored; returns the
    tile as stored (rounded to DX's dtype; 0 where masked)."""
    if HAS_DH:
        dx += tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(dx.dtype)
    stored = dx.to(DX.dtype.element_ty)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], stored, mask=mask)
    return stored


# Device types whose tensors go to the Triton kernels (ROCm tensors are "cuda" too); everything else
# takes the native PyTorch path. Tests add "cpu" to run the whole op through Triton's interpreter.
TRITON_DEVICE_TYPES: frozenset[str] = frozenset({"cuda"})


def use_triton(x: torch.Tensor, min_elements: int = 0) -> bool:
    """Whether an op should launch its Triton kernel for ``x`` (below ``min_elements``, the native
    path is faster: each op module keeps its own measured threshold)."""
    return HAS_TRITON and x.device.type in TRITON_DEVICE_TYPES and x.numel() >= min_elements


# The limit. A row lives in the registers of one program of at most 32 warps, so wide rows spill to
# local memory: still right, slower (the spills per hidden size: docs/kernels.md, "Row tiles").
# Wider rows need a split-row (two-pass or cluster) kernel we do not have: a clear error instead.
MAX_HIDDEN = 65536

# Tiles from a sweep: the settings below are the best or within 2% of it at hidden 2048-8192
# (benchmarks/tune_row_kernels.py, benchmarks/results/tune_row_kernels.json; docs/kernels.md, "Row tiles").
#
# A program should move at least this many elements, so that small rows are packed several to a
# program instead of one tiny program per row (hidden 64 -> 32 rows per program); 4096 and 8192 were
# no faster at hidden >= 2048.
_MIN_TILE_ELEMENTS = 2048

# The backward kernels (which prefetch the next tile while reducing this one) at the sizes measured, as
# (rows per tile, warps), with _WARPS_PER_SM: swept for RMSNorm, residual RMSNorm and LayerNorm once their
# partial sums went to one sum_partials launch (the fastest of the sweep: docs/kernels.md, "Row tiles").
_BACKWARD_TILES = {2048: (2, 8), 4096: (2, 16), 8192: (1, 16)}
# Elements of a row tile each thread holds. Forward: 16 (two 16-byte bf16 vector loads): 4 warps at
# hidden 2048, 8 at 4096, 16 from 8192 (4 and 8 per thread were slower; no spills). Backward: 8, twice the
# warps, because it keeps x, dy, the weight and the dweight accumulator live: 16 per thread spilled at
# 8192, 8 does not up to 8192. Past that the 32-warp cap makes threads hold more and the backwards spill,
# so layer_norm.py sends LayerNorm's to ATen (registers and speeds: docs/kernels.md, "Row tiles").
_ELEMENTS_PER_THREAD = {False: 16, True: 8}  # by backward


@dataclass(frozen=True)
class RowTile:
    """How a row-wise kernel tiles a (rows, hidden) problem."""

    block_n: int    # columns per tile: hidden rounded up to a power of two, the whole row at once
    rows: int       # rows per tile (several when rows are short)
    num_warps: int


def row_tile(hidden: int, n_rows: int = 1, *, backward: bool = False, hip: bool | None = None) -> RowTile:
    """The tile for rows of ``hidden`` elements (``n_rows`` of them) in a forward or backward kernel;
    ``ValueError`` past :data:`MAX_HIDDEN`.

    >>> row_tile(4096), row_tile(4096, backward=True).num_warps
    (RowTile(block_n=4096, rows=1, num_warps=8), 16)
    """
    if hidden < 1:
        raise ValueError(f"hidden size must be at least 1, got {hidden}")
    if hidden > MAX_HIDDEN:
        raise ValueError(
            f"hidden size {hidden} exceeds {MAX_HIDDEN}, the largest row kernel_pytorch's Triton norm kernels "
            f"hold in registers; use the native PyTorch op (F.rms_norm / F.layer_norm) for this layer")
    block_n = next_power_of_2(hidden)
    rows = max(1, _MIN_TILE_ELEMENTS // block_n)
    if isinstance(n_rows, int):  # under torch.compile with dynamic shapes it may be symbolic: no cap
        rows = min(rows, next_power_of_2(max(n_rows, 1)))
    if hip is None:
        hip = torch.version.hip is not None
    # ROCm's wavefronts are 64 wide: 16 warps already fill the 1024 threads a block may have. The
    # forward at hidden 16384 ran best with 16 warps (docs/kernels.md, "Row tiles").
    max_warps = 16 if hip or not backward else 32
    if backward and not hip and block_n in _BACKWARD_TILES and rows == 1:
        rows, num_warps = _BACKWARD_TILES[block_n]
        rows = min(rows, next_power_of_2(max(n_rows, 1))) if isinstance(n_rows, int) else rows
        return RowTile(block_n, rows, num_warps)
    num_warps = min(max(rows * block_n // (32 * _ELEMENTS_PER_THREAD[backward]), 4), max_warps)
    return RowTile(block_n, rows, num_warps)


def cdiv(n: int, d: int) -> int:
    """``ceil(n / d)`` for grid sizes on the host (ints or SymInts). Not ``triton.cdiv``: since Triton 3.5 that
    is a ``constexpr_function`` whose call unwraps its arguments, far slower on the host (docs/kernels.md,
    "Host time"); the FP8 linear's forward made ten of them, host time its GPU waited for."""
    return (n + d - 1) // d


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (n >= 1): Triton block sizes."""
    return 1 << (n - 1).bit_length()


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed and stored in: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def triton_acc_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


# Persistent backward grids: warps per SM. With their partial sums reduced by one launch (sum_partials),
# 16 warps per SM (one or two programs) was as fast as 32 or faster at hidden 2048-8192 in the sweep above,
# with the tiles there, and 64 lost everywhere (docs/kernels.md, "Row tiles").
_WARPS_PER_SM = 16
_PROGRAMS_OFF_GPU = 4  # under Triton's interpreter (CPU tensors): several programs, to test the reduction


def reduction_programs(device: torch.device, n_tiles: int, num_warps: int) -> int:
    """Programs for a kernel that loops over row tiles and writes one partial sum per program."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = sms * max(1, _WARPS_PER_SM // num_warps)
    else:
        programs = _PROGRAMS_OFF_GPU
    return max(1, min(programs, n_tiles))


# Columns per program of the partial-sum reduction: 16 at hidden 2048 gives 128 programs, about one per
# SM, each reading 16 contiguous fp32 (64 bytes) of every partial row.
_PARTIAL_SUM_COLUMNS = 16
_PARTIAL_SUM_ROWS = 64


@jit
def _sum_partials_kernel(
    PARTIAL,  # (n_programs, n_sums, n_cols) in ACC: per-program partial sums, n_sums 1 or 2
    OUT0,  # (n_cols,) the column sums of PARTIAL[:, 0], in its own dtype
    OUT1,  # (n_cols,) those of PARTIAL[:, 1]; written only if TWO
    n_programs, n_cols, stride_program,
    TWO: tl.constexpr, ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    sum0 = tl.zeros((BLOCK_C,), ACC)
    sum1 = tl.zeros((BLOCK_C,), ACC)
    for start in range(0, n_programs, BLOCK_P):
        programs = start + tl.arange(0, BLOCK_P)
        mask = (programs < n_programs)[:, None] & col_mask[None, :]
        offsets = programs[:, None] * stride_program + cols[None, :]
        sum0 += tl.sum(tl.load(PARTIAL + offsets, mask=mask, other=0.0), axis=0)
        if TWO:
            sum1 += tl.sum(tl.load(PARTIAL + n_cols + offsets, mask=mask, other=0.0), axis=0)
    tl.store(OUT0 + cols, sum0.to(OUT0.dtype.element_ty), mask=col_mask)
    if TWO:
        tl.store(OUT1 + cols, sum1.to(OUT1.dtype.element_ty), mask=col_mask)


def sum_partials(partial: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> list[torch.Tensor]:
    """The backward norm kernels' per-program partial parameter gradients, ``partial`` (n_programs, n_sums,
    n_cols) contiguous, summed over the programs and cast to ``dtypes`` (one per sum), in one launch. ATen
    took four kernels for LayerNorm's dweight and dbias (a sum and a cast each), fixed costs that weighed on
    the backward at hidden 2048 (docs/kernels.md, "Row norms")."""
    n_programs, n_sums, n_cols = partial.shape
    if n_sums != len(dtypes) or n_sums not in (1, 2):
        raise ValueError(f"sum_partials sums 1 or 2 partial buffers, one dtype each; got {n_sums} and {dtypes}")
    outs = [torch.empty(n_cols, dtype=dtype, device=partial.device) for dtype in dtypes]
    with device_guard(partial):
        launch(_sum_partials_kernel)[(cdiv(n_cols, _PARTIAL_SUM_COLUMNS),)](
            partial, outs[0], outs[1] if n_sums == 2 else unused_pointer(partial), n_programs, n_cols,
            partial.stride(0),
            TWO=n_sums == 2, ACC=triton_acc_dtype(partial.dtype), BLOCK_P=_PARTIAL_SUM_ROWS,
            BLOCK_C=_PARTIAL_SUM_COLUMNS, num_warps=4,
        )
    return outs


def unused_pointer(like: torch.Tensor) -> torch.Tensor:
    """A fresh zero-size tensor to pass for a kernel pointer that a constexpr switches off. Never an
    alias of another argument: Inductor's functionalization copies aliased arguments it may consider
    written, two full-size copies around an RMSNorm in a compiled graph (docs/kernels.md, "Row norms")."""
    return like.new_empty(0)


def device_guard(tensor: torch.Tensor):
    """Triton launches on the current CUDA device; make it the tensor's (multi-GPU processes). Nothing
    to do while tracing (fake tensors launch nothing) or when it already is: entering and leaving
    ``torch.cuda.device`` costs host time per launch (docs/kernels.md, "Host time")."""
    if not tensor.is_cuda or is_fake(tensor) or tensor.get_device() == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(tensor.device)


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A (rows, hidden) view with unit column stride; copies only when the last dim is strided or the
    leading dims do not merge."""
    if tensor.dim() == 0:
        raise ValueError("expected a tensor with at least one dimension")
    if tensor.stride(-1) != 1 and tensor.shape[-1] > 1:
        tensor = tensor.contiguous()
    return tensor.reshape(-1, tensor.shape[-1])
