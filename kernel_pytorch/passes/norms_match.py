"""The norms pass's matchers: RMSNorm and LayerNorm recognized by their mathematics, with the dtype flow
proved to be one the fused kernels reproduce.

Hand-written norms are matched from their inverse square root (``rsqrt(s)``, ``s ** -0.5``, or a division
by ``sqrt(s)`` / ``s ** 0.5``) with ``s = statistic + eps``::

    RMSNorm     statistic = mean(v ** 2, -1, keepdim=True)  (or v * v, v.square())
                n = u * rsqrt(statistic + eps)                 u and v the same values (x, or x upcast)
    LayerNorm   u = a - mean(a, -1, keepdim=True)
                statistic = mean(u' ** 2, -1, keepdim=True)    u' the same values as u (Cohere recomputes it)
                         or var(a', -1, unbiased=False / correction=0, keepdim=True)
    then        optional casts, ``* weight`` (one value per feature, any expression: Gemma's ``1 + w``),
                ``+ bias`` (LayerNorm)
    F.rms_norm / F.layer_norm over the last axis, also on an upcast input cast back (OLMo's LayerNorm)

Dtype flow. The kernels (ops/rms_norm.py, ops/layer_norm.py) load x, compute everything in ACC (float32;
float64 for float64 x) and round once to x's dtype; RMSNorm with ``cast_before_weight`` also rounds the
normalized value to x's dtype before the weight multiply. A spelling is rewritten only where its roundings
are exactly those. Accepted, and why:

- exact casts (bf16/f16 -> f32/f64, f32 -> f64, a cast to the same dtype) and the promotions they imply
  (T5's ``x_bf16 * rstd_f32``): they do not change a value, so they are the kernel's own load into ACC;
- the statistic, the normalized value, the weight and the bias computed in ACC: the kernel's arithmetic,
  up to the order of the sum and ACC's last bit (``x / sqrt(s)`` and ``s ** -0.5`` for ``x * rsqrt(s)``);
- one cast to x's dtype between normalizing and the RMSNorm weight (Llama, T5): ``cast_before_weight``.
  A weight product in x's dtype after it rounds the exact product (two 8- or 11-bit significands fit
  float32's 24) once, as the kernel's final rounding does;
- one cast to x's dtype at the end; and an output in ACC from a narrower x, by feeding the kernel x upcast.

Skipped, each with its reason: a statistic, mean or centered value computed in a dtype narrower than ACC (it
rounds where the kernel does not), a LayerNorm rounded before its weight or bias (its kernel rounds once),
a cast to a dtype other than x's or ACC, and a weight or bias wider than ACC (the kernel would round it).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.fx import Node

from kernel_pytorch.passes.normalize import is_call

__all__ = ["NormMatch", "match_norm", "cast_target"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The dtypes each dtype converts to without rounding.
_EXACT_UPCASTS = {torch.float16: (torch.float32, torch.float64), torch.bfloat16: (torch.float32, torch.float64),
                  torch.float32: (torch.float64,)}


@dataclass
class NormMatch:
    """What a rewrite needs: the kernel's input ``x`` and arguments, the node it replaces, the nodes it
    makes dead; ``upcast_input`` when the norm's output is ACC from a narrower x (the kernel then reads
    x upcast)."""

    kind: str  # "rms" | "layer"
    x: Node
    eps: float
    weight: Optional[Node] = None
    bias: Optional[Node] = None
    cast_before_weight: bool = False
    upcast_input: Optional[torch.dtype] = None
    output: Optional[Node] = None
    internal: list[Node] = field(default_factory=list)  # erased after the rewrite if unused


def match_norm(node: Node) -> NormMatch | str | None:
    """A norm ending at ``node`` (a functional norm, or the inverse square root of a hand-written one), the
    reason it is left alone, or None when ``node`` starts no norm."""
    match = _functional(node)
    if match is None:
        root = _inverse_sqrt(node)
        if root is None:
            return None
        match = _hand_written(node, *root)
        if isinstance(match, NormMatch):
            match = _absorb_affine(match) or match
    return _output_reason(match) or match if isinstance(match, NormMatch) else match


# ------------------------------------------------------------------------------------------ value helpers

def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, Node) else None


def _dtype(node: Any) -> Optional[torch.dtype]:
    return getattr(_value(node), "dtype", None)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _single_user(node: Node) -> Optional[Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _other(node: Node, one: Any) -> Any:
    a, b = node.args[:2]
    return b if a is one else a if b is one else None


def cast_target(node: Any) -> Optional[torch.dtype]:
    """The dtype of a cast (canonical ``x.to(dtype)``, or ``x.type_as(y)``), else None."""
    if is_call(node, "to") and len(node.args) == 2 and not node.kwargs and isinstance(node.args[1], torch.dtype):
        return node.args[1]
    if is_call(node, "type_as") and len(node.args) == 2:
        return _dtype(node.args[1])
    return None


def _is_exact_cast(node: Any) -> bool:
    source, target = _dtype(node.args[0]) if isinstance(node, Node) and node.args else None, cast_target(node)
    return target is not None and (target == source or target in _EXACT_UPCASTS.get(source, ()))


def _source(node: Any) -> Any:
    """``node`` with exact casts taken off: the tensor whose values it holds."""
    while _is_exact_cast(node):
        node = node.args[0]
    return node


def _same_values(a: Any, b: Any, depth: int = 2) -> bool:
    """Whether ``a`` and ``b`` hold the same values: one node up to exact casts, or the same call (same
    target, dtype and arguments) written twice, as Cohere's ``(x - mean)``."""
    if _source(a) is _source(b):
        return True
    if depth == 0 or not (isinstance(a, Node) and isinstance(b, Node)):
        return False
    if (a.op, a.target, a.kwargs) != (b.op, b.target, b.kwargs) or a.op not in ("call_function", "call_method"):
        return False
    if _dtype(a) != _dtype(b) or len(a.args) != len(b.args):
        return False
    return all(_same_values(p, q, depth - 1) if isinstance(p, Node) else p == q for p, q in zip(a.args, b.args))


