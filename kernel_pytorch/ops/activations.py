"""Elementwise and gated activations (SiLU, GELU, tanh-GELU; SwiGLU, GeGLU) as ``torch.library`` custom ops
with Triton kernels, and ``linear_activation`` (a linear layer followed by one of them).

    y = act(x)                                   kind in {"silu", "gelu" (erf), "gelu_tanh"}
    y = act(gate) * up                           SwiGLU ("silu") / GeGLU ("gelu", "gelu_tanh")
    y = act(gate_up[..., :N]) * gate_up[..., N:] the packed form: one (..., 2N) projection output

    silu(x)      = x * sigmoid(x)
    gelu(x)      = 0.5 * x * (1 + erf(x / sqrt(2)))
    gelu_tanh(x) = 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x³)))          (GPT-2, Gemma)
                 = x * sigmoid(2 * sqrt(2 / pi) * (x + 0.044715 * x³))               (what the kernels compute:
                   0.5 * (1 + tanh(z)) = sigmoid(2z), and Triton has no tanh its interpreter can run)

Rounding. Every op computes in fp32 (fp64 for fp64 inputs, so gradcheck runs through the kernels) and
rounds once to the input dtype: ``act(gate) * up`` is not rounded between the activation and the product
(Hugging Face's ``act_fn(gate_proj(x)) * up_proj(x)`` rounds twice in bf16; this is the more accurate of
the two, and the difference is at most about one ulp of the output).

Layers (docs/design.md, "Kernels"): ``_activation_fwd_kernel`` / ``_activation_bwd_kernel`` /
``_gated_fwd_kernel`` / ``_gated_bwd_kernel`` (Triton) -> ``activation_fwd`` / ``activation_bwd`` /
``gated_activation_fwd`` / ``gated_activation_bwd`` / ``gated_activation_packed_fwd`` /
``gated_activation_packed_bwd`` (launch, allocate, tile) -> ``kernel_pytorch::activation``,
``kernel_pytorch::gated_activation``, ``kernel_pytorch::gated_activation_packed`` and their ``*_backward``
ops (``triton_op``, autograd) -> :func:`activation`, :func:`gated_activation`,
:func:`gated_activation_packed`, :func:`linear_activation`, :class:`Activation`, :class:`GatedActivation`.

Dispatch, inside the ops: CUDA/ROCm tensors of at least ``TRITON_MIN_ELEMENTS`` elements run the Triton
kernels; everything else (CPU, other devices, small problems, machines without Triton) runs the same
formulas with ATen ops in fp32 (``F.silu`` / ``F.gelu`` and their ``aten::*_backward``), rounded once, so a
forward on one path and a backward on the other agree.

Layouts. The kernels read (rows, cols) views with a row stride and unit column stride. Contiguous inputs
are read as one flat row, so the tile never depends on the hidden size; other inputs go through
``triton_utils.as_rows``, which keeps row strides (the halves of a packed ``gate_up``, a row slice, the
chunks of a linear's output: read in place) and copies only when the last dim is strided or the leading
dims do not merge (a transposed tensor). Outputs are always contiguous.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernel_pytorch.ops import triton_utils as tu
from kernel_pytorch.ops.float8_cast import check_grad_amax_slot, tensor_abs_max
from kernel_pytorch.ops.triton_utils import jit, tl

__all__ = [
    "ACTIVATION_KINDS",
    "CUBLASLT_GELU_EPILOGUE",
    "TRITON_MIN_ELEMENTS",
    "Activation",
    "GatedActivation",
    "activation",
    "activation_bwd",
    "activation_fwd",
    "gated_activation",
    "gated_activation_bwd",
    "gated_activation_fwd",
    "gated_activation_packed",
    "gated_activation_packed_bwd",
    "gated_activation_packed_fwd",
    "linear_activation",
]

# The kinds, and the constexpr each kernel is compiled for.
ACTIVATION_KINDS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}

# Below this many elements (of the op's output) the native path runs instead of Triton. An elementwise
# kernel is one launch either way, so the floor only pays off where ATen's launch is cheaper than
# Triton's (Python launch overhead outside torch.compile). The threshold sweep found Triton faster from its
# smallest size up (benchmarks/results/kernels.json, "suggested_thresholds"; docs/kernels.md).
TRITON_MIN_ELEMENTS = 0

# linear_activation(..., kind="gelu_tanh") with a bias and no gradient required, on CUDA: one cuBLASLt
# GEMM with the bias + GELU epilogue (torch._addmm_activation) instead of F.linear + the Triton
# activation (one fewer read and write of the output). Not yet benchmarked; a first look is in
# docs/kernels.md, "Activations".
CUBLASLT_GELU_EPILOGUE = True

# Elements per program: 1024 with 4 warps is 8 elements per thread, one 16-byte vector load per input for
# 16-bit dtypes (two for fp32); Inductor's default tile for large pointwise kernels (XBLOCK 1024, 4 warps).
# Tiles are ROWS x BLOCK_N with ROWS * BLOCK_N == _BLOCK, so narrow rows (hidden 7, 64) are packed several
# to a program instead of one tiny program each. Not yet swept against other tiles; a first look found
# copy bandwidth for most kinds (docs/kernels.md, "Activations").
_BLOCK = 1024
_NUM_WARPS = 4
# The gated forward that also finds max |y| (fp8_amax): each program reduces its tile across warps and
# stores one partial maximum. Tiles of 2048 elements with 4 warps were the fastest of five sizes tried
# (docs/kernels.md, "Activations").
_AMAX_BLOCK = 2048
_AMAX_NUM_WARPS = 4


# --------------------------------------------------------------------------------------------- kernels

@jit
def _tile(n_rows, n_cols, n_col_blocks, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's ROWS x BLOCK_N tile of an (n_rows, n_cols) problem: (rows, cols) as int64 (their
    products with row strides, and flat column indices, pass 2**31), and the in-bounds mask."""
    pid = tl.program_id(0)
    # A 1-D grid (axis 0 allows 2**31 - 1 programs; axes 1 and 2 only 65535), split into (row block,
    # column block) once per program rather than per element.
    row_block = pid // n_col_blocks
    col_block = pid % n_col_blocks
    rows = row_block.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = col_block.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return rows, cols, mask


