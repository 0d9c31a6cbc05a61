"""Memory wrappers that go on top of the rewritten model: activation checkpointing of repeated blocks
(``apply_checkpointing``), offloading of saved activations to CPU memory (``offload_activations``,
``OffloadActivations``, ``install_activation_offload``) and an AdamW whose fp32 state lives in pinned CPU
memory (``OffloadedOptimizer``). ``kernel_pytorch.optimize`` applies them from its config
(``memory=MemoryConfig(checkpointing, budget_gb, offload_activations, offload_optimizer)``), and
``make_optimizer(model, lr=...)`` builds the optimizer that config chose.

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
    activation_offload_stats,
    install_activation_offload,
    offload_activations,
    remove_activation_offload,
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
from kernel_pytorch.memory.offloaded_optimizer import (
    OffloadedOptimizer,
    pinned_bytes_for,
)
from kernel_pytorch.memory.options import make_optimizer

__all__ = [
    "DEFAULT_MIN_BYTES",
    "MAX_PENDING_COPIES",
    "POLICIES",
    "CheckpointPlan",
    "OffloadActivations",
    "OffloadStats",
    "OffloadedOptimizer",
    "activation_offload_stats",
    "apply_checkpointing",
    "find_repeated_blocks",
    "install_activation_offload",
    "make_optimizer",
    "offload_activations",
    "pinned_bytes_for",
    "remove_activation_offload",
    "remove_checkpointing",
    "saved_activation_bytes",
    "selective_checkpoint_policy",
]
