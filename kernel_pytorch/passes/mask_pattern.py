"""Is this mask block-structured? Sliding windows, bands, document (block-diagonal) masks and other
block-sparse masks, recognized by evaluating the mask, as :mod:`kernel_pytorch.passes.causal_mask` does
for the causal mask, so that FlexAttention can skip the 128x128 tiles nothing attends to.

What is recognized (the allowed positions of one mask term, after the causal check said no):

* **band** ``("band", lo, hi)``: query i sees key j iff ``lo <= i - j <= hi`` (``None``: unbounded), with
  the diagonal inside (``lo <= 0 <= hi``, ``Lq <= Lk``: no fully masked row, where eager and FlexAttention
  differ). Mistral's causal sliding window w is ``(0, w - 1)``; a symmetric band ``(-w, w)``. However it is
  built (``triu``/``tril`` with offsets, ``(i - j) < w`` index arithmetic, a buffer), its evaluated value is
  compared with the band rule, entry by entry.
* **document** ``("document", lo, hi)``: ``doc[b, i] == doc[b, j]`` for a per-token document-id tensor that
  is a model input, possibly ``&`` a band (causal). The input cannot be evaluated, so the mask is checked on
  probes: the doc-id placeholder bound to all zeros gives the band part, then to random segment ids (sorted,
  and unsorted per batch) the mask must equal ``band & (doc_i == doc_j)``. The ops between the ids and the
  mask must be views, one ``==``/``!=`` and logical ops (a mask that computes anything else from the ids is
  not recognized). Static sizes without buffers only: then the band part is a constant.
* **blocks** ``("blocks",)``: any other mask whose 128x128 tiles are at most :data:`SPARSE_MAX_DENSITY`
  occupied and that leaves no row fully masked; FlexAttention reads the mask tensor itself in its
  ``mask_mod``, so its contents are never assumed, only its purity (0/-inf) and non-empty rows.

A mask with no such structure (a random dense mask, a bias with other values than 0 and -inf) stays a
dense mask tensor, as before. What depends on symbolic sizes or buffers is decided at the capture's values
and re-checked by a :class:`~kernel_pytorch.passes.causal_mask.MaskGuard` for each new size or buffer state;
where it fails, the call runs the unrewritten graph.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.fx import Node

from kernel_pytorch.attention.kernels.flex import FLEX_BLOCK_SIZE
from kernel_pytorch.passes.attention_match import AttentionMatch, MaskTerm
from kernel_pytorch.passes.causal_mask import MaskGuard, MaskPredicate
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.shape_constants import Bindings, ConstantEvaluator, example_value, is_buffer, static_int

__all__ = ["MaskPattern", "PatternDecision", "decide_pattern", "allowed_positions", "classify_allowed",
           "block_density", "SPARSE_MAX_DENSITY"]

# A general ("blocks") mask is sent to a block-sparse kernel only when at most this fraction of its
# 128x128 tiles hold an allowed entry. A guess, from FlexAttention's dense forward rate of about two thirds of
# cuDNN's (docs/attention.md, "Preference order"): it needs to skip at least a third of the tiles to break
# even; 0.5 leaves margin (benchmarks/sparse_attention.py measures it). Bands and documents are recognized at
# any density; the dispatcher measures whether FlexAttention wins.
SPARSE_MAX_DENSITY = 0.5

_VIEW_OPS = (operator.getitem, torch.unsqueeze, torch.reshape, torch.flatten, torch.broadcast_to, "view", "reshape",
             "unsqueeze", "expand", "expand_as", "flatten", "contiguous", "to", "long", "int")
_COMPARE_OPS = (operator.eq, operator.ne, torch.eq, torch.ne, "eq", "ne")
_LOGIC_OPS = (operator.and_, operator.or_, operator.invert, operator.xor, torch.logical_and, torch.logical_or,
              torch.logical_not, torch.bitwise_and, torch.bitwise_or, torch.bitwise_not, "__and__", "__or__",
              "__invert__", "logical_and", "logical_or", "logical_not", "expand", "expand_as", "unsqueeze",
              operator.getitem, "view", "reshape")


@dataclass(frozen=True)
class MaskPattern:
    """A recognized block structure: ``kind`` ("band" | "document" | "blocks"), the band bounds, and the
    fraction of 128x128 tiles with an allowed entry at the captured size (None: depends on the data)."""

    kind: str
    lo: Optional[int] = None
    hi: Optional[int] = None
    density: Optional[float] = None

    @property
    def spec(self) -> tuple:
        """What the graph's ``attention(..., pattern=...)`` carries (plain values only)."""
        return ("blocks",) if self.kind == "blocks" else (self.kind, self.lo, self.hi)

    @property
    def sparsity(self) -> tuple:
        """What the dispatcher keys its choice on: the spec and the density (2 digits)."""
        return (*self.spec, None if self.density is None else round(self.density, 2))

    def describe(self) -> str:
        density = "" if self.density is None else f", block density {self.density:.2f}"
        if self.kind == "blocks":
            return f"block-sparse mask{density}"
        band = _describe_band(self.lo, self.hi)
        if self.kind == "document":
            return f"document mask{' & ' + band if band else ''}{density}"
        return f"{band}{density}"