@jit
def _act(x, KIND: tl.constexpr):
    """act(x), in x's (ACC) dtype. The constants are written out as literals: a jit function may only read
    constexpr globals, and tl.constexpr does not exist where Triton is not installed."""
    if KIND == 0:  # silu
        y = x * tl.sigmoid(x)
    elif KIND == 1:  # gelu: 0.5 * (1 + erf(x / sqrt(2))), 0.7071067811865476 = 1 / sqrt(2)
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:  # gelu_tanh: x * sigmoid(2z), 1.5957691216057308 = 2 * sqrt(2 / pi)
        y = x * tl.sigmoid(1.5957691216057308 * x * (1.0 + 0.044715 * x * x))
    return y


@jit
def _act_and_grad(x, KIND: tl.constexpr):
    """(act(x), act'(x)) in x's (ACC) dtype."""
    if KIND == 0:  # silu' = s + x * s * (1 - s)
        s = tl.sigmoid(x)
        y = x * s
        d = s * (1.0 + x * (1.0 - s))
    elif KIND == 1:  # gelu' = Phi(x) + x * phi(x), 0.3989422804014327 = 1 / sqrt(2 * pi)
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        y = x * cdf
        d = cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    else:  # y = x * s, s = sigmoid(2z): y' = s + x * s * (1 - s) * 2z', 2z' = 2 sqrt(2/pi) (1 + 3 * 0.044715 x²)
        x2 = x * x
        s = tl.sigmoid(1.5957691216057308 * x * (1.0 + 0.044715 * x2))
        y = x * s
        d = s + x * s * (1.0 - s) * (1.5957691216057308 * (1.0 + 0.134145 * x2))
    return y, d


