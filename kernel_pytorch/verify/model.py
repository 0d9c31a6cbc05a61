"""The optimized model against the original, end to end, on the example inputs: ``optimize``'s last step.

Before the passes, :class:`EndToEndCheck` runs the original model (outputs, and in training the gradients of
a random projection of them) and keeps a structure copy of it for a float32 referee (low precision). After
the first optimized call, :meth:`EndToEndCheck.judge` compares, fills the report's verification line, and
rolls everything back if the check fails. Buffers are restored after each run, so ``state_dict`` is left
as it was found.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from kernel_pytorch.attention.kernels.aten_sdpa import sdpa_dispatch_without_cudnn
from kernel_pytorch.report import VerificationRecord
from kernel_pytorch.verify.numerics import (NoiseAwareCheck, Run, call_arguments, compared_counts, is_low_precision,
                                            run_reference, unless_out_of_memory)
from kernel_pytorch.verify.referee import host_referee, referee_copy, referee_device

__all__ = ["EndToEndCheck", "meta_device_reason"]


class EndToEndCheck:
    """``EndToEndCheck(model, run, unverified)`` before the passes (runs the original when ``run.verify``);
    ``first_call(model)`` then ``judge(model, optimized, config)`` after them. ``unverified``: why nothing can
    be verified (the meta device), or ""."""

    def __init__(self, model: nn.Module, run: Any, unverified: str = ""):
        self.args, self.kwargs = call_arguments(run.example_inputs)
        self.no_gradients = "the model is on the meta device" if unverified else _why_no_gradients(run.training)
        self.wrt = None if self.no_gradients else _gradient_targets(model, self.args, self.kwargs)
        self.reference: Run | None = None
        self.original: nn.Module | str | None = None
        self.unverified = unverified
        if run.verify and run.example_inputs is not None and not unverified:
            self._run_original(model)

    def _reference_run(self, model: nn.Module, call: Any, skip: frozenset[str] = frozenset()) -> Run | None:
        """The original model's run (``call``: the model, or its uncompiled call once optimize has put the compiled
        one in place); ``skip``: outputs left out of the gradients' projection. None: out of memory."""
        with _preserved_buffers(model), sdpa_dispatch_without_cudnn():
            return unless_out_of_memory(lambda: run_reference(call, self.args, self.kwargs, self.wrt, skip=skip))

    def _run_original(self, model: nn.Module) -> None:
        self.reference = self._reference_run(model, model)
        if self.reference is None:
            self.unverified = ("not verified end to end (out of memory running the original model on the example "
                               "inputs; smaller example inputs verify it, verify=False skips it)")
        elif is_low_precision(self.reference):
            self.original = _structure_copy(model)  # for a float32 referee, should the check fail

    def first_call(self, model: nn.Module) -> Run:
        """The optimized model on the example inputs: its graphs are captured, rewritten and compiled now."""
        with _preserved_buffers(model):
            return run_reference(model, self.args, self.kwargs, self.wrt)

    def judge(self, model: nn.Module, optimized: Run, config: Any) -> bool:
        """Compare (``config``'s tolerances), report, roll back on failure; False when there was nothing to judge."""
        if self.reference is None:
            return False
        gradients = self.wrt is not None
        dropped = _dropped_outputs(self.reference, optimized) if config.training_logits == "drop" else frozenset()
        if dropped:
            model._kernel_pytorch.report.notes.append(
                f"end-to-end check: {', '.join(sorted(dropped))} not compared (training_logits='drop' returns none)")
        if dropped and gradients:  # the original again, its gradients without the dropped outputs' share
            self.reference = self._reference_run(model, model._call_impl, dropped)
            if self.reference is None:
                return False
        check = NoiseAwareCheck(_without(self.reference, dropped),
                                lambda: _without(_float32_run(self.original, self.args, self.kwargs, gradients,
                                                              self.reference, dropped), dropped), config)
        _judge(model, _without(optimized, dropped), check, self.no_gradients)
        return True