def _describe_band(lo: Optional[int], hi: Optional[int]) -> str:
    if lo is None and hi is None:
        return ""
    if lo == 0 and hi is None:
        return "causal"
    if lo == 0:
        return f"causal sliding window {hi + 1}"
    return f"band {'-inf' if lo is None else lo} <= i-j <= {'inf' if hi is None else hi}"


@dataclass
class PatternDecision:
    """The recognized pattern, the guard it needs (None: proven for every call), a report note, and
    for documents the doc-id placeholder."""

    pattern: MaskPattern
    guard: Optional[MaskGuard] = None
    note: str = ""
    doc: Optional[Node] = None
    dead: list[Node] = field(default_factory=list)  # the mask's nodes, dead when the pattern replaces it


# ---------------------------------------------------------------------------------------------------
# Classification of evaluated masks
# ---------------------------------------------------------------------------------------------------


def allowed_positions(value: torch.Tensor, term: MaskTerm) -> Optional[torch.Tensor]:
    """The bool tensor of attended positions of ``value`` applied as ``term``; None when the mask is not
    a pure mask (an additive value other than 0 and a blocking one: a bias, which no pattern carries)."""
    if term.kind == "fill":
        if value.dtype != torch.bool or not term.blocking:
            return None
        return ~value if term.masked_value else value
    if not value.is_floating_point():
        return None
    value = value * term.multiplier if term.multiplier != 1.0 else value
    blocked = (value == -math.inf) | ((value <= torch.finfo(value.dtype).min) if term.multiplier == 1.0 else False)
    if not bool(((value == 0) | blocked).all()):
        return None
    return ~blocked


