"""Activation checkpointing of a model's repeated blocks, in place, with a measured memory plan.

``apply_checkpointing(model)`` finds the model's stack of identical blocks (a transformer's layers) and
makes each chosen block run under non-reentrant ``torch.utils.checkpoint.checkpoint``: the block's
intermediate activations are dropped after the forward and recomputed during the backward.

* ``policy="full"`` keeps only each block's inputs; everything inside is recomputed.
* ``policy="selective"`` keeps the outputs of matmuls and attention (the expensive ops) and recomputes
  the cheap pointwise ones (norms, activations, rotary, residual adds), through PyTorch's selective
  activation checkpointing (``create_selective_checkpoint_contexts``).

The wrap replaces the block's ``forward`` on the instance only: the module objects, their names,
parameters and ``state_dict`` keys do not change, so checkpoints load both ways, and
``remove_checkpointing`` undoes it. Dropout gives the same masks on recomputation because the RNG state
is saved and restored around it (``preserve_rng_state=True``).

With ``budget_gb`` and ``example_inputs`` only as many blocks as needed are checkpointed, from the first:
the bytes each block keeps for backward are measured on the example inputs with saved-tensor hooks.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from kernel_pytorch.memory.activation_offload import _eager_saved_tensors_hooks
from kernel_pytorch.verify import call_arguments

__all__ = [
    "POLICIES",
    "CheckpointPlan",
    "apply_checkpointing",
    "find_repeated_blocks",
    "remove_checkpointing",
    "saved_activation_bytes",
    "selective_checkpoint_policy",
]

POLICIES = ("full", "selective")

# Budgets are given in GiB, the unit torch.cuda.memory_summary and nvidia-smi report.
_GIB = 1 << 30

# Where a wrapped block keeps its checkpointing settings (an instance attribute, never a submodule, so
# ``state_dict`` and ``named_modules`` are untouched).
_STATE_ATTR = "_kernel_pytorch_checkpoint"

# aten ops whose outputs selective checkpointing keeps: the matmuls (``linear`` and ``matmul`` reach the
# dispatcher as these) and the fused attention kernels. Recomputing them would redo the FLOPs that
# dominate a transformer block; everything else in a block is memory-bound and cheap to redo.
_SAVED_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})
_SAVED_ATTENTION_PREFIXES = ("_scaled_dot_product_", "_flash_attention_forward", "_efficient_attention_forward")
# The same for this library's own ops, which is what ``optimize`` leaves in a model: its attention and
# FP8 matmul ops are single dispatcher ops, so the aten names above never show inside them. Without
# these, selective checkpointing after ``optimize`` recomputed every attention forward in the backward.
_SAVED_LIBRARY_OPS = frozenset({"attention_fwd", "ring_attention_fwd", "float8_linear"})


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass
class CheckpointPlan:
    """What ``apply_checkpointing`` did; ``describe()`` gives the one-line report entry.

    Byte counts are ``None`` unless ``example_inputs`` were given (nothing was measured). "Saved" bytes
    are the unique bytes that autograd keeps for backward on the example inputs (see
    ``saved_activation_bytes``), parameters excluded.

    Example::

        plan = apply_checkpointing(model, policy="selective", budget_gb=20, example_inputs=(tokens,))
        print(plan.describe())
        # checkpointing (selective): 7/12 blocks of 'layers' wrapped; saved activations 31.2 GiB ->
        # 19.6 GiB (budget 20.0 GiB)
    """

    policy: str
    group: str
    """Path of the container holding the blocks, e.g. ``'layers'``; ``''`` for the model itself."""
    candidates: tuple[str, ...]
    """Paths of every block of the repeated group, in order."""
    wrapped: tuple[str, ...]
    """Paths of the blocks now running under checkpoint (a prefix of ``candidates``)."""
    budget_bytes: int | None = None
    saved_bytes_before: int | None = None
    """Measured with no block checkpointed."""
    saved_bytes_after: int | None = None
    """Measured with ``wrapped`` checkpointed."""
    block_bytes_before: dict[str, int] = field(default_factory=dict)
    """Per block: bytes first kept for backward inside that block, not checkpointed."""
    block_bytes_after: dict[str, int] = field(default_factory=dict)
    """Per block: the same, checkpointed with ``policy`` (its kept inputs and, if selective, its saved
    matmul outputs)."""
    fits_budget: bool | None = None
    """``None`` without a budget; ``False`` when even every block checkpointed stays over it."""
    message: str = ""

    def describe(self) -> str:
        """One line for a report: the policy, what was wrapped, and the measured effect."""
        where = f"'{self.group}'" if self.group else "the model"
        line = f"checkpointing ({self.policy}): {len(self.wrapped)}/{len(self.candidates)} blocks of {where} wrapped"
        if self.saved_bytes_before is not None and self.saved_bytes_after is not None:
            line += f"; saved activations {_gib(self.saved_bytes_before)} -> {_gib(self.saved_bytes_after)}"
        if self.budget_bytes is not None:
            line += f" (budget {_gib(self.budget_bytes)})"
        if self.fits_budget is False:
            line += "; over budget even with every block checkpointed"
        return line


def _gib(n: int) -> str:
    # Small test models save kilobytes; three significant digits keep them readable too.
    return f"{n / _GIB:.3g} GiB"


# --------------------------------------------------------------------------------------------------
# Finding the blocks
# --------------------------------------------------------------------------------------------------


def _signature(module: nn.Module) -> tuple:
    """Blocks are "the same" when they share a class and their parameters' names and shapes."""
    return (type(module), tuple((name, tuple(p.shape)) for name, p in module.named_parameters()))


