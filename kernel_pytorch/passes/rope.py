"""Rotary position embeddings written out in model code -> one fused ``apply_rope`` call per q/k pair.

Matched (canonical forms, after :mod:`normalize`), from each ``operator.add`` of two products::

    y = x * cos + rot(x) * sin          # operands of + and of both * in any order

with ``rot`` one of

* **rotate-half** (Hugging Face Llama / Mistral / Qwen / GPT-NeoX ``rotate_half``)::

      x1, x2 = x[..., :D/2], x[..., D/2:]     # or x.chunk(2, -1), torch.split(x, D/2, -1), x[:, :, :, :D/2]
      rot = torch.cat([-x2, x1], -1)          # -x2 as neg(x2) or x2 * -1

* **interleaved** (GPT-J ``rotate_every_two``)::

      x1, x2 = x[..., ::2], x[..., 1::2]
      rot = torch.stack((-x2, x1), -1).flatten(-2)     # or .reshape / .view to x's shape

``cos`` and ``sin`` are used as given: the fused op computes ``x * cos + rot(x) * sin`` for any tensors
(GPT-J's ``repeat_interleave``d tables, swapped tables, learned ones), so matching the formula is enough.
Partial rotary (GPT-NeoX ``rotary_pct``, Phi ``partial_rotary_factor``, GPT-J ``rotary_dim``) is folded in
when the structure is exactly::

    x_rot, x_pass = q[..., :R], q[..., R:]            # slices, chunk or split of q's last dim
    out = torch.cat([x_rot * cos + rot(x_rot) * sin, x_pass], -1)

(the op passes features ``R..D`` through); any other arrangement rewrites only the rotation of ``x_rot``.

Before and after (a Llama layer)::

    # before                                        # after
    q_embed = add(mul(q, cos), mul(cat([neg(q[..., 8:]), q[..., :8]], -1), sin))
    k_embed = add(mul(k, cos), mul(cat([neg(k[..., 8:]), k[..., :8]], -1), sin))
                                                    rope = apply_rope(q, k, cos, sin, interleaved=False)
                                                    q_embed, k_embed = rope[0], rope[1]

**Pairing.** Two rotations with the same ``cos`` and ``sin`` (the same nodes, or nodes that compute the
same thing from the same inputs through pure shape and arithmetic ops: GPT-J rebuilds its tables for q
and for k), the same kind, rotary dim, head dim and dtype become one call, in graph order (the op is
symmetric in q and k). The call goes where the later of the two outputs was; pairing is not done when a
user of the earlier output comes before that point, or when an in-place operation or a grad/autocast
mode switch lies between the reads.
**A lone rotation** (only q, or a partner that does not fit) calls ``apply_rope(x, x, cos, sin)`` and
uses output 0: the op has no single-tensor entry point, and passing x twice is exact and needs no
shape trickery (a zero-size k must broadcast with cos, which not every layout allows). Its cost is the
unused second output (one more read and write of x forward, a zero gradient backward); eager code's
neg, cat, two multiplies and an add each read and write a tensor of x's size (not measured here). A
single-tensor entry point in ops/rope.py would remove that cost.

**Dtypes.** The op returns x's dtype. When the original promotes (bf16 x times fp32 cos gives fp32), x
is cast to the result dtype first (exact: a widening cast), so the op computes in that dtype as eager
code did; a non-float result is skipped. In bf16/fp16 the op rounds once where eager code rounds three
times (about one ulp apart, ops/rope.py); in fp32 they agree to ~1e-7.

Skipped with the reason: the rotation over a dim other than the last, ``x * cos - rot(x) * sin``, a cat
of halves that is not rotate-half (no negation, halves in another order), cos and sin of different
shapes, tables that broadcast q to a larger shape or are not one value per rotated feature, the rotated
tensor not the one multiplied by cos, the two products rounded to different dtypes, no shape metadata,
an in-place operation or a grad/autocast mode switch among the reads (the op reads them all at once).
Not matched at all: slices whose bounds are symbolic (a head dim that is itself a dynamic size), Meta's
complex-number RoPE (``view_as_complex``), einops ``rearrange`` spellings.

Example::

    from kernel_pytorch.passes.rope import RopePass
    result = RopePass().run(gm, ctx)   # after Normalize
    for rewrite in result.rewrites: print(rewrite.location, rewrite.replacement)
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernel_pytorch.ops.rope import apply_rope
from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult, candidates
from kernel_pytorch.passes.graph_utils import (
    blocks_reordering,
    erase_unused,
    module_path_of,
    set_example_value,
)
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.rope_match import (
    RopeMatch,
    fold_partial_rotary,
    match_rope_formula,
    tensor_of,
    validate_match,
)

__all__ = ["RopePass"]


def _rope_op() -> Callable[..., Any]:
    """The fused op the rewrite calls."""
    return apply_rope


# ---------------------------------------------------------------------------------------------------
# Pairing: same tables
# ---------------------------------------------------------------------------------------------------

# Ops that compute the same value from the same inputs (deterministic, no mutation): two nodes calling
# one of these with equal arguments hold equal values.
_PURE_FUNCTIONS = (
    operator.getitem, operator.mul, operator.add, operator.sub, operator.truediv, operator.neg,
    torch.repeat_interleave, torch.unsqueeze, torch.squeeze, torch.cat, torch.stack, torch.flatten,
    torch.transpose, torch.permute, torch.cos, torch.sin, torch.chunk, torch.split,
)
_PURE_METHODS = ("to", "view", "reshape", "expand", "contiguous", "cos", "sin", "repeat", "float",
                 "unsqueeze", "squeeze", "type_as")


def _pure(node: Node) -> bool:
    if node.op == "call_function":
        return any(node.target is f for f in _PURE_FUNCTIONS)
    return node.op == "call_method" and node.target in _PURE_METHODS


def _same_value(a: Any, b: Any, chain: list[Node], depth: int = 12) -> bool:
    """Whether ``a`` and ``b`` provably hold equal values: the same node, or pure calls of one target on
    arguments that do (the nodes of ``b`` that were compared are appended to ``chain``)."""
    if isinstance(a, Node) or isinstance(b, Node):
        if a is b:
            return True
        if not (isinstance(a, Node) and isinstance(b, Node)) or depth == 0:
            return False
        if a.op != b.op or a.target != b.target or not _pure(a) or set(a.kwargs) != set(b.kwargs):
            return False
        if len(a.args) != len(b.args):
            return False
        same = all(_same_value(x, y, chain, depth - 1) for x, y in zip(a.args, b.args)) and \
            all(_same_value(a.kwargs[k], b.kwargs[k], chain, depth - 1) for k in a.kwargs)
        if same:
            chain.append(b)
        return same
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            _same_value(x, y, chain, depth) for x, y in zip(a, b))
    if isinstance(a, slice) and isinstance(b, slice):
        return _same_value((a.start, a.stop, a.step), (b.start, b.stop, b.step), chain, depth)
    return type(a) is type(b) and a == b


class _Order:
    def __init__(self, graph: torch.fx.Graph):
        self.nodes = list(graph.nodes)
        self.position = {n: i for i, n in enumerate(self.nodes)}

    def barrier_between(self, first: int, last: int) -> bool:
        return any(blocks_reordering(n) for n in self.nodes[first + 1:last])

    def span(self, nodes: list[Node]) -> int:
        return min(self.position[n] for n in nodes if n in self.position)


def _checked_match(node: Node, order: _Order) -> tuple[RopeMatch, str | None] | str | None:
    """The rotation whose output is ``node``, with a note when a partial rotary was folded in; or why
    it is left alone; None when ``node`` is no rotation's output."""
    match = match_rope_formula(node)
    if match is None or isinstance(match, str):
        return match
    reason = validate_match(match)
    if reason is not None:
        return reason
    note = fold_partial_rotary(match)
    # The op reads x, cos and sin where the output was; the original read them from its first product
    # on: nothing may write, or switch grad or autocast mode, in between.
    if order.barrier_between(order.span(match.internal), order.position[match.output]):
        return "an in-place operation or a grad/autocast mode switch lies among the rotation's reads"
    return match, note


