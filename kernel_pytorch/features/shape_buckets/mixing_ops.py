"""Which operations of a model mix rows of the batch or positions of the sequence, found by running it.

:class:`OpRecorder` (a ``TorchFunctionMode``) records the watched torch functions a model calls, with the shapes of
their tensor arguments and the module they ran in. Two runs padded to two different shapes are then compared op by op
(:func:`mixing_findings`): a dim whose size changed between them carries the batch (its sizes are the two padded
batch sizes), the sequence (the two padded lengths) or both (any other change: a flattened batch x length). An op
that reduces, normalizes, accumulates or reorders along such a dim mixes padding into real values unless a mask
keeps it out.

Findings are *hard* (padding that dim is refused: a running sum, BatchNorm statistics, attention without a mask, a
convolution or pooling window along the sequence, a flip) or *soft* (a reduction over the sequence: pooling, harmless
when masked; the empirical comparison of padded and unpadded outputs decides, and a soft finding is named when it
fails). Integer and boolean tensors are left to the comparison: their cumulative sums and counts are index
arithmetic (position ids from a mask), which padding with the pad token and a zero mask leaves as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from kernel_pytorch.features.shape_buckets.padding import BATCH, LENGTH, CallShape

__all__ = ["OpRecord", "OpRecorder", "Findings", "mixing_findings"]

BOTH = "batch x length"

# name -> (position of the dim argument, its default): None reduces over every dim.
_CUMULATIVE = {name: (1, None) for name in ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp")}
_REDUCTIONS = {**{name: (1, None) for name in ("sum", "mean", "amax", "amin", "max", "min", "prod", "std", "var",
                                               "logsumexp", "nansum", "nanmean", "median", "nanmedian", "std_mean",
                                               "var_mean", "argmax", "argmin", "mode")},
               "norm": (2, None), "topk": (2, -1), "kthvalue": (2, -1), "sort": (1, -1)}
_REORDERS = {"flip": (1, None), "roll": (2, None), "fliplr": (None, 1)}
_WINDOWS = {f"{kind}{n}d" for n in (1, 2, 3) for kind in ("avg_pool", "max_pool", "adaptive_avg_pool",
                                                          "adaptive_max_pool", "lp_pool", "conv", "conv_transpose")}
_NORMS = {"batch_norm", "group_norm", "instance_norm", "layer_norm", "local_response_norm"}
_ATTENTION = {"scaled_dot_product_attention"}
_WATCHED = {*_CUMULATIVE, *_REDUCTIONS, *_REORDERS, *_WINDOWS, *_NORMS, *_ATTENTION}


@dataclass(frozen=True)
class OpRecord:
    """One watched call: the op, the shape and dtype of the tensor it works on, the dims it works along (None: every
    dim), whether it mixes the batch (BatchNorm statistics) and the module it ran in."""

    op: str
    shape: tuple[int, ...]
    floating: bool
    dims: tuple[int, ...] | None
    module: str
    kind: str  # "cumulative", "reduction", "reorder", "window", "norm", "attention"


class OpRecorder(TorchFunctionMode):
    """Records the watched ops of the runs made inside it (``with OpRecorder(model) as recorder: model(...)``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.records: list[OpRecord] = []
        self._names = {id(module): name for name, module in model.named_modules()}
        self._stack: list[str] = []
        self._hooks: list[Any] = []

    def __enter__(self) -> OpRecorder:
        hooks = torch.nn.modules.module
        self._hooks = [hooks.register_module_forward_pre_hook(self._enter_module),
                       hooks.register_module_forward_hook(self._leave_module, always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for handle in self._hooks:
            handle.remove()
        super().__exit__(*exc)

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        self._stack.append(self._names.get(id(module), type(module).__name__))

    def _leave_module(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._stack:
            self._stack.pop()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _WATCHED and args and isinstance(args[0], torch.Tensor):
            record = _record(name, args, kwargs, self._stack[-1] if self._stack else "")
            if record is not None:
                self.records.append(record)
        return func(*args, **kwargs)


def _record(name: str, args: tuple, kwargs: dict, module: str) -> OpRecord | None:
    tensor = args[0]
    shape, floating = tuple(tensor.shape), tensor.is_floating_point()
    if name in _CUMULATIVE or name in _REDUCTIONS or name in _REORDERS:
        table = _CUMULATIVE if name in _CUMULATIVE else _REDUCTIONS if name in _REDUCTIONS else _REORDERS
        if name in ("max", "min") and len(args) > 1 and isinstance(args[1], torch.Tensor):
            return None  # elementwise maximum of two tensors
        kind = "cumulative" if name in _CUMULATIVE else "reduction" if name in _REDUCTIONS else "reorder"
        return OpRecord(name, shape, floating, _dims(args, kwargs, *table[name], len(shape)), module, kind)
    if name in _WINDOWS:
        return _window_record(name, args, shape, floating, module)
    if name in _NORMS:
        return _norm_record(name, args, kwargs, shape, floating, module)
    return _attention_record(name, args, kwargs, floating, module)


def _dims(args: tuple, kwargs: dict, position: int | None, default: int | None, ndim: int) -> tuple[int, ...] | None:
    """The dims an op works along, from its ``dim`` / ``dims`` argument (positional at ``position``)."""
    value = kwargs.get("dim", kwargs.get("dims"))
    if value is None and position is not None and len(args) > position:
        value = args[position]
    if value is None:
        value = default
    if value is None or isinstance(value, bool) or not isinstance(value, (int, tuple, list, torch.Size)):
        return None
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not dims:
        return None  # sum(dim=()) reduces over every dim
    return tuple(d % ndim for d in dims if isinstance(d, int)) if ndim else ()


def _window_record(name: str, args: tuple, shape: tuple, floating: bool, module: str) -> OpRecord | None:
    """Pooling, and convolutions whose kernel spans more than one position along a spatial dim."""
    spatial = tuple(range(2, len(shape)))
    if name.startswith("conv"):
        weight = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if weight is not None:
            spatial = tuple(d for d in spatial if d < weight.dim() and weight.shape[d] > 1)
    return OpRecord(name, shape, floating, spatial, module, "window") if spatial else None


def _norm_record(name: str, args: tuple, kwargs: dict, shape: tuple, floating: bool, module: str) -> OpRecord | None:
    ndim = len(shape)
    if name == "layer_norm":
        normalized = args[1] if len(args) > 1 else kwargs.get("normalized_shape", ())
        dims = tuple(range(ndim - len(normalized), ndim))
    elif name == "batch_norm":
        running_mean = args[1] if len(args) > 1 else kwargs.get("running_mean")
        training = args[5] if len(args) > 5 else kwargs.get("training", False)
        if not training and running_mean is not None:
            return None  # running statistics: per element
        dims = tuple(d for d in range(ndim) if d != 1)
    else:  # group_norm, instance_norm, local_response_norm: over positions (and channels) of each sample
        dims = tuple(range(1, ndim))
    return OpRecord(name, shape, floating, dims, module, "norm")


def _attention_record(name: str, args: tuple, kwargs: dict, floating: bool, module: str) -> OpRecord | None:
    """Attention with neither a mask nor causality: every query sees every key, the padded ones too."""
    key = args[1] if len(args) > 1 else kwargs.get("key")
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
    if mask is not None or causal or not isinstance(key, torch.Tensor):
        return None
    return OpRecord(name, tuple(key.shape), floating, (key.dim() - 2,), module, "attention")


@dataclass
class Findings:
    """What mixes padding into real values: hard reasons per padded dim, and soft ones (sequence reductions)."""

    batch: list[str] = field(default_factory=list)
    length: list[str] = field(default_factory=list)
    soft_length: list[str] = field(default_factory=list)


def mixing_findings(first: Sequence[OpRecord], second: Sequence[OpRecord], first_shape: CallShape,
                    second_shape: CallShape) -> Findings:
    """The findings of two runs padded to ``first_shape`` and ``second_shape`` (module docstring). Ops are paired in
    order when both runs called the same ops; otherwise the second run's sizes alone say which dims carry what."""
    paired = len(first) == len(second) and all(a.op == b.op for a, b in zip(first, second))
    findings = Findings()
    for index, record in enumerate(second):
        if not record.floating and record.kind in ("cumulative", "reduction"):
            continue  # index arithmetic: left to the comparison
        earlier = first[index].shape if paired and len(first[index].shape) == len(record.shape) else None
        kinds = _padded_dims(record.shape, earlier, first_shape, second_shape)
        along = {kinds[d] for d in (record.dims if record.dims is not None else range(len(record.shape)))
                 if d in kinds}
        for kind in sorted(along):
            _add(findings, record, kind, next(d for d in sorted(kinds) if kinds[d] == kind))
    for name in ("batch", "length", "soft_length"):
        setattr(findings, name, list(dict.fromkeys(getattr(findings, name))))
    return findings


def _padded_dims(shape: tuple[int, ...], earlier: tuple[int, ...] | None, first: CallShape,
                 second: CallShape) -> dict[int, str]:
    """dim -> BATCH, LENGTH or BOTH for the dims of ``shape`` that follow the padding."""
    kinds = {}
    for d, size in enumerate(shape):
        if earlier is not None:
            if earlier[d] == size:
                continue
            pair = (earlier[d], size)
            kinds[d] = (BATCH if pair == (first.batch, second.batch) else
                        LENGTH if first.length is not None and pair == (first.length, second.length) else BOTH)
        elif size == second.batch and second.batch != first.batch:
            kinds[d] = BATCH
        elif second.length is not None and size == second.length and second.length != first.length:
            kinds[d] = LENGTH
        elif second.length is not None and size == second.batch * second.length and second != first:
            kinds[d] = BOTH
    return kinds


def _add(findings: Findings, record: OpRecord, kind: str, dim: int) -> None:
    where = f" in '{record.module}'" if record.module else ""
    what = {BATCH: "the batch", LENGTH: "the sequence", BOTH: "the batch and the sequence (flattened)"}[kind]
    reason = f"{record.op} along {what} (dim {dim} of a {list(record.shape)} tensor){where}"
    soft = record.kind == "reduction"
    if kind in (BATCH, BOTH):
        findings.batch.append(reason + " mixes the rows of a batch")
    if kind in (LENGTH, BOTH):
        (findings.soft_length if soft else findings.length).append(reason + " mixes the positions of a sequence")