@jit
def _activation_fwd_kernel(
    X,  # (n_rows, n_cols) input, row stride stride_x, unit column stride
    Y,  # (n_rows, n_cols) output act(X) in X's dtype, row stride stride_y
    stride_x, stride_y,
    n_rows, n_cols, n_col_blocks,  # n_col_blocks = cdiv(n_cols, BLOCK_N), the grid's split
    KIND: tl.constexpr,  # ACTIVATION_KINDS value
    ACC: tl.constexpr,  # tl.float32, or tl.float64 for fp64 inputs
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, n_col_blocks, ROWS, BLOCK_N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
    y = _act(x, KIND)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit
def _activation_bwd_kernel(
    DY,  # (n_rows, n_cols) gradient of the output, row stride stride_dy
    X,  # (n_rows, n_cols) the forward's input, row stride stride_x
    DX,  # (n_rows, n_cols) output dy * act'(x) in X's dtype, row stride stride_dx
    stride_dy, stride_x, stride_dx,
    n_rows, n_cols, n_col_blocks,
    KIND: tl.constexpr, ACC: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, n_col_blocks, ROWS, BLOCK_N)
    rows = rows[:, None]
    cols = cols[None, :]
    dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(ACC)
    x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(ACC)
    _, d = _act_and_grad(x, KIND)
    tl.store(DX + rows * stride_dx + cols, (dy * d).to(DX.dtype.element_ty), mask=mask)


@jit
def _gated_fwd_kernel(
    G,  # (n_rows, n_cols) gate, row stride stride_g (a packed gate_up's half: stride 2 * n_cols)
    U,  # (n_rows, n_cols) up, row stride stride_u
    Y,  # (n_rows, n_cols) output act(G) * U in G's dtype, rounded once, row stride stride_y
    stride_g, stride_u, stride_y,
    n_rows, n_cols, n_col_blocks,
    AMAX,  # (n_programs,) fp32 output: each program's max |y| (as rounded to Y's dtype); only if FP8_AMAX
    KIND: tl.constexpr, ACC: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, FP8_AMAX: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, n_col_blocks, ROWS, BLOCK_N)
    rows = rows[:, None]
    cols = cols[None, :]
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(ACC)
    y = (_act(g, KIND) * u).to(Y.dtype.element_ty)
    tl.store(Y + rows * stride_y + cols, y, mask=mask)
    if FP8_AMAX:  # masked elements are act(0) * 0 = 0, and |y| >= 0
        tl.store(AMAX + tl.program_id(0), tl.max(tl.max(tl.abs(y.to(tl.float32)), axis=1), axis=0))


@jit
def _gated_bwd_kernel(
    DY,  # (n_rows, n_cols) gradient of the output
    G,  # (n_rows, n_cols) the forward's gate
    U,  # (n_rows, n_cols) the forward's up
    DG,  # (n_rows, n_cols) output dy * up * act'(gate) in G's dtype; PACKED: d gate_up, (n_rows, 2 n_cols)
    DU,  # (n_rows, n_cols) output dy * act(gate) in G's dtype; unused if PACKED
    stride_dy, stride_g, stride_u, stride_dg, stride_du,
    n_rows, n_cols, n_col_blocks,
    dg_col, du_col,  # PACKED: where dgate and dup start in a row of d gate_up (0 and n_cols, or swapped)
    DAMAX,  # (n_programs,) fp32 output: each program's max over |dgate| and |dup| as rounded; only if FP8_AMAX
    KIND: tl.constexpr, ACC: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr,
    FP8_AMAX: tl.constexpr,
):
    rows, cols, mask = _tile(n_rows, n_cols, n_col_blocks, ROWS, BLOCK_N)
    rows = rows[:, None]
    cols = cols[None, :]
    dy = tl.load(DY + rows * stride_dy + cols, mask=mask, other=0.0).to(ACC)
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + rows * stride_u + cols, mask=mask, other=0.0).to(ACC)
    a, d = _act_and_grad(g, KIND)
    dg = (dy * u * d).to(DG.dtype.element_ty)
    du = (dy * a).to(DG.dtype.element_ty)
    # Packed, both halves are written through the one d gate_up pointer: two pointers to views of one
    # buffer would be two written tensors to Inductor, which copies them apart and back (docs/kernels.md).
    if PACKED:
        tl.store(DG + rows * stride_dg + dg_col + cols, dg, mask=mask)
        tl.store(DG + rows * stride_dg + du_col + cols, du, mask=mask)
    else:
        tl.store(DG + rows * stride_dg + cols, dg, mask=mask)
        tl.store(DU + rows * stride_du + cols, du, mask=mask)
    if FP8_AMAX:  # masked elements are 0 (dy = 0 there), and |.| >= 0
        both = tl.maximum(tl.abs(dg.to(tl.float32)), tl.abs(du.to(tl.float32)))
        tl.store(DAMAX + tl.program_id(0), tl.max(tl.max(both, axis=1), axis=0))


# -------------------------------------------------------------------------------------------- launches

def _tiling(n_rows, n_cols, block: int = _BLOCK) -> tuple[int, int, int]:
    """``(rows, block_n, n_col_blocks)`` of the (rows x block_n) tiles of ``block`` elements over an
    (n_rows, n_cols) view."""
    if isinstance(n_rows, int) and isinstance(n_cols, int) and n_rows > 1:
        block_n = min(tu.next_power_of_2(max(n_cols, 1)), block)
    else:
        # One row (the flat view of contiguous inputs: one compiled tile for every size), or sizes that are
        # symbolic under torch.compile(dynamic=True): full-width tiles, no specialization on the size.
        block_n = block
    return block // block_n, block_n, tu.cdiv(n_cols, block_n)


def _programs(view: Tensor, block: int = _BLOCK) -> int:
    """Programs (tiles) of a launch over ``view``."""
    rows, _, n_col_blocks = _tiling(*view.shape, block)
    return tu.cdiv(view.shape[0], rows) * n_col_blocks


