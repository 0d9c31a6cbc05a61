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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx import Node

from kernel_pytorch.ops.rope import apply_rope
from kernel_pytorch.ops.triton_utils import MAX_HIDDEN
from kernel_pytorch.passes.attention_match import example_value, same_shape
from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult
from kernel_pytorch.passes.graph_utils import erase_unused, module_path_of
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.shape_constants import static_int

__all__ = ["RopePass"]


def _rope_op() -> Callable[..., Any]:
    """The fused op the rewrite calls."""
    return apply_rope


# ---------------------------------------------------------------------------------------------------
# Reading nodes
# ---------------------------------------------------------------------------------------------------


def _tensor(node: Any) -> torch.Tensor | None:
    value = example_value(node) if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def _axis(dim: Any, rank: int) -> int | None:
    """``dim`` as a non-negative axis of a ``rank``-D tensor, or None if it is not a valid int."""
    if not isinstance(dim, int) or isinstance(dim, bool) or not -rank <= dim < rank:
        return None
    return dim % rank


@dataclass(frozen=True)
class _Piece:
    """``source[..., start:stop:step]`` along ``axis`` (bounds normalized by ``slice.indices``)."""

    source: Node
    axis: int
    start: int
    stop: int
    step: int
    nodes: tuple[Node, ...]  # the nodes that take the piece (getitem; chunk/split and its getitem)


def _slice_bounds(s: slice, size: int) -> tuple[int, int, int] | None:
    parts = (s.start, s.stop, s.step)
    if any(p is not None and (not isinstance(p, int) or isinstance(p, bool)) for p in parts) or s.step == 0:
        return None  # symbolic bounds (nodes) are not read
    return s.indices(size)


def _index_piece(node: Node) -> _Piece | None:
    """``x[..., a:b:c]`` (or ``x[:, :, a:b:c]``): exactly one non-full slice, no new axes or ints."""
    source, index = node.args[0], node.args[1]
    value = _tensor(source)
    if not isinstance(source, Node) or value is None:
        return None
    rank = value.dim()
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(item is Ellipsis for item in items) > 1 or not all(isinstance(i, slice) or i is Ellipsis for i in items):
        return None
    if len(items) - (Ellipsis in items) > rank:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        before, after = items[:at], items[at + 1:]
        positions = list(range(len(before))) + list(range(rank - len(after), rank))
        items = before + after
    else:
        positions = list(range(len(items)))
    cut = []
    for axis, item in zip(positions, items):
        size = static_int(value.shape[axis])
        bounds = _slice_bounds(item, size) if size is not None else None
        if item == slice(None) or bounds == (0, size, 1):  # the whole axis (x[:, 0:] too)
            continue
        if bounds is None:
            return None
        cut.append((axis, bounds))
    if len(cut) != 1:
        return None
    axis, bounds = cut[0]
    return _Piece(source, axis, *bounds, nodes=(node,))