def _is_feature_vector(node: Any, hidden: int) -> bool:
    value = _value(node)
    return value is not None and tuple(value.shape) == (hidden,)


# --------------------------------------------------------------------------------- the statistic's parts

def _last_dim_mean(node: Any, rank: int) -> Optional[Node]:
    """The mean's input if ``node`` is ``mean(t, -1 or rank-1, keepdim=True)``."""
    if not is_call(node, torch.mean):
        return None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    if keepdim is not True or dim not in (-1, rank - 1) or "dtype" in node.kwargs:
        return None
    return node.args[0]


def _last_dim_variance(node: Any, rank: int) -> Optional[Node] | str:
    """The input of ``var(t, -1, unbiased=False, keepdim=True)`` (``correction=0`` too), a reason for an
    unbiased one, or None."""
    if not is_call(node, torch.var, "var"):
        return None
    positional = [*node.args[1:], None, None, None][:3]  # dim, unbiased, keepdim
    dim, keepdim = node.kwargs.get("dim", positional[0]), node.kwargs.get("keepdim", positional[2])
    unbiased = node.kwargs.get("unbiased", positional[1])
    correction = node.kwargs.get("correction", 1 if unbiased in (None, True) else 0)
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if keepdim is not True or dim not in (-1, rank - 1):
        return None
    if correction != 0:
        return "the variance is unbiased (divides by n - 1); LayerNorm's divides by n"
    return node.args[0]


def _squared(node: Any) -> Optional[Node]:
    if is_call(node, operator.pow) and node.args[1] == 2:
        return node.args[0]
    if is_call(node, operator.mul) and node.args[0] is node.args[1]:
        return node.args[0]
    if is_call(node, torch.square, "square") and len(node.args) == 1:
        return node.args[0]
    return None


def _eps_and_stat(node: Any) -> tuple[Optional[Node], float]:
    if is_call(node, operator.add):
        a, b = node.args[:2]
        if isinstance(b, (int, float)) and isinstance(a, Node):
            return a, float(b)
        if isinstance(a, (int, float)) and isinstance(b, Node):
            return b, float(a)
    return None, 0.0


def _inverse_sqrt(node: Node) -> Optional[tuple[str, Any]]:
    """("multiply", s) for ``rsqrt(s)`` / ``s ** -0.5``, ("divide", s) for ``sqrt(s)`` / ``s ** 0.5``."""
    if is_call(node, torch.rsqrt):
        return "multiply", node.args[0]
    if is_call(node, torch.sqrt):
        return "divide", node.args[0]
    # a power is a candidate only on ``tensor + constant``: other powers are no norm, not worth a skip line
    if is_call(node, operator.pow) and node.args[1] in (-0.5, 0.5) and _eps_and_stat(node.args[0])[0] is not None:
        return ("multiply" if node.args[1] < 0 else "divide"), node.args[0]
    return None


