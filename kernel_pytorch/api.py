"""``optimize(model)``: detect -> backend -> prepare_model -> verify -> the optimized module."""

from __future__ import annotations

import difflib
import time
from typing import Any

import torch.nn as nn

from kernel_pytorch.backends import OptimizationState, get_backend
from kernel_pytorch.config import DEPRECATED_FLAT_OPTIONS, OptimizeConfig
from kernel_pytorch.features import OptimizeRun, enabled_features
from kernel_pytorch.hardware import detect_hardware
from kernel_pytorch.report import OptimizationReport
from kernel_pytorch.verify.model import EndToEndCheck, meta_device_reason

__all__ = ["optimize", "report_of"]


def optimize(
    model: nn.Module,
    config: OptimizeConfig | None = None,
    *,
    example_inputs: Any = None,
    **overrides: Any,
) -> nn.Module:
    """Optimize ``model`` for the hardware found, in place, and return it.

    The model keeps its parameters (no copies) and ``state_dict`` keys; its forward is compiled through
    TorchDynamo with kernel_pytorch's passes. ``example_inputs`` (a tensor, a tuple of positional
    arguments, or a dict of keyword arguments) makes capture, the passes and verification run now, so
    that :func:`report_of` is complete on return; without it they run at the first call.
    ``overrides`` are :class:`OptimizeConfig` fields.

    Example::

        model = kernel_pytorch.optimize(model, example_inputs=(tokens,), compile="max-autotune")
        kernel_pytorch.report_of(model).print()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"optimize() takes a torch.nn.Module, got {type(model).__name__}")
    config = _config_with(config, overrides)
    state = getattr(model, "_kernel_pytorch", None)
    if isinstance(state, OptimizationState) and (state.still_installed() or not state.unoptimized_because):
        state.report.notes.append("optimize() called again on an optimized model: left as it was")
        return model
    meta = meta_device_reason(model, example_inputs)
    if meta and config.verify is not False:
        config = config.model_copy(update={"verify": False})
    features = enabled_features(config)
    for feature in features:
        feature.check(config)  # before anything is changed
    backend = get_backend(detect_hardware(config.device))
    backend_config = config
    for feature in features:
        backend_config = feature.backend_config(backend_config)
    run = OptimizeRun.decide(model, config, example_inputs, backend_config)
    for feature in features:
        feature.prepare(model, run)
    end_to_end = EndToEndCheck(model, run, meta)  # runs the original, before the passes change it
    model, run.report = backend.prepare_model(model, backend_config, example_inputs, run=run, features=features)
    if end_to_end.unverified:
        run.report.notes.append(end_to_end.unverified)
    for feature in features:
        feature.install(model, run)
    if example_inputs is not None:
        started = time.perf_counter()
        optimized = end_to_end.first_call(model)
        run.report.add_time("first call (capture, passes, compile)", time.perf_counter() - started)
        judged_by = model._kernel_pytorch.graph_optimizer.judging_config(run.report.rewrites)
        if end_to_end.judge(model, optimized, judged_by):
            for feature in features:
                feature.after_check(model, run)
    return model


def report_of(model: nn.Module) -> OptimizationReport:
    """The :class:`OptimizationReport` of a model returned by :func:`optimize` (updated as graphs are captured)."""
    state = getattr(model, "_kernel_pytorch", None)
    if not isinstance(state, OptimizationState):
        raise ValueError(f"{type(model).__name__} was not optimized by kernel_pytorch.optimize()")
    state.still_installed()
    return state.report


def _config_with(config: OptimizeConfig | None, overrides: dict[str, Any]) -> OptimizeConfig:
    if config is not None and not isinstance(config, OptimizeConfig):
        raise TypeError(f"config must be an OptimizeConfig, got {type(config).__name__}")
    fields = OptimizeConfig.model_fields
    for name in overrides:
        if name not in fields and name not in DEPRECATED_FLAT_OPTIONS:  # those warn, in OptimizeConfig
            close = difflib.get_close_matches(name, [*fields, "example_inputs"], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise TypeError(f"optimize() got an unknown option '{name}'{hint} (options: {', '.join(fields)})")
    base = config.model_dump() if config is not None else {}
    return OptimizeConfig.model_validate({**base, **overrides}) if overrides or config is None else config
