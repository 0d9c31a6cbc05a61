"""Each shape bucket's compiled call replayed from a CUDA graph of its own (``shape_buckets.cuda_graphs``).

Why not Inductor's ``compile="reduce-overhead"``: its CUDA-graph trees record a graph per shape as calls reach it and
check each replay against the tree's memory state; serving requests of random shapes through them ran slower than
without graphs (``benchmarks/results/variable_shapes.json``). Here a bucket's padded call is captured once, after
warm-up runs, into a graph that owns static copies of the call's tensors; a later call of that bucket copies its
padded tensors in, replays, and gets fresh copies of the outputs (the next replay rewrites the graph's own). All the
graphs share one memory pool: each capture reuses what the previous one freed, so the pool holds the largest
bucket's activations and every bucket's outputs (the static inputs are ordinary allocations, made before capture).

A graph is used for calls that are inference (no autograd), on a CUDA device, with hashable non-tensor arguments;
other calls run the compiled entry as without the option, and so does every call once a capture failed (an op that
syncs with the host), with a report line. When the model's parameters or buffers move (``.to()``,
``.half()``, a replaced parameter) or a module's train/eval mode changes, every graph is dropped and captured again
at its next call. While a forward or backward hook is registered (on the model, a submodule, or globally), calls
run the compiled entry, which runs hooks, since a replay would skip their Python (a report line says so).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from kernel_pytorch.cuda_graph_capture import ModuleState, capture_after_warm_up, module_state, registered_hook
from kernel_pytorch.errors import first_line
from kernel_pytorch.report import OptimizationReport

__all__ = ["BucketGraphs", "replayable", "GRAPHS_NOTE"]

GRAPHS_NOTE = "bucket CUDA graphs:"  # the report note's key: one line, replaced as graphs are captured

_WARM_UPS = 2  # a capture must not be a first run: Triton's compiles and cuBLAS's workspaces happen there
# A call's key among a bucket's graphs: per argument (position or name), its shape, dtype and device, or its value.
CallKey = tuple[Any, ...]


def replayable(args: tuple, kwargs: dict) -> CallKey | None:
    """The key of a padded call that a CUDA graph can serve, or None: autograd on, a tensor off CUDA, or a
    non-tensor argument that cannot be a dictionary key."""
    if torch.is_grad_enabled():
        return None
    key: list[Any] = []
    for name, value in [*enumerate(args), *sorted(kwargs.items())]:
        if isinstance(value, torch.Tensor):
            if value.device.type != "cuda":
                return None
            key.append((name, tuple(value.shape), value.dtype, value.device))
        else:
            try:
                hash(value)
            except TypeError:
                return None
            key.append((name, value))
    return tuple(key)


class BucketGraphs:
    """The CUDA graphs of one model's buckets, keyed by :func:`replayable`'s key (which holds the bucket's sizes)."""

    def __init__(self, model: nn.Module, report: OptimizationReport):
        self.model, self.report = model, report
        self.graphs: dict[CallKey, _BucketGraph] = {}
        self.capture_seconds = 0.0
        self.failure = ""  # why a capture failed: then no call replays a graph
        self._captured_from: ModuleState | None = None  # the model's state the graphs were captured in

    def run(self, key: CallKey, entry: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """The outputs of ``entry(*args, **kwargs)``, from the key's graph (captured now if it has none), as fresh
        tensors."""
        if self.failure:
            return entry(*args, **kwargs)
        state = module_state(self.model)
        if state.hooked:
            self.report.note(f"bucket CUDA graphs not replayed while {registered_hook(self.model)} is registered (a "
                             "replay would skip its Python): those calls ran compiled, hooks and all")
            return entry(*args, **kwargs)
        self._drop_if_the_model_changed(state)
        graph = self.graphs.get(key)
        if graph is None:
            started = time.perf_counter()
            try:
                graph = _BucketGraph.capture(entry, args, kwargs, {k: g.graph for k, g in self.graphs.items()})
            except RuntimeError as error:  # an op the capture refuses (a host sync): every call runs compiled
                self.failure = first_line(error)
                self.report.set_note(GRAPHS_NOTE, f"{GRAPHS_NOTE} off, a capture failed ({self.failure}); calls run "
                                                  "compiled without graphs")
                return entry(*args, **kwargs)
            self.graphs[key] = graph
            self.capture_seconds += time.perf_counter() - started
            self.report.set_note(GRAPHS_NOTE, f"{GRAPHS_NOTE} {len(self.graphs)} shape buckets replayed from CUDA "
                                              f"graphs of their own (captured in {self.capture_seconds:.1f} s)")
        return graph.replay(args, kwargs)

    def _drop_if_the_model_changed(self, state: ModuleState) -> None:
        what = state.changed_since(self._captured_from)
        if what:
            if self.graphs:
                self.report.note(f"bucket CUDA graphs dropped: {what} since {len(self.graphs)} were captured (.to(), "
                                 ".half(), a replaced parameter, .train() / .eval()); captured again as calls come")
            self.graphs.clear()
        self._captured_from = state


class _BucketGraph:
    """One captured call: its static tensors (inputs the replays copy into) and outputs (the graph's memory)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static_args: tuple, static_kwargs: dict, outputs: Any):
        self.graph, self.static_args, self.static_kwargs, self.outputs = graph, static_args, static_kwargs, outputs

    @classmethod
    def capture(cls, entry: Callable[..., Any], args: tuple, kwargs: dict,
                sharing: dict[CallKey, torch.cuda.CUDAGraph]) -> _BucketGraph:
        static_args = tuple(_static_copy(value) for value in args)
        static_kwargs = {name: _static_copy(value) for name, value in kwargs.items()}
        graph, outputs = capture_after_warm_up(lambda: entry(*static_args, **static_kwargs), _WARM_UPS,
                                               reset=lambda: None, sharing=sharing)
        return cls(graph, static_args, static_kwargs, outputs)

    def replay(self, args: tuple, kwargs: dict) -> Any:
        for static, value in [*zip(self.static_args, args),
                              *((self.static_kwargs[name], value) for name, value in kwargs.items())]:
            if isinstance(static, torch.Tensor):
                static.copy_(value)
        self.graph.replay()
        return pytree.tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value,
                               self.outputs)


def _static_copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
