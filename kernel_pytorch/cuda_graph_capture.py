"""Capturing one call as a CUDA graph after warm-up runs (a decode step, a prefill bucket, a shape bucket), the
addresses a captured graph read its module's tensors at, and the module state a replay would ignore (train/eval
modes, hooks)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn as nn

from kernel_pytorch.compiled_call import GLOBAL_HOOK_DICTS

__all__ = ["capture_after_warm_up", "ModuleState", "module_state", "registered_hook"]

# A module's own hook dictionaries (the global ones: compiled_call.GLOBAL_HOOK_DICTS)
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")

T = TypeVar("T")


def capture_after_warm_up(body: Callable[[], T], warm_ups: int, reset: Callable[[], None],
                          sharing: Mapping[Any, torch.cuda.CUDAGraph]) -> tuple[torch.cuda.CUDAGraph, T]:
    """``body`` run ``warm_ups`` times on a side stream, then captured once into a new CUDA graph; ``reset`` runs
    before each run and before the capture (a run writes what the capture must find as it was). The warm-ups come
    first because a capture must not be a first run: Triton compiles, cuBLAS workspaces and the allocator's first
    blocks happen there. The new graph shares the memory pool of the graphs in ``sharing`` (none yet: a pool of its
    own). Returns the graph and what the captured call returned (in the graph's memory: each replay rewrites it)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warm_ups):
            reset()
            body()
    torch.cuda.current_stream().wait_stream(stream)
    reset()
    graph = torch.cuda.CUDAGraph()
    pool = next(iter(sharing.values())).pool() if sharing else None
    with torch.cuda.graph(graph, pool=pool):
        output = body()
    return graph, output


class ModuleState(NamedTuple):
    """What a graph captured from ``model`` depends on beyond its inputs: where each parameter and buffer lives (and
    its dtype), each module's training flag; and whether a forward or backward hook is registered (a replay runs
    none of a hook's Python)."""

    addresses: tuple[tuple[int, torch.dtype], ...]
    training: tuple[bool, ...]
    hooked: bool

    def changed_since(self, earlier: ModuleState | None) -> str:
        """What changed since ``earlier`` that graphs captured then depend on ('' when nothing did, or no graph was
        captured before: ``earlier`` None)."""
        if earlier is None:
            return ""
        if self.addresses != earlier.addresses:
            return "the model's parameters or buffers moved"
        return "a module's train/eval mode changed" if self.training != earlier.training else ""


def module_state(model: nn.Module) -> ModuleState:
    """The :class:`ModuleState` of ``model``. Checked at every call that replays a graph, so the module tree is
    walked directly, without the qualified names ``named_modules()`` builds (a shared tensor is listed once per
    owner, which compares the same)."""
    addresses, training, modules = [], [], [model]
    hooked = any(GLOBAL_HOOK_DICTS)
    while modules:
        module = modules.pop()
        addresses += [(t.data_ptr(), t.dtype) for t in itertools.chain(module._parameters.values(),
                                                                       module._buffers.values()) if t is not None]
        training.append(module.training)
        hooked = hooked or any(getattr(module, name) for name in _HOOK_DICTS)
        modules += [child for child in module._modules.values() if child is not None]
    return ModuleState(tuple(addresses), tuple(training), hooked)


def registered_hook(model: nn.Module) -> str:
    """Where a forward or backward hook is registered on ``model`` or globally, named for a report line ('' where
    none is)."""
    if any(GLOBAL_HOOK_DICTS):
        return "a global module hook (torch.nn.modules.module.register_module_forward_hook or the like)"
    for name, module in model.named_modules():
        for kind in _HOOK_DICTS:
            if getattr(module, kind):
                return f"a {kind.strip('_')[:-len('_hooks')].replace('_', ' ')} hook on {name or 'the model'}"
    return ""