def _normalized(root: Node, form: str) -> Optional[tuple[Any, Node]]:
    """(numerator, normalized node): ``u * root`` when ``root`` is an inverse square root, ``u / root``
    when it is a square root."""
    for user in root.users:
        if form == "multiply" and is_call(user, operator.mul) and _other(user, root) is not None:
            return _other(user, root), user
        if form == "divide" and is_call(user, operator.truediv) and user.args[1] is root:
            return user.args[0], user
    return None


# ------------------------------------------------------------------------------------ hand-written norms

def _hand_written(root: Node, form: str, shifted: Any) -> NormMatch | str:
    statistic, eps = _eps_and_stat(shifted)
    if statistic is None:
        return "the variance is not `mean(...) + eps` with a constant eps"
    normalized = _normalized(root, form)
    if normalized is None:
        return "rsqrt/sqrt result is not multiplied into (or divided out of) the input"
    numerator, n_node = normalized
    value = _value(numerator)
    if value is None:
        return "no shape metadata"
    rank = value.dim()
    internal = [n_node, root, shifted, statistic]
    mean_of = _last_dim_mean(statistic, rank)
    square_node = _source(mean_of)  # the squares, upcast or not: their dtype is checked below
    squared_of = _squared(square_node)
    variance_of = _last_dim_variance(statistic, rank)
    if isinstance(variance_of, str):
        return variance_of
    centered = _centered(numerator, rank)
    if centered is not None:
        a, mean = centered
        of_centered = squared_of is not None and _same_values(squared_of, numerator)
        if not (of_centered or (variance_of is not None and _same_values(variance_of, a))):
            return "the variance is not that of the centered tensor over the last axis"
        internal += [numerator, mean, a, mean_of, square_node, squared_of, variance_of]
        arithmetic = [shifted, statistic, root, n_node, numerator, mean, square_node if of_centered else None]
        x = _source(a)
        return _narrow_arithmetic(arithmetic, x) or NormMatch("layer", x, eps, output=n_node, internal=internal)
    if squared_of is None or not _same_values(squared_of, numerator):
        return "the statistic is not the mean of squares of the normalized tensor over the last axis"
    internal += [mean_of, square_node, squared_of, numerator]
    x = _source(numerator)
    return (_narrow_arithmetic([shifted, statistic, root, n_node, square_node], x)
            or NormMatch("rms", x, eps, output=n_node, internal=internal))


def _centered(node: Any, rank: int) -> Optional[tuple[Node, Node]]:
    """(a, mean) if ``node`` is ``a - mean(a', -1, keepdim=True)`` with a' the same values as a."""
    if not is_call(node, operator.sub) or not all(isinstance(arg, Node) for arg in node.args[:2]):
        return None
    a, mean = node.args[:2]
    of = _last_dim_mean(mean, rank)
    return (a, mean) if of is not None and _same_values(of, a) else None


def _narrow_arithmetic(nodes: list[Any], x: Node) -> Optional[str]:
    """Why the statistic's arithmetic rounds where the kernel's does not: a node computed in a dtype
    narrower than the kernel's ACC (a bf16 mean of squares, a bf16 centered value), or None."""
    x_dtype = _dtype(x)
    if x_dtype not in _FLOATS:
        return f"input dtype {x_dtype} is not a float dtype the kernels take"
    acc = _acc(x_dtype)
    for node in filter(None, nodes):
        dtype = _dtype(node)
        if dtype != acc:
            what = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
            return (f"`{what}` of the statistic is computed in {dtype}; the fused kernel computes it in {acc} "
                    f"(different rounding points)")
    return None


# ------------------------------------------------------------------------------------------ the tail

