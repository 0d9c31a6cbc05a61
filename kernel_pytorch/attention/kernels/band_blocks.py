"""The ``BlockMask`` of a band pattern (causal, sliding window) from tile arithmetic.

``create_block_mask`` evaluates the ``mask_mod`` at every (query, key) position, Lq x Lk of them, and reduces
that per 128 x 128 tile. Traced into a compiled graph at long lengths, that reduction's cold compile can take
minutes (pytorch/pytorch#182060, "several minutes or appear to hang for a simple causal mask at some sequence
lengths"), and every call evaluates the Lq x Lk positions again.

A band ``lo <= q - k <= hi`` needs no evaluation: a tile's smallest and largest ``q - k`` are its corners, so
whether it holds some allowed position, and whether all of its positions are allowed, follow from a few
integer operations per tile, (Lq / 128) x (Lk / 128) of them. The result is the one ``create_block_mask``
gives (the same partial and full tiles, ordered the same way; tiles cut short by the lengths are partial, as
there), which the CPU tests check tile for tile.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

__all__ = ["band_block_mask", "FLEX_BLOCK_SIZE"]

# FlexAttention's default BlockMask tile (create_block_mask's BLOCK_SIZE): the granularity at which it
# skips work, so the block density the pass reports is measured on tiles of this size.
FLEX_BLOCK_SIZE = 128


def band_block_mask(lo: Optional[int], hi: Optional[int], lq, lk, device, mask_mod: Callable[..., Tensor],
                    block: int = FLEX_BLOCK_SIZE) -> BlockMask:
    """The BlockMask of ``lo <= q_idx - kv_idx <= hi`` (None: unbounded) over ``lq`` x ``lk`` scores, for every
    batch row and head; ``mask_mod`` is the band's own, applied inside the partial tiles. ``lq`` and ``lk``
    may be symbolic (traced under torch.compile)."""
    q_first = torch.arange(0, lq, block, device=device)
    k_first = torch.arange(0, lk, block, device=device)
    q_last = (q_first + block).clamp(max=lq) - 1
    k_last = (k_first + block).clamp(max=lk) - 1
    nearest = q_first[:, None] - k_last[None, :]  # the tile's smallest q - k (its top-right corner)
    farthest = q_last[:, None] - k_first[None, :]  # its largest (bottom-left)
    some = torch.ones_like(nearest, dtype=torch.bool)
    every = ((q_last - q_first + 1) == block)[:, None] & ((k_last - k_first + 1) == block)[None, :]
    if lo is not None:
        some, every = some & (farthest >= lo), every & (nearest >= lo)
    if hi is not None:
        some, every = some & (nearest <= hi), every & (farthest <= hi)
    partial_counts, partial_order = _ordered(some & ~every)
    full_counts, full_order = _ordered(every)
    return BlockMask.from_kv_blocks(partial_counts, partial_order, full_counts, full_order,
                                    BLOCK_SIZE=(block, block), mask_mod=mask_mod, seq_lengths=(lq, lk))


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """Per query tile, how many key tiles are set and their columns first (a stable order), with batch and
    head dimensions of 1: the layout ``create_block_mask`` gives."""
    dense = tiles.to(torch.int32)[None, None]
    order = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1).to(torch.int32), order.to(torch.int32)