def _launch(kernel, views: list, kind: str, dtype: torch.dtype, *extra, block: int = _BLOCK,
            num_warps: int = _NUM_WARPS, **constexprs) -> None:
    """Launch ``kernel`` over (rows, cols) views with unit column stride, shaped like the first (inputs
    first, then outputs, in the kernel's pointer order), passing each view's row stride after them, then
    the sizes, then ``extra`` scalars and ``constexprs``; tiles of ``block`` elements."""
    n_rows, n_cols = views[0].shape
    rows, block_n, n_col_blocks = _tiling(n_rows, n_cols, block)
    with tu.device_guard(views[0]):
        tu.launch(kernel)[(_programs(views[0], block),)](
            *views, *[v.stride(0) for v in views], n_rows, n_cols, n_col_blocks, *extra,
            KIND=_kind_index(kind), ACC=tu.triton_acc_dtype(dtype), ROWS=rows, BLOCK_N=block_n,
            num_warps=num_warps, **constexprs,
        )


def _launch_with_amax(kernel, views: list, kind: str, dtype: torch.dtype, *extra, **constexprs) -> Tensor:
    """``_launch`` with ``FP8_AMAX``: the kernel writes each program's maximum to its pointer argument after
    ``extra``; returns the maximum of theirs as a (1,) fp32 tensor. Larger tiles (_AMAX_BLOCK)."""
    partial = torch.empty(_programs(views[0], _AMAX_BLOCK), dtype=torch.float32, device=views[0].device)
    _launch(kernel, views, kind, dtype, *extra, partial, block=_AMAX_BLOCK, num_warps=_AMAX_NUM_WARPS,
            FP8_AMAX=True, **constexprs)
    return partial.amax().reshape(1)


def _launch_gated_fwd(gate: Tensor, up: Tensor, y: Tensor, kind: str, fp8_amax: bool) -> Tensor | None:
    """The gated forward over (rows, cols) views ``gate``, ``up`` -> ``y``; with ``fp8_amax``, max |y| as a
    (1,) fp32 tensor (each program writes its tile's maximum, one small reduction takes theirs)."""
    if not fp8_amax:
        _launch(_gated_fwd_kernel, [gate, up, y], kind, gate.dtype, tu.unused_pointer(gate), FP8_AMAX=False)
        return None
    return _launch_with_amax(_gated_fwd_kernel, [gate, up, y], kind, gate.dtype)


def _views(*tensors: Tensor) -> list:
    """Same-shape tensors as (rows, cols) views with unit column stride: all contiguous -> one flat row
    each (1, numel), so any hidden size is read in full tiles; otherwise ``as_rows`` (a row stride, read
    in place, or a contiguous copy when the last dim is strided or the leading dims do not merge)."""
    if all(t.is_contiguous() for t in tensors):
        return [t.view(1, -1) for t in tensors]
    return [tu.as_rows(t) for t in tensors]


