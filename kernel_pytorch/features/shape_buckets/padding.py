"""Padding a call's tensor arguments up to a bucket, and slicing its outputs back (independent of the config).

Which dims are batch and sequence, the rule: the call's arguments are named by the model's ``forward`` signature;
the lead tensor is ``input_ids``, else ``inputs_embeds``, else the first tensor argument. Its dim 0 is the batch B
and, when lengths are bucketed, its dim 1 the length L. Any tensor argument's dim 0 is a batch dim if its size is B,
and its dim 1 a sequence dim if its size is L (batch-first layouts, as transformers models take them); no other dim
is padded. The dims found for each argument name on the first call are kept for the later ones.

Fill values: ``input_ids`` the pad token; ``attention_mask`` 0 on the padded positions of real rows and 1 over padded
rows (a row with every position masked gives NaN in some attention kernels, and 0 x NaN in the backward would reach
real gradients); ``token_type_ids`` 0; ``position_ids`` the positions continued; ``labels`` -100 (ignored by
cross-entropy); anything else 0. A model that takes ``attention_mask`` but was called without one gets one of ones
over the real tokens, so that the padding is masked.

Outputs: each tensor leaf (inside tuples, dicts, transformers ``ModelOutput``s) is sliced back on the dims the padding
check saw change with the padding (``OutputDims``, by the leaf's path); a leaf the check did not see is sliced on
dim 0 where it has the padded batch size and on any later dim that has the padded length.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

__all__ = ["BATCH", "LENGTH", "IGNORED_LABEL", "CallShape", "NamedCall", "Parameters", "OutputDims", "ArgumentDims",
           "name_call", "pad_call", "slice_outputs", "map_tensor_leaves", "output_dims", "slice_to",
           "with_attention_mask", "repeated_to", "call_shape", "argument_dims", "lead_tensor"]

BATCH, LENGTH = "batch", "length"
IGNORED_LABEL = -100  # cross-entropy's default ignore_index, which transformers' losses use

# Output leaf path (pytree.keystr) -> the (dim, BATCH | LENGTH) pairs to slice.
OutputDims = dict[str, tuple[tuple[int, str], ...]]
# Argument name -> (dim 0 is a batch dim, dim 1 is a sequence dim).
ArgumentDims = dict[str, tuple[bool, bool]]


class CallShape(NamedTuple):
    """A call's batch size and length (None: lengths are not bucketed, or the lead tensor has one dim)."""

    batch: int
    length: int | None


