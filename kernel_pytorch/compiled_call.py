"""The call ``optimize`` puts in ``model._compiled_call_impl``: the model through TorchDynamo and our backend,
kept true to what users do with the model afterwards.

* **Module hooks** added, removed or replaced after ``optimize`` (forward, pre-forward, backward, on the top
  module or a submodule) take effect at the next call: while one of our frames compiles, Dynamo's guards on
  the modules' hook dictionaries are on (Dynamo skips them by default, ``skip_nnmodule_hook_guards``, and a
  hook registered later then silently never ran).
* **Global module hooks** (``torch.nn.modules.module.register_module_forward_hook`` and the like) are not
  guarded by Dynamo at all: each set of them gets a compiled entry of its own (a fresh capture), looked up
  by the hooks' handle ids at every call.
* **TorchDynamo's recompile limit**: reaching it makes Dynamo run the frame unoptimized with a log line
  only; here it is a warning and a report note naming the cause and the fix.
* **Inputs the model rejects** (a wrong dtype or feature size): Dynamo's tracing wraps eager PyTorch's error
  in ``TorchRuntimeError`` / ``BackendCompilerFailed`` with fake-tensor logs; the call is run eagerly
  instead, so the user gets the model's own error, with one added line naming the optimized model and
  its arguments. A call that fails to compile but runs eagerly returns the eager result, with a warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import logging
import os
import re
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.modules.module as module_globals
from torch._dynamo.exc import TorchDynamoException

from kernel_pytorch.errors import KernelPytorchError, first_line

__all__ = ["CompiledCall", "GraphRun", "RecompileLimitWarning", "RecompileLimitWatch", "UnoptimizedCallWarning",
           "call_module", "compiled_entry", "call_in_chain", "entry_recompile_limit", "install", "GLOBAL_HOOK_DICTS"]

# TorchDynamo's default limit (8) is for one function; a model's call contract needs more variants: a
# transformers generate() alone is captured with and without a cache, for prefill and decode, and at
# batch size 1 and >= 2 (0/1 specialization). 32 per model bounds the recaptures all the same.
RECOMPILE_LIMIT = 32

# Compiled entries kept per model, one per set of global module hooks (the oldest set's goes first).
_MAX_ENTRIES = 8

# The global hook dictionaries of torch.nn.Module (mutated in place, never rebound), which TorchDynamo does not
# guard on.
GLOBAL_HOOK_DICTS = tuple(getattr(module_globals, name) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks"))

# The watched call running in this thread or task (an optimized model's, or a generation entry's; None outside
# one): Dynamo's compile callbacks and log records are attributed to it.
_ACTIVE: contextvars.ContextVar[_InFlight | None] = contextvars.ContextVar("kernel_pytorch_call", default=None)

_entry_numbers = itertools.count()


class RecompileLimitWarning(UserWarning):
    """TorchDynamo reached its recompile limit inside an optimized model: new variants run unoptimized."""


class UnoptimizedCallWarning(UserWarning):
    """A call of an optimized model could not be compiled and ran eagerly (correct, not optimized)."""


def install(model: nn.Module, backend: Callable[..., Any], dynamic: bool | None, report: Any) -> CompiledCall:
    """Make ``model(...)`` run through TorchDynamo with ``backend``, in place; ``report`` gets the notes."""
    call = CompiledCall(model, backend, dynamic, report)
    model._compiled_call_impl = call
    return call


def call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's call (hooks, forward) without its compiled call: what a compiled entry traces."""
    return module._call_impl(*args, **kwargs)


