"""``OptimizationState``: what ``optimize`` leaves on the model (``model._kernel_pytorch``): the live report,
how the compiled call is installed, how to undo it, and what a copy of the model gets.

A copy (``copy.deepcopy``, ``pickle`` / ``torch.save`` of the whole module) loses the compiled call:
``nn.Module.__getstate__`` drops ``_compiled_call_impl``. The state re-installs it on the copy, with a
report of the copy's own (the module-level rewrites it inherited; its graphs are captured, rewritten and
verified again at its first call). A copy that cannot carry the installation (a config holding a lambda
or a process group, which pickle refuses) is a plain model whose report says so, and ``optimize`` then
optimizes it again.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from kernel_pytorch.compiled_call import CompiledCall, call_in_chain, install
from kernel_pytorch.report import OptimizationReport

__all__ = ["AroundCall", "OptimizationState"]

# Installs a wrapper around the model's compiled call (activation offload, context parallelism): run once
# at optimize time and again on each copy of the model.
AroundCall = Callable[[nn.Module, OptimizationReport], None]


@dataclass
class OptimizationState:
    """``model._kernel_pytorch``. ``graph_optimizer`` is the dynamo backend (``capture.GraphOptimizer``)."""

    report: OptimizationReport
    graph_optimizer: Any
    module_undo: list[Callable[[], None]]
    model: nn.Module | None = None
    dynamic: bool | None = None
    around: list[AroundCall] = field(default_factory=list)
    active: bool = True
    # Set when the model no longer runs its optimized call for a reason other than a rollback (a copy that could
    # not keep it, a compiled call replaced): why. optimize() optimizes such a model again.
    unoptimized_because: str = ""

    def install(self) -> None:
        """The compiled call on ``self.model``, then the wrappers around it, in order."""
        install(self.model, self.graph_optimizer, self.dynamic, self.report)
        for around in self.around:
            around(self.model, self.report)

    def add_around(self, around: AroundCall) -> None:
        """Install ``around`` now and on every copy."""
        self.around.append(around)
        around(self.model, self.report)

    def still_installed(self) -> bool:
        """Whether the model still runs its optimized call. ``model.compile()`` (or any assignment to
        ``_compiled_call_impl``) replaces it without a word: then the state turns inactive, with a report
        line, and ``optimize`` optimizes the model again."""
        if not self.active:
            return False
        call = call_in_chain(self.model._compiled_call_impl, (CompiledCall, _InstallAtFirstCall))
        if call is None:
            self.active = False
            self.unoptimized_because = ("its compiled call was replaced (by model.compile() or an assignment to "
                               "_compiled_call_impl): it runs without kernel_pytorch's rewrites; pass compile= to "
                               "optimize instead of calling model.compile()")
            self.report.notes.append(self.unoptimized_because)
        return call is not None

    def roll_back_everything(self, model: nn.Module, reason: str) -> None:
        model._compiled_call_impl = None
        for undo in reversed(self.module_undo):
            undo()
        self.module_undo.clear()
        self.active = False
        self.report.notes.append(f"all optimizations rolled back: {reason}")

    # -- copies ------------------------------------------------------------------------------------------

    def __deepcopy__(self, memo: dict[int, Any]) -> OptimizationState:
        twin = memo.get(id(self.model))
        if twin is None:  # the state copied on its own, not with its model: it stays the original's
            return self
        return _state_of_copy(twin, self.report, self._carried(pickled=False), self.dynamic, "copy.deepcopy")

    def __getstate__(self) -> dict[str, Any]:
        return {"model": self.model, "report": self.report, "dynamic": self.dynamic,
                "carried": self._carried(pickled=True)}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        copy = _state_of_copy(saved["model"], saved["report"], saved["carried"], saved["dynamic"], "pickle")
        self.__dict__.update(copy.__dict__)

    def _carried(self, pickled: bool) -> tuple | str | bool:
        """What a copy gets: (graph optimizer, wrappers) to install; or why it runs unoptimized (optimize() then
        optimizes it again); or False for a model whose optimizations were rolled back."""
        if not self.active:
            return self.unoptimized_because or False
        carried = (self.graph_optimizer, self.around)
        return (_unpicklable(carried) if pickled else "") or carried


def _state_of_copy(twin: nn.Module, report: OptimizationReport, carried: tuple | str | bool, dynamic: bool | None,
                   how: str) -> OptimizationState:
    """The state of ``twin``, a copy made by ``how``; ``carried``: the (graph optimizer, wrappers) to install on
    it, or why they could not come along, or False for a model whose optimizations were rolled back."""
    if not isinstance(carried, tuple):
        note = (f"a copy ({how}) of an optimized model that runs unoptimized: {carried}; kernel_pytorch.optimize(copy) "
                "optimizes it again" if carried else
                f"a copy ({how}) of a model whose optimizations were rolled back: it runs unoptimized")
        return OptimizationState(_report_for_copy(report, note), None, [], twin, active=False,
                                 unoptimized_because=note if carried else "")
    graph_optimizer, around = carried
    report = _report_for_copy(report, f"a copy ({how}) of an optimized model: its graphs are captured, rewritten "
                              "and verified again at its first call")
    state = OptimizationState(report, graph_optimizer.for_report(report), [], twin, dynamic, list(around))
    # The copy's modules are not filled in yet (this runs while the copy is built): install at its first call.
    object.__setattr__(twin, "_compiled_call_impl", _InstallAtFirstCall(state))
    return state


class _InstallAtFirstCall:
    """``_compiled_call_impl`` of a fresh copy: installs the copy's compiled call, then makes the call."""

    def __init__(self, state: OptimizationState):
        self.state = state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.state.install()
        return self.state.model._compiled_call_impl(*args, **kwargs)


def _report_for_copy(report: OptimizationReport, note: str) -> OptimizationReport:
    """The records that hold for a copy (module-level rewrites, memory, the plan); the per-graph ones go,
    since the copy captures its own graphs."""
    copy = report.model_copy(deep=True)
    module_level = ("", "modules")
    copy.rewrites = [r for r in copy.rewrites if r.graph in module_level]
    copy.skipped = [s for s in copy.skipped if s.graph in module_level]
    copy.rollbacks, copy.blocks, copy.graphs, copy.timings_s = [], [], 0, {}
    copy.notes = [n for n in copy.notes if not n.startswith("graph ")] + [note]
    if copy.verification is not None:
        verdict = "passed" if copy.verification.passed else "failed"
        copy.notes.append(f"the original {verdict} its end-to-end check before it was copied")
        copy.verification = None
    return copy


def _unpicklable(value: Any) -> str:
    """Why ``value`` cannot be pickled ("" if it can)."""
    try:
        pickle.dumps(value)
    except Exception as error:  # whatever pickle refuses becomes the copy's report line
        return f"its optimization cannot be pickled ({type(error).__name__}: {error})"
    return ""
