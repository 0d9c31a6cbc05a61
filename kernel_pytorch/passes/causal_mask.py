"""Is this mask SDPA's causal mask? Proven at rewrite time, and re-checked at run time when it depends
on sizes or buffers.

A mask built from constants alone (static sizes, ``full``/``arange``/``triu``...) is evaluated once;
if it is exactly top-left causal with ``Lq == Lk``, the attention call gets ``is_causal=True`` and no
mask tensor, with nothing left to check.

A mask that reads **symbolic sizes** (Dynamo's dynamic shapes: one graph serves every sequence length)
or a **buffer** (GPT-2's ``bias``, a registered ``tril``) is only causal for the sizes and buffer
contents it was evaluated with: a later call could differ (``load_state_dict``, in-place edits, a size
where a hand-written rule changes). So it is evaluated with the capture's example values and, if
causal there, the rewrite carries a :class:`CausalMaskGuard`: before each call of the compiled graph
the guard looks up the call's sizes and buffer identities (``data_ptr`` and ``_version``, which every
in-place edit bumps) in a cache, and on a new key re-evaluates the mask subgraph on those values (on
the host: O(L²) once per new sequence length or buffer state). Where the mask is not causal, the
graph runs without the rewrites (see ``capture.GuardedGraph``); nothing runs on an assumption.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch.fx import Node

from kernel_pytorch.passes.attention_match import AttentionMatch, MaskTerm
from kernel_pytorch.passes.shape_constants import Bindings, ConstantEvaluator, Evaluation, example_value

__all__ = ["CausalDecision", "decide_causal", "is_top_left_causal", "MaskGuard", "CausalMaskGuard"]

# Distinct (sizes, buffer states) a guard remembers; past it the oldest is forgotten and re-checked
# if seen again. A model serves few sequence lengths at once; each entry is a handful of ints.
_GUARD_CACHE_ENTRIES = 256


def is_top_left_causal(value: torch.Tensor, term: MaskTerm, lq: int, lk: int) -> bool:
    """Whether the evaluated mask ``value`` applied as ``term`` is exactly SDPA's ``is_causal`` mask
    (query i attends to keys 0..i) for scores of ``lq`` x ``lk``: blocked entries are ``-inf`` (or the
    dtype's ``finfo.min`` added unscaled), allowed ones are 0 (additive) or unmasked (fill)."""
    if lq != lk or value.dim() < 2 or tuple(value.shape[-2:]) != (lq, lk):
        return False
    allowed = torch.ones(lq, lk, dtype=torch.bool).tril().expand(value.shape)
    if term.kind == "fill":
        if value.dtype != torch.bool or not term.blocking:
            return False
        masked = value if term.masked_value else ~value
        return bool(torch.equal(masked, ~allowed))
    if not value.is_floating_point():
        return False
    value = value * term.multiplier if term.multiplier != 1.0 else value
    blocked = value[~allowed]
    exact_min = term.multiplier == 1.0
    blocking = (blocked == -math.inf) | ((blocked <= torch.finfo(value.dtype).min) if exact_min else False)
    return bool((value[allowed] == 0).all() and blocking.all())


class CausalDecision:
    """The outcome for one mask term: ``causal`` or not, the guard it needs (None: proven for every
    call), and a note for the report."""

    def __init__(self, causal: bool, guard: Optional["CausalMaskGuard"] = None, note: str = "",
                 detail: str = "") -> None:
        self.causal, self.guard, self.note, self.detail = causal, guard, note, detail


def decide_causal(term: MaskTerm, match: AttentionMatch, constants: ConstantEvaluator,
                  bindings: Bindings) -> CausalDecision:
    """Whether ``term`` is the causal mask: proven from constants, or checked at the capture's sizes and
    buffer contents (``bindings``) and then guarded."""
    lq, lk = match.scores_shape[-2], match.scores_shape[-1]
    if isinstance(lq, int) and isinstance(lk, int) and lq != lk:
        return CausalDecision(False)
    evaluation = constants.evaluate(term.node)
    if evaluation.value is not None:
        return CausalDecision(is_top_left_causal(evaluation.value, term, lq, lk))
    if evaluation.kind not in ("buffer", "symbolic"):
        return CausalDecision(False)
    bound = ConstantEvaluator(bindings).evaluate(term.node)
    concrete_lq, concrete_lk = bindings.size(lq), bindings.size(lk)
    source = "a buffer" if evaluation.kind == "buffer" else "symbolic sizes"
    if bound.value is None or concrete_lq is None or concrete_lk is None:
        why = bound.reason or "the sequence lengths are not known"
        return CausalDecision(False, detail=f" (from {source}: not evaluated, {why})")
    if not is_top_left_causal(bound.value, term, concrete_lq, concrete_lk):
        return CausalDecision(False, detail=f" (from {source})")
    guard = CausalMaskGuard(term, ConstantEvaluator(bindings).ancestors(term.node), lq, lk, bound)
    return CausalDecision(True, guard, note=(
        f"is_causal from a mask built from {source} ({', '.join(sorted(bound.bound))}): causal at the captured "
        f"values, re-checked at run time for each new size or buffer state (graph runs unrewritten where not)"))


# (evaluated mask value, the term as applied, Lq, Lk) -> whether the rewrite's assumption holds
MaskPredicate = Callable[[torch.Tensor, MaskTerm, int, int], bool]


class MaskGuard:
    """Re-checks at run time that a mask evaluated from sizes or buffers still has the property a
    rewrite relies on (``predicate``: causal, a sliding window, a block pattern...).

    It keeps a private copy of the mask's subgraph (the rewrite may erase the original) and the symbolic
    query/key lengths; :meth:`bind` ties its inputs to the compiled graph's argument positions.
    """

    def __init__(self, term: MaskTerm, nodes: Sequence[Node], lq: Any, lk: Any, evaluation: Evaluation,
                 predicate: MaskPredicate, what: str) -> None:
        self.predicate, self.what = predicate, what
        self.graph = torch.fx.Graph()
        copies: dict[Node, Node] = {}
        for node in nodes:
            copies[node] = self.graph.node_copy(node, lambda n: copies[n])
        self.root = copies[term.node]
        self.graph.output(self.root)
        self.term = MaskTerm(term.kind, self.root, term.multiplier, term.fill, term.masked_value, term.blocking)
        self.lq, self.lk = lq, lk
        self.inputs = sorted(evaluation.bound)  # placeholder names: sizes and buffers
        self._positions: dict[str, int] = {}
        self._symbols: dict[Any, int] = {}  # sympy symbol -> argument position
        self._cache: dict[tuple, bool] = {}

    def bind(self, graph: torch.fx.Graph) -> None:
        """Record where the compiled graph's arguments hold this guard's sizes and buffers."""
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        positions = {n.name: i for i, n in enumerate(placeholders)}
        self._positions = {name: positions[name] for name in self.inputs}
        self._symbols = {}
        for i, node in enumerate(placeholders):
            value = example_value(node)
            if isinstance(value, torch.SymInt) and value.node.expr.is_Symbol:
                self._symbols[value.node.expr] = i

    def holds(self, args: Sequence[Any]) -> bool:
        """Whether the mask is causal for this call's arguments (cached by sizes and buffer states)."""
        key = tuple(args[i] for i in self._symbols.values()) + tuple(
            (t.data_ptr(), t._version, tuple(t.shape)) for t in (args[self._positions[n]] for n in self.inputs)
            if isinstance(t, torch.Tensor))
        result = self._cache.get(key)
        if result is None:
            result = self._check(args)
            if len(self._cache) >= _GUARD_CACHE_ENTRIES:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = result
        return result

    def _check(self, args: Sequence[Any]) -> bool:
        sizes = {symbol: int(args[i]) for symbol, i in self._symbols.items()}
        buffers = {name: args[self._positions[name]] for name in self.inputs
                   if isinstance(args[self._positions[name]], torch.Tensor)}
        bindings = Bindings(sizes, buffers)
        value = ConstantEvaluator(bindings).evaluate(self.root).value
        lq, lk = bindings.size(self.lq), bindings.size(self.lk)
        return value is not None and lq is not None and lk is not None and self.predicate(value, self.term, lq, lk)

    def describe(self) -> str:
        return f"{self.what} from {', '.join(self.inputs)}"


class CausalMaskGuard(MaskGuard):
    """A :class:`MaskGuard` for ``is_causal``: the mask must stay exactly top-left causal."""

    def __init__(self, term: MaskTerm, nodes: Sequence[Node], lq: Any, lk: Any, evaluation: Evaluation) -> None:
        super().__init__(term, nodes, lq, lk, evaluation, is_top_left_causal, "causal mask")