def compiled_entry(model: nn.Module, backend: Callable[..., Any], dynamic: bool | None) -> Callable[..., Any]:
    """``torch.compile`` of a copy of :func:`call_module` with a code object of its own.

    Not ``model.compile()``: that compiles ``Module._call_impl``, a frame in torch's own files, which dynamo
    skips when it is the top frame, so a model made only of ``torch.nn`` modules (an ``nn.Sequential``) was
    never captured (measured: zero graphs on torch 2.13). Dynamo keeps its cache per code object, so each
    entry gets its own (a shared one would hit the recompile limit after a few optimized models), with a
    unique name too: dynamo remembers which sizes changed per (file, line, name) of the code, and with a
    shared name a second model of another size was captured with symbolic sizes at once.
    """
    name = f"{_ENTRY_PREFIX}{type(model).__name__}_{next(_entry_numbers)}"
    names = {"co_name": name, **({"co_qualname": name} if sys.version_info >= (3, 11) else {})}
    entry = types.FunctionType(call_module.__code__.replace(**names), call_module.__globals__, name)
    limit = {"recompile_limit": RECOMPILE_LIMIT} if _compile_takes_recompile_limit() else {}
    return torch.compile(entry, backend=backend, dynamic=dynamic, **limit)


@functools.cache
def _compile_takes_recompile_limit() -> bool:
    return "recompile_limit" in inspect.signature(torch.compile).parameters  # torch >= 2.13


def entry_recompile_limit() -> int:
    """How many variants TorchDynamo captures of one compiled entry: RECOMPILE_LIMIT where torch.compile takes a
    limit per function (torch >= 2.13), else Dynamo's global limit."""
    return RECOMPILE_LIMIT if _compile_takes_recompile_limit() else torch._dynamo.config.recompile_limit


def call_in_chain(call: Any, kinds: type | tuple[type, ...]) -> Any:
    """The first call of type ``kinds`` in a model's ``_compiled_call_impl`` chain, or None: the wrappers around the
    compiled call (activation offload, shape buckets, context parallelism) each keep the call they wrap as ``inner``."""
    while call is not None and not isinstance(call, kinds):
        call = getattr(call, "inner", None)
    return call

class CompiledCall:
    """``model._compiled_call_impl`` after ``optimize``: ``call(*args, **kwargs)`` runs the model compiled.

    One compiled entry per set of global module hooks (usually one: none); see the module docstring.
    """

    def __init__(self, model: nn.Module, backend: Callable[..., Any], dynamic: bool | None, report: Any):
        self.model, self.backend, self.dynamic, self.report = model, backend, dynamic, report
        self.entries: dict[tuple[tuple[int, ...], ...], Callable[..., Any]] = {}
        self.limit_watch = RecompileLimitWatch(f"the optimized {type(model).__name__}", self._note)
        # Call signatures that failed to compile and ran eagerly: they go straight to the eager call (Dynamo does
        # not remember a failure, and each retry would capture, rewrite and verify again).
        self.eager_signatures: set[tuple] = set()

    # Opaque to an outer torch.compile(model): it would trace through the entry with its own backend, and the
    # model would run without the rewrites; disabled here, the outer compile calls the optimized model as it is.
    @torch._dynamo.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager_signatures and _signature(args, kwargs) in self.eager_signatures:
            return self.model._call_impl(*args, **kwargs)
        entry = self._entry(_global_hook_ids())
        _register_compile_callbacks()
        flight = _InFlight(self.limit_watch, optimized_call=True)
        token = _ACTIVE.set(flight)
        try:
            return entry(self.model, *args, **kwargs)
        except TorchDynamoException as error:
            failure = error
        finally:
            _ACTIVE.reset(token)
        return self._after_compile_failure(failure, flight.graph_ran, args, kwargs)

    def _entry(self, hooks: tuple) -> Callable[..., Any]:
        """The compiled entry for this set of global module hooks; at most _MAX_ENTRIES are kept (a tool that
        adds and removes a global hook at every step would otherwise grow them without bound)."""
        entry = self.entries.get(hooks)
        if entry is None:
            if len(self.entries) >= _MAX_ENTRIES:
                del self.entries[next(key for key in self.entries if key != ())]
            entry = self.entries[hooks] = compiled_entry(self.model, self.backend, self.dynamic)
            if len(self.entries) > 1:
                self._note("global module hooks changed: the model is captured again for each new set of them")
        return entry

    def _after_compile_failure(self, failure: TorchDynamoException, graph_ran: bool, args: tuple, kwargs: dict) -> Any:
        """The model's own error for inputs it rejects; else the eager result, said once. Only before any of the
        call's graphs ran: after one did (a graph break before the failure), in-place updates (a KV cache,
        BatchNorm statistics) would be applied twice, so the failure is raised as it is."""
        inner = getattr(failure, "inner_exception", None)
        if isinstance(inner, KernelPytorchError):
            raise inner from None
        if graph_ran:
            _add_note(failure, f"(in the model optimized by kernel_pytorch, {type(self.model).__name__}, called with "
                               f"{describe_arguments(args, kwargs)}, after some of its graphs ran)")
            raise failure
        try:
            out = self.model._call_impl(*args, **kwargs)
        except Exception as error:
            _add_note(error, f"(raised by the model optimized by kernel_pytorch, {type(self.model).__name__}, called "
                             f"with {describe_arguments(args, kwargs)}; it raises the same unoptimized)")
            raise error from None
        if getattr(getattr(self.backend, "config", None), "strict", False):
            raise failure
        self.eager_signatures.add(_signature(args, kwargs))
        message = (f"a call of the optimized {type(self.model).__name__} with {describe_arguments(args, kwargs)} "
                   f"could not be compiled and ran unoptimized (eager): {first_line(inner or failure)}")
        self._note(message + "; calls with these argument shapes and types run eagerly from now on")
        warnings.warn(message, UnoptimizedCallWarning, stacklevel=3)
        return out

    def _note(self, text: str) -> None:
        self.report.note(text)


