"""Memory wrappers that go on top of the rewritten model: activation checkpointing of repeated blocks
(``apply_checkpointing``), offloading of saved activations to CPU memory (``offload_activations``,
``OffloadActivations``) and an AdamW whose fp32 state lives in pinned CPU memory (``OffloadedOptimizer``).

Example::

    from kernel_pytorch.memory import apply_checkpointing, OffloadActivations

    plan = apply_checkpointing(model, policy="selective", budget_gb=20, example_inputs=(tokens,))
    print(plan.describe())
"""

from __future__ import annotations

from kernel_pytorch.memory.activation_offload import (
    DEFAULT_MIN_BYTES,
    MAX_PENDING_COPIES,
    OffloadActivations,
    OffloadStats,
    offload_activations,
)
from kernel_pytorch.memory.checkpointing import (
    POLICIES,
    CheckpointPlan,
    apply_checkpointing,
    find_repeated_blocks,
    remove_checkpointing,
    saved_activation_bytes,
    selective_checkpoint_policy,
)
from kernel_pytorch.memory.offloaded_optimizer import OffloadedOptimizer

__all__ = [
    "apply_checkpointing",
    "remove_checkpointing",
    "CheckpointPlan",
    "POLICIES",
    "find_repeated_blocks",
    "saved_activation_bytes",
    "selective_checkpoint_policy",
    "offload_activations",
    "OffloadActivations",
    "OffloadStats",
    "DEFAULT_MIN_BYTES",
    "MAX_PENDING_COPIES",
    "OffloadedOptimizer",
]
