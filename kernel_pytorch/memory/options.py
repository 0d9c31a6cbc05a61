"""``OptimizeConfig``'s memory options as ``kernel_pytorch.optimize`` applies them, and ``make_optimizer``.

``optimize(model, memory=MemoryConfig(checkpointing=..., budget_gb=..., offload_activations=...,
offload_optimizer=...))``:

* **Before capture**: ``offload_optimizer=True`` (the ``memory`` section's fields, named alone here) without a CUDA GPU is refused (``HardwareUnavailableError``)
  before anything is changed; the repeated blocks are checkpointed (``apply_checkpointing``), so that
  TorchDynamo records each as a checkpointed region whose body the passes rewrite too.
* **After capture**: activation offload is installed in place around the compiled call
  (``install_activation_offload``): the hooks stay outside the compiled code, so the graph and its
  rewrites are the same with or without them, and every tensor the compiled graph saves for backward
  goes through them. ``offload_activations="auto"`` measures the saved activations at the first training
  call (during ``optimize`` when ``example_inputs`` are given) and offloads from the next call on if they
  exceed ``budget_gb`` (or, without a budget, if the GPU memory left after that forward is less
  than the gradients, AdamW's states and a 10% margin still need).
* **The report** (``report_of(model).memory``) gets one ``MemoryRecord`` per wrapper: checkpointing's
  saved-activation bytes before and after (measured on the example inputs), the bytes activation
  offload moves to the host per forward (at the first training call), and the optimizer-state bytes
  that go to the host with the GPU bytes this saves against ``torch.optim.AdamW``.

The optimizer: ``optimize`` returns the model (one return value, in place, torchao-style), and an
optimizer needs what it does not know (learning rate, parameter groups), so it does not build one.
``offload_optimizer`` records the intent on the model and ``make_optimizer(model, lr=...)`` reads it:
an ``OffloadedOptimizer`` when offload was asked for, else ``torch.optim.AdamW`` (fused on CUDA). A
training script thus switches between the two by config alone, nothing is pinned until an optimizer is
actually built, and the report says beforehand how much host memory it will take. For every knob
(a numeric ``gpu_fraction``, ``max_grad_norm``, ``num_threads``) build ``OffloadedOptimizer`` directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.errors import HardwareUnavailableError
from kernel_pytorch.memory.activation_offload import (
    DEFAULT_MIN_BYTES,
    _eager_saved_tensors_hooks,
    _Offloader,
    _state_storages,
    install_activation_offload,
)
from kernel_pytorch.memory.checkpointing import (
    CheckpointPlan,
    _SavedBytesMeter,
    apply_checkpointing,
)
from kernel_pytorch.memory.checkpointing import _state_storages as _state_storage_keys
from kernel_pytorch.memory.offloaded_optimizer import (
    OffloadedOptimizer,
    pinned_bytes_for,
)
from kernel_pytorch.report import MemoryRecord, OptimizationReport

__all__ = [
    "check_memory_options",
    "checkpoint_for_config",
    "install_memory_options",
    "make_optimizer",
    "sync_memory_report",
]

# Where optimize's choices are kept on the model (a plain attribute: not a submodule, not in state_dict).
_INTENT_ATTR = "_kernel_pytorch_memory"

# Whose saved tensors activation offload moves: None means every CUDA device. Tests set "cpu" to run
# the copy path without a GPU.
_OFFLOAD_SOURCE: str | None = None
# Smallest saved tensor offloaded: activation_offload's default (1 MiB); tests lower it for tiny models.
_OFFLOAD_MIN_BYTES = DEFAULT_MIN_BYTES

# offload_activations="auto" without a budget keeps 10% of the GPU free, as OffloadedOptimizer's
# gpu_fraction="auto" does: later steps can peak higher (fragmentation, other shapes).
_AUTO_MARGIN_FRACTION = 0.10

_GIB = 1 << 30


@dataclass(frozen=True)
class _MemoryIntent:
    """What ``make_optimizer`` reads: ``None`` (torch.optim.AdamW), or the ``gpu_fraction`` of the
    ``OffloadedOptimizer`` to build (0.0 or ``"auto"``)."""

    optimizer_gpu_fraction: float | str | None


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _size(nbytes: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, three significant digits."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} B"


# --------------------------------------------------------------------------------------------------
# Before capture
# --------------------------------------------------------------------------------------------------


def check_memory_options(config: OptimizeConfig) -> None:
    """Refuse, before anything is changed, what this machine cannot do: ``offload_optimizer=True``
    without a CUDA GPU."""
    if config.memory.offload_optimizer is True and not _cuda_available():
        raise HardwareUnavailableError(
            "memory offload_optimizer=True needs a CUDA GPU: the optimizer states go to pinned host memory and the "
            f"gradients stream from the GPU, but torch.cuda.is_available() is False (torch {torch.__version__}). "
            "Use memory={'offload_optimizer': False} here, or 'auto' (torch.optim.AdamW without a GPU)")


def checkpoint_for_config(model: nn.Module, config: OptimizeConfig, example_inputs: Any) -> CheckpointPlan | None:
    """Wrap the repeated blocks before capture, so that Dynamo records each as a checkpointed region
    (whose body the passes rewrite too). ``None`` when ``config.memory.checkpointing`` is off."""
    if config.memory.checkpointing == "off":
        return None
    if config.memory.budget_gb is not None and example_inputs is None:
        raise ValueError("memory budget_gb needs example_inputs: the activation bytes per block are measured on them")
    return apply_checkpointing(model, policy=config.memory.checkpointing, budget_gb=config.memory.budget_gb,
                               example_inputs=example_inputs)


# --------------------------------------------------------------------------------------------------
# After capture
# --------------------------------------------------------------------------------------------------


def install_memory_options(model: nn.Module, config: OptimizeConfig, report: OptimizationReport,
                           plan: CheckpointPlan | None, training: bool) -> None:
    """Record the checkpointing plan and the optimizer choice in ``report``, and install activation
    offload around the model's (compiled) call, on it and on its copies (``OptimizationState.add_around``)."""
    if plan is not None:
        report.set_memory(_checkpointing_record(plan))
    fraction = _optimizer_fraction(config.memory.offload_optimizer)
    object.__setattr__(model, _INTENT_ATTR, _MemoryIntent(fraction))
    if config.memory.offload_optimizer is not False:
        report.set_memory(_optimizer_record(_trainable(model), fraction))
    if config.memory.offload_activations is not False:
        model._kernel_pytorch.add_around(functools.partial(_install_activation_offload, config=config,
                                                           training=training))


