"""The matcher behind :mod:`kernel_pytorch.passes.attention`: from a ``torch.softmax`` node to a proven
attention record, or a :class:`NotAttention` with the reason.

It reads the canonical forms of :mod:`kernel_pytorch.passes.normalize` only (``operator.matmul``,
``operator.mul/truediv/add/sub``, ``torch.transpose``, ``torch.permute``, ``call_method "to"``,
``F.dropout(x, p, training, False)``, ``torch.masked_fill``...) and the FakeTensors Dynamo leaves in
``node.meta["example_value"]``. Nothing here edits the graph.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx import Node

from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.shape_constants import (
    ConstantEvaluator,
    describe_node,
    example_value,
    same_shape,
    static_int,
    static_numel,
)

__all__ = ["AttentionMatch", "MaskTerm", "Operand", "NotAttention", "match_attention", "unrepeated_heads",
           "reads_metadata_only", "value_users"]

class NotAttention(Exception):
    """The candidate is not (provably) attention; ``str(error)`` is the reason for the report."""


@dataclass(frozen=True)
class Operand:
    """An SDPA input: ``node`` as it is, or ``torch.permute(node, dims)`` when ``dims`` is given."""

    node: Node
    dims: Optional[tuple[int, ...]] = None


@dataclass
class MaskTerm:
    """One masking operation between Q·Kᵀ and the softmax, as an equivalent addition to the scores.

    ``additive``: ``scores + multiplier * node`` (a float mask or bias).
    ``fill``: ``masked_fill``/``where`` with the bool ``node``; positions where ``node == masked_value``
    get ``fill`` (already multiplied by the scale factors applied after it).
    """

    kind: str  # "additive" | "fill"
    node: Node
    multiplier: float = 1.0
    fill: float = 0.0
    masked_value: bool = True
    blocking: bool = False  # fill: -inf, or the dtype's finfo.min not rescaled (adding to it rounds to it)
    source: Optional[Node] = None  # the masked_fill / where / add node


@dataclass
class AttentionMatch:
    """One attention call: hand-written (``softmax`` and ``qk`` set, ``pv`` the ·V product) or an existing
    ``F.scaled_dot_product_attention`` call (``source == "sdpa"``, ``pv`` the call, no softmax or Q·Kᵀ node)."""

    softmax: Optional[Node]
    qk: Optional[Node]
    pv: Node  # the node the fused call replaces
    q: Operand
    k: Operand
    v: Operand
    scale: Optional[float]  # None: SDPA's default, 1/sqrt(E) (an SDPA call given no scale)
    scores_shape: tuple
    terms: list[MaskTerm] = field(default_factory=list)
    dropout_p: float = 0.0
    enable_gqa: bool = False
    heads: Optional[tuple[int, int]] = None  # (query heads, key/value heads) when they differ
    out_dims: Optional[tuple[int, ...]] = None  # permute of SDPA's output (einsum ·V with another layout)
    removable: list[Node] = field(default_factory=list)  # erased once they have no users
    is_causal: bool = False  # an SDPA call's own is_causal=True (a hand-written one's comes from its mask)
    source: str = "softmax"  # "softmax" (hand-written) | "sdpa" (an F.scaled_dot_product_attention call)
    # Nodes that read only the dtype or shape of a node the rewrite removes (T5's ``probs.type_as(scores)``).
    metadata_reads: list[Node] = field(default_factory=list)
    # Gemma-2's soft cap: the scores are ``cap * tanh(scale * q·k / cap)`` before the mask (None: no cap).
    softcap: Optional[float] = None


def _shape(node: Node) -> tuple:
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        raise NotAttention("no shape metadata")
    return tuple(value.shape)


def _dtype(node: Node) -> torch.dtype:
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        raise NotAttention("no shape metadata")
    return value.dtype


# ---------------------------------------------------------------------------------------------------
# Small node readers
# ---------------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _cast_dtype(node: Node) -> Optional[torch.dtype]:
    """The dtype of a cast ``x.to(dtype)`` or ``x.type_as(y)``; None for anything else."""
    if is_call(node, "to") and len(node.args) == 2 and not node.kwargs and isinstance(node.args[1], torch.dtype):
        return node.args[1]
    if is_call(node, "type_as") and len(node.args) == 2 and not node.kwargs and isinstance(example_value(node),
                                                                                             torch.Tensor):
        return example_value(node).dtype  # x.type_as(other): a cast to other's dtype, read from the metadata
    return None


def _single_user(node: Node) -> bool:
    return len(node.users) == 1


_METADATA_ATTRIBUTES = ("dtype", "shape", "ndim", "device")


def reads_metadata_only(user: Node, node: Node) -> bool:
    """Whether ``user`` reads only ``node``'s dtype or static shape, not its values: ``x.type_as(node)``
    (x on node's device: a cast to its dtype), ``node.dtype``/``.shape``/``.ndim``, and ``node.size()`` or
    ``node.dim()`` whose result is known at capture (a symbolic size read is a use: it needs the tensor)."""
    if is_call(user, "type_as") and len(user.args) == 2 and not user.kwargs:
        source, other = user.args
        return other is node and source is not node and _same_device(source, node)
    if is_call(user, getattr) and user.args[:1] == (node,) and user.args[1:] in ((a,) for a in _METADATA_ATTRIBUTES):
        return user.args[1] in ("dtype", "device") or _static_metadata(example_value(user))
    if is_call(user, "size", "dim") and user.args[:1] == (node,) and node not in user.args[1:]:
        return _static_metadata(example_value(user))
    return False


def value_users(node: Node) -> list[Node]:
    """The users of ``node`` that read its values (see :func:`reads_metadata_only`)."""
    return [user for user in node.users if not reads_metadata_only(user, node)]


def _same_device(a: Any, b: Node) -> bool:
    va, vb = example_value(a), example_value(b)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.device == vb.device


def _static_metadata(value: Any) -> bool:
    """An int, or a tuple of ints (torch.Size), with no symbolic size."""
    if isinstance(value, (tuple, list)):
        return all(type(v) is int for v in value)
    return type(value) is int


def _product_kind(node: Node) -> Optional[str]:
    if is_call(node, operator.matmul):
        return "matmul"
    if is_call(node, torch.bmm):
        return "bmm"
    if is_call(node, torch.einsum, torch.functional.einsum):
        return "einsum"
    return None


def _einsum_parts(node: Node) -> tuple[str, list[Any]]:
    equation, *operands = node.args
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or node.kwargs:
        raise NotAttention(f"einsum with arguments not understood: {node.args}")
    return equation.replace(" ", ""), operands


def _parse_equation(equation: str, count: int) -> tuple[list[str], str]:
    if "..." in equation or "->" not in equation:
        raise NotAttention(f"einsum '{equation}' not understood (ellipsis or implicit output)")
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    if len(terms) != count or any(len(set(t)) != len(t) for t in (*terms, output)):
        raise NotAttention(f"einsum '{equation}' not understood (repeated letters or operand count)")
    return terms, output


def _permutation(source: str, target: str) -> Optional[tuple[int, ...]]:
    """dims such that ``x.permute(dims)`` turns layout ``source`` into ``target`` (None: identity)."""
    dims = tuple(source.index(letter) for letter in target)
    return None if dims == tuple(range(len(dims))) else dims


def _normalized_dims(dims: Any, ndim: int) -> Optional[tuple[int, ...]]:
    if not isinstance(dims, (list, tuple)) or len(dims) != ndim or not all(isinstance(d, int) for d in dims):
        return None
    dims = tuple(d % ndim for d in dims)
    return dims if sorted(dims) == list(range(ndim)) else None


def _as_permutation(node: Node) -> Optional[tuple[int, ...]]:
    """``torch.transpose(x, a, b)`` or ``torch.permute(x, dims)`` as permute dims; None otherwise."""
    source = node.args[0] if node.args else None
    if not isinstance(source, Node):
        return None
    value = example_value(source)
    if not isinstance(value, torch.Tensor):
        return None
    ndim = value.dim()
    if is_call(node, torch.transpose) and len(node.args) == 3 and not node.kwargs:
        a, b = node.args[1], node.args[2]
        if not (isinstance(a, int) and isinstance(b, int)):
            return None
        dims = list(range(ndim))
        dims[a % ndim], dims[b % ndim] = dims[b % ndim], dims[a % ndim]
        return tuple(dims)
    if is_call(node, torch.permute) and len(node.args) == 2 and not node.kwargs:
        return _normalized_dims(node.args[1], ndim)
    return None


# ---------------------------------------------------------------------------------------------------
# The matcher
# ---------------------------------------------------------------------------------------------------


class _Matcher:
    def __init__(self, softmax: Node, constants: ConstantEvaluator):
        self.softmax = softmax
        self.constants = constants
        self.removable: list[Node] = []
        self.metadata_reads: list[Node] = []
        self.softcap: Optional[float] = None

    # -- softmax ---------------------------------------------------------------------------------

    def match(self) -> AttentionMatch:
        softmax = self.softmax
        if len(softmax.args) != 2 or set(softmax.kwargs) - {"dtype"}:
            raise NotAttention(f"softmax called with arguments not understood: {softmax.args} {dict(softmax.kwargs)}")
        scores, dim = softmax.args
        if not isinstance(scores, Node):
            raise NotAttention("softmax of a non-tensor")
        shape = _shape(scores)
        ndim = len(shape)
        if not isinstance(dim, int) or dim % max(ndim, 1) != ndim - 1:
            raise NotAttention(f"softmax over dim {dim} of a {ndim}-D tensor, not the key axis (last)")
        if ndim < 3:
            raise NotAttention(f"softmax of a {ndim}-D tensor: attention needs a batch axis (>= 3-D scores)")
        softmax_dtype = softmax.kwargs.get("dtype")
        if softmax_dtype is not None and softmax_dtype not in (torch.float32, torch.float64):
            raise NotAttention(f"softmax computed in {softmax_dtype}, not float32/float64")
        self.removable.append(softmax)
        dropout_p, pv = self._forward(softmax)
        scale, terms, qk = self._backward(scores, shape)
        return self._finish(qk, pv, scale, terms, dropout_p, shape)

    def _forward(self, softmax: Node) -> tuple[float, Node]:
        """From the softmax through casts and dropout to the ·V product."""
        node, dropout_p, seen_dropout = softmax, 0.0, False
        while True:
            users = list(node.users)
            if len(users) != 1:
                raise NotAttention("attention probabilities are also used elsewhere"
                                   if users else "attention probabilities are unused")
            user = users[0]
            if user.op == "output":
                raise NotAttention("attention probabilities are also used elsewhere (returned as an output)")
            cast = _cast_dtype(user)
            if cast is not None and user.args[0] is node:
                if cast not in _FLOAT_DTYPES:
                    raise NotAttention(f"attention probabilities cast to {cast}")
                self.removable.append(user)
                node = user
                continue
            if is_call(user, F.dropout) and user.args[0] is node and not seen_dropout:
                p, training = user.args[1], user.args[2]
                if not isinstance(p, (int, float)) or not isinstance(training, bool):
                    raise NotAttention(f"dropout with a non-constant p or training flag: {user.args[1:3]}")
                dropout_p, seen_dropout = (float(p) if training else 0.0), True
                self.removable.append(user)
                node = user
                continue
            if _product_kind(user) is not None and self._first_operand(user) is node:
                if _product_kind(user) != "einsum" and node in user.args[1:]:
                    raise NotAttention("attention probabilities are also the second operand of ·V")
                return dropout_p, user
            raise NotAttention(f"attention probabilities are modified before ·V ({describe_node(user)})")

    @staticmethod
    def _first_operand(product: Node) -> Any:
        if _product_kind(product) == "einsum":
            try:
                _, operands = _einsum_parts(product)
            except NotAttention:
                return None
            return operands[0] if operands else None
        return product.args[0] if product.args else None

    # -- from the softmax input back to Q·Kᵀ --------------------------------------------------------

    def _backward(self, scores: Node, shape: tuple) -> tuple[float, list[MaskTerm], Node]:
        node = scores
        scale, after, terms = 1.0, 1.0, []
        while True:
            if len(value_users(node)) != 1:
                raise NotAttention(f"attention scores ({node.name}) are also used elsewhere")
            self.metadata_reads += [user for user in node.users if reads_metadata_only(user, node)]
            if not same_shape(_shape(node), shape):
                raise NotAttention(f"{node.name} has shape {_shape(node)}, the scores {shape}: "
                                   "a broadcast not understood")
            if _product_kind(node) is not None:
                return scale, terms, node
            self.removable.append(node)
            cast = _cast_dtype(node)
            if cast is not None:
                if cast not in _FLOAT_DTYPES:
                    raise NotAttention(f"attention scores cast to {cast}")
                source = _dtype(node.args[0])
                widening = cast in (torch.float32, torch.float64) and cast.itemsize >= source.itemsize
                if cast != source and not widening:  # fused kernels compute in fp32: only upcasts match
                    raise NotAttention(f"scores cast from {source} to {cast} before the softmax")
                node = node.args[0]
                continue
            if is_call(node, operator.mul, operator.truediv):
                path, factor = self._scaled(node)
                scale *= factor
                after *= factor
                node = path
                continue
            masking = self._masking(node, after)
            if masking is not None:
                node, term = masking
                terms.append(term)
                continue
            if is_call(node, torch.tanh) and len(node.args) == 1 and not node.kwargs:
                node = self._soft_cap(node, after)
                continue
            if isinstance(node, Node) and node.op in ("placeholder", "get_attr"):
                raise NotAttention("softmax input is not a Q·Kᵀ product")
            raise NotAttention(f"scores pass through {describe_node(node)} between the softmax and Q·Kᵀ")

    def _masking(self, node: Node, after: float) -> Optional[tuple[Node, MaskTerm]]:
        """The scores before a mask or bias (``+``, ``-``, ``masked_fill``, ``where``) and the term; None for
        another op."""
        if not is_call(node, operator.add, operator.sub, torch.masked_fill, torch.where):
            return None
        if self.softcap is not None:
            raise NotAttention(f"a mask or bias inside the soft cap ({node.name} before tanh): no kernel computes it")
        if is_call(node, operator.add, operator.sub):
            return self._additive(node, after)
        return self._masked_fill(node, after) if is_call(node, torch.masked_fill) else self._where(node, after)

    def _soft_cap(self, tanh: Node, after: float) -> Node:
        """Gemma-2's ``cap * tanh(s / cap)``: the factors after the tanh are the cap (those before it and
        the cap together are the scale, so ``cap * tanh(scale * q·k / cap)`` is what was written)."""
        if self.softcap is not None:
            raise NotAttention("the scores pass through tanh twice")
        if not (after > 0 and math.isfinite(after)):
            raise NotAttention(f"tanh of the scores scaled by {after!r} after it: not a soft cap")
        self.softcap = after
        return tanh.args[0]

    def _scaled(self, node: Node) -> tuple[Node, float]:
        a, b = node.args
        if is_call(node, operator.truediv):
            if not isinstance(a, Node):
                raise NotAttention(f"scores divide a constant ({node.name}): not a scale")
            value, reason = self.constants.scalar(b)
            if value is None:
                raise NotAttention(f"scale cannot be determined: divisor {reason}")
            if value == 0:
                raise NotAttention("scores divided by zero")
            return a, 1.0 / value
        side = self._score_side(a, b)
        if side is None:
            raise NotAttention(f"cannot tell the scores from the scale in {node.name}")
        path, other = (a, b) if side == 0 else (b, a)
        value, reason = self.constants.scalar(other)
        if value is None:
            raise NotAttention(f"scale cannot be determined: factor {reason}")
        return path, value

    def _additive(self, node: Node, after: float) -> tuple[Node, MaskTerm]:
        a, b = node.args
        if not (isinstance(a, Node) and isinstance(b, Node)):
            raise NotAttention(f"scores shifted by a constant in {node.name}")
        side = self._score_side(a, b)
        if side is None:
            raise NotAttention(f"cannot tell the scores from the mask in {node.name}")
        if side == 1 and is_call(node, operator.sub):
            raise NotAttention(f"the scores are subtracted from a tensor in {node.name}")
        path, other = (a, b) if side == 0 else (b, a)
        sign = -1.0 if is_call(node, operator.sub) else 1.0
        if _dtype(other) == torch.bool:
            raise NotAttention(f"a bool tensor added to the scores ({other.name})")
        if after <= 0:
            raise NotAttention("a non-positive scale is applied after the mask")
        return path, MaskTerm("additive", other, multiplier=sign * after, source=node)

    def _fill_value(self, value: Any, after: float, node: Node) -> float:
        fill, reason = self.constants.scalar(value)
        if fill is None:
            raise NotAttention(f"mask fill value not constant: {reason}")
        if after <= 0:
            raise NotAttention("a non-positive scale is applied after the mask")
        dtype = _dtype(node)
        blocking = fill == -math.inf or fill <= torch.finfo(dtype).min
        if not blocking:
            raise NotAttention(f"mask fill value {fill!r} is neither -inf nor finfo({dtype}).min: fully masked rows "
                               f"would differ from a fused kernel")
        return fill * after

    @staticmethod
    def _blocking(fill: float, node: Node) -> bool:
        return fill == -math.inf or fill <= torch.finfo(_dtype(node)).min

    def _masked_fill(self, node: Node, after: float) -> tuple[Node, MaskTerm]:
        if len(node.args) != 3 or node.kwargs:
            raise NotAttention(f"masked_fill arguments not understood: {node.args}")
        path, mask, value = node.args
        if not isinstance(path, Node) or not isinstance(mask, Node) or _dtype(mask) != torch.bool:
            raise NotAttention(f"masked_fill arguments not understood: {node.args}")
        fill = self._fill_value(value, after, node)
        return path, MaskTerm("fill", mask, fill=fill, masked_value=True, blocking=self._blocking(fill, node),
                              source=node)

    def _where(self, node: Node, after: float) -> tuple[Node, MaskTerm]:
        if len(node.args) != 3 or node.kwargs:
            raise NotAttention(f"where arguments not understood: {node.args}")
        condition, a, b = node.args
        if not isinstance(condition, Node) or _dtype(condition) != torch.bool:
            raise NotAttention(f"where condition {condition} is not a bool tensor")
        side = self._score_side(a, b)
        if side is None:
            raise NotAttention(f"cannot tell the scores from the fill value in {node.name}")
        path, value, masked_value = (a, b, False) if side == 0 else (b, a, True)
        if isinstance(value, Node) and not same_shape(_shape(value), ()) and static_numel(example_value(value)) != 1:
            raise NotAttention(f"where fills with a tensor of shape {_shape(value)}, not a scalar")
        fill = self._fill_value(value, after, node)
        return path, MaskTerm("fill", condition, fill=fill, masked_value=masked_value,
                              blocking=self._blocking(fill, node), source=node)

    def _score_side(self, a: Any, b: Any) -> Optional[int]:
        """Which operand (0 or 1) carries the scores: the one that leads back to Q·Kᵀ through the ops the
        chain allows; when neither does, the one with a product among its ancestors, so that the walk goes
        on and names the op that stops it (e.g. Gemma 2's tanh soft-capping); None when ambiguous."""
        strict = [isinstance(x, Node) and self._reaches_product(x) for x in (a, b)]
        if strict.count(True) == 1:
            return strict.index(True)
        if strict.count(True) == 0:
            loose = [isinstance(x, Node) and _has_product_ancestor(x) for x in (a, b)]
            if loose.count(True) == 1:
                return loose.index(True)
        return None

    def _reaches_product(self, node: Any) -> bool:
        """Whether ``node`` leads back to a matmul/bmm/einsum through the ops the score chain allows."""
        for _ in range(64):
            if not isinstance(node, Node):
                return False
            if _product_kind(node) is not None:
                return True
            if _cast_dtype(node) is not None or is_call(node, torch.masked_fill, torch.tanh):
                node = node.args[0]
            elif is_call(node, operator.mul, operator.truediv, operator.add, operator.sub):
                return any(self._reaches_product(a) for a in node.args[:2] if isinstance(a, Node))
            elif is_call(node, torch.where) and len(node.args) == 3:
                return any(self._reaches_product(a) for a in node.args[1:] if isinstance(a, Node))
            else:
                return False
        return False

    # -- the products ------------------------------------------------------------------------------

    def _peel_scale(self, node: Node) -> tuple[Node, float]:
        """A constant factor on an operand of Q·Kᵀ (``q * d**-0.5``), when only the product reads it."""
        factor = 1.0
        while isinstance(node, Node) and _single_user(node) and is_call(node, operator.mul, operator.truediv):
            scaling, (a, b) = node, node.args
            if is_call(node, operator.truediv):
                value, _ = self.constants.scalar(b) if isinstance(a, Node) else (None, "")
                if value is None or value == 0:
                    break
                factor, node = factor / value, a
            else:
                value_b, _ = self.constants.scalar(b) if isinstance(a, Node) else (None, "")
                value_a, _ = self.constants.scalar(a) if value_b is None and isinstance(b, Node) else (None, "")
                if value_b is not None:
                    factor, node = factor * value_b, a
                elif value_a is not None:
                    factor, node = factor * value_a, b
                else:
                    break
            self.removable.append(scaling)
        return node, factor

    def _operand(self, node: Node, dims: Optional[tuple[int, ...]]) -> Operand:
        """``node.permute(dims)`` with the transposes/permutes that only this operand reads folded in."""
        while dims is not None and isinstance(node, Node) and _single_user(node):
            inner = _as_permutation(node)
            if inner is None:
                break
            self.removable.append(node)
            node, dims = node.args[0], tuple(inner[d] for d in dims)
            dims = None if dims == tuple(range(len(dims))) else dims
        return Operand(node, dims)

    def _key_operand(self, k_t: Node) -> tuple[Operand, float]:
        """K for SDPA from the right operand of Q·Kᵀ (Kᵀ, with its last two axes swapped)."""
        k_t, factor = self._peel_scale(k_t)
        ndim = len(_shape(k_t))
        operand = self._operand(k_t, (*range(ndim - 2), ndim - 1, ndim - 2))
        source, more = self._peel_scale(operand.node)
        if source is not operand.node:
            operand = self._operand(source, operand.dims)
        return operand, factor * more

    def _qk(self, qk: Node) -> tuple[Operand, Operand, float]:
        kind = _product_kind(qk)
        if kind in ("matmul", "bmm"):
            if len(qk.args) != 2 or qk.kwargs or not all(isinstance(a, Node) for a in qk.args):
                raise NotAttention(f"Q·Kᵀ {kind} arguments not understood")
            q, q_factor = self._peel_scale(qk.args[0])
            k, k_factor = self._key_operand(qk.args[1])
            if len(_shape(q)) != len(_shape(k.node)):
                raise NotAttention(f"Q is {len(_shape(q))}-D and K {len(_shape(k.node))}-D (broadcast matmul)")
            return Operand(q), k, q_factor * k_factor
        equation, operands = _einsum_parts(qk)
        (left, right), out = _parse_equation(equation, 2)
        batch, query, key = out[:-2], out[-2], out[-1]
        depth = set(left) - set(batch) - {query}
        if len(depth) != 1 or set(left) != set(batch) | {query} | depth or set(right) != set(batch) | {key} | depth:
            raise NotAttention(f"einsum '{equation}' is not Q·Kᵀ")
        (d,) = depth
        q, q_factor = self._peel_scale(operands[0])
        k, k_factor = self._peel_scale(operands[1])
        return (self._operand(q, _permutation(left, batch + query + d)),
                self._operand(k, _permutation(right, batch + key + d)), q_factor * k_factor)

    def _pv(self, pv: Node) -> tuple[Operand, Optional[tuple[int, ...]]]:
        kind = _product_kind(pv)
        if kind in ("matmul", "bmm"):
            if len(pv.args) != 2 or pv.kwargs or not isinstance(pv.args[1], Node):
                raise NotAttention(f"·V {kind} arguments not understood")
            return Operand(pv.args[1]), None
        equation, operands = _einsum_parts(pv)
        (probs, right), out = _parse_equation(equation, 2)
        batch, query, key = probs[:-2], probs[-2], probs[-1]
        depth = set(right) - set(batch) - {key}
        if len(depth) != 1 or set(right) != set(batch) | {key} | depth or set(out) != set(batch) | {query} | depth:
            raise NotAttention(f"einsum '{equation}' is not P·V")
        (e,) = depth
        return self._operand(operands[1], _permutation(right, batch + key + e)), _permutation(batch + query + e, out)

    # -- checks and GQA ----------------------------------------------------------------------------

    def _finish(self, qk: Node, pv: Node, factor: float, terms: list[MaskTerm], dropout_p: float,
                shape: tuple) -> AttentionMatch:
        q, k, q_k_factor = self._qk(qk)
        v, out_dims = self._pv(pv)
        scale = factor * q_k_factor
        if scale == 0 or not math.isfinite(scale):
            raise NotAttention(f"scale {scale!r} is not usable")
        self.removable += [qk, pv]
        shapes = [self._operand_shape(x) for x in (q, k, v)]
        dtypes = {_dtype(q.node), _dtype(k.node), _dtype(v.node), _dtype(pv)}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _FLOAT_DTYPES:
            raise NotAttention(f"Q, K, V and the output have dtypes {sorted(map(str, dtypes))}")
        ndims = {len(s) for s in shapes}
        if len(ndims) != 1:
            raise NotAttention(f"Q, K, V have ranks {[len(s) for s in shapes]}")
        if not same_shape(shapes[0][:-1] + shapes[1][-2:-1], shape):
            raise NotAttention(f"scores {shape} are not Q {shapes[0]} times K {shapes[1]} transposed")
        k_unrepeated, v_unrepeated = unrepeated_heads(k), unrepeated_heads(v)
        enable_gqa, heads = False, None
        if k_unrepeated and v_unrepeated and k_unrepeated[1] == v_unrepeated[1]:
            k, v = Operand(k_unrepeated[0]), Operand(v_unrepeated[0])
            self.removable += k_unrepeated[2] + v_unrepeated[2]
            shapes = [shapes[0], _shape(k.node), _shape(v.node)]
        q_shape, k_shape, v_shape = shapes
        if not same_shape(k_shape[:-1], v_shape[:-1]):
            raise NotAttention(f"K {k_shape} and V {v_shape} differ before the last axis")
        if not same_shape(q_shape[:-3], k_shape[:-3]) or not same_shape(q_shape[-1:], k_shape[-1:]):
            raise NotAttention(f"Q {q_shape} and K {k_shape} differ in batch axes (broadcast) or head size")
        if not same_shape(q_shape[-3:-2], k_shape[-3:-2]):
            hq, hk = static_int(q_shape[-3]), static_int(k_shape[-3])
            if len(q_shape) < 4 or hq is None or hk is None or hq % hk:
                raise NotAttention(f"Q {q_shape} and K {k_shape}: head counts not a multiple")
            enable_gqa, heads = True, (hq, hk)
        return AttentionMatch(softmax=self.softmax, qk=qk, pv=pv, q=q, k=k, v=v, scale=scale,
                              scores_shape=shape, terms=terms, dropout_p=dropout_p, enable_gqa=enable_gqa,
                              heads=heads, out_dims=out_dims,
                              removable=[n for n in self.removable if isinstance(n, Node)],
                              metadata_reads=self.metadata_reads, softcap=self.softcap)

    @staticmethod
    def _operand_shape(operand: Operand) -> tuple:
        shape = _shape(operand.node)
        return shape if operand.dims is None else tuple(shape[d] for d in operand.dims)

def unrepeated_heads(operand: Operand) -> Optional[tuple[Node, int, list[Node]]]:
    """``(x, n, nodes)`` when the operand repeats each head of ``x`` n times in place (repeat_kv,
    ``repeat_interleave(n, dim=heads)``): SDPA's ``enable_gqa`` does the same from ``x``."""
    node = operand.node
    if operand.dims is not None or not isinstance(node, Node):
        return None
    shape = _shape(node)
    if len(shape) < 4:
        return None
    heads_axis = len(shape) - 3
    if is_call(node, torch.repeat_interleave):
        args = list(node.args) + [None] * (3 - len(node.args))
        source = args[0]
        repeats = node.kwargs.get("repeats", args[1])
        dim = node.kwargs.get("dim", args[2])
        if not isinstance(source, Node) or not isinstance(repeats, int) or not isinstance(dim, int):
            return None
        if dim % len(shape) != heads_axis or set(node.kwargs) - {"repeats", "dim", "output_size"}:
            return None
        return source, repeats, [node]
    if not is_call(node, "reshape", "view"):
        return None
    expanded = node.args[0]
    if not (isinstance(expanded, Node) and is_call(expanded, "expand") and _single_user(expanded)):
        return None
    inserted = expanded.args[0]
    if not (isinstance(inserted, Node) and _single_user(inserted)):
        return None
    if is_call(inserted, torch.unsqueeze) and len(inserted.args) == 2:
        source = inserted.args[0]
    elif is_call(inserted, operator.getitem) and _only_full_slices_and_one_none(inserted.args[1]):
        source = inserted.args[0]
    else:
        return None
    if not isinstance(source, Node):
        return None
    src = _shape(source)
    if len(src) != len(shape):
        return None
    groups = static_int(_shape(expanded)[heads_axis + 1])
    batch, kv_heads, rest = src[:heads_axis], src[heads_axis], src[heads_axis + 1:]
    if groups is None:
        return None
    expected_inserted = (*batch, kv_heads, 1, *rest)
    expected_expanded = (*batch, kv_heads, groups, *rest)
    if not (same_shape(_shape(inserted), expected_inserted) and same_shape(_shape(expanded), expected_expanded)):
        return None
    hk = static_int(kv_heads)
    if hk is None or not same_shape(shape, (*batch, hk * groups, *rest)):
        return None
    return source, groups, [node, expanded, inserted]


def _has_product_ancestor(node: Node, limit: int = 32) -> bool:
    seen, stack = set(), [node]
    while stack and len(seen) < limit:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if _product_kind(current) is not None:
            return True
        torch.fx.node.map_arg((current.args, dict(current.kwargs)), stack.append)
    return False


def _only_full_slices_and_one_none(index: Any) -> bool:
    if not isinstance(index, tuple):
        return False
    full = slice(None, None, None)
    nones = sum(item is None for item in index)
    return nones == 1 and all(item is None or item is Ellipsis or item == full for item in index)


def match_attention(softmax: Node, constants: ConstantEvaluator) -> AttentionMatch:
    """The attention that ``softmax`` belongs to; raises :class:`NotAttention` with the reason otherwise."""
    return _Matcher(softmax, constants).match()