def _dropped_outputs(reference: Run, optimized: Run) -> frozenset[str]:
    """The outputs ``training_logits="drop"`` took away: tensors the original returns and the optimized model not."""
    return frozenset(key for key, value in reference.outputs.items()
                     if isinstance(value, torch.Tensor) and optimized.outputs.get(key) is None)


def _without(run: Run | str, outputs: frozenset[str]) -> Run | str:
    """``run`` without ``outputs`` (a referee's "why not" string as it is)."""
    if not outputs or not isinstance(run, Run):
        return run
    return Run({k: v for k, v in run.outputs.items() if k not in outputs}, run.gradients, run.where)


def meta_device_reason(model: nn.Module, example_inputs: Any) -> str:
    """Why nothing can be verified when the model or its example inputs hold meta tensors ("" otherwise)."""
    tensors = [*model.parameters(), *model.buffers(), *pytree.tree_leaves(example_inputs)]
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors):
        return "not verified: the model or its example inputs are on the meta device, which holds no values to compare"
    return ""


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


def _float32_run(original: nn.Module | str | None, args: tuple, kwargs: dict, gradients: bool,
                 reference: Run, skip: frozenset[str] = frozenset()) -> Run | str:
    """The original model, with its bfloat16/float16 parameters, buffers and inputs upcast to float32, run
    as the reference runs were (``reference``: the low-precision run, whose outputs size the memory); on the
    host when the GPU lacks the memory (:func:`~kernel_pytorch.verify.referee.referee_device`); or why not."""
    if not isinstance(original, nn.Module):
        return original or "no copy of the original model was kept"
    tensors = [*original.parameters(), *original.buffers(), *(a for a in (*args, *kwargs.values())
                                                              if isinstance(a, torch.Tensor))]
    device, why = referee_device(tensors, gradients, reference, nothing_compiles_after=True)
    if why and device is None:
        return why
    started = time.perf_counter()
    try:
        run = _float32_copy_run(original, args, kwargs, gradients, skip, device)
        if run is None and device is None:  # the estimate fell short on the GPU: the host, if it has the memory
            device, why = host_referee(tensors, gradients, reference, "out of memory on the GPU")
            if device is None:
                return why
            started = time.perf_counter()
            run = _float32_copy_run(original, args, kwargs, gradients, skip, device)
    except Exception as error:  # the referee is optional: its failure leaves the plain verdict
        return f"it failed: {type(error).__name__}: {error}"
    if run is None:
        return "out of memory"
    if device is not None:
        run.where = f"on the CPU in {time.perf_counter() - started:.0f} s ({why})"
    return run


def _float32_copy_run(original: nn.Module, args: tuple, kwargs: dict, gradients: bool, skip: frozenset[str],
                      device: torch.device | None) -> Run | None:
    """A float32 copy of ``original`` run on float32 copies of the inputs, on ``device`` (None: where they are);
    None when out of memory, the copies included."""

    def run() -> Run:
        memo = {id(t): referee_copy(t, device) for t in (*original.parameters(), *original.buffers())}
        fp32 = copy.deepcopy(original, memo=memo)
        args32 = tuple(referee_copy(a, device) for a in args)
        kwargs32 = {k: referee_copy(v, device) for k, v in kwargs.items()}
        wrt = _gradient_targets(fp32, args32, kwargs32) if gradients else None
        return run_reference(fp32, args32, kwargs32, wrt, skip=skip)

    return unless_out_of_memory(run)


def _judge(model: nn.Module, optimized: Run, check: NoiseAwareCheck, no_gradients: str) -> None:
    state = model._kernel_pytorch  # the OptimizationState optimize left
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
    elif check.referee_where:
        report.notes.append(f"end-to-end check: the float32 referee ran {check.referee_where}")
    elif comparison.ok and comparison.rule != "tolerance":
        report.notes.append(f"end-to-end check passed against a float32 run of the original: {comparison.describe()}")
    if not comparison.ok:
        state.roll_back_everything(model, f"end-to-end check failed: {comparison.describe()}")
