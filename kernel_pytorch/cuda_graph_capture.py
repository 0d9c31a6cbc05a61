"""Capturing one call as a CUDA graph after warm-up runs (a decode step, a prefill bucket, a shape bucket), and the
addresses a captured graph read its module's tensors at."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.nn as nn

__all__ = ["capture_after_warm_up", "tensor_addresses"]

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


def tensor_addresses(model: nn.Module) -> tuple[tuple[int, torch.dtype], ...]:
    """Where each parameter and buffer lives, and its dtype: what a captured graph read. Checked at every call that
    replays one, so the module tree is walked directly, without the qualified name ``model.parameters()`` builds per
    tensor (a shared tensor is listed once per owner, which compares the same)."""
    addresses, modules = [], [model]
    while modules:
        module = modules.pop()
        addresses += [(t.data_ptr(), t.dtype) for t in itertools.chain(module._parameters.values(),
                                                                       module._buffers.values()) if t is not None]
        modules += [child for child in module._modules.values() if child is not None]
    return tuple(addresses)
