"""``optimize(model)``: detect -> backend -> prepare_model -> verify -> the optimized module."""

from __future__ import annotations

import copy
import difflib
import time
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from kernel_pytorch.backends import OptimizationState, get_backend
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.features import OptimizeRun, enabled_features
from kernel_pytorch.hardware import detect_hardware
from kernel_pytorch.report import OptimizationReport, VerificationRecord
from kernel_pytorch.verify import (LOW_PRECISION, NoiseAwareCheck, Run, call_arguments, compared_counts, float32_fits,
                                   is_low_precision, run_reference, to_float32)

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
    meta = _on_meta_device(model, example_inputs)
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
    args, kwargs = call_arguments(example_inputs)
    no_gradients = "the model is on the meta device" if meta else _why_no_gradients(run.training)
    wrt = None if no_gradients else _gradient_targets(model, args, kwargs)
    reference, original, unverified = None, None, meta
    if run.verify and example_inputs is not None:
        try:
            with _preserved_buffers(model):
                reference = run_reference(model, args, kwargs, wrt)
        except torch.cuda.OutOfMemoryError:  # as the per-graph check does (capture.py): go on, unverified
            torch.cuda.empty_cache()
            unverified = ("not verified end to end (out of memory running the original model on the example "
                          "inputs; smaller example inputs verify it, verify=False skips it)")
        if reference is not None and is_low_precision(reference):
            original = _structure_copy(model)  # for a float32 referee, should the end-to-end check fail
    model, run.report = backend.prepare_model(model, backend_config, example_inputs, run=run, features=features)
    if unverified:
        run.report.notes.append(unverified)
    for feature in features:
        feature.install(model, run)
    if example_inputs is not None:
        started = time.perf_counter()
        with _preserved_buffers(model):
            optimized = run_reference(model, args, kwargs, wrt)
        run.report.add_time("first call (capture, passes, compile)", time.perf_counter() - started)
        if reference is not None:
            check = NoiseAwareCheck(reference, lambda: _float32_run(original, args, kwargs, wrt is not None),
                                    model._kernel_pytorch.graph_optimizer.judging_config(run.report.rewrites))
            _check_end_to_end(model, optimized, check, no_gradients)
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
        if name not in fields:
            close = difflib.get_close_matches(name, [*fields, "example_inputs"], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise TypeError(f"optimize() got an unknown option '{name}'{hint} (options: {', '.join(fields)})")
    base = config.model_dump() if config is not None else {}
    return OptimizeConfig.model_validate({**base, **overrides}) if overrides or config is None else config


def _why_no_gradients(training: bool) -> str:
    """Why the checks compare outputs only ("" when they compare gradients too)."""
    if not training:
        return "the model was optimized for inference"
    if torch.is_inference_mode_enabled():
        return "optimize ran under torch.inference_mode(), where no gradients exist"
    return ""


def _gradient_targets(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    targets = {f"parameter {n}": p for n, p in model.named_parameters() if p.requires_grad}
    for index, value in enumerate((*args, *kwargs.values())):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            targets[f"input {index}"] = value
    return targets


def _on_meta_device(model: nn.Module, example_inputs: Any) -> str:
    """Why nothing can be verified when the model or its example inputs hold meta tensors ("" otherwise)."""
    tensors = [*model.parameters(), *model.buffers(), *pytree.tree_leaves(example_inputs)]
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        return "not verified: the model or its example inputs are on the meta device, which holds no values to compare"
    return ""


class _preserved_buffers:
    """Restores buffers after a verification run, so that ``optimize`` leaves ``state_dict`` as it found
    it (a training-mode BatchNorm would otherwise update its running statistics)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __enter__(self) -> None:
        self.saved = {name: b.detach().clone() for name, b in self.model.named_buffers()}

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                if name in self.saved:
                    buffer.copy_(self.saved[name])


def _structure_copy(model: nn.Module) -> nn.Module | str:
    """A copy of the module tree sharing every parameter and buffer (no tensor memory): what the model was
    before the passes swapped modules, kept in case a float32 referee is needed; or why it could not be
    copied (a module holding something deepcopy refuses), which the report's note then gives."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    try:
        return copy.deepcopy(model, memo=shared)
    except Exception as error:  # the referee is optional: the reason reaches the report if it is needed
        return f"the model could not be copied: {type(error).__name__}: {error}"


def _float32_run(original: nn.Module | str | None, args: tuple, kwargs: dict, gradients: bool) -> Run | str:
    """The original model, with its bfloat16/float16 parameters, buffers and inputs upcast to float32, run
    as the reference runs were; or why not."""
    if not isinstance(original, nn.Module):
        return original or "no copy of the original model was kept"
    tensors = [*original.parameters(), *original.buffers(), *(a for a in (*args, *kwargs.values())
                                                              if isinstance(a, torch.Tensor))]
    reason = float32_fits(tensors, gradients)
    if reason:
        return reason
    memo: dict[int, Any] = {}
    for tensor in (*original.parameters(), *original.buffers()):
        if tensor.dtype in LOW_PRECISION:
            upcast = tensor.detach().float()
            memo[id(tensor)] = nn.Parameter(upcast, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else upcast
        else:
            memo[id(tensor)] = tensor
    try:
        fp32 = copy.deepcopy(original, memo=memo)
        args32 = tuple(to_float32(a) for a in args)
        kwargs32 = {k: to_float32(v) for k, v in kwargs.items()}
        wrt = _gradient_targets(fp32, args32, kwargs32) if gradients else None
        return run_reference(fp32, args32, kwargs32, wrt)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "out of memory"
    except Exception as error:  # the referee is optional: its failure leaves the plain verdict
        return f"it failed: {type(error).__name__}: {error}"


def _check_end_to_end(model: nn.Module, optimized: Run, check: NoiseAwareCheck, no_gradients: str) -> None:
    state: OptimizationState = model._kernel_pytorch
    report = state.report
    if state.graph_optimizer.draws_random_numbers:
        report.notes.append("end-to-end check skipped: the model draws random numbers (e.g. dropout in "
                            "training), which the compiler samples differently; each graph was verified instead")
        return
    comparison = check(optimized)
    outputs, gradients, identical = compared_counts(optimized, check.reference)
    if not gradients and not no_gradients:
        no_gradients = "no output depends on a parameter or input that requires grad"
    report.verification = VerificationRecord(passed=comparison.ok, worst=comparison.worst, error=comparison.error,
                                             tolerance=comparison.tolerance, compared_gradients=gradients > 0,
                                             outputs_compared=outputs, gradients_compared=gradients,
                                             identical=identical, not_compared=no_gradients, rule=comparison.rule,
                                             detail=comparison.describe())
    if check.unavailable:
        report.notes.append(f"end-to-end check judged by tolerance only, no float32 referee ({check.unavailable})")
    elif comparison.ok and comparison.rule != "tolerance":
        report.notes.append(f"end-to-end check passed against a float32 run of the original: {comparison.describe()}")
    if not comparison.ok:
        state.roll_back_everything(model, f"end-to-end check failed: {comparison.describe()}")
