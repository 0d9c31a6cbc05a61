"""What a pass is: a graph pass rewrites a captured FX graph, a module pass swaps modules in place.

Both return a :class:`PassResult` saying what they rewrote and what they skipped, with the reason.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Protocol, TypeVar, Union

import torch.fx
import torch.nn as nn
from torch.fx import Node

from kernel_pytorch.passes.graph_utils import module_path_of

if TYPE_CHECKING:
    from kernel_pytorch.config import OptimizeConfig
    from kernel_pytorch.hardware import HardwareInfo

__all__ = ["Candidate", "GraphPass", "ModulePass", "PassContext", "PassResult", "Rewrite", "Skip", "RuntimeGuard",
           "candidates", "replace_module"]

M = TypeVar("M")
# What a pass's matcher answers for one node: None (not a candidate), a reason to leave it alone, or the match.
MatchOrReason = Union[M, str, None]


@dataclass(frozen=True)
class Rewrite:
    """One subgraph or module replaced: where (module path) and by what."""

    location: str
    replacement: str


@dataclass(frozen=True)
class Skip:
    """One candidate a pass looked at and left alone, with the reason."""

    location: str
    reason: str


class RuntimeGuard(Protocol):
    """A condition a rewrite relies on that a later call could break (a buffer's contents, a symbolic
    size): checked before each call of the compiled graph, which runs unrewritten where it fails."""

    def bind(self, graph: torch.fx.Graph) -> None:
        """Locate the guard's inputs among ``graph``'s placeholders (the graph that gets compiled)."""

    def holds(self, args: Sequence[Any]) -> bool:
        """Whether the rewrite is valid for this call's arguments (in placeholder order); cheap."""

    def describe(self) -> str: ...


@dataclass
class PassResult:
    """What one run of one pass did. ``changed`` counts nodes touched, rewrites included."""

    rewrites: list[Rewrite] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    changed: int = 0
    # Module passes record how to put each swapped module back, newest last.
    undo: list[Callable[[], None]] = field(default_factory=list)
    # Conditions the rewrites rely on, checked at run time (see RuntimeGuard).
    guards: list[RuntimeGuard] = field(default_factory=list)

    @property
    def matched(self) -> int:
        """Candidates the pass found: those it rewrote and those it skipped."""
        return len(self.rewrites) + len(self.skipped)

    def rewrite(self, location: str, replacement: str) -> None:
        self.rewrites.append(Rewrite(location, replacement))
        self.changed += 1

    def skip(self, location: str, reason: str) -> None:
        self.skipped.append(Skip(location, reason))


@dataclass(frozen=True)
class Candidate(Generic[M]):
    """A node a pass's matcher accepted: the node, where it is in the model, and what the matcher found."""

    node: Node
    location: str
    match: M


def candidates(nodes: Iterable[Node], match: Callable[[Node], MatchOrReason[M]],
               result: PassResult) -> Iterator[Candidate[M]]:
    """The nodes of ``nodes`` that ``match`` accepts, each as a :class:`Candidate`: the loop that opens a
    graph pass's ``run``.

    ``match(node)`` answers None for a node that is no candidate, a string for one the pass leaves alone
    (recorded in ``result`` as a skip at the node's module path, with that string as the reason), and
    anything else for a match. ``nodes`` is read up front, so the loop's body may rewrite the graph; nodes
    a rewrite erased are passed over when their turn comes. Each node is matched when its turn comes, so a
    matcher sees the rewrites done before it.

    Example::

        result = PassResult()
        for found in candidates(gm.graph.nodes, match_norm, result):
            result.rewrite(found.location, rewrite_norm(gm, found.match))
    """
    for node in list(nodes):
        if node._erased:  # by an earlier rewrite (torch.fx's own flag: an erased node keeps its .graph)
            continue
        found = match(node)
        if found is None:
            continue
        location = module_path_of(node, "(model)")
        if isinstance(found, str):
            result.skip(location, found)
            continue
        yield Candidate(node, location, found)


@dataclass(frozen=True)
class PassContext:
    """What a pass may consult: the target hardware, the config and whether the model trains."""

    hardware: HardwareInfo
    config: OptimizeConfig
    training: bool
    graph_name: str = "graph"
    # The capture's example values by placeholder name (sizes as ints): what shape-only subgraphs
    # that read sizes or buffers are evaluated with. Empty when unknown (a graph built by hand).
    example_inputs: Mapping[str, Any] = field(default_factory=dict)
    # Placeholders whose values are proven constants (a checkpointed region's causal mask built outside it
    # from shape-only ops), by name: passes may rely on them as on constants in the graph.
    constant_inputs: Mapping[str, Any] = field(default_factory=dict)
    # Whether the rewritten graph goes to a compiler (Inductor, XLA) or runs eagerly: some kernels
    # (FlexAttention) are fast only compiled.
    compiled: bool = True
    # Whether the compiled graph runs as CUDA graphs (compile="reduce-overhead"): not every kernel captures.
    cuda_graphs: bool = False
    # The model's nn.Linear paths, each with None (an FP8 candidate) or why not (float8_conversion.linear_targets);
    # empty unless fp8 is on.
    fp8_targets: Mapping[str, str | None] = field(default_factory=dict)
    # What the passes that ran before this one did to this graph, by pass name (the context_parallel pass reads
    # the attention pass's guards and skips).
    earlier_results: Mapping[str, PassResult] = field(default_factory=dict)


class _Pass(abc.ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    # A pass that raises is skipped with a report line (the graph stays correct without it), unless skipping it
    # would leave the graph wrong: then its error stops the capture (context parallelism's sharding).
    skipped_on_error: ClassVar[bool] = True

    def unavailable_reason(self, hardware: HardwareInfo) -> str | None:
        """Why this pass cannot run on ``hardware`` (``None``: it can). Shown by ``kernel-pytorch info``."""
        return None

    def reason_not_to_run(self, hardware: HardwareInfo, config: OptimizeConfig) -> str | None:
        """Why this pass does not run on ``hardware`` with ``config`` (``None``: it runs); by default the
        hardware's reason. A pass a config option turns on or off overrides it."""
        return self.unavailable_reason(hardware)


class GraphPass(_Pass):
    """A rewrite of a torch-level FX graph, as TorchDynamo captured it and :mod:`normalize` spelled it.

    ``run`` edits ``gm.graph`` in place; the manager lints and recompiles afterwards.
    """

    @abc.abstractmethod
    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult: ...


class ModulePass(_Pass):
    """An in-place module swap that needs no graph (e.g. ``nn.Linear`` -> FP8 linear).

    Swap with :func:`replace_module`, which records in ``result`` how to put the original back, so
    that a failed verification can roll the swap back.
    """

    @abc.abstractmethod
    def run(self, model: nn.Module, ctx: PassContext) -> PassResult: ...


def replace_module(model: nn.Module, path: str, new: nn.Module, result: PassResult, replacement: str) -> None:
    """Put ``new`` at ``path`` (e.g. ``"layers.0.mlp.act"``) in ``model``; record the rewrite and its undo.

    ``new`` should hold the original's parameters (not copies) under the same names, so that
    ``state_dict`` keys and values stay as they were.
    """
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    old = getattr(parent, name)
    setattr(parent, name, new)
    result.undo.append(lambda: setattr(parent, name, old))
    result.rewrite(path, replacement)
