"""Rotary position embedding (RoPE) of q and k, fused, as a ``torch.library`` custom op with a Triton kernel.

    q_out = q * cos + rot(q) * sin,   k_out = k * cos + rot(k) * sin        one kernel launch for both

exactly what model code computes, over the first ``R = cos.shape[-1]`` features (the rotary dim); features
``R..D`` of a head of ``D`` features pass through unchanged (partial rotary: GPT-NeoX / Phi ``rotary_pct``).

``rot`` pairs feature ``a`` with feature ``b`` and maps ``(x_a, x_b) -> (-x_b, x_a)``:

* rotate-half (``interleaved=False``; Llama, GPT-NeoX, Hugging Face's ``rotate_half``): pairs
  ``(i, i + R/2)``, so ``rot(x) = cat(-x[..., R/2:R], x[..., :R/2])``;
* interleaved (``interleaved=True``; GPT-J, Meta's original Llama code, ``rotate_every_two``): pairs
  ``(2i, 2i + 1)``, so ``rot(x)[2i] = -x[2i+1]``, ``rot(x)[2i+1] = x[2i]``.

``cos`` and ``sin`` are used as given, every element of them (their two halves need not repeat), read
through broadcast strides (stride 0, never materialized): any shape that broadcasts to ``q.shape[:-1] + (R,)``
and to ``k.shape[:-1] + (R,)``, e.g. ``(B, 1, L, R)``, ``(1, 1, L, R)`` or ``(L, R)`` for ``(B, H, L, D)``
heads, ``(B, L, 1, R)`` for ``(B, L, H, D)``; q and k may have different head counts (GQA).

Numerics: math in fp32 (fp64 for fp64 inputs), each output rounded once to q's dtype. Eager model code
rounds three times in half precision (``q * cos``, ``rot(q) * sin``, their sum), so in bf16/fp16 the op
is closer to the exact result than the model's own code, and differs from it by about one ulp; in fp32 it
matches it to ~1e-7. Outputs are contiguous tensors of q's and k's shapes (whatever q's and k's strides),
in q's dtype (eager would promote to a wider cos dtype; the op does not).

Backward: the map is linear in x with ``dx = dy * cos + rotᵀ(dy * sin)``, ``rotᵀ = -rot``, so the same
kernel computes dq and dk (one launch) from cos and sin alone: q and k are saved only when cos or sin
need a gradient, which native PyTorch ops then compute (``sum of dy * x`` and ``dy * rot(x)`` over the
broadcast dims; correct, not tuned: tables are usually built from a buffer and need none).

Layers (docs/design.md, "Kernels"): ``_rope_kernel`` (Triton; ``BACKWARD`` selects the adjoint) ->
``rope_fwd`` / ``rope_bwd`` (launch) -> ``kernel_pytorch::rope`` and ``kernel_pytorch::rope_backward``
(``triton_op`` custom ops, autograd) -> :func:`apply_rope`.

Dispatch, inside the ops: CUDA/ROCm tensors (q and k together at least ``TRITON_MIN_ELEMENTS`` elements)
run the Triton kernel; everything else (CPU, other devices, machines without Triton) runs the same formula
in native PyTorch with the same rounding, so a forward on one path and a backward on the other agree.
"""

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kernel_pytorch.ops import triton_utils as tu
from kernel_pytorch.ops.triton_utils import jit, tl

__all__ = ["TRITON_MIN_ELEMENTS", "apply_rope", "rope_bwd", "rope_fwd"]

# Below this many elements (q and k together) the native path runs instead of Triton. Both paths are
# one pass over q and k, but the native one is ~4-6 elementwise kernels plus a cat; the fused kernel
# should win at every size, hence 0; the threshold sweep found it did, from its smallest size up
# (benchmarks/results/kernels.json, "suggested_thresholds"; docs/kernels.md).
TRITON_MIN_ELEMENTS = 0


# --------------------------------------------------------------------------------------------- kernels