def sync_memory_report(model: nn.Module, report: OptimizationReport) -> None:
    """After ``optimize``'s end-to-end check: a rollback of everything also removed activation offload
    (it lived in the compiled call); say so."""
    state = getattr(model, "_kernel_pytorch", None)
    if getattr(state, "active", True):
        return
    for record in report.memory:
        if record.wrapper == "activation_offload" and record.applied:
            report.set_memory(MemoryRecord(wrapper="activation_offload", applied=False,
                                           description="activation offload: removed with the rolled-back optimizations"))


def _checkpointing_record(plan: CheckpointPlan) -> MemoryRecord:
    measured = plan.saved_bytes_before is not None and plan.saved_bytes_after is not None
    description = plan.describe()
    if measured:
        # Measured on the model as written: hand-written attention saves far more than the fused
        # kernel the rewrite puts in its place, so both figures are upper bounds.
        description += " (measured on the example inputs, before the rewrites)"
    return MemoryRecord(wrapper="checkpointing", applied=bool(plan.wrapped), description=description,
                        device_bytes_saved=plan.saved_bytes_before - plan.saved_bytes_after if measured else None)


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------------------------------
# The optimizer
# --------------------------------------------------------------------------------------------------


def _optimizer_fraction(setting: bool | str) -> float | str | None:
    if setting is False or (setting == "auto" and not _cuda_available()):
        return None
    return 0.0 if setting is True else "auto"


def _optimizer_record(params: list[torch.Tensor], fraction: float | str | None) -> MemoryRecord:
    if fraction is None:
        return MemoryRecord(wrapper="optimizer_offload", applied=False,
                            description="optimizer offload ('auto'): not applied: no CUDA GPU "
                            "(torch.cuda.is_available() is False); make_optimizer gives torch.optim.AdamW")
    host = pinned_bytes_for(params)
    # torch.optim.AdamW keeps exp_avg and exp_avg_sq in each parameter's dtype on its device.
    adamw = 2 * _nbytes(params)
    count = sum(p.numel() for p in params)
    up_to = "up to " if fraction == "auto" else ""
    description = (f"optimizer offload: AdamW states of {count:,} parameters in {up_to}{_size(host)} of pinned host "
                   f"memory (fp32 masters and moments, gradient buffers), {up_to}{_size(adamw)} of GPU memory saved "
                   "against torch.optim.AdamW; build it with kernel_pytorch.memory.make_optimizer(model, lr=...)")
    if fraction == "auto":
        description += " ('auto': the states that fit in the GPU memory left after the first step move back)"
    return MemoryRecord(wrapper="optimizer_offload", applied=True, description=description,
                        device_bytes_saved=adamw, host_bytes=host)


