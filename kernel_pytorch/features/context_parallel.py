"""Context parallelism as a feature: ``optimize(model, context_parallel=group)``
(``kernel_pytorch.distributed.context_parallel`` holds the boundary, the ``context_parallel`` pass the graph
side)."""

from __future__ import annotations

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

    def install(self, model: nn.Module, run: OptimizeRun) -> None:
        context_parallel.install(model, run.config, run.report)  # outermost: shard in, gather out