class RecompileLimitWatch:
    """Reports TorchDynamo reaching its recompile limit inside the calls it watches, once per function: a note
    through ``note`` and a :class:`RecompileLimitWarning`, since Dynamo then runs that code unoptimized with only a
    log line. An optimized model's call has one; so do the generation lanes' prefill, step and encoder, whose
    compiled entries are called without the model's call."""

    def __init__(self, owner: str, note: Callable[[str], None]):
        self.owner, self.note = owner, note
        self.limits_reached: set[str] = set()

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Within the block, Dynamo's limit records are attributed to this watch."""
        token = _ACTIVE.set(_InFlight(self, optimized_call=False))
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def recompile_limit_reached(self, function: str, reason: str) -> None:
        if function in self.limits_reached:
            return
        self.limits_reached.add(function)
        message = (f"TorchDynamo reached its recompile limit for {function} inside {self.owner}: calls unlike the "
                   f"variants already captured now run that code unoptimized (last change: {reason}). Fix: fewer "
                   "distinct call variants (shapes, batch sizes, cache types), optimize(..., dynamic=True), or a "
                   "higher torch._dynamo.config.recompile_limit; TORCH_LOGS=recompiles lists each change")
        self.note(message)
        warnings.warn(message, RecompileLimitWarning, stacklevel=2)


class _InFlight:
    """One watched call in progress (what ``_ACTIVE`` holds, per thread and task): the watch its recompile-limit
    records go to, and whether it is an optimized model's :class:`CompiledCall` (whose compiles guard on hooks and
    whose fake-tensor tracebacks are dropped: the call re-raises the model's own error)."""

    __slots__ = ("watch", "optimized_call", "graph_ran")

    def __init__(self, watch: RecompileLimitWatch, optimized_call: bool):
        self.watch, self.optimized_call, self.graph_ran = watch, optimized_call, False