def activation_fwd(x: Tensor, kind: str) -> Tensor:
    """Triton forward: ``act(x)``, contiguous, in x's dtype. Any device Triton can launch on, CPU tensors
    included under ``TRITON_INTERPRET=1``."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    (x2,) = _views(x)
    _launch(_activation_fwd_kernel, [x2, y.view(x2.shape)], kind, x.dtype)
    return y


def activation_bwd(dy: Tensor, x: Tensor, kind: str) -> Tensor:
    """Triton backward: ``dy * act'(x)``, contiguous, in x's dtype."""
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return dx
    dy2, x2 = _views(dy, x)
    _launch(_activation_bwd_kernel, [dy2, x2, dx.view(x2.shape)], kind, x.dtype)
    return dx


def gated_activation_fwd(gate: Tensor, up: Tensor, kind: str, fp8_amax: bool = False):
    """Triton forward: ``act(gate) * up`` in fp32, rounded once to gate's dtype; contiguous. With
    ``fp8_amax``, ``(y, max |y|)``: the (1,) fp32 maximum an FP8 linear fed by y would otherwise read y for."""
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return (y, tensor_abs_max(y)) if fp8_amax else y  # the maximum of nothing: 0
    g2, u2 = _views(gate, up)
    amax = _launch_gated_fwd(g2, u2, y.view(g2.shape), kind, fp8_amax)
    return (y, amax) if fp8_amax else y


def gated_activation_bwd(dy: Tensor, gate: Tensor, up: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """Triton backward: ``(dgate, dup) = (dy * up * act'(gate), dy * act(gate))``, contiguous."""
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    dup = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return dgate, dup
    dy2, g2, u2 = _views(dy, gate, up)
    _launch(_gated_bwd_kernel, [dy2, g2, u2, dgate.view(g2.shape), dup.view(g2.shape)], kind, gate.dtype, 0, 0,
            tu.unused_pointer(gate), PACKED=False, FP8_AMAX=False)
    return dgate, dup


def _halves(rows2: Tensor, gate_first: bool) -> tuple[Tensor, Tensor]:
    """(gate, up): the two (rows, N) column halves of a (rows, 2N) view; each keeps the row stride."""
    n = rows2.shape[-1] // 2
    first, second = rows2[:, :n], rows2[:, n:]
    return (first, second) if gate_first else (second, first)


def gated_activation_packed_fwd(gate_up: Tensor, kind: str, gate_first: bool = True, fp8_amax: bool = False):
    """Triton forward of the packed form: ``act(gate) * up`` with ``gate, up = gate_up.chunk(2, -1)``
    (swapped when ``gate_first`` is False), read in place; output (..., N), contiguous. With ``fp8_amax``,
    ``(y, max |y|)`` as in :func:`gated_activation_fwd`."""
    n = gate_up.shape[-1] // 2
    y = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    if y.numel() == 0:
        return (y, tensor_abs_max(y)) if fp8_amax else y  # the maximum of nothing: 0
    # The halves as two views of gate_up: reading both through one pointer with column offsets measured
    # the same (docs/kernels.md, "Activations").
    g2, u2 = _halves(tu.as_rows(gate_up), gate_first)
    amax = _launch_gated_fwd(g2, u2, y.view(-1, n), kind, fp8_amax)
    return (y, amax) if fp8_amax else y


def gated_activation_packed_bwd(dy: Tensor, gate_up: Tensor, kind: str, gate_first: bool = True,
                                fp8_amax: bool = False):
    """Triton backward of the packed form: d gate_up, one contiguous tensor of gate_up's shape whose halves
    the kernel writes dgate and dup into. With ``fp8_amax``, ``(d gate_up, max |d gate_up|)``: the (1,) fp32
    maximum the FP8 gate/up projection's backward would otherwise read d gate_up for."""
    dgate_up = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    if dgate_up.numel() == 0:
        return (dgate_up, tensor_abs_max(dgate_up)) if fp8_amax else dgate_up
    g2, u2 = _halves(tu.as_rows(gate_up), gate_first)
    n = g2.shape[-1]
    dgu = dgate_up.view(g2.shape[0], 2 * n)
    dg_col, du_col = (0, n) if gate_first else (n, 0)
    # The kernel writes through dgu only (PACKED); DU gets a zero-size stand-in, never an alias of dgu.
    du_unused = tu.unused_pointer(dgu).view(0, 1)
    views = [tu.as_rows(dy), g2, u2, dgu, du_unused]
    if not fp8_amax:
        _launch(_gated_bwd_kernel, views, kind, gate_up.dtype, dg_col, du_col, tu.unused_pointer(dgu),
                PACKED=True, FP8_AMAX=False)
        return dgate_up
    # The forward's tiles with the maximum (_AMAX_BLOCK), cheaper than a separate abs_max pass (other tiles
    # not tried; docs/kernels.md, "Activations").
    return dgate_up, _launch_with_amax(_gated_bwd_kernel, views, kind, gate_up.dtype, dg_col, du_col, PACKED=True)


# ---------------------------------------------------------------------------------- native (non-Triton)
# The same formulas with ATen's kernels, on fp32 (fp64) copies, rounded once; contiguous outputs like the
# Triton path's (and the traced fake's).

def _act_native(x: Tensor, kind: str) -> Tensor:
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")


def _act_backward_native(dy: Tensor, x: Tensor, kind: str) -> Tensor:
    if kind == "silu":
        return torch.ops.aten.silu_backward(dy, x)
    return torch.ops.aten.gelu_backward(dy, x, approximate="tanh" if kind == "gelu_tanh" else "none")


def _activation_fwd_native(x: Tensor, kind: str) -> Tensor:
    acc = tu.acc_dtype(x.dtype)
    return _act_native(x.to(acc), kind).to(x.dtype).contiguous()


def _activation_bwd_native(dy: Tensor, x: Tensor, kind: str) -> Tensor:
    acc = tu.acc_dtype(x.dtype)
    return _act_backward_native(dy.to(acc), x.to(acc), kind).to(x.dtype).contiguous()


def _gated_fwd_native(gate: Tensor, up: Tensor, kind: str) -> Tensor:
    acc = tu.acc_dtype(gate.dtype)
    return (_act_native(gate.to(acc), kind) * up.to(acc)).to(gate.dtype).contiguous()


def _gated_bwd_native(dy: Tensor, gate: Tensor, up: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    acc = tu.acc_dtype(gate.dtype)
    dy32, g32 = dy.to(acc), gate.to(acc)
    dgate = _act_backward_native(dy32 * up.to(acc), g32, kind)
    dup = dy32 * _act_native(g32, kind)
    return dgate.to(gate.dtype).contiguous(), dup.to(gate.dtype).contiguous()


def _gated_packed_fwd_native(gate_up: Tensor, kind: str, gate_first: bool) -> Tensor:
    gate, up = _chunk(gate_up, gate_first)
    return _gated_fwd_native(gate, up, kind)


def _gated_packed_bwd_native(dy: Tensor, gate_up: Tensor, kind: str, gate_first: bool) -> Tensor:
    gate, up = _chunk(gate_up, gate_first)
    dgate, dup = _gated_bwd_native(dy, gate, up, kind)
    return torch.cat([dgate, dup] if gate_first else [dup, dgate], dim=-1)


def _chunk(gate_up: Tensor, gate_first: bool) -> tuple[Tensor, Tensor]:
    first, second = gate_up.chunk(2, dim=-1)
    return (first, second) if gate_first else (second, first)


# ------------------------------------------------------------------------------------------ custom ops
# ``triton_op`` rather than ``custom_op``: under torch.compile Inductor traces the body and calls the
# Triton kernels from its generated code instead of calling back into Python per launch (row_norm.py
# says more). Fake tensors: the same body, traced (the launch is skipped or wrapped).

def _use_triton(x: Tensor) -> bool:
    return tu.use_triton(x, TRITON_MIN_ELEMENTS) and x.dtype in _FLOAT_DTYPES


@torch.library.triton_op("kernel_pytorch::activation", mutates_args=())
def _activation_op(x: Tensor, kind: str) -> Tensor:
    _kind_index(kind)
    forward = activation_fwd if _use_triton(x) else _activation_fwd_native
    return forward(x, kind)


@torch.library.triton_op("kernel_pytorch::activation_backward", mutates_args=())
def _activation_backward_op(dy: Tensor, x: Tensor, kind: str) -> Tensor:
    _kind_index(kind)
    backward = activation_bwd if _use_triton(x) else _activation_bwd_native
    return backward(dy, x, kind)


@torch.library.triton_op("kernel_pytorch::gated_activation", mutates_args=())
def _gated_op(gate: Tensor, up: Tensor, kind: str, fp8_amax: bool) -> tuple[Tensor, Tensor]:
    # Returns (y, amax): amax is an empty tensor that nothing reads without fp8_amax (an op's outputs
    # cannot be optional).
    _kind_index(kind)
    if _use_triton(gate):
        return _with_amax(gated_activation_fwd(gate, up, kind, fp8_amax), fp8_amax)
    return _with_amax(_gated_fwd_native(gate, up, kind), fp8_amax, native=True)


@torch.library.triton_op("kernel_pytorch::gated_activation_backward", mutates_args=())
def _gated_backward_op(dy: Tensor, gate: Tensor, up: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    _kind_index(kind)
    backward = gated_activation_bwd if _use_triton(gate) else _gated_bwd_native
    return backward(dy, gate, up, kind)


@torch.library.triton_op("kernel_pytorch::gated_activation_packed", mutates_args=())
def _gated_packed_op(gate_up: Tensor, kind: str, gate_first: bool, fp8_amax: bool,
                     grad_amax_slot: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    # Returns (y, amax), as _gated_op. grad_amax_slot is not read: its gradient carries max |d gate_up|.
    _kind_index(kind)
    if _use_triton(gate_up):
        return _with_amax(gated_activation_packed_fwd(gate_up, kind, gate_first, fp8_amax), fp8_amax)
    return _with_amax(_gated_packed_fwd_native(gate_up, kind, gate_first), fp8_amax, native=True)


def _with_amax(result, fp8_amax: bool, native: bool = False) -> tuple[Tensor, Tensor]:
    """``(y, amax)`` from a forward's result: ``(y, amax)`` from a Triton forward with ``fp8_amax``, else
    ``y``, whose maximum the native path computes here (and which gets an empty amax without fp8_amax)."""
    if not fp8_amax:
        return result, result.new_empty(0, dtype=torch.float32)
    return (result, tensor_abs_max(result)) if native else result


@torch.library.triton_op("kernel_pytorch::gated_activation_packed_backward", mutates_args=())
def _gated_packed_backward_op(dy: Tensor, gate_up: Tensor, kind: str, gate_first: bool,
                              fp8_amax: bool) -> tuple[Tensor, Tensor]:
    # Returns (d gate_up, its maximum); the maximum is empty without fp8_amax.
    _kind_index(kind)
    if _use_triton(gate_up):
        return _with_amax(gated_activation_packed_bwd(dy, gate_up, kind, gate_first, fp8_amax), fp8_amax)
    return _with_amax(_gated_packed_bwd_native(dy, gate_up, kind, gate_first), fp8_amax, native=True)


def _activation_setup(ctx, inputs, output):
    x, kind = inputs
    ctx.kind = kind
    ctx.save_for_backward(x)


def _activation_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return _activation_backward_op(dy, x, ctx.kind), None


def _gated_setup(ctx, inputs, output):
    gate, up, kind, _fp8_amax = inputs
    ctx.kind = kind
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(gate, up)


def _gated_backward(ctx, dy, _damax):
    gate, up = ctx.saved_tensors
    dgate, dup = _gated_backward_op(dy, gate, up, ctx.kind)
    return (dgate if ctx.needs_input_grad[0] else None), (dup if ctx.needs_input_grad[1] else None), None, None


def _gated_packed_setup(ctx, inputs, output):
    gate_up, kind, gate_first, _fp8_amax, grad_amax_slot = inputs
    ctx.kind, ctx.gate_first = kind, gate_first
    ctx.grad_amax = grad_amax_slot is not None
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(gate_up)


def _gated_packed_backward(ctx, dy, _damax):
    """d gate_up; and, where ``grad_amax_slot`` was given, its maximum as the slot's "gradient": how the FP8
    gate/up projection that made the slot (``float8_linear(..., grad_amax_slot=True)``) receives the maximum
    of its output's gradient from this kernel instead of reading that gradient again."""
    (gate_up,) = ctx.saved_tensors
    dgate_up, amax = _gated_packed_backward_op(dy, gate_up, ctx.kind, ctx.gate_first, ctx.grad_amax)
    return dgate_up, None, None, None, (amax if ctx.grad_amax else None)


_activation_op.register_autograd(_activation_backward, setup_context=_activation_setup)
_gated_op.register_autograd(_gated_backward, setup_context=_gated_setup)
_gated_packed_op.register_autograd(_gated_packed_backward, setup_context=_gated_packed_setup)


# ---------------------------------------------------------------------------------------- public API

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _kind_index(kind: str) -> int:
    if kind not in ACTIVATION_KINDS:
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {', '.join(ACTIVATION_KINDS)}")
    return ACTIVATION_KINDS[kind]


def _check_float(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor) or t.dtype not in _FLOAT_DTYPES:
        got = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), got {got}")


def _check_pair(gate: Tensor, up: Tensor) -> None:
    _check_float("gate", gate)
    _check_float("up", up)
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate and up must have the same shape, dtype and device: gate {gate.dtype} "
                         f"{tuple(gate.shape)} on {gate.device}, up {up.dtype} {tuple(up.shape)} on {up.device}")


def activation(x: Tensor, kind: str = "silu") -> Tensor:
    """``act(x)`` for ``kind`` in ``"silu"``, ``"gelu"`` (erf) and ``"gelu_tanh"`` (``F.gelu(x,
    approximate="tanh")``): fp32 math, output in x's dtype, contiguous. Any shape and layout;
    differentiable, and traceable by ``torch.compile(fullgraph=True)``.

    >>> x = torch.randn(2, 8, 64)
    >>> y = activation(x, "gelu_tanh")            # ~ F.gelu(x, approximate="tanh")
    """
    _kind_index(kind)
    _check_float("x", x)
    return _activation_op(x, kind)


def gated_activation(gate: Tensor, up: Tensor, kind: str = "silu", *, fp8_amax: bool = False):
    """``act(gate) * up`` (SwiGLU for ``"silu"``, GeGLU for the GELUs) from two same-shape tensors,
    computed in fp32 and rounded once. Strided inputs (e.g. the chunks of one projection's output) are
    read in place. ``fp8_amax=True`` returns ``(y, max |y|)``, the maximum computed by the activation's own
    kernel: what :func:`~kernel_pytorch.ops.float8_linear.float8_linear` takes as ``x_amax``.

    >>> gate, up = torch.randn(2, 8, 172), torch.randn(2, 8, 172)
    >>> y = gated_activation(gate, up, "silu")    # ~ F.silu(gate) * up
    """
    _kind_index(kind)
    _check_pair(gate, up)
    y, amax = _gated_op(gate, up, kind, bool(fp8_amax))
    return (y, amax) if fp8_amax else y


def gated_activation_packed(gate_up: Tensor, kind: str = "silu", gate_first: bool = True, *,
                            fp8_amax: bool = False, grad_amax_slot: Tensor | None = None):
    """``act(gate) * up`` with ``gate, up = gate_up.chunk(2, -1)`` (``up, gate`` when ``gate_first`` is
    False): the output of one fused gate/up projection, last dim 2N -> N. The gradient is one tensor
    of gate_up's shape. ``fp8_amax=True`` returns ``(y, max |y|)`` as :func:`gated_activation` does.
    ``grad_amax_slot``: the slot ``float8_linear(..., grad_amax_slot=True)`` returned with gate_up; the
    backward computes ``max |d gate_up|`` in its kernel and hands it to that linear's backward through it.

    >>> gate_up = torch.randn(2, 8, 344)
    >>> y = gated_activation_packed(gate_up, "silu")   # (2, 8, 172)
    """
    _kind_index(kind)
    _check_float("gate_up", gate_up)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be even (gate and up side by side), got shape "
                         f"{tuple(gate_up.shape)}")
    check_grad_amax_slot(grad_amax_slot)
    y, amax = _gated_packed_op(gate_up, kind, bool(gate_first), bool(fp8_amax), grad_amax_slot)
    return (y, amax) if fp8_amax else y


def _use_gelu_epilogue(x: Tensor, weight: Tensor, bias: Tensor | None, kind: str) -> bool:
    """Whether ``linear_activation`` runs cuBLASLt's GEMM + bias + GELU epilogue. ``torch._addmm_activation``
    has no autograd formula, so only when nothing needs a gradient. Its GELU is the tanh approximation on
    CUDA (ATen's cuBLASLt epilogue, and its fallback ``gelu_(result, "tanh")``) but the erf GELU on CPU,
    hence CUDA only."""
    if not (CUBLASLT_GELU_EPILOGUE and kind == "gelu_tanh" and bias is not None and x.is_cuda):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return False
    # Same dtypes (ATen's requirement; autocast casts all three), and no empty reduction (ATen returns the
    # bias without the activation when in_features is 0).
    return x.dtype == weight.dtype == bias.dtype and x.numel() > 0 and weight.numel() > 0


def linear_activation(x: Tensor, weight: Tensor, bias: Tensor | None = None, kind: str = "gelu_tanh") -> Tensor:
    """``act(F.linear(x, weight, bias))``. On CUDA, for ``"gelu_tanh"`` with a bias and no gradient
    required (inference), one cuBLASLt GEMM with the bias + GELU epilogue (``torch._addmm_activation``,
    behind :data:`CUBLASLT_GELU_EPILOGUE`); it rounds once where F.linear + the activation rounds the
    linear's output first. Otherwise (training included) ``F.linear`` then :func:`activation`, both
    differentiable.

    >>> x, w, b = torch.randn(4, 32), torch.randn(64, 32), torch.randn(64)
    >>> y = linear_activation(x, w, b, "gelu_tanh")    # (4, 64)
    """
    _kind_index(kind)
    _check_float("x", x)
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be (out_features, in_features) with in_features "
                         f"= x's last dim, x {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias shape {tuple(bias.shape)} is not ({weight.shape[0]},), one value per output")
    if _use_gelu_epilogue(x, weight, bias, kind):
        y = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
        return y.view(*x.shape[:-1], weight.shape[0])
    return activation(F.linear(x, weight, bias), kind)


