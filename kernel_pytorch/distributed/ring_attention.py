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

Both rings are ``torch.library`` custom ops, ``kernel_pytorch::ring_attention_fwd`` (output and fp32 LSE)
and ``kernel_pytorch::ring_attention_bwd`` (dq and the packed dK/dV), with fake implementations and a
registered autograd formula, taking the group by name: Dynamo, AOTAutograd and Inductor cannot trace the
point-to-point exchanges, so a graph holds the op as one opaque call and compiles with ``fullgraph=True``.

Memory per token per GPU (32 query heads, 8 K/V heads, head dim 128, bf16; KiB per local token). The op's
inputs and what autograd keeps: q 8, k 2, v 2, out 8, LSE 0.125 (fp32); grad_out 8 in the backward, and
its results dq 8, dk 2, dv 2. Transient, alive at the peaks:

* forward, during the block kernel of a step s >= 1: the packed K/V held (and being sent) 4, the receive
  buffer for the next 4 (not at the last step), the fp32 output accumulator 16 and LSE 0.125, the
  block's output <= 8 (half the rows, or all rows against half the keys): 32. At the end, the fp32 output
  16 and its bf16 copy 8 are alive together (the conversion cannot be done in place), with K/V 4: 28.
* backward, during the block kernel of a step s >= 1: packed K/V 4 + its receive buffer 4, the fp32 dq
  accumulator 16, the fp32 dK/dV of the previous step still being sent 8 + the receive buffer for this
  step's 8, the block's dq/dk/dv <= 12 (bf16): 52, plus the kernel's own workspace (flash: an fp32 dq
  accumulator, 16 per query row it processes, and dK/dV at the 32 query heads before the GQA sum, 16),
  plus 8 for grad_out when it comes in another layout than out (``_with_layout_of``). With one rank
  there is no receive buffer and no dK/dV in flight (32 + workspace), which is the N = 1 vs N > 1
  difference measured by benchmarks/ring_attention.py (H200, cuDNN blocks: 94.6 KB per token on one GPU,
  113 on two, 117 on four, before the change below).

What can go without changing any number: each block's results (its output and LSE in the forward; dq, dk,
dv in the backward) were kept alive until the next step's call replaced them, that is through the next
block's kernel; they are now freed once merged or added: up to 8 KiB per token off the forward's step
peak and up to 12 off the backward's (expected N > 1: ~113 -> ~101 KB per token; not measured yet). What
stays, and why: the dK/dV in flight and its receive buffer (the transfer overlaps the next block's compute;
waiting first would serialize it), the K/V receive buffer (same), the fp32 accumulators (precision), the
packed K/V copy (one message per step instead of two).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

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

__all__ = ["RING_ATTENTION_KERNELS", "ring_attention", "ring_attention_bwd", "ring_attention_fwd"]

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
    local checks run: for a training loop whose shapes are known to agree. Under ``torch.compile`` the
    all_gather is skipped (it would run once, at trace time, not per call).

    Example (on each of N ranks; ``gather_sequence`` reassembles the output)::

        q, k, v = (shard_sequence(t, dim=2) for t in (q_full, k_full, v_full))
        out = ring_attention(q, k, v, causal=True)
        out_full = gather_sequence(out, dim=2)
    """
    ranks = RankGroup.of(group)
    kernel = default_block_kernel(q) if kernel is None else kernel
    # Under torch.compile the check is skipped: an all_gather of shapes at trace time would run once, not
    # per call (the graph's shape guards, the same on every rank, stand in for it).
    if check_inputs and not torch.compiler.is_compiling():
        # Before any local raise: a rank raising alone would leave the others waiting in this all_gather.
        kernel_index = RING_ATTENTION_KERNELS.index(kernel) if kernel in RING_ATTENTION_KERNELS else -1
        require_same_on_all_ranks(ranks, {"q": q, "k": k, "v": v},
                                  {"causal": int(causal), "kernel_index": kernel_index}, "ring_attention")
    if kernel not in RING_ATTENTION_KERNELS:
        raise ValueError(f"unknown ring attention kernel {kernel!r}; valid: {', '.join(RING_ATTENTION_KERNELS)}")
    _check_local_inputs(q, k, v, causal, ranks.size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, _ = ring_attention_fwd(q, k, v, ranks.name, causal, scale, kernel)
    return out


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


def _forward_block(step: int, q: Tensor, kv: Tensor, k_shape: torch.Size, v_shape: torch.Size,
                   options: _RingOptions) -> tuple[Tensor, Tensor, _Block]:
    """(output, LSE, block) of this rank's queries against the packed K/V block held at ``step``."""
    block = _block_for_step(step, options.ranks.rank, options.ranks.size, options.causal, q.shape[2])
    k_held, v_held = _unpack(kv, k_shape, v_shape)
    block_out, block_lse = block_attention_forward(
        _rows(q, block.q_rows), _rows(k_held, block.kv_rows), _rows(v_held, block.kv_rows),
        causal=block.causal, scale=options.scale, kernel=options.kernel)
    return block_out, block_lse, block


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, options: _RingOptions) -> tuple[Tensor, Tensor]:
    """(output in q's dtype, LSE in the accumulation dtype) of this rank's queries over all keys."""
    ranks, dtype = options.ranks, accumulation_dtype(q.dtype)
    kv = _pack(k, v)
    out = lse = None
    for step in range(ranks.size):
        incoming = ranks.pass_to_next(kv, _KV_TAG) if step + 1 < ranks.size else None
        block_out, block_lse, block = _forward_block(step, q, kv, k.shape, v.shape, options)
        if out is None:  # step 0 covers every query row (the own block: each query sees at least itself);
            # .to keeps the kernel's layout, so the output is laid out as the kernel's (and SDPA's) would be
            out, lse = block_out.to(dtype, copy=True), block_lse.to(dtype, copy=True)
        else:
            _merge_block(out, lse, block_out, block_lse, block.q_rows)
        # Merged: free the block's output now, not when the next block's replaces it (it would be alive
        # through that block's kernel: up to 8 KB per token, module docstring).
        del block_out, block_lse
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


