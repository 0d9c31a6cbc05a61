"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each rank holds its queries and one K/V block at a time. For N steps it computes attention of its
queries against the K/V block it holds while already sending that block to the next rank and receiving
the previous rank's (``batch_isend_irecv`` posted before the compute, so the transfer hides behind it);
block outputs are merged with their log-sum-exps in fp32. K/V are never all-gathered: a rank holds two
K/V blocks at a time, not N. With GQA only the Hkv heads of K/V travel.

The backward is a second ring: K/V travel as in the forward, and with them the dK/dV accumulated so far
for that block; each rank adds its share and passes both on, and after N steps plus one more pass the
finished dK/dV arrive back at the rank that owns that block.

Causal attention expects the zigzag layout of :func:`~kernel_pytorch.distributed.shard_sequence`: rank r
holds chunks r and 2N-1-r of 2N. Every block pair is then one of three kinds (see ``_block_for_step``):
the rank's own block (causal), an earlier rank's (all queries see the first key chunk, none the second)
or a later rank's (the second query chunk sees both key chunks, the first none): every step but the
first does half a block of work, without masking, on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from kernel_pytorch.distributed.block_attention import (
    BLOCK_KERNELS,
    accumulation_dtype,
    block_attention_backward,
    block_attention_forward,
    default_block_kernel,
)
from kernel_pytorch.distributed.rank_group import (
    PendingReceive,
    RankGroup,
    require_same_on_all_ranks,
)

__all__ = ["RING_ATTENTION_KERNELS", "ring_attention"]

RING_ATTENTION_KERNELS = BLOCK_KERNELS
# Point-to-point tags: gloo matches messages by (peer, tag), so K/V and dK/dV never take each other's place.
_KV_TAG, _KV_GRAD_TAG = 0, 1


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                   group: dist.ProcessGroup | None = None, scale: float | None = None,
                   kernel: str | None = None, check_inputs: bool = True) -> Tensor:
    """``softmax(q k^T * scale) v`` over the whole sequence, called on every rank of ``group`` with that
    rank's shard: q (B, Hq, Lq_local, D), k (B, Hkv, Lk_local, D), v (B, Hkv, Lk_local, Dv), Hq a multiple
    of Hkv (GQA). Returns this rank's (B, Hq, Lq_local, Dv). Differentiable in q, k and v.

    ``causal=True`` needs q and k in the zigzag layout of ``shard_sequence`` (equal local lengths, the
    full length divisible by 2 x world size). Non-causal attention works with any layout, and Lq may
    differ from Lk. ``scale`` defaults to 1/sqrt(D); ``kernel`` (one of :data:`RING_ATTENTION_KERNELS`)
    to flash for fp16/bf16 on CUDA, efficient for fp32 on CUDA and math otherwise.

    ``check_inputs``: all ranks' shapes are compared (one small all_gather, which on GPUs also waits
    for the host) and bad input raises the same ``ValueError`` on every rank. With ``False`` only the
    local checks run: for a training loop whose shapes are known to agree.

    Example (on each of N ranks; ``gather_sequence`` reassembles the output)::

        q, k, v = (shard_sequence(t, dim=2) for t in (q_full, k_full, v_full))
        out = ring_attention(q, k, v, causal=True)
        out_full = gather_sequence(out, dim=2)
    """
    ranks = RankGroup.of(group)
    kernel = default_block_kernel(q) if kernel is None else kernel
    if check_inputs:
        # Before any local raise: a rank raising alone would leave the others waiting in this all_gather.
        kernel_index = RING_ATTENTION_KERNELS.index(kernel) if kernel in RING_ATTENTION_KERNELS else -1
        require_same_on_all_ranks(ranks, {"q": q, "k": k, "v": v},
                                  {"causal": int(causal), "kernel_index": kernel_index}, "ring_attention")
    if kernel not in RING_ATTENTION_KERNELS:
        raise ValueError(f"unknown ring attention kernel {kernel!r}; valid: {', '.join(RING_ATTENTION_KERNELS)}")
    _check_local_inputs(q, k, v, causal, ranks.size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, _RingOptions(causal, scale, kernel, ranks))