def _absorb_affine(match: NormMatch) -> Optional[str]:
    """Extend ``match`` over the casts, the weight multiply and the bias add after the normalized value,
    following the dtype of each step; the reason when a rounding is not one the kernel makes."""
    x_dtype = _dtype(match.x)
    acc, hidden = _acc(x_dtype), _value(match.x).shape[-1]
    rounded = _absorb_cast(match, (x_dtype, acc)) != acc  # a cast to x's dtype before the weight
    user = _single_user(match.output)
    if is_call(user, operator.mul) and _is_feature_vector(_other(user, match.output), hidden):
        match.internal.append(match.output)
        match.weight, match.output = _other(user, match.output), user
    user = _single_user(match.output)
    if match.kind == "layer" and is_call(user, operator.add) and _is_feature_vector(_other(user, match.output), hidden):
        rounded = rounded or _dtype(match.output) != acc  # the product was rounded before the bias add
        match.internal.append(match.output)
        match.bias, match.output = _other(user, match.output), user
    for parameter in (match.weight, match.bias):
        if parameter is not None and torch.promote_types(_dtype(parameter), acc) != acc:
            return (f"weight/bias dtype {_dtype(parameter)} is wider than the kernel's {acc} arithmetic "
                    f"(mixed precision)")
    if rounded and match.kind == "layer" and (match.weight is not None or match.bias is not None):
        return (f"the LayerNorm is rounded to {x_dtype} before its weight or bias; the fused LayerNorm "
                f"rounds once, at the end")
    match.cast_before_weight = rounded and match.weight is not None
    _absorb_cast(match, (x_dtype, acc) if not rounded else (x_dtype,))
    return None


def _absorb_cast(match: NormMatch, allowed: tuple) -> Optional[torch.dtype]:
    """Take the output's one user into the match if it is a cast to one of ``allowed``; the output's
    dtype after it."""
    user = _single_user(match.output)
    if cast_target(user) in allowed:
        match.internal.append(match.output)
        match.output = user
    return _dtype(match.output)


def _output_reason(match: NormMatch) -> Optional[str]:
    """Why the match's output is not what the kernel writes (x's dtype and shape), or None; an ACC output
    from a narrower x is taken by feeding the kernel x upcast (an exact cast)."""
    x_value, out_value = _value(match.x), _value(match.output)
    if x_value is None or out_value is None:
        return "no shape metadata"
    if tuple(out_value.shape) != tuple(x_value.shape):
        return "output shape differs from the input's"
    if out_value.dtype == x_value.dtype:
        return None
    if out_value.dtype == _acc(x_value.dtype) and not match.cast_before_weight:
        match.upcast_input = out_value.dtype
        return None
    return f"output dtype {out_value.dtype} differs from input dtype {x_value.dtype} (mixed-precision weight)"


# ----------------------------------------------------------------------------------- functional norms

def _functional(node: Node) -> NormMatch | str | None:
    """``F.rms_norm(x, shape, w, eps)`` / ``F.layer_norm(x, shape, w, b, eps)`` over the last axis."""
    # dynamo records F.rms_norm / F.layer_norm as the torch.* builtins they call
    if is_call(node, F.rms_norm, torch.rms_norm):
        names, kind = ("input", "normalized_shape", "weight", "eps"), "rms"
    elif is_call(node, F.layer_norm, torch.layer_norm):
        names, kind = ("input", "normalized_shape", "weight", "bias", "eps"), "layer"
    else:
        return None
    args = {**dict(zip(names, node.args)), **node.kwargs}
    x, shape = args.get("input"), args.get("normalized_shape")
    value = _value(x)
    if value is None:
        return "no shape metadata"
    if len(tuple(shape)) != 1 or tuple(shape)[0] != value.shape[-1]:
        return "normalizes over more than the last axis"
    eps = args.get("eps")
    if eps is None:  # F.rms_norm's default is its input's machine epsilon; F.layer_norm's is 1e-5
        eps = torch.finfo(value.dtype).eps if kind == "rms" else 1e-5
    match = NormMatch(kind, x, float(eps), weight=args.get("weight"), bias=args.get("bias"), output=node)
    _strip_upcast_round_trip(match)
    return match


def _strip_upcast_round_trip(match: NormMatch) -> None:
    """``norm(x.to(float32)).to(x.dtype)`` (OLMo) is the kernel on x: it computes in float32 from x's exact
    values and rounds once to x's dtype."""
    cast_back = _single_user(match.output)
    source = match.x.args[0] if _is_exact_cast(match.x) else None
    if source is None or cast_target(cast_back) != _dtype(source) or _dtype(match.x) != _acc(_dtype(source)):
        return
    match.internal += [match.output, match.x]
    match.x, match.output = source, cast_back
