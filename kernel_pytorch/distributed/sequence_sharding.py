"""Lay a full sequence out across ranks and back, so user code need not know the layout.

The zigzag layout (for causal ring attention): the sequence is cut into 2N chunks and rank r holds chunks
r and 2N-1-r, concatenated. Under a causal mask each rank then does the same amount of attention work
(an early chunk with few keys before it, paired with a late chunk with many); with N contiguous shards
rank N-1 would do 2N-1 times the work of rank 0. With ``zigzag=False`` rank r holds the r-th of N
contiguous chunks, which suits non-causal attention (any layout does).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from kernel_pytorch.distributed.rank_group import RankGroup, require_same_on_all_ranks

__all__ = ["gather_sequence", "shard_sequence"]


def shard_sequence(x: Tensor, dim: int, group: dist.ProcessGroup | None = None, *, zigzag: bool = True) -> Tensor:
    """This rank's part of the full tensor ``x`` along ``dim`` (a copy; differentiable). Every rank
    passes the same ``x``; no communication.

    Example (2 ranks: rank 0 gets tokens [0, 1, 6, 7], rank 1 [2, 3, 4, 5]), position ids included::

        q_local = shard_sequence(q, dim=2)                      # (B, H, L / N, D)
        positions = shard_sequence(torch.arange(L), dim=0)      # the global positions, e.g. for RoPE
    """
    ranks = RankGroup.of(group)
    dim = _check_dim(x, dim)
    chunks = _chunk_count(ranks.size, zigzag)
    length = x.shape[dim]
    if length % chunks:
        raise ValueError(_indivisible_message(length, ranks.size, zigzag))
    size = length // chunks
    owned = (ranks.rank, chunks - 1 - ranks.rank) if zigzag else (ranks.rank,)
    return torch.cat([x.narrow(dim, index * size, size) for index in owned], dim)


def gather_sequence(x: Tensor, dim: int, group: dist.ProcessGroup | None = None, *, zigzag: bool = True) -> Tensor:
    """The full tensor from every rank's part ``x`` (as :func:`shard_sequence` laid it out), on every
    rank: one all_gather, then reordered.

    Differentiable: the gradient reaching a rank's part is the sum, over ranks, of the gradients their
    gathered copies received (so a loss computed on the gathered tensor counts once per rank)."""
    ranks = RankGroup.of(group)
    dim = _check_dim(x, dim)
    require_same_on_all_ranks(ranks, {"x": x}, {"dim": dim, "zigzag": int(zigzag)}, "gather_sequence")
    if zigzag and x.shape[dim] % 2:
        raise ValueError(f"gather_sequence(zigzag=True): each rank holds two chunks, so its length along dim {dim} "
                         f"must be even, got {x.shape[dim]}")
    if ranks.size == 1:
        return x
    parts = _AllGather.apply(x, ranks)
    if not zigzag:
        return torch.cat(parts, dim)
    firsts, seconds = zip(*(part.chunk(2, dim) for part in parts))
    return torch.cat([*firsts, *reversed(seconds)], dim)  # chunks 0..N-1, then N..2N-1


class _AllGather(torch.autograd.Function):
    """Every rank's ``x`` (equal shapes), in rank order. The list form of all_gather: the one that every
    backend (gloo included) and torch 2.11 to 2.13 take without a deprecation."""

    @staticmethod
    def forward(ctx, x: Tensor, ranks: RankGroup) -> tuple[Tensor, ...]:
        ctx.ranks = ranks
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(ranks.size)]
        dist.all_gather(parts, x.contiguous(), group=ranks.group)
        return tuple(parts)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_parts: Tensor):
        # Sum every rank's gradients and keep this rank's part: an all_reduce rather than a reduce_scatter,
        # which gloo lacks; gathering is for results and losses on them, not a per-layer hot path.
        grads = torch.stack(grad_parts)  # unused parts come as zeros (autograd materializes them)
        dist.all_reduce(grads, group=ctx.ranks.group)
        return grads[ctx.ranks.rank], None


def _check_dim(x: Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _chunk_count(world_size: int, zigzag: bool) -> int:
    return 2 * world_size if zigzag else world_size


def _indivisible_message(length: int, world_size: int, zigzag: bool) -> str:
    if zigzag:
        return (f"sequence length {length} is not divisible by 2 x world size = {2 * world_size} "
                "(the zigzag layout gives each rank 2 of 2N equal chunks)")
    return f"sequence length {length} is not divisible by the world size {world_size}"