def make_optimizer(model: nn.Module, params: Iterable[Any] | None = None, *, lr: float = 1e-3,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 0.01) -> torch.optim.Optimizer:
    """The AdamW that ``optimize``'s ``offload_optimizer`` option chose for ``model``.

    ``OffloadedOptimizer(params, gpu_fraction=0.0)`` for ``offload_optimizer=True``,
    ``gpu_fraction="auto"`` for ``"auto"`` on a CUDA machine; otherwise (the option off, ``"auto"``
    without a GPU, or a model ``optimize`` never saw) ``torch.optim.AdamW``, fused when every parameter
    is on a CUDA device. Both apply AdamW with these hyperparameters and their state dicts load into each
    other; with bf16 parameters the offloaded one updates fp32 masters with fp32 moments, where
    ``torch.optim.AdamW`` keeps its moments in bf16 and updates the bf16 weights.

    Args:
        model: the model returned by ``kernel_pytorch.optimize``.
        params: parameters or parameter groups (default: ``model``'s parameters that require grad).
        lr, betas, eps, weight_decay: AdamW's (decoupled weight decay).

    Gradient clipping: ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` works with both
    (the offloaded optimizer then copies the clipped gradients again at ``step()``); an
    ``OffloadedOptimizer``'s own ``clip_grad_norm_`` scales its host copies instead.

    Example::

        model = kernel_pytorch.optimize(model, example_inputs=(tokens,), memory={"offload_optimizer": True})
        opt = make_optimizer(model, lr=3e-4, weight_decay=0.1)
        loss_fn(model(tokens)).backward()
        opt.step()
        opt.zero_grad()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    groups = _param_groups(_trainable(model) if params is None else params)
    intent = getattr(model, _INTENT_ATTR, None)
    fraction = intent.optimizer_gpu_fraction if isinstance(intent, _MemoryIntent) else None
    hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    if fraction is not None:
        return OffloadedOptimizer(groups, gpu_fraction=fraction, **hyper)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = True if tensors and all(p.device.type == "cuda" for p in tensors) else None
    return torch.optim.AdamW(groups, fused=fused, **hyper)


def _param_groups(params: Iterable[Any]) -> list[Any]:
    """A list of tensors or of groups (each group's ``params`` a list), so it can be read twice."""
    groups = list(params)
    return [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in groups]


# --------------------------------------------------------------------------------------------------
# Activation offload
# --------------------------------------------------------------------------------------------------


class _AtFirstTrainingCall:
    """Sits in ``model._compiled_call_impl`` until the model's first call with gradients enabled; that
    call runs through ``first(call, args, kwargs)``, after this object has stepped aside (so ``first``
    may install something in its place). Calls without gradients save nothing and pass straight
    through; a first call that raises leaves it in place for the next."""

    def __init__(self, model: nn.Module, first: Callable[[Callable, tuple, dict], Any]):
        self.model = model
        self.inner = model._compiled_call_impl
        self.first = first
        model._compiled_call_impl = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.inner if self.inner is not None else self.model._call_impl
        if not torch.is_grad_enabled():
            return call(*args, **kwargs)
        outer = self._step_aside()
        try:
            return self.first(call, args, kwargs)
        except BaseException:
            outer.inner = self  # back in place for the next call
            raise

    def _step_aside(self) -> Any:
        """Unlink this wrapper from the chain of calls, wherever it sits (context parallelism wraps it from
        outside); returns what held it: a wrapper, or a stand-in for the model's slot."""
        holder: Any = _ModelSlot(self.model)
        while holder.inner is not self and holder.inner is not None:
            holder = holder.inner
        if holder.inner is self:  # else the chain was replaced (model.compile()): nothing to unlink
            holder.inner = self.inner
        return holder


class _ModelSlot:
    """``model._compiled_call_impl`` seen as the ``inner`` of a wrapper, the head of the chain of calls."""

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def inner(self) -> Any:
        return self.model._compiled_call_impl

    @inner.setter
    def inner(self, call: Any) -> None:
        self.model._compiled_call_impl = call


def _install_activation_offload(model: nn.Module, report: OptimizationReport, *, config: OptimizeConfig,
                                training: bool) -> None:
    label = "activation offload ('auto')" if config.memory.offload_activations == "auto" else "activation offload"
    if not training:
        report.set_memory(MemoryRecord(wrapper="activation_offload", applied=False,
                                       description=f"{label}: not applied: in inference no activations are saved"))
    elif not _cuda_available():
        report.set_memory(MemoryRecord(
            wrapper="activation_offload", applied=False,
            description=f"{label}: not applied: no CUDA GPU (torch.cuda.is_available() is False); saved "
            "activations stay where they are"))
    elif config.memory.offload_activations is True:
        _offload_and_count(model, report)
    else:
        _AtFirstTrainingCall(model, _measure_then_decide(model, config, report))
        report.set_memory(MemoryRecord(
            wrapper="activation_offload", applied=False,
            description=f"{label}: undecided: the saved activations are measured at the first training call"))


def _offload_and_count(model: nn.Module, report: OptimizationReport) -> None:
    """Offload from now on; the first training call's bytes go into the report."""
    stats = install_activation_offload(model, min_bytes=_OFFLOAD_MIN_BYTES, device=_OFFLOAD_SOURCE)
    report.set_memory(MemoryRecord(
        wrapper="activation_offload", applied=True,
        description=f"activation offload: saved tensors of at least {_size(_OFFLOAD_MIN_BYTES)} go to pinned host "
        "memory; the bytes moved are counted at the first training call"))

    def count(call: Callable, args: tuple, kwargs: dict) -> Any:
        tensors, moved = stats.offloaded_tensors, stats.offloaded_bytes
        out = call(*args, **kwargs)  # a first call that compiles counts only the model's forward
        tensors, moved = stats.offloaded_tensors - tensors, stats.offloaded_bytes - moved
        report.set_memory(MemoryRecord(
            wrapper="activation_offload", applied=True, device_bytes_saved=moved, host_bytes=moved,
            description=f"activation offload: {_size(moved)} of saved activations ({tensors} tensors of at least "
            f"{_size(_OFFLOAD_MIN_BYTES)}) moved to pinned host memory per forward, measured at the first "
            "training call"))
        return out

    _AtFirstTrainingCall(model, count)


def _measure_then_decide(model: nn.Module, config: OptimizeConfig,
                         report: OptimizationReport) -> Callable[[Callable, tuple, dict], Any]:
    """The first training call of ``offload_activations="auto"``: run it counting what is saved (the
    tensors are kept as usual), then offload from the next call on if it is too much."""

    def first(call: Callable, args: tuple, kwargs: dict) -> Any:
        meter = _SavedBytesMeter(_state_storage_keys(model))
        probe = _Offloader(min_bytes=_OFFLOAD_MIN_BYTES, source=_OFFLOAD_SOURCE, exclude=_state_storages(model))
        movable = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling():
                return tensor  # a backend's check of its graph, not the model's forward (see _Offloader.pack)
            meter.add(tensor)
            if probe.should_offload(tensor):
                movable[0] += tensor.numel() * tensor.element_size()
            return tensor

        with _eager_saved_tensors_hooks(pack, lambda tensor: tensor):
            out = call(*args, **kwargs)
        over, why = _too_much(model, config, meter.total)
        saved = f"the model saves {_size(meter.total)} of activations at its first training call"
        if over:
            install_activation_offload(model, min_bytes=_OFFLOAD_MIN_BYTES, device=_OFFLOAD_SOURCE)
            description = (f"activation offload ('auto'): on, {saved}, {why}; {_size(movable[0])} of them (tensors of "
                           f"at least {_size(_OFFLOAD_MIN_BYTES)}) go to pinned host memory from the next call on")
        else:
            description = f"activation offload ('auto'): off, {saved}, {why}"
        report.set_memory(MemoryRecord(wrapper="activation_offload", applied=over, description=description,
                                       device_bytes_saved=movable[0] if over else None,
                                       host_bytes=movable[0] if over else None))
        return out

    return first


def _too_much(model: nn.Module, config: OptimizeConfig, saved: int) -> tuple[bool, str]:
    """Whether ``saved`` activation bytes call for offloading, and why (for the report)."""
    if config.memory.budget_gb is not None:
        budget = int(config.memory.budget_gb * _GIB)
        return saved > budget, f"{'over' if saved > budget else 'within'} memory budget_gb ({_size(budget)})"
    devices = sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)
    if not devices:
        return False, "and its parameters are on no CUDA device (nothing to compare with)"
    left, needed = _gpu_room(devices[0], model, config)
    verdict = "less than" if left < needed else "enough for"
    return left < needed, (f"the GPU has {_size(left)} left, {verdict} the {_size(needed)} that gradients, AdamW's "
                           "states and a 10% margin still need")


def _gpu_room(device: torch.device, model: nn.Module, config: OptimizeConfig) -> tuple[int, int]:
    """(bytes the caching allocator can still hand out on ``device`` now, bytes the rest of a training
    step still needs): gradients not yet allocated, AdamW's two moments (unless the optimizer is
    offloaded) and ``_AUTO_MARGIN_FRACTION`` of the GPU."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    params = _trainable(model)
    grads = _nbytes(p for p in params if p.grad is None)
    states = 0 if config.memory.offload_optimizer is not False else 2 * _nbytes(params)
    return free + cached, grads + states + int(_AUTO_MARGIN_FRACTION * total)
