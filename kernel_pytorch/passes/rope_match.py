"""The matcher behind :mod:`kernel_pytorch.passes.rope`: from a sum ``x * cos + rot(x) * sin`` to a
proven RoPE record (:class:`RopeMatch`), or the reason it is not one. Reads normalized graphs
(:mod:`kernel_pytorch.passes.normalize`); nothing here edits the graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernel_pytorch.ops.triton_utils import MAX_HIDDEN
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.shape_constants import example_value, same_shape, static_int

__all__ = ["RopeMatch", "match_rope_formula", "validate_match", "fold_partial_rotary", "tensor_of"]


# ---------------------------------------------------------------------------------------------------
# Reading nodes
# ---------------------------------------------------------------------------------------------------


def tensor_of(node: Any) -> torch.Tensor | None:
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
    value = tensor_of(source)
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
    value = tensor_of(source)
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
    rank = tensor_of(first.source).dim()
    if first.axis != second.axis:
        return "the two halves are sliced along different dims"
    if joined_axis != first.axis:
        return f"the halves are sliced along dim {first.axis} but joined along another"
    if first.axis != rank - 1:
        return f"rotation over dim {first.axis} of a {rank}-D tensor, not the last (feature) dim"
    size = static_int(tensor_of(first.source).shape[-1])
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
    axis = _axis(dim, tensor_of(pieces[0][0].source).dim())
    reason = _check_pieces(pieces, axis, interleaved=False)
    return reason or _Rotation(pieces[0][0].source, False, (node, *nodes))


def _rotate_every_two(node: Node) -> _Rotation | str | None:
    merged = node.args[0] if node.args else None
    if not is_call(merged, torch.stack) or not isinstance(merged, Node):
        return None
    stacked, out = tensor_of(merged), tensor_of(node)
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
class RopeMatch:
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
        return int(tensor_of(self.cos).shape[-1])

    @property
    def head_dim(self) -> int:
        return int(tensor_of(self.x).shape[-1])


def _products(node: Node) -> list[tuple[Node, Node]]:
    """(the product holding rot(x), the other product) for each order of the add's operands."""
    a, b = node.args[:2]
    if not (is_call(a, operator.mul) and is_call(b, operator.mul)):
        return []
    if len(a.args) != 2 or len(b.args) != 2 or a.kwargs or b.kwargs:
        return []
    return [(a, b), (b, a)] if a is not b else []


def match_rope_formula(node: Node) -> RopeMatch | str | None:
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
            return RopeMatch(x=x, cos=cos, sin=sin, interleaved=rotation.interleaved, output=node,
                          internal=[node, rotated, plain, *rotation.nodes], products=(plain, rotated))
    return reasons[0] if reasons else None


def validate_match(match: RopeMatch) -> str | None:
    """Why the op cannot compute what the matched nodes computed (None: it can)."""
    x, cos, sin, out = (tensor_of(n) for n in (match.x, match.cos, match.sin, match.output))
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
    dtypes = [getattr(tensor_of(p), "dtype", None) for p in match.products]
    if any(d != out.dtype for d in dtypes):
        return (f"x * cos and rot(x) * sin are computed in {dtypes[0]} and {dtypes[1]}, the sum in {out.dtype}: "
                "the op would round differently")
    match.dtype = out.dtype
    return None


def fold_partial_rotary(match: RopeMatch) -> str | None:
    """Extend ``match`` over ``cat([rope(q[..., :R]), q[..., R:]], -1)``; a note when the rotated tensor
    is a leading slice of q but the rest is not exactly that."""
    rotated = _piece(match.x)
    if rotated is None or rotated.start != 0 or rotated.step != 1:
        return None
    q = tensor_of(rotated.source)
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
    out = tensor_of(cat)
    if passed is None or passed.source is not rotated.source or passed.axis != rotated.axis or \
            (passed.start, passed.stop, passed.step) != (rotated.stop, size, 1) or \
            _axis(_arg(cat, 1, "dim", 0), q.dim()) != q.dim() - 1 or out is None or \
            not same_shape(tuple(out.shape), tuple(q.shape)) or out.dtype != match.dtype:
        return note
    match.internal += [match.output, cat, *rotated.nodes, *passed.nodes]
    match.partial = (rotated.stop, size)
    match.x, match.output = rotated.source, cat
    return None
