"""``shape_buckets.split_batch``: a batch between two batch buckets served as calls of smaller buckets, its rows
split among them and their outputs joined, where the buckets' measured times say that beats padding.

Padding a batch of 17 up to a bucket of 24 computes 7 rows for nothing; 16 + 1 computes none, but makes two calls, and
a call of one row uses a GPU far below its throughput. Which is faster depends on the kernels and the length, so it is
measured: the warm-up times every bucket's call, and for each length bucket the fastest way to serve each batch size
is found from those times once, after the warm-up (:func:`fastest_splits`). Splitting is sound where padding the batch
is: the padding check refuses batch padding where an op mixes rows (a reduction over the batch, BatchNorm in training)
and compares padded outputs with unpadded ones. It also needs every output tensor to have a batch dim to join along (a
loss averaged over the batch cannot be split).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kernel_pytorch.features.shape_buckets.ladder import bucket_for
from kernel_pytorch.features.shape_buckets.padding import (BATCH, ArgumentDims, NamedCall, OutputDims,
                                                           map_tensor_leaves)

__all__ = ["Chunk", "fastest_splits", "rows_of", "join_outputs", "splittable"]

# One call of a split: (the rows it serves, the batch bucket it runs at).
Chunk = tuple[int, int]


def fastest_splits(buckets: tuple[int, ...], seconds: Mapping[int, float]) -> dict[int, tuple[Chunk, ...]]:
    """For every batch size up to the largest bucket, the calls that serve it fastest by ``seconds`` per batch
    bucket (one length): padded up to its bucket, or a bucket below it in full plus the fastest way to serve the
    rest (each smaller size's answer found before the sizes that build on it)."""
    best: dict[int, tuple[float, tuple[Chunk, ...]]] = {}
    for batch in range(1, buckets[-1] + 1):
        padded = bucket_for(batch, buckets)
        choice = (seconds[padded], ((batch, padded),))
        for bucket in reversed([b for b in buckets if b < batch]):  # the largest first: of equal times, fewer calls
            rest_seconds, rest = best[batch - bucket]
            if seconds[bucket] + rest_seconds < choice[0]:
                choice = (seconds[bucket] + rest_seconds, ((bucket, bucket), *rest))
        best[batch] = choice
    return {batch: chunks for batch, (_, chunks) in best.items()}


def rows_of(call: NamedCall, dims: ArgumentDims, start: int, stop: int) -> NamedCall:
    """``call`` with only rows ``start:stop`` of each argument whose dim 0 is the batch."""
    return call.replaced(lambda name, value: value[start:stop]
                         if isinstance(value, torch.Tensor) and dims.get(name, (False,))[0] else value)


def splittable(known: OutputDims) -> str:
    """Why the outputs cannot be joined along their batch dims ('' when they can)."""
    without = [path or "the output" for path, dims in known.items() if not any(kind == BATCH for _, kind in dims)]
    return f"{', '.join(without)} has no batch dim to join the calls' rows along" if without else ""


def join_outputs(outs: list[Any], known: OutputDims) -> Any:
    """The outputs of consecutive row ranges joined into one: each tensor leaf concatenated along its batch dim."""
    if len(outs) == 1:
        return outs[0]
    later: list[dict[str, torch.Tensor]] = []
    for out in outs[1:]:
        leaves: dict[str, torch.Tensor] = {}
        map_tensor_leaves(out, "", lambda path, value: leaves.setdefault(path, value))
        later.append(leaves)

    def join(path: str, value: torch.Tensor) -> torch.Tensor:
        dim = next(d for d, kind in known.get(path, ((0, BATCH),)) if kind == BATCH)
        return torch.cat([value, *(leaves[path] for leaves in later)], dim=dim)

    return map_tensor_leaves(outs[0], "", join)
