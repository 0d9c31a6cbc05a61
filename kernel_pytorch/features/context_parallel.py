"""Context parallelism as a feature: ``optimize(model, context_parallel=group)``
(``kernel_pytorch.distributed.context_parallel`` holds the boundary, the ``context_parallel`` pass the graph
side)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.distributed import context_parallel
from kernel_pytorch.features.base import Feature, OptimizeRun, register_feature

__all__ = ["ContextParallelFeature"]


@register_feature
class ContextParallelFeature(Feature):
    name = "context_parallel"

    @classmethod
    def enabled(cls, config: OptimizeConfig) -> bool:
        return config.context_parallel is not None

    def backend_config(self, config: OptimizeConfig) -> OptimizeConfig:
        return context_parallel.backend_config(config)

    def pass_inputs(self, model: nn.Module, run: OptimizeRun, passes: Sequence[str]) -> dict[str, Any]:
        """Refuse a backend that would not run the passes sharding needs (TPU's has no rope pass): without them
        the model would run on its shard as if it were the whole sequence."""
        context_parallel.require_passes(passes)
        return {}

    def install(self, model: nn.Module, run: OptimizeRun) -> None:
        context_parallel.install(model, run.config, run.report)  # outermost: shard in, gather out