def block_density(allowed: torch.Tensor, block: int = FLEX_BLOCK_SIZE) -> float:
    """Fraction of (block x block) tiles of the last two axes with an allowed entry (over leading axes too)."""
    lq, lk = allowed.shape[-2:]
    flat = allowed.reshape(-1, lq, lk)
    pad_q, pad_k = -lq % block, -lk % block
    padded = torch.nn.functional.pad(flat, (0, pad_k, 0, pad_q))
    tiles = padded.reshape(flat.shape[0], (lq + pad_q) // block, block, (lk + pad_k) // block, block)
    return float(tiles.any(dim=4).any(dim=2).float().mean())


def _band_rule(lq: int, lk: int, lo: Optional[int], hi: Optional[int]) -> torch.Tensor:
    distance = torch.arange(lq)[:, None] - torch.arange(lk)[None, :]
    rule = torch.ones(lq, lk, dtype=torch.bool)
    if lo is not None:
        rule &= distance >= lo
    if hi is not None:
        rule &= distance <= hi
    return rule


def _band_of(allowed: torch.Tensor) -> Optional[tuple[Optional[int], Optional[int]]]:
    """``(lo, hi)`` when the 2-D ``allowed`` is exactly ``lo <= i - j <= hi`` with the diagonal inside
    (a bound at the matrix's edge is reported unbounded: the guard re-checks other sizes)."""
    lq, lk = allowed.shape
    if lq > lk or not bool(allowed.any()):
        return None
    distance = torch.arange(lq)[:, None] - torch.arange(lk)[None, :]
    lo, hi = int(distance[allowed].min()), int(distance[allowed].max())
    if not lo <= 0 <= hi or not torch.equal(allowed, _band_rule(lq, lk, lo, hi)):
        return None
    return (None if lo <= -(lk - 1) else lo), (None if hi >= lq - 1 else hi)


def _broadcast_plane(allowed: torch.Tensor) -> Optional[torch.Tensor]:
    """The one (Lq, Lk) plane when every batch/head slice is the same; None when they differ."""
    flat = allowed.reshape(-1, *allowed.shape[-2:])
    return flat[0] if bool((flat == flat[:1]).all()) else None


def classify_allowed(allowed: torch.Tensor, lq: int, lk: int) -> Optional[MaskPattern]:
    """The block structure of a bool mask of attended positions for ``lq`` x ``lk`` scores; None when
    there is none worth a block-sparse kernel (or a row is fully masked)."""
    if allowed.dim() < 2 or tuple(allowed.shape[-2:]) != (lq, lk) or not bool(allowed.any(-1).all()):
        return None
    density = block_density(allowed)
    plane = _broadcast_plane(allowed)
    band = _band_of(plane) if plane is not None else None
    if band is not None:
        if band in ((None, None), (0, None)):
            return None  # no mask at all, or plain causal (decided before, by the causal rules; Lq != Lk stays dense)
        return MaskPattern("band", band[0], band[1], density)
    if allowed.dim() > 4 or density > SPARSE_MAX_DENSITY:
        return None
    return MaskPattern("blocks", density=density)


def _matches(pattern: MaskPattern) -> MaskPredicate:
    """The guard's check that an evaluated mask still has ``pattern`` for a call's lengths."""
    def holds(value: torch.Tensor, term: MaskTerm, lq: int, lk: int) -> bool:
        if value.dim() < 2 or tuple(value.shape[-2:]) != (lq, lk):
            return False
        allowed = allowed_positions(value, term)
        if allowed is None or not bool(allowed.any(-1).all()):
            return False
        if pattern.kind == "blocks":
            return True  # FlexAttention reads the mask itself: purity and non-empty rows are all it needs
        plane = _broadcast_plane(allowed)
        return plane is not None and lq <= lk and torch.equal(plane, _band_rule(lq, lk, pattern.lo, pattern.hi))
    return holds


# ---------------------------------------------------------------------------------------------------
# The decision for one mask term
# ---------------------------------------------------------------------------------------------------


def decide_pattern(term: MaskTerm, match: AttentionMatch, constants: ConstantEvaluator,
                   bindings: Bindings) -> tuple[Optional[PatternDecision], str]:
    """The block structure of ``term`` (None when it has none), and a detail for the report."""
    lq, lk = match.scores_shape[-2], match.scores_shape[-1]
    evaluation = constants.evaluate(term.node)
    if evaluation.kind == "input":
        return _decide_document(term, match, bindings)
    if evaluation.value is not None:
        proven = _classified(evaluation.value, term, lq, lk)
        return (PatternDecision(proven, dead=constants.ancestors(term.node)) if proven else None), ""
    if evaluation.kind not in ("buffer", "symbolic"):
        return None, ""
    bound_evaluator = ConstantEvaluator(bindings)
    bound = bound_evaluator.evaluate(term.node)
    concrete_lq, concrete_lk = bindings.size(lq), bindings.size(lk)
    if bound.value is None or concrete_lq is None or concrete_lk is None:
        return None, ""
    pattern = _classified(bound.value, term, concrete_lq, concrete_lk)
    if pattern is None:
        return None, ""
    source = "a buffer" if evaluation.kind == "buffer" else "symbolic sizes"
    nodes = bound_evaluator.ancestors(term.node)
    guard = MaskGuard(term, nodes, lq, lk, bound, _matches(pattern), pattern.describe().split(",")[0])
    note = (f"{pattern.describe()} from a mask built from {source} ({', '.join(sorted(bound.bound))}): recognized at "
            f"the captured values, re-checked at run time for each new size or buffer state (graph runs unrewritten "
            f"where not)")
    return PatternDecision(pattern, guard, note, dead=nodes), ""


def _classified(value: torch.Tensor, term: MaskTerm, lq, lk) -> Optional[MaskPattern]:
    lq, lk = static_int(lq), static_int(lk)
    allowed = allowed_positions(value, term)
    if allowed is None or lq is None or lk is None:
        return None
    return classify_allowed(allowed, lq, lk)


def _doc_input(node: Node) -> tuple[Optional[Node], list[Node], str]:
    """The one model input ``node`` reads (the document ids), the call nodes in between, or why not."""
    seen, stack, inputs, calls = set(), [node], [], []
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "placeholder":
            if isinstance(example_value(current), torch.Tensor) and not is_buffer(current):
                inputs.append(current)
            continue
        calls.append(current)
        torch.fx.node.map_arg((current.args, dict(current.kwargs)), stack.append)
    if len(inputs) != 1:
        return None, [], f"reads {len(inputs)} model inputs"
    return inputs[0], [n for n in node.graph.nodes if n in set(calls)], ""


def _depends_on(node: Node, source: Node, memo: dict) -> bool:
    if node is source:
        return True
    if node not in memo:
        found = []
        torch.fx.node.map_arg((node.args, dict(node.kwargs)), lambda n: found.append(_depends_on(n, source, memo)))
        memo[node] = any(found)
    return memo[node]


def _only_views_compare_logic(calls: list[Node], doc: Node) -> bool:
    """Every op that reads the ids is a view up to one comparison, then logical ops only."""
    memo: dict = {}
    compared: set[Node] = set()
    for node in calls:
        if not _depends_on(node, doc, memo):
            continue
        inputs_compared = any(a in compared for a in node.all_input_nodes)
        if is_call(node, *_COMPARE_OPS) and not inputs_compared:
            compared.add(node)
        elif inputs_compared and is_call(node, *_LOGIC_OPS):
            compared.add(node)
        elif inputs_compared or not is_call(node, *_VIEW_OPS):
            return False
    return True


def _doc_probes(shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Document ids to check a mask on: sorted segments of random lengths, and unsorted random ids
    (different per batch row), both with a negative and a large id."""
    generator = torch.Generator().manual_seed(0)
    length = shape[-1]
    sorted_ids = torch.randint(0, 2, shape, generator=generator).cumsum(-1) * 7 - 3
    unsorted = torch.randint(-2, 3, shape, generator=generator) * 1000003
    return [sorted_ids, unsorted] if length > 1 else [unsorted]


def _decide_document(term: MaskTerm, match: AttentionMatch, bindings: Bindings) -> tuple[
        Optional[PatternDecision], str]:
    if term.kind != "fill":
        return None, ""
    doc, calls, why = _doc_input(term.node)
    ids = example_value(doc) if doc is not None else None
    if doc is None or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() not in (1, 2):
        return None, ""
    shape = tuple(static_int(s) for s in ids.shape)
    lq, lk = (static_int(s) for s in match.scores_shape[-2:])
    if None in shape or lq is None or lq != lk or shape[-1] != lq:
        return None, " (document ids with symbolic sizes or another length: not recognized)"
    if not _only_views_compare_logic(calls, doc):
        return None, ""
    batch = shape[0] if len(shape) == 2 else 1
    planes = []
    for probe in [torch.zeros(shape, dtype=ids.dtype), *_doc_probes(shape)]:
        evaluation = ConstantEvaluator(known={doc.name: probe}).evaluate(term.node)
        allowed = allowed_positions(evaluation.value, term) if evaluation.value is not None else None
        if allowed is None or evaluation.bound or allowed.shape[-2:] != (lq, lk):
            return None, ""
        if allowed.dim() > 4:
            return None, ""
        allowed = allowed[(None,) * (4 - allowed.dim())]  # (Bm, Hm, Lq, Lk), as it broadcasts to the scores
        if allowed.shape[0] not in (1, batch):
            return None, ""
        planes.append(allowed)
    base = _broadcast_plane(planes[0])
    band = _band_of(base) if base is not None else None
    if band is None:
        return None, ""
    rule = _band_rule(lq, lk, *band)
    for probe, allowed in zip(_doc_probes(shape), planes[1:]):
        rows = probe.reshape(batch, lq)
        expected = (rows[:, :, None] == rows[:, None, :]) & rule
        if not bool((allowed == expected[:, None]).all()):
            return None, ""
    pattern = MaskPattern("document", band[0], band[1], None)
    return PatternDecision(pattern, doc=doc, dead=calls), ""
