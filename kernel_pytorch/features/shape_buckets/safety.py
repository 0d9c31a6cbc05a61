"""Is padding harmless for this model? Decided once, at ``optimize`` with example inputs, else at the first call.

1. A look at the modules: BatchNorm in training mode averages over the batch and the positions; recurrent layers
   carry a state across positions (their last state, or a backward pass, would see the padding). A model whose
   ``forward`` takes no ``attention_mask`` has nothing to mask sequence padding with (the feature says so).
2. Three eager runs of the model in eval mode (dropout would draw different numbers for padded and unpadded
   inputs; BatchNorm's training mode is step 1's): the real inputs, and the same padded to two different shapes
   under :class:`~.mixing_ops.OpRecorder`. The ops that mix along a padded dim refuse that dim's padding
   (``mixing_ops``); the dims of each output that follow the padding are read off the two padded runs.
3. The padded outputs, sliced back, against the real ones with the config's per-dtype tolerance
   (``verify.numerics.compare``). If they differ, batch padding alone is tried; a refusal gives the measured error
   and the sequence reductions seen (unmasked pooling).

Gradients are not compared: where the sliced outputs equal the real ones and the padded rows and positions stay
finite, the padding gets zero gradient and adds nothing to the parameters' gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.errors import first_line
from kernel_pytorch.features.shape_buckets.mixing_ops import OpRecorder, mixing_findings
from kernel_pytorch.features.shape_buckets.padding import (LENGTH, ArgumentDims, CallShape, NamedCall, OutputDims,
                                                           argument_dims, call_shape, output_dims, pad_call,
                                                           slice_outputs, slice_to)
from kernel_pytorch.verify.numerics import NOTHING_COMPARED, Run, compare, flatten_tensors

__all__ = ["Verdict", "check_padding", "module_reasons"]

# The check pads the real inputs by these many rows and positions, twice: odd sizes, unlikely to equal a hidden
# or head size, so that the dims that follow the padding are told apart from the others.
_CHECK_ROWS = (1, 2)
_CHECK_POSITIONS = (7, 13)


@dataclass(frozen=True)
class Verdict:
    """Which dims may be padded, why not the others, what the comparison measured, and the dims learned."""

    batch: bool
    length: bool
    batch_refused: tuple[str, ...] = ()  # why the batch is not padded
    length_refused: tuple[str, ...] = ()  # why the sequence is not padded
    measured: str = ""
    outputs: OutputDims = field(default_factory=dict)
    arguments: ArgumentDims = field(default_factory=dict)


def module_reasons(model: nn.Module, training: bool) -> tuple[list[str], list[str]]:
    """(why not pad the batch, why not pad the sequence), from the modules alone."""
    batch, length = [], []
    for name, module in model.named_modules():
        where = f"'{name}'" if name else "the model"
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and (training or module.training):
            reason = f"{type(module).__name__} at {where} in training mode normalizes over the batch and the positions"
            batch.append(reason)
            length.append(reason)
        elif isinstance(module, nn.RNNBase):
            length.append(f"{type(module).__name__} at {where} carries its state across positions (its last state "
                          "would see the padding)")
    return batch, length


def check_padding(model: nn.Module, call: NamedCall, batch: bool, length: bool, largest_length: int | None,
                  fills: dict[str, float], config: OptimizeConfig, training: bool) -> Verdict:
    """The verdict for padding the batch (``batch``) and the sequence (``length``) of calls like ``call``, given
    the largest length bucket and the pad values (module docstring)."""
    batch_reasons, length_reasons = module_reasons(model, training)
    batch, length = batch and not batch_reasons, length and not length_reasons
    shape = call_shape(call, length)
    if shape is None:
        return _refused("the call has no tensor argument to pad")
    if length and shape.length is None:
        length = False
        length_reasons.append("the lead tensor argument has no sequence dim (dim 1)")
    if length and largest_length is not None and largest_length <= _CHECK_POSITIONS[-1]:
        length = False
        length_reasons.append(f"the largest length bucket ({largest_length}) leaves no room for the padding check")
    if not (batch or length):
        return Verdict(False, False, _distinct(batch_reasons), _distinct(length_reasons))
    return _empirical(model, call, shape, batch, length, largest_length, fills, config, batch_reasons, length_reasons)


def _empirical(model: nn.Module, call: NamedCall, shape: CallShape, batch: bool, length: bool,
               largest_length: int | None, fills: dict[str, float], config: OptimizeConfig,
               batch_reasons: list[str], length_reasons: list[str]) -> Verdict:
    if not length:
        shape = CallShape(shape.batch, None)
    dims = argument_dims(call, shape, {})
    if length and largest_length is not None and shape.length + _CHECK_POSITIONS[-1] > largest_length:
        call, shape = _shortened(call, shape, dims, largest_length - _CHECK_POSITIONS[-1])
    sizes = [CallShape(shape.batch + (rows if batch else 0), shape.length + positions if length else None)
             for rows, positions in zip(_CHECK_ROWS, _CHECK_POSITIONS)]

    def padded_run(size: CallShape) -> Any:
        return _run(model, *pad_call(call, shape, size, dims, fills))

    with _eval_mode(model), _buffers_kept(model):
        real = _run(model, *call.arguments())  # an error here is the model's own: raised
        cached = _cache_outputs(real)
        if cached:
            return _refused(f"the model returns a KV cache ({cached}), which would keep the padding: call it with "
                            "use_cache=False")
        padded, records = [], []
        try:
            for size in sizes:
                with OpRecorder(model) as recorder:
                    padded.append(padded_run(size))
                records.append(recorder.records)
        except Exception as error:  # a model that rejects padded inputs is served unbucketed, said in the report
            return _refused(f"the model raised on padded inputs: {first_line(error)}")
        outputs, unsliceable = output_dims(padded[0], padded[1], sizes[0], sizes[1])
        findings = mixing_findings(records[0], records[1], sizes[0], sizes[1])
        batch_reasons += findings.batch + unsliceable
        length_reasons += findings.length + unsliceable
        batch, length = batch and not batch_reasons, length and not length_reasons
        measured = ""
        if batch or length:

            def compared(size: CallShape, suspects: list[str]) -> tuple[bool, str]:
                out = padded[0] if size == sizes[0] else padded_run(size)
                return _compared(out, real, shape, size, outputs, config, suspects)

            batch, length, measured = _judged(compared, shape, sizes[0], batch, length, findings.soft_length,
                                              batch_reasons, length_reasons)
    return Verdict(batch, length, _distinct(batch_reasons), _distinct(length_reasons), measured, outputs, dims)


def _judged(compared: Callable[[CallShape, list[str]], tuple[bool, str]], shape: CallShape, padded: CallShape,
            batch: bool, length: bool, suspects: list[str], batch_reasons: list[str],
            length_reasons: list[str]) -> tuple[bool, bool, str]:
    """(batch, length, measured): the comparison of the dims still allowed, padded as ``padded``; when padding both
    fails, batch padding alone is tried. A failure goes into the refused dim's reasons."""
    size = CallShape(padded.batch if batch else shape.batch, padded.length if length else shape.length)
    ok, measured = compared(size, suspects)
    if not ok and batch and length:  # the sequence to blame? batch padding alone
        length_reasons.append(measured)
        length, size = False, CallShape(padded.batch, shape.length)
        ok, measured = compared(size, [])
    if not ok:
        (batch_reasons if batch else length_reasons).append(measured)
        batch = length = False
    return batch, length, measured


