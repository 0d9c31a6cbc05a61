"""Sequence (context) parallelism over ``torch.distributed``: ring attention and the sequence layout.

Each rank holds a shard of the sequence; :func:`ring_attention` computes exact attention over the whole
sequence by passing K/V blocks around the ranks; :func:`shard_sequence` and :func:`gather_sequence` lay a
full tensor out in the load-balanced (zigzag) order that causal ring attention expects, and back;
``optimize(model, context_parallel=group)`` (:mod:`.context_parallel`) applies both to a whole model.
"""

from kernel_pytorch.distributed.context_parallel import ContextParallelError
from kernel_pytorch.distributed.ring_attention import (
    RING_ATTENTION_KERNELS,
    ring_attention,
)
from kernel_pytorch.distributed.sequence_sharding import gather_sequence, shard_sequence

__all__ = ["ContextParallelError", "RING_ATTENTION_KERNELS", "gather_sequence", "ring_attention", "shard_sequence"]