def _pair_key(match: RopeMatch) -> tuple:
    value = tensor_of(match.x)
    return (match.interleaved, match.rotary_dim, match.head_dim, match.dtype, value.device)


def _pairable(first: RopeMatch, second: RopeMatch, order: _Order) -> list[Node] | None:
    """The nodes of ``second``'s tables that duplicate ``first``'s when the two can share one call
    (placed where ``second``'s output is); None when they cannot."""
    if _pair_key(first) != _pair_key(second):
        return None
    chain: list[Node] = []
    if not (_same_value(first.cos, second.cos, chain) and _same_value(first.sin, second.sin, chain)):
        return None
    at = order.position[second.output]
    if any(order.position[user] < at for user in first.output.users):
        return None
    # Our call reads everything at ``at``; the original read between its first product and ``at``
    # (and, when the tables are recomputed, the first tables where they were made).
    reads = [*first.internal, *second.internal, *chain, *([first.cos, first.sin] if chain else [])]
    if order.barrier_between(order.span(reads), at):
        return None
    return chain


# ---------------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------------


@register_pass
class RopePass(GraphPass):
    """Replace written-out rotary embeddings with ``apply_rope`` calls, q and k paired (module docstring)."""

    name = "rope"
    description = "rotary embeddings (rotate-half, interleaved, partial rotary) -> one fused RoPE call per q/k pair"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        graph = gm.graph
        order = _Order(graph)
        matches: list[RopeMatch] = []
        notes: dict[int, str] = {}
        claimed: set[Node] = set()

        def match(node: Node) -> tuple[RopeMatch, str | None] | str | None:
            # The inner add of a folded partial rotary is not a second candidate.
            return None if node in claimed else _checked_match(node, order)

        for found in candidates(order.nodes, match, result):
            rope, note = found.match
            if note:
                notes[id(rope)] = note
            claimed.update(rope.internal)
            matches.append(rope)

        matches.sort(key=lambda m: order.position[m.output])
        done: set[int] = set()
        for i, first in enumerate(matches):
            if i in done:
                continue
            done.add(i)
            partner: tuple[RopeMatch | None, list[Node]] = (None, [])
            for j in range(i + 1, len(matches)):
                chain = None if j in done else _pairable(first, matches[j], order)
                if chain is not None:
                    partner = (matches[j], chain)
                    done.add(j)
                    break
            location = module_path_of(first.output, "(model)")
            replaced: dict[Node, Node] = {}
            note = "; ".join(dict.fromkeys(notes[id(m)] for m in (first, partner[0]) if id(m) in notes))
            result.rewrite(location, self._rewrite(gm, first, *partner, replaced, note=note))
            for later in matches[i + 1:]:  # a rotation of a rotation reads the new output now
                later.x, later.cos, later.sin = (replaced.get(n, n) for n in (later.x, later.cos, later.sin))
            order = _Order(graph)  # nodes were added and erased
        return result

    @staticmethod
    def _rewrite(gm: torch.fx.GraphModule, first: RopeMatch, second: RopeMatch | None, duplicate_tables: list[Node],
                 replaced: dict[Node, Node], note: str | None) -> str:
        graph = gm.graph
        anchor = second.output if second is not None else first.output
        carried = {k: v for k, v in first.output.meta.items() if k in ("nn_module_stack", "stack_trace")}

        def add(target: Any, args: tuple, kwargs: dict | None = None, method: bool = False) -> Node:
            with graph.inserting_before(anchor):
                node = (graph.call_method if method else graph.call_function)(target, args, kwargs or {})
            node.meta.update(carried)
            set_example_value(gm, node)  # left without one if it cannot be computed: still correct
            return node

        def operand(match: RopeMatch) -> Node:
            if tensor_of(match.x).dtype == match.dtype:
                return match.x
            return add("to", (match.x, match.dtype), method=True)

        q = operand(first)
        k = operand(second) if second is not None else q
        call = add(_rope_op(), (q, k, first.cos, first.sin), {"interleaved": first.interleaved})
        outputs = call.meta.get("example_value")
        for index, match in enumerate([first, second] if second is not None else [first]):
            with graph.inserting_before(anchor):
                out = graph.call_function(operator.getitem, (call, index))
            out.meta.update(match.output.meta)
            if isinstance(outputs, (tuple, list)):  # the op's outputs are contiguous, the original's may not be
                out.meta["example_value"] = outputs[index]
            match.output.replace_all_uses_with(out)
            replaced[match.output] = out
        internal = [*first.internal, *(second.internal if second is not None else []), *duplicate_tables]
        erase_unused(graph, internal)

        parts = ["interleaved" if first.interleaved else "rotate-half"]
        parts.append("q+k paired" if second is not None else "single tensor (passed as q and k)")
        if first.partial:
            parts.append(f"partial rotary {first.partial[0]}/{first.partial[1]}")
        else:
            parts.append(f"rotary dim {first.rotary_dim}")
        casts = {str(m.dtype).replace("torch.", "") for m in (first, second) if m is not None and
                 tensor_of(m.x).dtype != m.dtype}
        if casts:
            parts.append(f"x cast to {casts.pop()} as the original promoted")
        if note:
            parts.append(note)
        return f"apply_rope({', '.join(parts)})"