def _refused(reason: str) -> Verdict:
    return Verdict(False, False, (reason,), (reason,))


def _distinct(reasons: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(reasons))


def _compared(out: Any, real: Any, shape: CallShape, size: CallShape, outputs: OutputDims, config: OptimizeConfig,
              suspects: list[str]) -> tuple[bool, str]:
    """Whether the outputs padded to ``size``, sliced back, match the real ones, and the measurement in words
    (naming the sequence reductions seen, ``suspects``, when they do not)."""
    comparison = compare(Run(flatten_tensors(slice_outputs(out, shape, size, outputs)), None),
                         Run(flatten_tensors(real), None), config)
    padded = " and ".join(what for what, on in (("the batch", size.batch != shape.batch),
                                                 ("the sequence", size.length != shape.length)) if on)
    if comparison.worst == NOTHING_COMPARED:
        return True, f"padding {padded} kept every output bit-identical"
    worst = "the output" if comparison.worst == "output output" else comparison.worst  # a model returning one tensor
    measured = f"worst {worst} relative error {comparison.error:.1e}, tolerance {comparison.tolerance:.0e}"
    if comparison.ok:
        return True, f"padding {padded} kept the outputs ({measured})"
    seen = f"; seen: {'; '.join(suspects)}" if suspects else ""
    return False, f"padding {padded} changed the outputs ({measured}{seen})"


def _cache_outputs(out: Any) -> str:
    """The type names of the KV caches among ``out``'s leaves (transformers' ``Cache`` classes), "" for none."""
    names = {type(leaf).__name__ for leaf in pytree.tree_leaves(out) if type(leaf).__name__.endswith("Cache")}
    return ", ".join(sorted(names))


def _shortened(call: NamedCall, shape: CallShape, dims: ArgumentDims, length: int) -> tuple[NamedCall, CallShape]:
    """The call cut to ``length`` positions (so that the check's padding stays within the largest bucket)."""
    short = CallShape(shape.batch, max(1, length))

    def cut(name: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and dims.get(name, (False, False))[1]:
            return slice_to(value, ((1, LENGTH),), short)
        return value

    return call.replaced(cut), short


def _run(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The model, eagerly (not its compiled call), without gradients, with a fixed random seed."""
    devices = sorted({t.device.index or 0 for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        torch.manual_seed(0)
        return model._call_impl(*args, **kwargs)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


@contextlib.contextmanager
def _buffers_kept(model: nn.Module) -> Iterator[None]:
    """Buffers as they were before the runs (a forward may update some in place): state_dict stays unchanged."""
    saved = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in saved:
                    buffer.copy_(saved[name])
