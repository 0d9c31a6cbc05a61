"""FP8 linear layers as a feature: ``optimize(model, fp8=True | "auto", ...)`` (``kernel_pytorch.float8_conversion``
holds the rules, ``passes/fp8_linear.py`` the graph rewrite)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch.fx
import torch.nn as nn

from kernel_pytorch.float8_conversion import PASS_NAME, cuda_graphs_note, judging_config, linear_targets
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.features.base import Feature, OptimizeRun, register_feature

__all__ = ["Float8Feature"]


@register_feature
class Float8Feature(Feature):
    name = "fp8"

    @classmethod
    def enabled(cls, config: OptimizeConfig) -> bool:
        return config.fp8.mode is not False

    def pass_inputs(self, model: nn.Module, run: OptimizeRun, passes: Sequence[str]) -> dict[str, Any]:
        """The candidate linears and their shapes, read on the example inputs before capture (where the fp8
        pass runs at all: not on hardware without FP8)."""
        if PASS_NAME not in passes:
            return {}
        return {"fp8_targets": linear_targets(model, run.config, run.example_inputs)}

    def judging_config(self, config: OptimizeConfig, rewritten: Iterable[str]) -> OptimizeConfig:
        return judging_config(config, rewritten)

    def compile_note(self, gm: torch.fx.GraphModule, training: bool, without_graphs: bool) -> str | None:
        return cuda_graphs_note(gm, training, without_graphs)
