"""The bucket ladders: which padded batch sizes and sequence lengths calls are served at, independent of the config.

A call of batch ``b`` and length ``l`` runs at the smallest batch bucket ``>= b`` and the smallest length bucket
``>= l``; each (batch, length) bucket is one shape the compiled graphs run at (and, with CUDA graphs, one captured
graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Ladder", "auto_batch_buckets", "auto_length_buckets", "bucket_for"]

# Below this length, steps of 16 tokens: per-call overheads dominate short calls, and 16 is the tile of the
# attention and matmul kernels, so finer steps would save little work.
_FINE_STEP = 16
_FINE_UNTIL = 128


def auto_batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below ``max_batch``, then ``max_batch``: at most half of a padded batch is padding."""
    buckets = []
    size = 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return (*buckets, max_batch)


def auto_length_buckets(max_length: int) -> tuple[int, ...]:
    """Multiples of 16 up to 128, then steps of alternately x1.5 and x4/3 (128, 192, 256, 384, 512, 768, ...: powers
    of two and their halfway points), then ``max_length`` itself: at most a third of a padded length is padding."""
    buckets = list(range(_FINE_STEP, min(_FINE_UNTIL, max_length) + 1, _FINE_STEP))
    size = _FINE_UNTIL
    while True:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3  # a power of two: its 1.5x; else the next one
        if size > max_length:
            break
        buckets.append(size)
    if not buckets or buckets[-1] < max_length:
        buckets.append(max_length)
    return tuple(buckets)


def bucket_for(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``size``; None above the largest."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    return None


@dataclass(frozen=True)
class Ladder:
    """The buckets of one model: ``batch`` and ``length`` ascending, or None where that dim is not bucketed;
    ``grow``: a size above the largest bucket becomes a bucket of its own (else it is an error)."""

    batch: tuple[int, ...] | None
    length: tuple[int, ...] | None
    grow: bool = False

    def without(self, batch: bool = False, length: bool = False) -> Ladder:
        """This ladder with the batch and / or the length dim no longer bucketed."""
        return Ladder(None if batch else self.batch, None if length else self.length, self.grow)

    @property
    def size(self) -> int:
        """The number of (batch, length) buckets."""
        return len(self.batch or (None,)) * len(self.length or (None,))

    def describe(self) -> str:
        dims = [f"{name} {_compact(buckets)}" for name, buckets in (("batch", self.batch), ("length", self.length))
                if buckets]
        return " x ".join(dims) + f" ({self.size} bucket{'s' if self.size != 1 else ''})"


def _compact(buckets: Sequence[int]) -> str:
    return ", ".join(map(str, buckets)) if len(buckets) <= 8 else \
        f"{', '.join(map(str, buckets[:4]))}, ..., {', '.join(map(str, buckets[-2:]))}"