def _check_local_inputs(q: Tensor, k: Tensor, v: Tensor, causal: bool, world_size: int) -> None:
    """The checks that need only this rank's tensors; the same on every rank once shapes agree."""
    if not q.dim() == k.dim() == v.dim() == 4:
        raise ValueError("ring_attention takes 4-D q, k, v (B, H, L_local, D), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{q.device}, {k.dtype}/{k.device}, "
                         f"{v.dtype}/{v.device}")
    (batch, heads_q, seq_q, dim_q), (_, heads_kv, seq_k, dim_k) = q.shape, k.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != batch or dim_k != dim_q:
        raise ValueError("ring_attention needs equal batch, K/V heads and K/V lengths, and equal q/k head dims; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"query heads ({heads_q}) must be a multiple of key/value heads ({heads_kv})")
    if seq_q == 0 or seq_k == 0:
        raise ValueError("ring_attention needs at least one query and one key per rank")
    if causal and seq_q != seq_k:
        raise ValueError(f"causal ring attention needs equal local query and key lengths, got {seq_q} and {seq_k}")
    if causal and seq_q % 2:
        raise ValueError(
            f"causal ring attention needs the sequence length divisible by 2 x world size = {2 * world_size} "
            f"(zigzag layout: 2 equal chunks per rank); each rank holds {seq_q} tokens, "
            f"{seq_q * world_size} in all")


@dataclass(frozen=True)
class _RingOptions:
    causal: bool
    scale: float
    kernel: str
    ranks: RankGroup


@dataclass(frozen=True)
class _Block:
    """Which local query rows meet which rows of the K/V block held, and whether under a causal mask."""

    q_rows: slice
    kv_rows: slice
    causal: bool


_ALL = slice(None)


def _block_for_step(step: int, rank: int, world_size: int, causal: bool, seq_local: int) -> _Block:
    """At ``step`` a rank holds the K/V of rank (rank - step) mod N. Under the zigzag layout (query
    chunks rank < 2N-1-rank, key chunks source < 2N-1-source):

    * source == rank: the same positions: causal, the only masked block;
    * source < rank: key chunk ``source`` precedes both query chunks, key chunk 2N-1-source follows
      both: all queries against the first half of K/V;
    * source > rank: both key chunks follow query chunk ``rank`` and precede query chunk 2N-1-rank:
      the second half of the queries against all of K/V.
    """
    if not causal:
        return _Block(_ALL, _ALL, False)
    source = (rank - step) % world_size
    half = seq_local // 2
    if source == rank:
        return _Block(_ALL, _ALL, True)
    if source < rank:
        return _Block(_ALL, slice(0, half), False)
    return _Block(slice(half, None), _ALL, False)


def _pack(k: Tensor, v: Tensor) -> Tensor:
    """K and V in one flat buffer: one message per step instead of two."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buffer: Tensor, k_shape: torch.Size, v_shape: torch.Size) -> tuple[Tensor, Tensor]:
    split = k_shape.numel()
    return buffer[:split].view(k_shape), buffer[split:].view(v_shape)


def _rows(t: Tensor, rows: slice) -> Tensor:
    return t[:, :, rows]


def _merge_block(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor, rows: slice) -> None:
    """Fold one block's (output, LSE) into the running ones for ``rows``, in place, in their fp32/fp64:
    each side is weighted by exp(its LSE - merged LSE), both <= 1, so nothing overflows."""
    out_rows, lse_rows = _rows(out, rows), _rows(lse, rows)
    merged = torch.logaddexp(lse_rows, block_lse)
    # two passes over the fp32 output (mul_, then addcmul_ reading the block's output in its own dtype):
    # the merge is memory-bound, about 4 bytes x 4.5 per output element per step
    out_rows.mul_(torch.exp(lse_rows - merged).unsqueeze(-1))
    out_rows.addcmul_(block_out, torch.exp(block_lse - merged).unsqueeze(-1))
    lse_rows.copy_(merged)


def _with_layout_of(out: Tensor, grad_out: Tensor) -> Tensor:
    """``grad_out`` in ``out``'s memory layout, which is the first block kernel's (flash: (B, L, H, D)
    memory, as SDPA returns it): the fused backward kernels then copy neither to a common layout."""
    if grad_out.stride() == out.stride():
        return grad_out
    return torch.empty_like(out).copy_(grad_out)  # empty_like keeps a dense tensor's strides


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, options: _RingOptions) -> tuple[Tensor, Tensor]:
    """(output in q's dtype, LSE in the accumulation dtype) of this rank's queries over all keys."""
    ranks, dtype = options.ranks, accumulation_dtype(q.dtype)
    kv = _pack(k, v)
    out = lse = None
    for step in range(ranks.size):
        incoming = ranks.pass_to_next(kv, _KV_TAG) if step + 1 < ranks.size else None
        block = _block_for_step(step, ranks.rank, ranks.size, options.causal, q.shape[2])
        k_held, v_held = _unpack(kv, k.shape, v.shape)
        block_out, block_lse = block_attention_forward(
            _rows(q, block.q_rows), _rows(k_held, block.kv_rows), _rows(v_held, block.kv_rows),
            causal=block.causal, scale=options.scale, kernel=options.kernel)
        if out is None:  # step 0 covers every query row (the own block: each query sees at least itself);
            # .to keeps the kernel's layout, so the output is laid out as the kernel's (and SDPA's) would be
            out, lse = block_out.to(dtype, copy=True), block_lse.to(dtype, copy=True)
        else:
            _merge_block(out, lse, block_out, block_lse, block.q_rows)
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


def _ring_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   options: _RingOptions) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's shard. The dK/dV of the block held at step s are passed on after the
    step's compute and waited for one step later, so that transfer too runs behind a block's compute."""
    ranks, dtype = options.ranks, accumulation_dtype(q.dtype)
    grad_out = _with_layout_of(out, grad_out)
    kv = _pack(k, v)
    grad_q = torch.zeros(q.shape, dtype=dtype, device=q.device)
    pending_kv_grad: PendingReceive | None = None
    for step in range(ranks.size):
        incoming = ranks.pass_to_next(kv, _KV_TAG) if step + 1 < ranks.size else None
        block = _block_for_step(step, ranks.rank, ranks.size, options.causal, q.shape[2])
        k_held, v_held = _unpack(kv, k.shape, v.shape)
        rows = block.q_rows
        dq, dk, dv = block_attention_backward(
            _rows(grad_out, rows), _rows(q, rows), _rows(k_held, block.kv_rows), _rows(v_held, block.kv_rows),
            _rows(out, rows), _rows(lse, rows), causal=block.causal, scale=options.scale, kernel=options.kernel)
        _rows(grad_q, rows).add_(dq)
        # The held block's dK/dV so far: from the previous rank, or zeros at step 0 (the own block, first seen).
        kv_grad = pending_kv_grad.wait() if pending_kv_grad is not None else kv.new_zeros(kv.shape, dtype=dtype)
        grad_k, grad_v = _unpack(kv_grad, k.shape, v.shape)
        _rows(grad_k, block.kv_rows).add_(dk)
        _rows(grad_v, block.kv_rows).add_(dv)
        if ranks.size > 1:  # after the last step this pass brings each block's finished dK/dV home
            pending_kv_grad = ranks.pass_to_next(kv_grad, _KV_GRAD_TAG)
        if incoming is not None:
            kv = incoming.wait()
    if pending_kv_grad is not None:
        kv_grad = pending_kv_grad.wait()
    grad_k, grad_v = _unpack(kv_grad, k.shape, v.shape)
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, options: _RingOptions) -> Tensor:
        out, lse = _ring_forward(q, k, v, options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = options
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        grad_q, grad_k, grad_v = _ring_backward(grad_out, q, k, v, out, lse, ctx.options)
        return grad_q, grad_k, grad_v, None