class GraphRun:
    """A compiled graph of an optimized model, marking the call in progress as having run one of its graphs
    (``CompiledCall._after_compile_failure``: why)."""

    __slots__ = ("graph",)

    def __init__(self, graph: Callable[..., Any]):
        self.graph = graph

    def __call__(self, *args: Any) -> Any:
        flight = _ACTIVE.get()
        if flight is not None:
            flight.graph_ran = True
        return self.graph(*args)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """A call's arguments as Dynamo tells calls apart, roughly: tensors by shape, dtype and device, anything else
    by type, keywords by name."""
    return tuple(map(_leaf_signature, args)) + tuple((name, _leaf_signature(v)) for name, v in kwargs.items())


def _leaf_signature(value: Any) -> Any:
    return (tuple(value.shape), value.dtype, value.device) if isinstance(value, torch.Tensor) else type(value)


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note)


def describe_arguments(args: tuple, kwargs: dict) -> str:
    """``(Tensor[2, 5] float32, mask=Tensor[2, 5] bool)``: what a call passed, for error messages."""
    parts = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')} on {value.device}"
    return type(value).__name__


def _global_hook_ids() -> tuple[tuple[int, ...], ...]:
    """The handle ids of the global module hooks; () for none, the common case, read without building tuples."""
    if not any(GLOBAL_HOOK_DICTS):
        return ()
    return tuple(tuple(hooks) for hooks in GLOBAL_HOOK_DICTS)


# -- Dynamo's compile callbacks and logs, attributed to the optimized call in progress -------------------------

# The config patches entered at compile start, per thread (Dynamo compiles under one lock, start and end in the
# same thread; an end without a start in this thread finds nothing to exit).
_compiling = threading.local()


def _guard_hooks_while_compiling(*_: Any) -> None:
    """Dynamo's compile-start callback: guard on module hooks while a frame of an optimized call compiles."""
    patch = torch._dynamo.config.patch(skip_nnmodule_hook_guards=False) if _optimized_call_in_flight() else None
    if patch is not None:
        patch.__enter__()
    _compiling.__dict__.setdefault("patches", []).append(patch)


def _end_of_compile(*_: Any) -> None:
    patches = _compiling.__dict__.get("patches")
    patch = patches.pop() if patches else None
    if patch is not None:
        patch.__exit__(None, None, None)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENTRY_PREFIX = "kernel_pytorch_call_"
_LIMIT_MESSAGE = re.compile(r"function: (?P<function>.*)\n\s*last reason: (?P<reason>.*)")


class _RecompileLimitRecords(logging.Filter):
    """Takes Dynamo's "hit config.recompile_limit" record inside a watched call (its watch warns instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        flight = _ACTIVE.get()
        if flight is None or not str(record.msg).startswith("torch._dynamo hit config."):
            return True
        found = _LIMIT_MESSAGE.search(record.getMessage())
        function, reason = (found["function"], found["reason"].strip()) if found else ("a frame", "unknown")
        if _PACKAGE_DIR in function and _ENTRY_PREFIX not in function:
            return True  # a compile of kernel_pytorch's own (a kernel measured inside the backend), not the model's
        flight.watch.recompile_limit_reached(function, reason)
        return False


class _FakeTensorErrorRecords(logging.Filter):
    """Drops fake-tensor "failed while attempting to run meta" tracebacks inside an optimized call: the
    call re-raises eager PyTorch's own error for such inputs (CompiledCall._after_compile_failure)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_optimized_call_in_flight() and str(record.msg).startswith("failed while attempting to run meta"))


def _optimized_call_in_flight() -> bool:
    flight = _ACTIVE.get()
    return flight is not None and flight.optimized_call


def _register_compile_callbacks() -> None:
    """Once, and again after ``torch._dynamo.reset()``, which clears every compile callback."""
    handler = torch._dynamo.callback_handler
    if _guard_hooks_while_compiling not in handler.start_callbacks:
        handler.register_start_callback(_guard_hooks_while_compiling)
        handler.register_end_callback(_end_of_compile)


logging.getLogger("torch._dynamo.convert_frame").addFilter(_RecompileLimitRecords())
logging.getLogger("torch._subclasses.fake_tensor").addFilter(_FakeTensorErrorRecords())