def _ring_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   options: _RingOptions) -> tuple[Tensor, Tensor]:
    """(dq, dK and dV packed as ``_pack`` packs K and V) of this rank's shard. The dK/dV of the block held
    at step s are passed on after the step's compute and waited for one step later, so that transfer too
    runs behind a block's compute."""
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
        # Added: free the block's gradients now, not when the next block's replace them (they would be alive
        # through that block's backward kernel: up to 12 KB per token, module docstring).
        del dq, dk, dv
        if ranks.size > 1:  # after the last step this pass brings each block's finished dK/dV home
            pending_kv_grad = ranks.pass_to_next(kv_grad, _KV_GRAD_TAG)
        if incoming is not None:
            kv = incoming.wait()
    if pending_kv_grad is not None:
        kv_grad = pending_kv_grad.wait()
    return grad_q.to(q.dtype), kv_grad.to(k.dtype)  # k and v share a dtype (checked)


# ---------------------------------------------------------------------------------------------------------
# The custom ops: opaque to Dynamo/AOTAutograd/Inductor, which cannot trace the point-to-point exchanges
# inside; the group travels by name (a string constant in the graph; the schema has no ProcessGroup type).
# ---------------------------------------------------------------------------------------------------------


def _ring_attention_fwd(q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool, scale: float,
                        kernel: str) -> tuple[Tensor, Tensor]:
    """(this rank's output (B, Hq, Lq, Dv) in q's dtype, its LSE (B, Hq, Lq) in the accumulation dtype).
    ``group_name``: ``RankGroup.name`` (``""``: no torch.distributed, a group of one)."""
    return _ring_forward(q, k, v, _RingOptions(causal, scale, kernel, RankGroup.named(group_name)))


def _ring_attention_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        group_name: str, causal: bool, scale: float, kernel: str) -> tuple[Tensor, Tensor]:
    """(dq, dK and dV in one flat buffer, k's elements first). Packed rather than two tensors: dK and dV
    arrive in one message buffer, and two views of it as outputs would alias each other, which a custom op
    may not return (splitting them would copy both); the autograd formula takes the views."""
    options = _RingOptions(causal, scale, kernel, RankGroup.named(group_name))
    return _ring_backward(grad_out, q, k, v, out, lse, options)


ring_attention_fwd = torch.library.custom_op("kernel_pytorch::ring_attention_fwd", _ring_attention_fwd,
                                             mutates_args=())
ring_attention_bwd = torch.library.custom_op("kernel_pytorch::ring_attention_bwd", _ring_attention_bwd,
                                             mutates_args=())

# Step 0 holds the rank's own block on every rank and in every layout (all queries, all keys, causal iff
# ``causal``), so a group of one computes the first block exactly as rank r of N does.
_ONE_RANK = RankGroup(None, 0, 1)


@ring_attention_fwd.register_fake
def _ring_attention_fwd_fake(q, k, v, group_name, causal, scale, kernel):
    """Step 0 of the real forward on fake tensors: the block kernel's own output layout (flash's and
    cpu_flash's (B, L, H, D) memory, math's contiguous) and LSE, as the merged result keeps them."""
    options = _RingOptions(causal, scale, kernel, _ONE_RANK)
    block_out, block_lse, _ = _forward_block(0, q, _pack(k, v), k.shape, v.shape, options)
    dtype = accumulation_dtype(q.dtype)
    return block_out.to(dtype, copy=True).to(q.dtype), block_lse.to(dtype, copy=True)


@ring_attention_bwd.register_fake
def _ring_attention_bwd_fake(grad_out, q, k, v, out, lse, group_name, causal, scale, kernel):
    # dq: a contiguous accumulator in q's dtype; dK/dV: one flat buffer in k's
    return q.new_empty(q.shape), k.new_empty(k.numel() + v.numel())


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, group_name, causal, scale, kernel = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.params = (group_name, causal, scale, kernel)
    # The LSE is returned for callers that merge it further; no gradient flows through it (none is derived).
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    # Not differentiable again: ring_attention_bwd has no autograd formula (double backward raises).
    q, k, v, out, lse = ctx.saved_tensors
    grad_q, grad_kv = ring_attention_bwd(grad_out, q, k, v, out, lse, *ctx.params)
    grad_k, grad_v = _unpack(grad_kv, k.shape, v.shape)
    return grad_q, grad_k, grad_v, None, None, None, None


ring_attention_fwd.register_autograd(_backward, setup_context=_setup_context)
