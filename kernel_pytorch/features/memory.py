"""The memory wrappers as a feature: ``optimize(model, memory={"checkpointing": ..., "budget_gb": ...,
"offload_activations": ..., "offload_optimizer": ...})`` (``kernel_pytorch.memory.options`` applies them)."""

from __future__ import annotations

import torch.nn as nn

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.features.base import Feature, OptimizeRun, register_feature
from kernel_pytorch.memory import options

__all__ = ["MemoryFeature"]


@register_feature
class MemoryFeature(Feature):
    name = "memory"

    @classmethod
    def enabled(cls, config: OptimizeConfig) -> bool:
        return (config.memory.checkpointing != "off" or config.memory.offload_activations is not False
                or config.memory.offload_optimizer is not False)

    def check(self, config: OptimizeConfig) -> None:
        options.check_memory_options(config)

    def prepare(self, model: nn.Module, run: OptimizeRun) -> None:
        """Checkpoint the repeated blocks before capture, so that Dynamo records each as a checkpointed region."""
        self.plan = options.checkpoint_for_config(model, run.config, run.example_inputs)

    def install(self, model: nn.Module, run: OptimizeRun) -> None:
        options.install_memory_options(model, run.config, run.report, self.plan, run.training)

    def after_check(self, model: nn.Module, run: OptimizeRun) -> None:
        options.sync_memory_report(model, run.report)