def _split_piece(node: Node) -> _Piece | None:
    """``torch.chunk(x, n, dim)[i]`` / ``torch.split(x, size_or_sections, dim)[i]``."""
    parent, i = node.args[0], node.args[1]
    if not isinstance(parent, Node) or not isinstance(i, int) or not is_call(parent, torch.chunk, torch.split):
        return None
    source = parent.args[0] if parent.args else None
    value = _tensor(source)
    if value is None:
        return None
    axis = _axis(_arg(parent, 2, "dim", 0), value.dim())
    size = static_int(value.shape[axis]) if axis is not None else None
    if size is None:
        return None
    if is_call(parent, torch.chunk):
        chunks = _arg(parent, 1, "chunks")
        if not isinstance(chunks, int) or chunks <= 0:
            return None
        width = -(-size // chunks)
        start, stop = i * width, min((i + 1) * width, size)
    else:
        sections = _arg(parent, 1, "split_size_or_sections")
        if isinstance(sections, int) and sections > 0:
            start, stop = i * sections, min((i + 1) * sections, size)
        elif isinstance(sections, (list, tuple)) and all(isinstance(s, int) for s in sections) and \
                sum(sections) == size and 0 <= i < len(sections):
            start = sum(sections[:i])
            stop = start + sections[i]
        else:
            return None
    if not 0 <= start < stop <= size:
        return None
    return _Piece(source, axis, start, stop, 1, nodes=(node, parent))


def _piece(node: Any) -> _Piece | None:
    if not is_call(node, operator.getitem) or len(node.args) != 2:
        return None
    return _split_piece(node) if isinstance(node.args[1], int) else _index_piece(node)


def _constant(value: Any, expected: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == expected


def _strip_negation(node: Any) -> tuple[Any, bool, tuple[Node, ...]]:
    """(t, True, nodes) for ``-t`` (``neg(t)``, ``t * -1``, ``-1 * t``); (node, False, ()) otherwise."""
    if is_call(node, operator.neg) and len(node.args) == 1:
        return node.args[0], True, (node,)
    if is_call(node, operator.mul) and len(node.args) == 2:
        a, b = node.args
        if isinstance(a, Node) and _constant(b, -1):
            return a, True, (node,)
        if isinstance(b, Node) and _constant(a, -1):
            return b, True, (node,)
    return node, False, ()


# ---------------------------------------------------------------------------------------------------
# rot(x)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rotation:
    source: Node  # x
    interleaved: bool
    nodes: tuple[Node, ...]  # the nodes computing rot(x), erased once unused


def _two_pieces(tensors: Any) -> tuple[list[tuple[_Piece, bool]], tuple[Node, ...]] | None:
    """The two operands of a cat/stack as (slice of one common tensor, negated), if they are that."""
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2:
        return None
    pieces, nodes = [], []
    for t in tensors:
        inner, negated, negation = _strip_negation(t)
        piece = _piece(inner)
        if piece is None:
            return None
        pieces.append((piece, negated))
        nodes += [*negation, *piece.nodes]
    if pieces[0][0].source is not pieces[1][0].source:
        return None
    return pieces, tuple(nodes)


def _check_pieces(pieces: list[tuple[_Piece, bool]], joined_axis: int | None, interleaved: bool,
                  ) -> str | None:
    """Why two slices do not form rot(x) over x's last axis (None when they do)."""
    (first, first_negated), (second, second_negated) = pieces
    rank = _tensor(first.source).dim()
    if first.axis != second.axis:
        return "the two halves are sliced along different dims"
    if joined_axis != first.axis:
        return f"the halves are sliced along dim {first.axis} but joined along another"
    if first.axis != rank - 1:
        return f"rotation over dim {first.axis} of a {rank}-D tensor, not the last (feature) dim"
    size = static_int(_tensor(first.source).shape[-1])
    name = "rotate_every_two (stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2))" if interleaved else \
        "rotate_half (cat(-x[..., D/2:], x[..., :D/2]))"
    if size is None or size % 2:
        return f"feature dim {size} is not a known even size"
    if not first_negated and not second_negated:
        return f"no negation: a swap of the halves, not {name}"
    if interleaved:
        expected = ((1, size, 2), True), ((0, size, 2), False)
    else:
        expected = ((size // 2, size, 1), True), ((0, size // 2, 1), False)
    actual = tuple(((p.start, p.stop, p.step), negated) for p, negated in pieces)
    if actual != expected:
        return f"the slices and negation are not {name}"
    return None


def _rotate_half(node: Node) -> _Rotation | str | None:
    tensors, dim = node.args[0], _arg(node, 1, "dim", 0)
    found = _two_pieces(tensors)
    if found is None:
        return None
    pieces, nodes = found
    axis = _axis(dim, _tensor(pieces[0][0].source).dim())
    reason = _check_pieces(pieces, axis, interleaved=False)
    return reason or _Rotation(pieces[0][0].source, False, (node, *nodes))


def _rotate_every_two(node: Node) -> _Rotation | str | None:
    merged = node.args[0] if node.args else None
    if not is_call(merged, torch.stack) or not isinstance(merged, Node):
        return None
    stacked, out = _tensor(merged), _tensor(node)
    if stacked is None or out is None or stacked.dim() < 2:
        return None
    if is_call(node, torch.flatten):
        start, end = _arg(node, 1, "start_dim", 0), _arg(node, 2, "end_dim", -1)
        merges_last_two = _axis(start, stacked.dim()) == stacked.dim() - 2 and \
            _axis(end, stacked.dim()) == stacked.dim() - 1
    else:  # view/reshape: row-major, so a result of shape (..., a * b) from (..., a, b) merges the last two
        merges_last_two = same_shape(tuple(out.shape), (*stacked.shape[:-2], stacked.shape[-2] * stacked.shape[-1]))
    found = _two_pieces(_arg(merged, 0, "tensors"))
    if found is None:
        return None
    pieces, nodes = found
    if not merges_last_two:
        return "the stacked halves are not merged back by flattening the last two dims"
    if _axis(_arg(merged, 1, "dim", 0), stacked.dim()) != stacked.dim() - 1:
        return "the halves are not stacked along a new last dim"
    reason = _check_pieces(pieces, pieces[0][0].axis, interleaved=True)
    return reason or _Rotation(pieces[0][0].source, True, (node, merged, *nodes))


def _rotation(node: Any) -> _Rotation | str | None:
    """rot(x) computed by ``node``; a reason when it looks like one (slices of one tensor re-joined)
    but is not; None when it is nothing of the kind."""
    if is_call(node, torch.cat) and node.args:
        return _rotate_half(node)
    if is_call(node, torch.flatten, "view", "reshape"):
        return _rotate_every_two(node)
    return None


# ---------------------------------------------------------------------------------------------------
# x * cos + rot(x) * sin
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Match:
    x: Node  # the tensor rotated (q, or q[..., :R] when partial rotary is not folded)
    cos: Node
    sin: Node
    interleaved: bool
    output: Node  # the node whose uses the op's output takes over
    internal: list[Node] = field(default_factory=list)  # erased once unused
    products: tuple[Node, ...] = ()  # x * cos and rot(x) * sin
    partial: tuple[int, int] | None = None  # (R, D) when the pass-through cat was folded in
    dtype: torch.dtype | None = None  # what the op computes in (the original's result dtype)

    @property
    def rotary_dim(self) -> int:
        return int(_tensor(self.cos).shape[-1])

    @property
    def head_dim(self) -> int:
        return int(_tensor(self.x).shape[-1])


def _products(node: Node) -> list[tuple[Node, Node]]:
    """(the product holding rot(x), the other product) for each order of the add's operands."""
    a, b = node.args[:2]
    if not (is_call(a, operator.mul) and is_call(b, operator.mul)):
        return []
    if len(a.args) != 2 or len(b.args) != 2 or a.kwargs or b.kwargs:
        return []
    return [(a, b), (b, a)] if a is not b else []


def _match_formula(node: Node) -> _Match | str | None:
    """``x * cos + rot(x) * sin`` ending at ``node`` (an add, or a sub to report); reason or None."""
    if not is_call(node, operator.add, operator.sub) or len(node.args) != 2 or node.kwargs:
        return None
    reasons = []
    for rotated, plain in _products(node):
        for r, sin in (rotated.args, tuple(reversed(rotated.args))):
            rotation = _rotation(r)
            if rotation is None:
                continue
            if isinstance(rotation, str):
                reasons.append(rotation)
                continue
            x = rotation.source
            if plain.args[0] is x:
                cos = plain.args[1]
            elif plain.args[1] is x:
                cos = plain.args[0]
            else:
                reasons.append("the rotated tensor is not the one multiplied by the other table")
                continue
            if is_call(node, operator.sub):
                reasons.append("x * cos and rot(x) * sin are subtracted; RoPE adds them")
                continue
            if not isinstance(cos, Node) or not isinstance(sin, Node):
                reasons.append("cos or sin is a Python number, not a tensor")
                continue
            return _Match(x=x, cos=cos, sin=sin, interleaved=rotation.interleaved, output=node,
                          internal=[node, rotated, plain, *rotation.nodes], products=(plain, rotated))
    return reasons[0] if reasons else None


def _validate(match: _Match) -> str | None:
    """Why the op cannot compute what the matched nodes computed (None: it can)."""
    x, cos, sin, out = (_tensor(n) for n in (match.x, match.cos, match.sin, match.output))
    if x is None or cos is None or sin is None or out is None:
        return "no shape metadata"
    if not (x.is_floating_point() and cos.is_floating_point() and sin.is_floating_point()):
        return f"not floating tensors (x {x.dtype}, cos {cos.dtype}, sin {sin.dtype})"
    if len({x.device, cos.device, sin.device}) != 1:
        return "x, cos and sin are on different devices"
    if not same_shape(tuple(cos.shape), tuple(sin.shape)):
        return f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} have different shapes"
    head_dim = static_int(x.shape[-1])
    if cos.dim() == 0 or head_dim is None or not same_shape(tuple(cos.shape[-1:]), (head_dim,)):
        return f"cos/sin {tuple(cos.shape)} do not have one value per rotated feature ({x.shape[-1]})"
    if cos.dim() > x.dim() or not same_shape(tuple(out.shape), tuple(x.shape)):
        return f"cos/sin {tuple(cos.shape)} broadcast x {tuple(x.shape)} to a larger result {tuple(out.shape)}"
    if head_dim > MAX_HIDDEN:
        return f"head dim {head_dim} exceeds {MAX_HIDDEN}, the widest row the fused RoPE kernel holds"
    if not out.dtype.is_floating_point:
        return f"result dtype {out.dtype} is not a float dtype"
    # The op computes both products in one dtype (x's, after a cast to the result's when that is wider);
    # eager code that rounds one product to a narrower dtype than the other computes something else.
    dtypes = [getattr(_tensor(p), "dtype", None) for p in match.products]
    if any(d != out.dtype for d in dtypes):
        return (f"x * cos and rot(x) * sin are computed in {dtypes[0]} and {dtypes[1]}, the sum in {out.dtype}: "
                "the op would round differently")
    match.dtype = out.dtype
    return None


def _fold_partial(match: _Match) -> str | None:
    """Extend ``match`` over ``cat([rope(q[..., :R]), q[..., R:]], -1)``; a note when the rotated tensor
    is a leading slice of q but the rest is not exactly that."""
    rotated = _piece(match.x)
    if rotated is None or rotated.start != 0 or rotated.step != 1:
        return None
    q = _tensor(rotated.source)
    size = static_int(q.shape[-1]) if q is not None else None
    if size is None or rotated.axis != q.dim() - 1 or rotated.stop >= size:
        return None
    note = "partial rotary not folded: the result is not exactly cat([rotated, q[..., R:]], -1)"
    users = list(match.output.users)
    if len(users) != 1 or not is_call(users[0], torch.cat) or not users[0].args:
        return note
    cat = users[0]
    tensors = cat.args[0]
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 2 or tensors[0] is not match.output:
        return note
    passed = _piece(tensors[1])
    out = _tensor(cat)
    if passed is None or passed.source is not rotated.source or passed.axis != rotated.axis or \
            (passed.start, passed.stop, passed.step) != (rotated.stop, size, 1) or \
            _axis(_arg(cat, 1, "dim", 0), q.dim()) != q.dim() - 1 or out is None or \
            not same_shape(tuple(out.shape), tuple(q.shape)) or out.dtype != match.dtype:
        return note
    match.internal += [match.output, cat, *rotated.nodes, *passed.nodes]
    match.partial = (rotated.stop, size)
    match.x, match.output = rotated.source, cat
    return None


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


# Calls that change how later ops run: moving a read across one would change what autograd records.
_STATE_CHANGES = ("_set_grad_enabled", "set_grad_enabled", "_enter_autocast", "_exit_autocast",
                  "_enter_inference_mode", "_exit_inference_mode")


def _barrier(node: Node) -> bool:
    """Whether ``node`` may write a tensor in place or switch grad / autocast mode (conservative)."""
    if node.op == "call_module":
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name in _STATE_CHANGES:
        return True
    if node.target in (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ipow, operator.imatmul):
        return True
    if name.endswith("_") and not name.endswith("__") or name.startswith("__i") or name == "__setitem__":
        return True
    return "out" in node.kwargs or node.kwargs.get("inplace", False) is True or \
        (is_call(node, F.dropout) and len(node.args) > 3 and node.args[3] is True)


class _Order:
    def __init__(self, graph: torch.fx.Graph):
        self.nodes = list(graph.nodes)
        self.position = {n: i for i, n in enumerate(self.nodes)}

    def barrier_between(self, first: int, last: int) -> bool:
        return any(_barrier(n) for n in self.nodes[first + 1:last])

    def span(self, nodes: list[Node]) -> int:
        return min(self.position[n] for n in nodes if n in self.position)


def _pair_key(match: _Match) -> tuple:
    value = _tensor(match.x)
    return (match.interleaved, match.rotary_dim, match.head_dim, match.dtype, value.device)


def _pairable(first: _Match, second: _Match, order: _Order) -> list[Node] | None:
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


def _fake(target: Any, args: tuple, kwargs: dict | None = None, method: bool = False) -> Any:
    """The example value of a new node, computed on the FakeTensors of its inputs (None if that fails)."""
    from torch._guards import detect_fake_mode

    values: list[Any] = []

    def read(n: Node) -> Any:
        values.append(example_value(n))
        return values[-1]

    fake_args = torch.fx.node.map_arg(args, read)
    fake_kwargs = torch.fx.node.map_arg(kwargs or {}, read)
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if mode is None or any(v is None for v in values):
        return None
    try:
        with mode:
            if method:
                return getattr(fake_args[0], target)(*fake_args[1:], **fake_kwargs)
            return target(*fake_args, **fake_kwargs)
    except Exception:  # noqa: BLE001  metadata only: a node without an example value is still correct
        return None


@register_pass
class RopePass(GraphPass):
    """Replace written-out rotary embeddings with ``apply_rope`` calls, q and k paired (module docstring)."""

    name = "rope"
    description = "rotary embeddings (rotate-half, interleaved, partial rotary) -> one fused RoPE call per q/k pair"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        graph = gm.graph
        order = _Order(graph)
        matches: list[_Match] = []
        notes: dict[int, str] = {}
        claimed: set[Node] = set()
        for node in order.nodes:
            if node in claimed:  # the inner add of a folded partial rotary is not a second candidate
                continue
            match = _match_formula(node)
            if match is None:
                continue
            location = module_path_of(node, "(model)")
            reason = match if isinstance(match, str) else _validate(match)
            if reason is None:
                note = _fold_partial(match)
                # The op reads x, cos and sin where the output was; the original read them from its
                # first product on: nothing may write, or switch grad or autocast mode, in between.
                if order.barrier_between(order.span(match.internal), order.position[match.output]):
                    reason = "an in-place operation or a grad/autocast mode switch lies among the rotation's reads"
            if reason is not None:
                result.skip(location, reason)
                continue
            if note:
                notes[id(match)] = note
            claimed.update(match.internal)
            matches.append(match)

        matches.sort(key=lambda m: order.position[m.output])
        done: set[int] = set()
        for i, first in enumerate(matches):
            if i in done:
                continue
            done.add(i)
            partner: tuple[_Match | None, list[Node]] = (None, [])
            for j in range(i + 1, len(matches)):
                chain = None if j in done else _pairable(first, matches[j], order)
                if chain is not None:
                    partner = (matches[j], chain)
                    done.add(j)
                    break
            location = module_path_of(first.output, "(model)")
            replaced: dict[Node, Node] = {}
            note = "; ".join(dict.fromkeys(notes[id(m)] for m in (first, partner[0]) if id(m) in notes))
            result.rewrite(location, self._rewrite(graph, first, *partner, replaced, note=note))
            for later in matches[i + 1:]:  # a rotation of a rotation reads the new output now
                later.x, later.cos, later.sin = (replaced.get(n, n) for n in (later.x, later.cos, later.sin))
            order = _Order(graph)  # nodes were added and erased
        return result

    @staticmethod
    def _rewrite(graph: torch.fx.Graph, first: _Match, second: _Match | None, duplicate_tables: list[Node],
                 replaced: dict[Node, Node], note: str | None) -> str:
        anchor = second.output if second is not None else first.output
        carried = {k: v for k, v in first.output.meta.items() if k in ("nn_module_stack", "stack_trace")}

        def add(target: Any, args: tuple, kwargs: dict | None = None, method: bool = False) -> Node:
            with graph.inserting_before(anchor):
                node = (graph.call_method if method else graph.call_function)(target, args, kwargs or {})
            node.meta.update(carried)
            value = _fake(target, args, kwargs, method)
            if value is not None:
                node.meta["example_value"] = value
            return node

        def operand(match: _Match) -> Node:
            if _tensor(match.x).dtype == match.dtype:
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
                 _tensor(m.x).dtype != m.dtype}
        if casts:
            parts.append(f"x cast to {casts.pop()} as the original promoted")
        if note:
            parts.append(note)
        return f"apply_rope({', '.join(parts)})"