def _group_numel(modules: Sequence[nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def find_repeated_blocks(model: nn.Module) -> tuple[str, list[str]]:
    """The model's largest group of repeated blocks: ``(container_path, block_paths)``.

    A group is the children of one ``nn.ModuleList`` or ``nn.Sequential`` that share a class and
    parameter shapes, at least two of them. "Largest" means most parameters, then most blocks: a
    transformer's layer stack beats a list of small heads.

    Example::

        group, blocks = find_repeated_blocks(LlamaStyleLM(LlamaStyleConfig.tiny()))
        # ('layers', ['layers.0', 'layers.1'])

    Raises ``ValueError`` when the model has no such group.
    """
    best: tuple[tuple[int, int], str, list[str]] | None = None
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_signature: dict[tuple, list[tuple[str, nn.Module]]] = defaultdict(list)
        for name, child in container.named_children():
            by_signature[_signature(child)].append((name, child))
        for members in by_signature.values():
            if len(members) < 2:
                continue
            key = (_group_numel([m for _, m in members]), len(members))
            if best is None or key > best[0]:
                paths = [f"{path}.{name}" if path else name for name, _ in members]
                best = (key, path, paths)
    if best is None:
        raise ValueError(
            f"model: no repeated blocks found in {type(model).__name__}; apply_checkpointing needs an "
            "nn.ModuleList or nn.Sequential holding at least two modules of the same class and parameter "
            "shapes (e.g. a transformer's layers)")
    return best[1], best[2]


# --------------------------------------------------------------------------------------------------
# The selective policy
# --------------------------------------------------------------------------------------------------


def _is_saved_op(op: Any) -> bool:
    """True for the aten matmul and fused-attention ops whose outputs selective checkpointing keeps."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    namespace, _, name = schema.name.partition("::")
    if namespace == "kernel_pytorch":
        return name in _SAVED_LIBRARY_OPS
    return namespace == "aten" and (name in _SAVED_MATMULS or name.startswith(_SAVED_ATTENTION_PREFIXES))


def selective_checkpoint_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The policy of ``policy="selective"``, in the form ``create_selective_checkpoint_contexts`` takes:
    ``MUST_SAVE`` for aten ``mm``/``addmm``/``bmm``/``baddbmm``/``_scaled_mm``, the fused attention
    ops (``_scaled_dot_product_*``) and this library's attention and FP8 linear ops,
    ``PREFER_RECOMPUTE`` for everything else.

    Example::

        context_fn = functools.partial(create_selective_checkpoint_contexts, selective_checkpoint_policy)
        out = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
    """
    return CheckpointPolicy.MUST_SAVE if _is_saved_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_checkpoint_policy)


# --------------------------------------------------------------------------------------------------
# Measuring what autograd keeps
# --------------------------------------------------------------------------------------------------


class _SavedBytesMeter:
    """Unique storages kept for backward, each charged to the block running when it was first seen.

    A storage is "seen" while it lives: its key (device, address) is forgotten when it is freed, so a
    later storage that the allocator places at the same address counts as the new storage it is. That
    lets ``_measure`` drop what the forward saves instead of keeping it (see ``_Dropped``).
    """

    def __init__(self, excluded: set[tuple[torch.device, int]]):
        self.excluded = excluded  # parameters and buffers: they stay in memory anyway
        self.seen: set[tuple[torch.device, int]] = set()
        self.owner = ""  # path of the block running now; '' outside every block
        self.by_owner: dict[str, int] = defaultdict(int)

    @property
    def total(self) -> int:
        return sum(self.by_owner.values())

    def add(self, tensor: torch.Tensor) -> bool:
        """Charge ``tensor``'s storage unless already seen; True when its storage has a tracked
        lifetime (a plain strided tensor), i.e. when dropping the tensor cannot confuse the count."""
        key, nbytes, storage = _storage_key(tensor)
        if nbytes == 0 or key in self.excluded or key in self.seen:
            return storage is not None
        self.seen.add(key)
        if storage is not None:
            # The storage's Python object lives exactly as long as the storage (PyTorch preserves it).
            weakref.finalize(storage, self.seen.discard, key)
        self.by_owner[self.owner] += nbytes
        return storage is not None


def _storage_key(tensor: torch.Tensor) -> tuple[tuple[torch.device, int], int, Any]:
    """(device, address) of the tensor's storage, its bytes, and the storage (``None`` when it has no
    plain storage)."""
    try:
        storage = tensor.untyped_storage()
        return (tensor.device, storage.data_ptr()), storage.nbytes(), storage
    except (RuntimeError, NotImplementedError):
        # Tensors without a plain storage (sparse, some subclasses): count their elements, never dedupe.
        return (tensor.device, id(tensor)), tensor.numel() * tensor.element_size(), None


# The meters measuring now. Checkpointed blocks report their kept inputs and selectively saved outputs
# here: checkpoint keeps those itself, out of reach of the outer saved-tensor hooks.
_ACTIVE_METERS: list[_SavedBytesMeter] = []


def _charge(tensors: Any) -> None:
    for meter in _ACTIVE_METERS:
        for t in _tensors_in(tensors):
            meter.add(t)


def _tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    return (t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


class _RecordingPolicy:
    """While measuring: a selective policy that charges the outputs selective checkpointing keeps (it
    caches them itself, out of reach of saved-tensor hooks).

    torch 2.13 asks the policy after running the op and hands it the output (``ctx.op_output``); older
    versions ask before running it, so the op to be saved is left ``pending`` for
    ``_ChargeSavedOutputs`` to charge its output.
    """

    def __init__(self, policy: Callable):
        self.policy = policy
        self.pending: Any = None

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision = self.policy(ctx, op, *args, **kwargs)
        if not ctx.is_recompute and decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            if hasattr(ctx, "op_output"):
                _charge(ctx.op_output)
            else:
                self.pending = op
        return decision


class _ChargeSavedOutputs(TorchDispatchMode):
    """The other half of ``_RecordingPolicy`` for torch versions that ask the policy before the op.

    Entered outside the checkpoint, this mode sits under selective checkpointing's own dispatch mode,
    which decides about each op and then runs it: the op reaching us is the one just decided.
    """

    def __init__(self, recorder: _RecordingPolicy):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recorder.pending is func:
            _charge(out)
        self.recorder.pending = None
        return out


def _state_storages(model: nn.Module) -> set[tuple[torch.device, int]]:
    return {_storage_key(t)[0] for t in [*model.parameters(), *model.buffers()]}


class _Dropped:
    """What a measuring forward saves in place of a tensor: nothing. The measurement never runs the
    backward, so keeping the saved tensors would only make it need the very memory it measures (a
    1B-parameter model with hand-written attention at 8k tokens saves more than an 80 GB GPU holds);
    dropped, its peak is that of the forward alone."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<dropped by saved_activation_bytes>"


_DROPPED = _Dropped()


def _never_unpacked(packed: Any) -> torch.Tensor:
    if packed is _DROPPED:
        raise RuntimeError("saved_activation_bytes / apply_checkpointing(example_inputs=...): the model ran a "
                           "backward inside its forward, which needs the tensors the measurement drops; "
                           "measure without example_inputs")
    return packed


@contextlib.contextmanager
def _undisturbed(model: nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
    """Measuring runs forwards; leave the RNG streams and buffers (e.g. BatchNorm statistics) as found."""
    devices = sorted({t.device.index or 0 for t in [*_tensors_in((args, kwargs)), *model.parameters()]
                      if t.device.type == "cuda"})
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)


def _measure(model: nn.Module, example_inputs: Any, loss_fn: Callable | None,
             blocks: dict[str, nn.Module]) -> _SavedBytesMeter:
    """One forward (and ``loss_fn``) under saved-tensor hooks; storages charged to ``blocks``' paths."""
    if not isinstance(example_inputs, (torch.Tensor, tuple, list, dict)):
        # call_arguments would pass it as the one argument; the model's error would not name the cause.
        raise ValueError(f"example_inputs: expected a tensor, a tuple/list of arguments or a dict of keyword "
                         f"arguments, got {type(example_inputs).__name__}")
    args, kwargs = call_arguments(example_inputs)
    meter = _SavedBytesMeter(_state_storages(model))

    def pack(tensor):
        if torch.compiler.is_compiling():
            return tensor  # a dynamo backend checking its graph on real tensors: not the model's forward
        return _DROPPED if meter.add(tensor) else tensor

    def enter(path):
        def hook(module, inputs):
            meter.owner = path
        return hook

    def leave(module, inputs, output):
        meter.owner = ""

    handles = [h for path, block in blocks.items()
               for h in (block.register_forward_pre_hook(enter(path)), block.register_forward_hook(leave))]
    _ACTIVE_METERS.append(meter)
    try:
        with _undisturbed(model, args, kwargs), torch.enable_grad(), \
                _eager_saved_tensors_hooks(pack, _never_unpacked):
            out = model(*args, **kwargs)
            if loss_fn is not None:
                out = loss_fn(out)
            del out
    finally:
        _ACTIVE_METERS.remove(meter)
        for handle in handles:
            handle.remove()
    return meter


def saved_activation_bytes(model: nn.Module, example_inputs: Any, loss_fn: Callable | None = None) -> int:
    """Unique bytes autograd keeps for backward after ``model(*example_inputs)`` (then ``loss_fn(out)``
    when given): each saved storage counted once, the model's parameters and buffers not at all.

    Blocks checkpointed by ``apply_checkpointing`` count what checkpointing keeps for them (their inputs,
    and with ``policy="selective"`` the matmul outputs). The model runs in its current train/eval mode;
    RNG state and buffers are restored afterwards, and no gradient is computed.

    Example::

        before = saved_activation_bytes(model, (tokens,))
        apply_checkpointing(model)
        after = saved_activation_bytes(model, (tokens,))   # after < before
    """
    return _measure(model, example_inputs, loss_fn, {}).total


# --------------------------------------------------------------------------------------------------
# Wrapping and unwrapping
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _WrapState:
    policy: str
    original_forward: Callable | None  # an instance-level forward found there before us, if any


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a wrapped block (bound to the block as ``block.forward``)."""
    state: _WrapState = getattr(self, _STATE_ATTR)
    # functools.partial, not ``type(self).forward.__get__(self)``: torch 2.11's Dynamo cannot trace
    # ``function.__get__`` and broke the graph at every block, much slower in the memory benchmark
    # (docs/kernels.md, "Memory wrappers").
    inner = state.original_forward if state.original_forward is not None else functools.partial(type(self).forward, self)
    if not torch.is_grad_enabled():
        # Nothing is saved for backward under no_grad / inference: checkpointing would only add overhead.
        return inner(*args, **kwargs)
    args, kwargs = _without_kv_cache(args, kwargs)
    if _ACTIVE_METERS:
        _charge((args, kwargs))  # checkpoint keeps the block's inputs to rerun it in backward

    def run(*run_args):
        # kwargs go through a closure, so a block's own keyword named like a checkpoint option
        # (``context_fn``, ``debug``...) cannot be taken for one.
        return inner(*run_args, **kwargs)

    options = {"use_reentrant": False, "preserve_rng_state": True}
    mode = contextlib.nullcontext()
    if state.policy == "selective" and _ACTIVE_METERS:
        recorder = _RecordingPolicy(selective_checkpoint_policy)
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, recorder)
        mode = _ChargeSavedOutputs(recorder)
    elif state.policy == "selective":
        options["context_fn"] = _selective_contexts
    with mode:
        return checkpoint(run, *args, **options)


# Keyword arguments through which transformers' decoder layers write their KV cache.
_KV_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")


def _is_kv_cache(value: Any) -> bool:
    # transformers' Cache objects, recognised without importing transformers (if it is not imported,
    # no such object can exist).
    cache_utils = sys.modules.get("transformers.cache_utils")
    return cache_utils is not None and isinstance(value, getattr(cache_utils, "Cache", ()))


def _without_kv_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block that appends to a KV cache would append twice, once more when the backward recomputes
    it, and the recomputation then fails on the longer keys. As transformers' own gradient checkpointing
    does, a checkpointed block gets no cache (``None`` in its place) and ``use_cache=False``, with a
    warning."""
    dropped = [f"argument {i}" for i, a in enumerate(args) if _is_kv_cache(a)]
    dropped += [k for k, v in kwargs.items() if v is not None and (k in _KV_CACHE_KWARGS or _is_kv_cache(v))]
    if kwargs.get("use_cache"):
        dropped.append("use_cache")
    if not dropped:
        return args, kwargs
    warnings.warn(f"checkpointed blocks do not use a KV cache: ignoring {', '.join(dropped)} (as transformers' "
                  "gradient checkpointing does); pass use_cache=False to the model to silence this", stacklevel=2)
    args = tuple(None if _is_kv_cache(a) else a for a in args)
    kwargs = {k: None if k in _KV_CACHE_KWARGS or _is_kv_cache(v) else v for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def _is_wrapped(block: nn.Module) -> bool:
    return _STATE_ATTR in block.__dict__


def _wrap(block: nn.Module, policy: str) -> None:
    original = block.__dict__.get("forward")  # e.g. a forward another library patched in
    object.__setattr__(block, _STATE_ATTR, _WrapState(policy, original))
    # A bound method, not a closure over the block: copy.deepcopy rebinds it to the copy.
    block.forward = types.MethodType(_checkpointed_forward, block)


def _unwrap(block: nn.Module) -> None:
    state: _WrapState = block.__dict__.pop(_STATE_ATTR)
    if state.original_forward is not None:
        block.forward = state.original_forward
    else:
        del block.forward


def remove_checkpointing(model: nn.Module) -> list[str]:
    """Undo ``apply_checkpointing``: every wrapped block of ``model`` gets its own forward back.

    Returns the paths unwrapped (empty when nothing was wrapped).

    Example::

        apply_checkpointing(model)
        remove_checkpointing(model)   # ['layers.0', 'layers.1', ...]
    """
    unwrapped = []
    for path, module in model.named_modules():
        if _is_wrapped(module):
            _unwrap(module)
            unwrapped.append(path)
    return unwrapped


# --------------------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------------------


def _validate(policy: str, budget_gb: float | None, example_inputs: Any) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {POLICIES}, got {policy!r}")
    if budget_gb is None:
        return
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)) or not budget_gb > 0:
        raise ValueError(f"budget_gb: expected a positive number of GiB, got {budget_gb!r}")
    if example_inputs is None:
        raise ValueError("example_inputs: required with budget_gb, to measure what each block saves")


def _count_to_wrap(outside: int, before: list[int], after: list[int], budget: int) -> int:
    """Fewest blocks, from the first, whose checkpointing brings the estimate under ``budget``."""
    total = outside + sum(before)
    for count in range(len(before) + 1):
        if total <= budget:
            return count
        if count < len(before):
            total += after[count] - before[count]
    return len(before)


def apply_checkpointing(model: nn.Module, policy: str = "full", budget_gb: float | None = None,
                        example_inputs: Any = None) -> CheckpointPlan:
    """Checkpoint the repeated blocks of ``model`` in place; returns the ``CheckpointPlan``.

    Args:
        model: the model; its blocks are found with ``find_repeated_blocks``.
        policy: ``"full"`` (recompute everything inside a block) or ``"selective"`` (keep matmul and
            attention outputs, recompute the pointwise ops; less memory saved, less recompute).
        budget_gb: target for the activation bytes kept for backward (GiB, 2**30 bytes; parameters
            not counted) on ``example_inputs``; blocks are checkpointed from the first until the
            measured estimate fits. Without it every block is checkpointed.
        example_inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments for
            ``model``; with it, the bytes before and after are measured (in the model's current
            train/eval mode) and recorded in the plan.

    Calling it again replaces the previous wrapping; ``remove_checkpointing`` undoes it. If the budget
    cannot be met even with every block checkpointed, every block is wrapped and the plan says so
    (``fits_budget=False``) instead of raising. A checkpointed block running with gradients gets no KV
    cache (transformers' ``past_key_values``, ``use_cache=False``, a warning), as in transformers' own
    gradient checkpointing: recomputing it would write the cache twice.

    Example::

        model = LlamaStyleLM(config).train()
        plan = apply_checkpointing(model, policy="selective", budget_gb=20, example_inputs=(tokens,))
        print(plan.describe())
        model(tokens).sum().backward()    # the same gradients, less memory
    """
    _validate(policy, budget_gb, example_inputs)
    group, paths = find_repeated_blocks(model)
    remove_checkpointing(model)
    blocks = {path: model.get_submodule(path) for path in paths}
    plan = CheckpointPlan(policy=policy, group=group, candidates=tuple(paths), wrapped=())
    if example_inputs is None:
        _wrap_all(blocks.values(), policy)
        plan.wrapped = tuple(paths)
        return plan

    plan.budget_bytes = None if budget_gb is None else int(budget_gb * _GIB)
    try:
        _plan_from_measurements(model, example_inputs, blocks, plan)
    except BaseException:
        remove_checkpointing(model)  # a model that fails on its example inputs is left unwrapped
        raise
    return plan


def _plan_from_measurements(model: nn.Module, example_inputs: Any, blocks: dict[str, nn.Module],
                            plan: CheckpointPlan) -> None:
    """Measure with no block and with every block checkpointed, keep the fewest wrapped that fit."""
    paths, policy = list(blocks), plan.policy
    plain = _measure(model, example_inputs, None, blocks)
    _wrap_all(blocks.values(), policy)
    checkpointed = _measure(model, example_inputs, None, blocks)
    plan.saved_bytes_before = plain.total
    plan.block_bytes_before = {path: plain.by_owner.get(path, 0) for path in paths}
    after_all = {path: checkpointed.by_owner.get(path, 0) for path in paths}

    count = len(paths)
    if plan.budget_bytes is not None:
        count = _count_to_wrap(plain.by_owner.get("", 0), list(plan.block_bytes_before.values()),
                               list(after_all.values()), plan.budget_bytes)
        for path in paths[count:]:
            _unwrap(blocks[path])
    # The estimate adds per-block figures; what is recorded is measured on the final wrapping, and
    # should the estimate have been short, one more block is wrapped until the measurement fits.
    saved_after = checkpointed.total if count == len(paths) else saved_activation_bytes(model, example_inputs)
    while plan.budget_bytes is not None and saved_after > plan.budget_bytes and count < len(paths):
        _wrap(blocks[paths[count]], policy)
        count += 1
        saved_after = saved_activation_bytes(model, example_inputs)
    plan.wrapped = tuple(paths[:count])
    plan.saved_bytes_after = saved_after
    plan.block_bytes_after = {path: after_all[path] if path in plan.wrapped else plan.block_bytes_before[path]
                              for path in paths}
    _finish_budget(plan)


def _wrap_all(blocks: Any, policy: str) -> None:
    for block in blocks:
        _wrap(block, policy)


def _finish_budget(plan: CheckpointPlan) -> None:
    if plan.budget_bytes is None:
        return
    plan.fits_budget = plan.saved_bytes_after <= plan.budget_bytes
    if not plan.fits_budget:
        plan.message = (f"over budget: {_gib(plan.saved_bytes_after)} kept for backward with "
                        f"{len(plan.wrapped)}/{len(plan.candidates)} blocks checkpointed ({plan.policy}), "
                        f"budget {_gib(plan.budget_bytes)}; try policy='full', smaller inputs or "
                        "activation offloading")
    elif not plan.wrapped:
        plan.message = "within budget without checkpointing"