@jit
def _rope_rows(
    X,  # q or k (in the backward: the gradient of q_out or k_out), viewed as (A, B, C, head_dim) with
        # strides stride_x0, stride_x1, stride_x2 and unit feature stride; a row is one (a, b, c) vector
    Y,  # (A * B * C, head_dim) output in X's dtype, contiguous: row r starts at r * head_dim
    COS,  # cos broadcast to (A, B, C, 2 * half) through strides stride_c0, stride_c1, stride_c2 (0 on
          # broadcast dims), unit feature stride; any float dtype
    SIN,  # sin, same shape and strides as COS
    tile,  # which tile of ROWS consecutive rows of X this program handles
    n_rows, dim_b, dim_c,  # n_rows = A * B * C; B and C to split a row index into (a, b, c)
    stride_x0, stride_x1, stride_x2, stride_c0, stride_c1, stride_c2,
    head_dim,  # D: features per row
    half,  # R / 2: rotary pairs per row
    INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr, ACC: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, ROWS: tl.constexpr,
):
    rows = tile * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_rows
    rows = rows.to(tl.int64)  # offsets overflow int32 past 2**31 elements
    c = rows % dim_c
    ab = rows // dim_c
    b = ab % dim_b
    a = ab // dim_b
    x_row = X + (a * stride_x0 + b * stride_x1 + c * stride_x2)  # (ROWS,) pointers to each row's feature 0
    t_off = a * stride_c0 + b * stride_c1 + c * stride_c2  # (ROWS,) offsets of the rows' cos / sin
    y_row = Y + rows * head_dim

    # Each rotary pair (x_a, x_b) as two (ROWS, BLOCK_H) tiles, with their cos and sin.
    if INTERLEAVED:  # pairs (2i, 2i + 1): one contiguous (vectorizable) load, split in registers
        cols = tl.arange(0, 2 * BLOCK_H)
        mask = row_mask[:, None] & (cols < 2 * half)[None, :]
        x = tl.load(x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        cs = tl.load(COS + t_off[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        sn = tl.load(SIN + t_off[:, None] + cols[None, :], mask=mask, other=0.0).to(ACC)
        x_a, x_b = tl.split(tl.reshape(x, (ROWS, BLOCK_H, 2)))
        cos_a, cos_b = tl.split(tl.reshape(cs, (ROWS, BLOCK_H, 2)))
        sin_a, sin_b = tl.split(tl.reshape(sn, (ROWS, BLOCK_H, 2)))
    else:  # pairs (i, i + half): two contiguous loads
        cols = tl.arange(0, BLOCK_H)
        mask = row_mask[:, None] & (cols < half)[None, :]
        offs_a = cols[None, :]
        offs_b = half + cols[None, :]
        x_a = tl.load(x_row[:, None] + offs_a, mask=mask, other=0.0).to(ACC)
        x_b = tl.load(x_row[:, None] + offs_b, mask=mask, other=0.0).to(ACC)
        cos_a = tl.load(COS + t_off[:, None] + offs_a, mask=mask, other=0.0).to(ACC)
        cos_b = tl.load(COS + t_off[:, None] + offs_b, mask=mask, other=0.0).to(ACC)
        sin_a = tl.load(SIN + t_off[:, None] + offs_a, mask=mask, other=0.0).to(ACC)
        sin_b = tl.load(SIN + t_off[:, None] + offs_b, mask=mask, other=0.0).to(ACC)

    if BACKWARD:  # dx = dy * cos + rotᵀ(dy * sin), rotᵀ(g)_a = g_b, rotᵀ(g)_b = -g_a
        y_a = x_a * cos_a + x_b * sin_b
        y_b = x_b * cos_b - x_a * sin_a
    else:  # y = x * cos + rot(x) * sin, rot(x)_a = -x_b, rot(x)_b = x_a
        y_a = x_a * cos_a - x_b * sin_a
        y_b = x_b * cos_b + x_a * sin_b
    y_a = y_a.to(Y.dtype.element_ty)
    y_b = y_b.to(Y.dtype.element_ty)

    if INTERLEAVED:
        y = tl.reshape(tl.join(y_a, y_b), (ROWS, 2 * BLOCK_H))
        tl.store(y_row[:, None] + cols[None, :], y, mask=mask)
    else:
        tl.store(y_row[:, None] + offs_a, y_a, mask=mask)
        tl.store(y_row[:, None] + offs_b, y_b, mask=mask)

    if HAS_PASS:  # features 2 * half .. head_dim: copied (the gradient too)
        pcols = 2 * half + tl.arange(0, BLOCK_P)
        pmask = row_mask[:, None] & (pcols < head_dim)[None, :]
        v = tl.load(x_row[:, None] + pcols[None, :], mask=pmask)
        tl.store(y_row[:, None] + pcols[None, :], v, mask=pmask)


@jit
def _rope_kernel(
    Q,  # q (backward: dq_out), (A, B, C, head_dim) with strides stride_q0/1/2, unit feature stride
    K,  # k (backward: dk_out), (A', B', C', head_dim) with strides stride_k0/1/2, unit feature stride
    QO,  # (n_q_rows, head_dim) output for Q in Q's dtype, contiguous
    KO,  # (n_k_rows, head_dim) output for K in K's dtype, contiguous
    COS_Q,  # cos broadcast to Q's rows: (A, B, C, 2 * half), strides stride_cq0/1/2 (0 on broadcast
            # dims), unit feature stride, any float dtype; a view of the caller's table, not a copy
    SIN_Q,  # sin broadcast to Q's rows, same strides as COS_Q
    COS_K,  # cos broadcast to K's rows, strides stride_ck0/1/2
    SIN_K,  # sin broadcast to K's rows, same strides as COS_K
    q_programs,  # programs 0 .. q_programs - 1 take Q's row tiles, the rest K's
    n_q_rows, q_dim_b, q_dim_c, stride_q0, stride_q1, stride_q2, stride_cq0, stride_cq1, stride_cq2,
    n_k_rows, k_dim_b, k_dim_c, stride_k0, stride_k1, stride_k2, stride_ck0, stride_ck1, stride_ck2,
    head_dim, half,
    INTERLEAVED: tl.constexpr,  # pairs (2i, 2i + 1) instead of (i, i + half)
    BACKWARD: tl.constexpr,  # apply the adjoint: dx = dy * cos + rotᵀ(dy * sin)
    HAS_PASS: tl.constexpr,  # 2 * half < head_dim: copy the features past the rotary dim
    ACC: tl.constexpr,  # tl.float32, or tl.float64 for fp64 inputs
    BLOCK_H: tl.constexpr,  # half rounded up to a power of two
    BLOCK_P: tl.constexpr,  # head_dim - 2 * half rounded up to a power of two (1 when HAS_PASS is off)
    ROWS: tl.constexpr,  # rows per program
):
    # One 1-D grid over the row tiles of q then of k: one launch for both, and no program straddles them.
    pid = tl.program_id(0)
    if pid < q_programs:
        _rope_rows(Q, QO, COS_Q, SIN_Q, pid, n_q_rows, q_dim_b, q_dim_c,
                   stride_q0, stride_q1, stride_q2, stride_cq0, stride_cq1, stride_cq2, head_dim, half,
                   INTERLEAVED, BACKWARD, HAS_PASS, ACC, BLOCK_H, BLOCK_P, ROWS)
    else:
        _rope_rows(K, KO, COS_K, SIN_K, pid - q_programs, n_k_rows, k_dim_b, k_dim_c,
                   stride_k0, stride_k1, stride_k2, stride_ck0, stride_ck1, stride_ck2, head_dim, half,
                   INTERLEAVED, BACKWARD, HAS_PASS, ACC, BLOCK_H, BLOCK_P, ROWS)


# -------------------------------------------------------------------------------------------- launches

# Rows of q/k per program: enough that a program moves at least this many elements of x (head dim 128
# -> 16 rows, 64 -> 32, 80 -> 16): a one-row program (128 bf16 = 256 bytes) is too little work to hide its
# scheduling cost and too little memory in flight. The kernel is a pure stream (read x, cos, sin, write
# y, no reduction), so this is the only lever besides warps. Not yet swept on a GPU: 2048 is the norm
# kernels' per-program work (triton_utils), where it was chosen for the same reason.
_TILE_ELEMENTS = 2048
# Elements of a tile each thread handles: a 2048-element tile -> 4 warps, i.e. 8 rotary pairs per thread
# (x_a, x_b, two cos, two sin: 48 fp32 registers, no pressure) and 16-byte bf16 vector loads on the
# rotate-half path. More warps per program buy nothing without a reduction to share; fewer make each
# thread's loads serial. Not yet swept on a GPU.
_ELEMENTS_PER_THREAD = 16
_MIN_WARPS, _MAX_WARPS = 4, 16  # 16: ROCm's 64-wide wavefronts cap a block at 1024 threads


@dataclass(frozen=True)
class _Tile:
    block_h: int  # rotary pairs per row, rounded up to a power of two
    block_p: int  # pass-through features per row, rounded up to a power of two (1 if none)
    rows: int  # rows per program
    num_warps: int


def _rope_tile(head_dim: int, rotary_dim: int, n_rows=None) -> _Tile:
    """Tile for rows of ``head_dim`` features with ``rotary_dim`` rotated; ``ValueError`` past the widest
    row the kernel holds in registers (``triton_utils.MAX_HIDDEN``)."""
    if head_dim > tu.MAX_HIDDEN:
        raise ValueError(f"head dim {head_dim} exceeds {tu.MAX_HIDDEN}, the widest row kernel_pytorch's Triton "
                         f"RoPE kernel holds in registers")
    half = rotary_dim // 2
    block_h = tu.next_power_of_2(max(half, 1))
    block_p = tu.next_power_of_2(head_dim - rotary_dim) if head_dim > rotary_dim else 1
    row_block = 2 * block_h + (block_p if head_dim > rotary_dim else 0)
    rows = 1 << max(0, (_TILE_ELEMENTS // row_block).bit_length() - 1)  # a power of two (tl.arange)
    if isinstance(n_rows, int):  # symbolic under torch.compile with dynamic shapes: no cap
        rows = min(rows, tu.next_power_of_2(max(n_rows, 1)))
    num_warps = min(max(rows * row_block // (32 * _ELEMENTS_PER_THREAD), _MIN_WARPS), _MAX_WARPS)
    return _Tile(block_h, block_p, rows, num_warps)


def _as_4d(x: Tensor, table: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` as an (A, B, C, D) view with unit feature stride, and ``table`` expanded (stride 0, no copy)
    to (A, B, C, R). Copies only a strided last dim, or, above 4-D, leading dims that do not merge."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t = table[(None,) * (x.dim() - table.dim())].expand(*x.shape[:-1], table.shape[-1])
    if x.dim() > 4:
        x = x.reshape(-1, *x.shape[-3:])
        t = t.reshape(-1, *t.shape[-3:])
    while x.dim() < 4:
        x, t = x.unsqueeze(0), t.unsqueeze(0)
    return x, t


def _launch(xq: Tensor, xk: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, backward: bool):
    head_dim, rotary_dim = xq.shape[-1], cos.shape[-1]
    yq = torch.empty(xq.shape, dtype=xq.dtype, device=xq.device)
    yk = torch.empty(xk.shape, dtype=xk.dtype, device=xk.device)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:  # the kernel reads both with cos's strides
        cos, sin = cos.contiguous(), sin.contiguous()
    q4, cq = _as_4d(xq, cos)
    k4, ck = _as_4d(xk, cos)
    _, sq = _as_4d(xq, sin)
    _, sk = _as_4d(xk, sin)
    n_q, n_k = q4.shape[0] * q4.shape[1] * q4.shape[2], k4.shape[0] * k4.shape[1] * k4.shape[2]
    tile = _rope_tile(head_dim, rotary_dim, max(n_q, n_k) if isinstance(n_q, int) else None)
    q_programs = tu.cdiv(n_q, tile.rows)
    programs = q_programs + tu.cdiv(n_k, tile.rows)
    if programs == 0:
        return yq, yk
    # cos and sin have one shape and one set of strides (made so above), so their expansions do too.
    assert sq.stride() == cq.stride() and sk.stride() == ck.stride()
    with tu.device_guard(xq):
        tu.launch(_rope_kernel)[(programs,)](
            q4, k4, yq, yk, cq, sq, ck, sk, q_programs,
            n_q, q4.shape[1], q4.shape[2], q4.stride(0), q4.stride(1), q4.stride(2),
            cq.stride(0), cq.stride(1), cq.stride(2),
            n_k, k4.shape[1], k4.shape[2], k4.stride(0), k4.stride(1), k4.stride(2),
            ck.stride(0), ck.stride(1), ck.stride(2),
            head_dim, rotary_dim // 2,
            INTERLEAVED=interleaved, BACKWARD=backward, HAS_PASS=rotary_dim < head_dim,
            ACC=tu.triton_acc_dtype(xq.dtype), BLOCK_H=tile.block_h, BLOCK_P=tile.block_p, ROWS=tile.rows,
            num_warps=tile.num_warps,
        )
    return yq, yk


def rope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Triton forward, one launch for q and k: ``(q_out, k_out)``, contiguous, in q's dtype (arguments
    as :func:`apply_rope` checks them). Any device Triton can launch on, CPU tensors included under
    ``TRITON_INTERPRET=1``.

    Grid: one program per tile of ``ROWS`` consecutive rows (a row is one head vector of q or k, rows in
    q's / k's logical order, so the contiguous outputs are written in order), q's tiles first, then k's.
    """
    return _launch(q, k, cos, sin, interleaved, backward=False)


def rope_bwd(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Triton backward, one launch: the gradients of q and k, ``dq * cos + rotᵀ(dq * sin)`` (and k's),
    from the gradients of q_out and k_out (any strides). Same grid as :func:`rope_fwd`."""
    return _launch(dq, dk, cos, sin, interleaved, backward=True)


# ---------------------------------------------------------------------------------- native (non-Triton)

def _rot(x: Tensor, interleaved: bool) -> Tensor:
    """rot(x): ``(x_a, x_b) -> (-x_b, x_a)`` for each rotary pair (Hugging Face's ``rotate_half`` /
    GPT-J's ``rotate_every_two``)."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_native(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool, backward: bool) -> Tensor:
    # The kernel's formula and rounding: fp32 (fp64) math, one rounding, contiguous output.
    acc = tu.acc_dtype(x.dtype)
    rotary_dim = cos.shape[-1]
    xr, c, s = x[..., :rotary_dim].to(acc), cos.to(acc), sin.to(acc)
    if backward:  # rotᵀ = -rot
        y = xr * c - _rot(xr * s, interleaved)
    else:
        y = xr * c + _rot(xr, interleaved) * s
    if rotary_dim < x.shape[-1]:
        y = torch.cat((y, x[..., rotary_dim:].to(acc)), dim=-1)
    return y.to(x.dtype).contiguous()


def _rope_fwd_native(q, k, cos, sin, interleaved):
    return _rope_native(q, cos, sin, interleaved, False), _rope_native(k, cos, sin, interleaved, False)


def _rope_bwd_native(dq, dk, cos, sin, interleaved):
    return _rope_native(dq, cos, sin, interleaved, True), _rope_native(dk, cos, sin, interleaved, True)


def _use_triton(q: Tensor, k: Tensor) -> bool:
    return tu.use_triton(q) and q.numel() + k.numel() >= TRITON_MIN_ELEMENTS


# ------------------------------------------------------------------------------------------ custom ops
# ``triton_op`` rather than ``custom_op``, as in row_norm.py: under torch.compile Inductor traces the body
# and calls the Triton kernel from its generated code. Fake tensors: the same body, traced.

@torch.library.triton_op("kernel_pytorch::rope", mutates_args=())
def _rope_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    forward = rope_fwd if _use_triton(q, k) else _rope_fwd_native
    return forward(q, k, cos, sin, interleaved)


@torch.library.triton_op("kernel_pytorch::rope_backward", mutates_args=())
def _rope_backward_op(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor,
                      interleaved: bool) -> tuple[Tensor, Tensor]:
    backward = rope_bwd if _use_triton(dq, dk) else _rope_bwd_native
    return backward(dq, dk, cos, sin, interleaved)


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, interleaved = inputs
    ctx.interleaved = interleaved
    # q and k are needed only for the tables' gradients; usually nothing requires those.
    ctx.table_grads = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    if ctx.table_grads:
        ctx.save_for_backward(cos, sin, q, k)
    else:
        ctx.save_for_backward(cos, sin)


def _backward(ctx, dq_out, dk_out):
    cos, sin = ctx.saved_tensors[:2]
    needs = ctx.needs_input_grad
    dq = dk = dcos = dsin = None
    if needs[0] or needs[1]:
        dq, dk = _rope_backward_op(dq_out, dk_out, cos, sin, ctx.interleaved)
    if ctx.table_grads:
        q, k = ctx.saved_tensors[2:]
        dcos, dsin = _table_grads(dq_out, dk_out, q, k, cos, sin, ctx.interleaved)
    return (dq if needs[0] else None, dk if needs[1] else None, dcos if needs[2] else None,
            dsin if needs[3] else None, None)


def _table_grads(dq_out: Tensor, dk_out: Tensor, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                 interleaved: bool) -> tuple[Tensor, Tensor]:
    """Gradients of cos and sin, native: the sums of ``dy * x`` and ``dy * rot(x)`` over the dims cos and
    sin were broadcast along, for q and k together."""
    acc = tu.acc_dtype(q.dtype)
    rotary_dim = cos.shape[-1]
    dcos = dsin = 0
    for dy, x in ((dq_out, q), (dk_out, k)):
        g, xr = dy[..., :rotary_dim].to(acc), x[..., :rotary_dim].to(acc)
        dcos = dcos + (g * xr).sum_to_size(cos.shape)
        dsin = dsin + (g * _rot(xr, interleaved)).sum_to_size(sin.shape)
    return dcos.to(cos.dtype), dsin.to(sin.dtype)


_rope_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------- public API

def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of q and k: ``(q * cos + rot(q) * sin, k * cos + rot(k) * sin)``.

    ``q`` (..., D) and ``k`` (..., D) of one floating dtype (any strides; different head counts are fine);
    ``cos`` and ``sin`` of one shape (..., R), R even and at most D, broadcastable to q's and k's leading
    dims (never materialized). ``rot`` is Hugging Face's ``rotate_half`` (``interleaved=False``) or GPT-J's
    ``rotate_every_two`` (``interleaved=True``); features R..D pass through. Math in fp32, outputs rounded
    once, contiguous, in q's dtype. Differentiable in all four tensors; traceable by
    ``torch.compile(fullgraph=True)``. On CUDA/ROCm one Triton kernel launch computes both outputs.

    >>> q, k = torch.randn(2, 8, 16, 64), torch.randn(2, 2, 16, 64)   # (B, H, L, D), GQA
    >>> cos, sin = torch.randn(2, 1, 16, 64), torch.randn(2, 1, 16, 64)
    >>> q_out, k_out = apply_rope(q, k, cos, sin)                     # as HF apply_rotary_pos_emb(q, k, cos, sin)
    >>> q_out.shape, k_out.shape
    (torch.Size([2, 8, 16, 64]), torch.Size([2, 2, 16, 64]))
    """
    _check_arguments(q, k, cos, sin)
    q_out, k_out = _rope_op(q, k, cos, sin, bool(interleaved))
    return q_out, k_out


def _known_mismatch(table_size: int, size: int) -> bool:
    """Whether a cos/sin leading size is known not to broadcast to q's or k's: neither 1 nor equal. Symbolic sizes
    are decided only where already known, never guarded on: a guard ``batch == 1`` gave a generation prefill traced
    at batch 1 a graph of its own for batch 2+ (the op's own broadcasting still checks the values)."""
    return statically_known_true(table_size != 1) and statically_known_true(table_size != size)


def _check_arguments(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if t.dim() == 0 or not t.is_floating_point():
            raise ValueError(f"apply_rope expects floating tensors with a last (feature) axis; "
                             f"{name} is {t.dtype} {tuple(t.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q and k must have one dtype, got {q.dtype} and {k.dtype}")
    devices = {t.device for t in (q, k, cos, sin)}
    if len(devices) > 1:
        raise ValueError(f"q, k, cos and sin must be on one device, got {sorted(map(str, devices))}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have one head dim, got {q.shape[-1]} and {k.shape[-1]}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    rotary_dim, head_dim = cos.shape[-1], q.shape[-1]
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary dim (cos/sin last dim) must be even and positive, got {rotary_dim}")
    if rotary_dim > head_dim:
        raise ValueError(f"rotary dim (cos/sin last dim) {rotary_dim} exceeds the head dim {head_dim}")
    for name, x in (("q", q), ("k", k)):
        lead, table = tuple(x.shape[:-1]), tuple(cos.shape[:-1])
        if len(table) > len(lead) or any(_known_mismatch(t, n) for t, n in zip(reversed(table), reversed(lead))):
            raise ValueError(f"cos/sin of shape {tuple(cos.shape)} do not broadcast to {name}'s "
                             f"{tuple(x.shape)} (cos/sin leading dims must be 1 or {name}'s)")
