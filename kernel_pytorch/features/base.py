"""``Feature``: the one way an optional capability plugs into ``optimize`` (FP8, the memory wrappers, context
parallelism, sparse attention), in the shape of lightning-thunder's ``Transform`` hooks.

``optimize`` builds one object per enabled feature (:func:`enabled_features`, registration order) and calls
each hook at its point of the pipeline; nothing else in the pipeline names a feature:

1. ``check(config)``: refuse, before anything is changed, what this machine or config cannot do;
2. ``backend_config(config)``: the config the backend and its passes get (context parallelism turns
   per-graph verification off);
3. ``prepare(model, run)``: change the model before capture (checkpointing wraps its blocks);
4. ``pass_inputs(model, run, passes)``: what the feature's passes read from ``PassContext`` (FP8's targets; the
   keys are ``PassContext`` fields), given the passes the backend runs (context parallelism refuses without its own);
5. ``judging_config(config, rewritten)`` and ``compile_note(gm, training, without_graphs)``: the tolerances a
   graph or the model is judged by once the feature's passes rewrote it, and a report note at compile time;
6. ``install(model, run)``: wrappers around the compiled call (``OptimizationState.add_around``, so copies of
   the model get them too) and report lines;
7. ``after_check(model, run)``: the report after the end-to-end check (a rollback removed the wrappers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch.fx
import torch.nn as nn

if TYPE_CHECKING:
    from kernel_pytorch.config import OptimizeConfig
    from kernel_pytorch.report import OptimizationReport

__all__ = ["Feature", "OptimizeRun", "enabled_features", "register_feature", "registered_features"]

_FEATURES: list[type[Feature]] = []


@dataclass
class OptimizeRun:
    """What one ``optimize`` call decided, once, and shares with the backend and the features."""

    config: OptimizeConfig
    example_inputs: Any
    training: bool
    verify: bool  # the model against the original, end to end
    verify_graphs: bool  # each rewritten graph against the captured one
    report: OptimizationReport | None = None  # set once the backend made it

    @classmethod
    def decide(cls, model: nn.Module, config: OptimizeConfig, example_inputs: Any,
               backend_config: OptimizeConfig) -> OptimizeRun:
        """Training follows ``config.mode`` ('auto': the model's mode); verification is on when asked, or
        'auto' with example inputs to verify on; per graph, also as the features' ``backend_config`` allows."""
        training = config.mode == "training" or (config.mode == "auto" and model.training)
        verify = config.verify is True or (config.verify == "auto" and example_inputs is not None)
        return cls(config, example_inputs, training, verify, verify and backend_config.verify is not False)


class Feature:
    """Base of the features: every hook does nothing unless a feature overrides it (module docstring)."""

    name: ClassVar[str]

    @classmethod
    def enabled(cls, config: OptimizeConfig) -> bool:
        raise NotImplementedError

    def check(self, config: OptimizeConfig) -> None:
        pass

    def prepare(self, model: nn.Module, run: OptimizeRun) -> None:
        pass

    def backend_config(self, config: OptimizeConfig) -> OptimizeConfig:
        return config

    def pass_inputs(self, model: nn.Module, run: OptimizeRun, passes: Sequence[str]) -> dict[str, Any]:
        return {}

    def judging_config(self, config: OptimizeConfig, rewritten: Iterable[str]) -> OptimizeConfig:
        return config

    def compile_note(self, gm: torch.fx.GraphModule, training: bool, without_graphs: bool) -> str | None:
        return None

    def install(self, model: nn.Module, run: OptimizeRun) -> None:
        pass

    def after_check(self, model: nn.Module, run: OptimizeRun) -> None:
        pass


def register_feature(feature: type[Feature]) -> type[Feature]:
    """Class decorator: ``optimize`` runs the feature's hooks when ``feature.enabled(config)``."""
    if any(known.name == feature.name for known in _FEATURES):
        raise ValueError(f"a feature named {feature.name!r} is already registered")
    _FEATURES.append(feature)
    return feature


def registered_features() -> tuple[type[Feature], ...]:
    """The features in registration order (``kernel_pytorch.features`` registers the built-in ones on import)."""
    return tuple(_FEATURES)


def enabled_features(config: OptimizeConfig) -> list[Feature]:
    """One object per feature ``config`` enables, in registration order (the order wrappers nest in)."""
    return [feature() for feature in registered_features() if feature.enabled(config)]