class Activation(nn.Module):
    """Drop-in for ``nn.SiLU()`` (``"silu"``), ``nn.GELU()`` (``"gelu"``) and ``nn.GELU(approximate="tanh")``
    (``"gelu_tanh"``); no parameters.

    >>> act = Activation("silu")
    >>> y = act(torch.randn(4, 64))
    """

    def __init__(self, kind: str = "silu"):
        super().__init__()
        _kind_index(kind)
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        return activation(x, self.kind)

    def extra_repr(self) -> str:
        return repr(self.kind)


class GatedActivation(nn.Module):
    """SwiGLU / GeGLU: ``forward(gate, up)``, or ``forward(gate_up)`` for a packed (..., 2N) input.

    >>> glu = GatedActivation("silu")
    >>> y = glu(torch.randn(4, 128))                   # (4, 64)
    """

    def __init__(self, kind: str = "silu", gate_first: bool = True):
        super().__init__()
        _kind_index(kind)
        self.kind, self.gate_first = kind, gate_first

    def forward(self, gate_or_gate_up: Tensor, up: Tensor | None = None) -> Tensor:
        if up is None:
            return gated_activation_packed(gate_or_gate_up, self.kind, self.gate_first)
        return gated_activation(gate_or_gate_up, up, self.kind)

    def extra_repr(self) -> str:
        return f"{self.kind!r}, gate_first={self.gate_first}"
