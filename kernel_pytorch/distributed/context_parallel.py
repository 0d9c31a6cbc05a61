"""``optimize(model, context_parallel=group)``: the model boundary of context (sequence) parallelism.

Every rank of ``group`` calls the optimized model with the FULL inputs, as it would without context
parallelism: the loss code stays as it was, and no rank needs to know the layout. Chosen over passing local
shards because the outputs come back whole too (``gather_sequence``), so labels, losses and metrics need no
change; the cost is that each rank holds the full token ids (small) and the full logits (not small: a loss
on the local shard would avoid it, and is the next step for long sequences with large vocabularies).

What the wrapper in ``model._compiled_call_impl`` does per call:

1. checks that every rank passed the same input shapes (one small all_gather: mismatched ranks raise the
   same error everywhere instead of hanging later);
2. shards dim 1 (batch-first sequence) of every tensor input to this rank's zigzag part (no communication);
3. runs the compiled model on it: the context_parallel pass (``kernel_pytorch.passes.context_parallel``) made its
   causal attention ring attention and its RoPE tables the rows of the tokens' global positions;
4. gathers dim 1 of every tensor output back into the full sequence (differentiable).

Parameter gradients: the gathered outputs are the same on every rank, so every rank computes the same loss,
and ``gather_sequence``'s backward sums the N identical copies of each part's gradient: rank r's parameter
gradient is N x the contribution of its tokens. A hook on each parameter averages its gradient over the
group (all_reduce / N), which gives each rank the full-sequence gradient; a term that is already the same
on every rank (weight decay on the parameters) is left as it was by the average. DDP over the same group
averages again, which changes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.utils import _pytree as pytree

from kernel_pytorch.distributed.rank_group import RankGroup, require_same_on_all_ranks
from kernel_pytorch.distributed.sequence_sharding import gather_sequence, shard_sequence
from kernel_pytorch.errors import KernelPytorchError

__all__ = ["ContextParallelCall", "ContextParallelError", "backend_config", "install", "require_passes"]

# Batch-first models: (batch, sequence, ...) token ids, embeddings and logits.
_SEQUENCE_DIM = 1
# Passes the rewrite needs: without them attention and RoPE would run on the local shard as if it were the
# whole sequence.
_REQUIRED_PASSES = ("normalize", "rope", "attention", "context_parallel")


class ContextParallelError(KernelPytorchError, ValueError):
    """The model or its inputs cannot be split along the sequence; the message names what and where."""


def backend_config(config):
    """The config the backend gets: per-graph verification off (a rewritten graph computes the local
    shard at global positions, so it differs from the captured graph by design; the end-to-end check
    against the unsharded model stands in) and, unless asked otherwise, static shapes (a causal mask proven
    only behind a runtime guard would fall back to local attention where the guard fails)."""
    if config.context_parallel is None:
        return config
    disabled = [name for name in _REQUIRED_PASSES if name in config.disable_passes]
    if disabled:
        raise ContextParallelError(f"context_parallel needs the passes {list(_REQUIRED_PASSES)}; "
                                   f"{disabled} are disabled (config.disable_passes)")
    return config.model_copy(update={"verify": False, "dynamic": False if config.dynamic is None else config.dynamic})


def require_passes(selected: Sequence[str]) -> None:
    """Raise unless the backend runs every pass sharding needs (``selected``: the pass names it runs)."""
    missing = [name for name in _REQUIRED_PASSES if name not in selected]
    if missing:
        raise ContextParallelError(f"context_parallel needs the passes {list(_REQUIRED_PASSES)}; this backend does "
                                   f"not run {missing} (disabled by config.disable_passes, or not on this hardware)")


def install(model: nn.Module, config, report) -> None:
    """Wrap the compiled call of ``model`` (see the module docstring) and hook its parameters' gradients, on
    the model and on its copies (``OptimizationState.add_around``)."""
    if config.context_parallel is not None:
        model._kernel_pytorch.add_around(functools.partial(_wrap_compiled_call, config=config))


def _wrap_compiled_call(model: nn.Module, report, *, config) -> None:
    ranks = RankGroup.of(config.context_parallel)
    call = ContextParallelCall(model, model._compiled_call_impl, ranks)
    model._compiled_call_impl = call
    for parameter in model.parameters():
        if parameter.requires_grad:
            call.hooks.append(parameter.register_hook(call.average_gradient))
    note = (f"context parallel over {ranks.size} ranks: inputs sharded along dim {_SEQUENCE_DIM} (zigzag), outputs "
            "gathered; parameter gradients averaged over the group. Per-graph verification is off (a sharded "
            "graph differs from the captured one by design); the end-to-end check compares with the unsharded "
            "model on the full example inputs")
    report.note(note)  # once: a copy of the model installs it again, with its report copied


class ContextParallelCall:
    """What :func:`install` puts in ``model._compiled_call_impl``: shard, run ``inner``, gather."""

    def __init__(self, model: nn.Module, inner, ranks: RankGroup):
        self.model = model
        self.inner = inner  # the compiled call (and memory wrappers) found there
        self.ranks = ranks
        self.hooks: list = []

    @property
    def active(self) -> bool:
        """False once optimize rolled everything back (the model then runs whole on every rank)."""
        return self.model._compiled_call_impl is self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        length = self._check_inputs(args, kwargs)
        args, kwargs = pytree.tree_map(self._shard, (args, kwargs))
        out = self.inner(*args, **kwargs)
        return pytree.tree_map(lambda value: self._gather(value, length // self.ranks.size), out)

    def average_gradient(self, grad: Tensor) -> Tensor | None:
        if not self.active or self.ranks.size == 1:
            return None
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=self.ranks.group)
        return total.div_(self.ranks.size)

    def _check_inputs(self, args: tuple, kwargs: dict) -> int:
        """The full sequence length, after checking that every rank passed the same shapes (before any
        local raise: a rank raising alone would leave the others waiting in that all_gather)."""
        tensors = {f"input {i}": t for i, t in enumerate(pytree.tree_leaves((args, kwargs))) if isinstance(t, Tensor)}
        if not tensors:
            raise ContextParallelError("context_parallel: the model got no tensor input to shard along the sequence")
        require_same_on_all_ranks(self.ranks, tensors, {}, "optimize(context_parallel=...)")
        lengths = {name: tuple(t.shape) for name, t in tensors.items()}
        if any(len(shape) <= _SEQUENCE_DIM for shape in lengths.values()) or \
                len({shape[_SEQUENCE_DIM] for shape in lengths.values()}) != 1:
            raise ContextParallelError(f"context_parallel shards dim {_SEQUENCE_DIM} (batch, sequence, ...) of every "
                                       f"tensor input, which must have one common length there; got {lengths}")
        length = next(iter(lengths.values()))[_SEQUENCE_DIM]
        if length % (2 * self.ranks.size):
            raise ContextParallelError(
                f"context_parallel: sequence length {length} is not divisible by 2 x world size = "
                f"{2 * self.ranks.size} (the zigzag layout gives each rank 2 of 2N equal chunks); pad the sequence")
        return length

    def _shard(self, value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        return shard_sequence(value, _SEQUENCE_DIM, self.ranks.group)

    def _gather(self, value: Any, local_length: int) -> Any:
        if not isinstance(value, Tensor):
            return value
        if value.dim() <= _SEQUENCE_DIM or value.shape[_SEQUENCE_DIM] != local_length:
            raise ContextParallelError(
                f"context_parallel: an output of shape {tuple(value.shape)} has no sequence dim {_SEQUENCE_DIM} of the "
                f"local length {local_length}, so it cannot be gathered (a loss or pooling inside the model's forward "
                "reduces over the local shard only: compute it outside, on the gathered outputs)")
        return gather_sequence(value, _SEQUENCE_DIM, self.ranks.group)