@dataclass
class NamedCall:
    """A call's arguments with their names (``forward``'s parameter names; ``*args`` extras as ``args[i]``).
    ``by_keyword``: every positional argument may be passed by its name, as :meth:`arguments` then passes it (so
    that ``model(ids, mask)`` and ``model(input_ids=ids, attention_mask=mask)`` run the same captured graph)."""

    positional: list[tuple[str, Any]]
    keywords: dict[str, Any]
    by_keyword: bool = False

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: value for name, value in [*self.positional, *self.keywords.items()]
                if isinstance(value, torch.Tensor)}

    def arguments(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.by_keyword:
            return (), {**dict(self.positional), **self.keywords}
        return tuple(value for _, value in self.positional), dict(self.keywords)

    def replaced(self, change: Callable[[str, Any], Any]) -> NamedCall:
        """This call with ``change(name, value)`` for every argument."""
        return NamedCall([(n, change(n, v)) for n, v in self.positional],
                         {n: change(n, v) for n, v in self.keywords.items()}, self.by_keyword)


class Parameters(NamedTuple):
    """A ``forward``'s positional parameter names, and how many positional arguments may be passed by name (none
    where a parameter is positional-only: positions are then kept as given)."""

    names: tuple[str, ...]
    by_name: int

    @classmethod
    def of(cls, function: Callable[..., Any]) -> Parameters:
        positional = [p for p in inspect.signature(function).parameters.values()
                      if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        by_name = all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in positional)
        return cls(tuple(p.name for p in positional), len(positional) if by_name else 0)


def name_call(parameters: Parameters, args: tuple, kwargs: dict) -> NamedCall:
    """``args`` named by the positional ``parameters`` (extras by their index)."""
    names = parameters.names
    named = [(names[i] if i < len(names) else f"args[{i}]", value) for i, value in enumerate(args)]
    return NamedCall(named, dict(kwargs), by_keyword=len(args) <= parameters.by_name)


def lead_tensor(call: NamedCall) -> torch.Tensor | None:
    """``input_ids``, else ``inputs_embeds``, else the first tensor argument (None: the call has none)."""
    tensors = call.tensors()
    for name in ("input_ids", "inputs_embeds"):
        if isinstance(tensors.get(name), torch.Tensor):
            return tensors[name]
    return next((t for t in tensors.values() if t.dim() >= 1), None)


def call_shape(call: NamedCall, lengths: bool) -> CallShape | None:
    """The call's (batch, length) by the module docstring's rule; None for a call without a tensor argument."""
    lead = lead_tensor(call)
    if lead is None:
        return None
    return CallShape(lead.shape[0], lead.shape[1] if lengths and lead.dim() >= 2 else None)


def argument_dims(call: NamedCall, shape: CallShape, known: ArgumentDims) -> ArgumentDims | None:
    """Which of dims 0 and 1 of each tensor argument are padded: the dims ``known`` for its name, else the rule's;
    None when a known argument's sizes disagree with ``shape`` (the call is then served unbucketed)."""
    dims: ArgumentDims = {}
    for name, tensor in call.tensors().items():
        sizes = tuple(tensor.shape[:2])
        rule = (len(sizes) >= 1 and sizes[0] == shape.batch,
                shape.length is not None and len(sizes) >= 2 and sizes[1] == shape.length)
        if name in known:
            learned = (known[name][0], known[name][1] and shape.length is not None)
            if any(padded and not fits for padded, fits in zip(learned, rule)):
                return None
            rule = learned
        dims[name] = rule
    return dims


def with_attention_mask(call: NamedCall, shape: CallShape, device: torch.device) -> NamedCall:
    """``call`` with an ``attention_mask`` of ones over its tokens where it passed none (its padding is then masked)."""
    if call.tensors().get("attention_mask") is not None or shape.length is None:
        return call
    mask = torch.ones(shape.batch, shape.length, dtype=torch.long, device=device)
    if any(name == "attention_mask" for name, _ in call.positional):  # passed as None positionally
        return call.replaced(lambda name, value: mask if name == "attention_mask" else value)
    return NamedCall(call.positional, {**call.keywords, "attention_mask": mask}, call.by_keyword)


def pad_call(call: NamedCall, shape: CallShape, bucket: CallShape, dims: ArgumentDims,
             fills: dict[str, float]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments padded to ``bucket`` (``fills``: the value per argument name, default 0)."""
    def pad(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not any(dims.get(name, ())):
            return value
        batch_pad = bucket.batch - shape.batch if dims[name][0] else 0
        length_pad = bucket.length - shape.length if dims[name][1] and bucket.length is not None else 0
        if batch_pad == length_pad == 0:
            return value
        if name == "position_ids":
            return _continued_positions(value, batch_pad, length_pad)
        padded = F.pad(value, _pad_widths(value.dim(), batch_pad, length_pad), value=fills.get(name, 0))
        if name == "attention_mask" and batch_pad:
            padded[shape.batch:] = 1  # padded rows attend to their pad tokens: no fully masked row
        return padded

    return call.replaced(pad).arguments()


def repeated_to(call: NamedCall, shape: CallShape, bucket: CallShape, dims: ArgumentDims) -> NamedCall:
    """``call`` with its batch and sequence dims filled to exactly ``bucket`` by repeating its rows and positions
    (a call the size of a bucket, for capturing it ahead of time)."""
    def repeat(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        for dim, (padded, size, target) in enumerate(zip(dims.get(name, ()), shape, bucket)):
            if padded and target is not None and target != size:
                value = value.index_select(dim, torch.arange(target, device=value.device) % size)
        return value

    return call.replaced(repeat)


def _pad_widths(ndim: int, batch_pad: int, length_pad: int) -> tuple[int, ...]:
    """F.pad's widths (last dim first) for ``batch_pad`` at the end of dim 0 and ``length_pad`` at the end of dim 1."""
    widths = [0] * (2 * ndim)
    widths[2 * (ndim - 1) + 1] = batch_pad
    if ndim >= 2:
        widths[2 * (ndim - 2) + 1] = length_pad
    return tuple(widths)


def _continued_positions(positions: torch.Tensor, batch_pad: int, length_pad: int) -> torch.Tensor:
    """Positions counted on past each row's last one; padded rows copy the first row."""
    if length_pad:
        steps = torch.arange(1, length_pad + 1, device=positions.device, dtype=positions.dtype)
        positions = torch.cat([positions, positions[:, -1:] + steps], dim=1)
    if batch_pad:
        positions = torch.cat([positions, positions[:1].expand(batch_pad, *positions.shape[1:])], dim=0)
    return positions


def slice_to(value: torch.Tensor, dims: tuple[tuple[int, str], ...], shape: CallShape) -> torch.Tensor:
    """``value`` cut back to the call's batch and length on ``dims``."""
    for dim, kind in dims:
        size = shape.batch if kind == BATCH else shape.length
        if size is not None and dim < value.dim() and value.shape[dim] > size:
            value = value.narrow(dim, 0, size)
    return value


def _items_replaceable(out: dict) -> bool:
    """Plain dicts, and transformers' ``ModelOutput`` (its ``__setitem__`` keeps the attribute of the same name in
    step); looked up only where transformers is already imported (it is optional)."""
    setitem = type(out).__setitem__
    generic = sys.modules.get("transformers.utils.generic")
    return setitem is dict.__setitem__ or (generic is not None and setitem is generic.ModelOutput.__setitem__)


def _dims_by_size(value: torch.Tensor, bucket: CallShape) -> tuple[tuple[int, str], ...]:
    """The fallback rule for a leaf the check did not see (module docstring)."""
    dims = [(0, BATCH)] if value.dim() >= 1 and value.shape[0] == bucket.batch else []
    if bucket.length is not None:
        dims += [(d, LENGTH) for d in range(1, value.dim()) if value.shape[d] == bucket.length]
    return tuple(dims)


def slice_outputs(out: Any, shape: CallShape, bucket: CallShape, known: OutputDims) -> Any:
    """Every tensor leaf of ``out`` sliced back from ``bucket`` to the call's ``shape``."""
    if shape == bucket:
        return out

    def leaf(path: str, value: torch.Tensor) -> torch.Tensor:
        dims = known.get(path)
        return slice_to(value, _dims_by_size(value, bucket) if dims is None else dims, shape)

    return map_tensor_leaves(out, "", leaf)


def map_tensor_leaves(out: Any, path: str, leaf: Callable[[str, torch.Tensor], torch.Tensor]) -> Any:
    """``out`` with ``leaf(path, tensor)`` for each tensor, paths spelt as ``pytree.keystr``. Dicts (transformers'
    ``ModelOutput`` too: a fresh object per call) are updated in place, sparing a rebuild per call; tuples and lists
    rebuilt; other containers go through ``torch.utils._pytree``."""
    if isinstance(out, torch.Tensor):
        return leaf(path, out)
    if type(out) in (tuple, list):
        return type(out)(map_tensor_leaves(value, f"{path}[{i}]", leaf) for i, value in enumerate(out))
    if isinstance(out, dict) and _items_replaceable(out):
        for key, value in out.items():
            if value is not None:
                out[key] = map_tensor_leaves(value, f"{path}[{key!r}]", leaf)
        return out
    leaves, spec = pytree.tree_flatten_with_path(out)
    return pytree.tree_unflatten([leaf(path + pytree.keystr(p), v) if isinstance(v, torch.Tensor) else v
                                  for p, v in leaves], spec)


def output_dims(first: Any, second: Any, first_shape: CallShape, second_shape: CallShape
                ) -> tuple[OutputDims, list[str]]:
    """The dims of each output leaf that follow the padding, from two runs padded to two different shapes; and the
    leaves with a dim that changed but is neither the batch nor the length (a flattened batch x length: they cannot
    be sliced back)."""
    dims: OutputDims = {}
    unsliceable: list[str] = []
    a, _ = pytree.tree_flatten_with_path(first)
    b, _ = pytree.tree_flatten_with_path(second)
    for (path, x), (_, y) in zip(a, b):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.dim() != y.dim():
            continue
        found = []
        for d, (m, n) in enumerate(zip(x.shape, y.shape)):
            if m == n:
                continue
            kind = _dim_kind(m, n, first_shape, second_shape)
            if kind is None:
                unsliceable.append(f"output {pytree.keystr(path) or 'output'} (dim {d}: {m} -> {n})")
            else:
                found.append((d, kind))
        dims[pytree.keystr(path)] = tuple(found)
    return dims, unsliceable


def _dim_kind(m: int, n: int, first: CallShape, second: CallShape) -> str | None:
    if (m, n) == (first.batch, second.batch):
        return BATCH
    if first.length is not None and (m, n) == (first.length, second.length):
        return LENGTH
    return None
