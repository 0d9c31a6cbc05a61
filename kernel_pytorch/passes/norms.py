"""Find RMSNorm and LayerNorm in model code, with the residual add feeding them, and call the fused ops.

Matched (canonical forms, after :mod:`normalize`), starting from each ``rsqrt``/``sqrt``::

    RMSNorm     x32 = x.to(float32)                      # optional upcast
                n = x32 * rsqrt(mean(x32 ** 2, -1, keepdim=True) + eps)   # or x32 / sqrt(...)
                y = weight * n.to(x.dtype)                # optional cast and weight, either order
    LayerNorm   d = x - mean(x, -1, keepdim=True)
                n = d * rsqrt(mean(d ** 2, -1, keepdim=True) + eps)       # or d / sqrt(...)
                y = n * weight + bias                     # optional
    F.rms_norm / F.layer_norm over the last dimension (nn.RMSNorm, nn.LayerNorm as dynamo records them)

and rewritten as (``h`` is the residual stream when ``x = a + b`` is also used elsewhere)::

    y = rms_norm(x, weight, eps, cast_before_weight=...)         # or
    y, h = rms_norm(a, weight, eps, residual=b)                   # one kernel reads a and b once

Hugging Face and Llama round the normalized value to the input dtype before the weight multiply, while
``F.rms_norm`` rounds once at the end; the op takes ``cast_before_weight`` so each model keeps its own
rounding. Anything the matcher cannot prove (another reduction axis, a mean without keepdim, a weight
that is not one value per feature, an output dtype other than the input's) is skipped with the reason.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx import Node

from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult, candidates
from kernel_pytorch.passes.graph_utils import erase_unused, set_example_value
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.registry import register_pass

__all__ = ["NormPass"]


@dataclass
class _NormMatch:
    kind: str  # "rms" | "layer"
    x: Node
    eps: float
    weight: Optional[Node] = None
    bias: Optional[Node] = None
    cast_before_weight: bool = False
    output: Optional[Node] = None
    internal: list[Node] = field(default_factory=list)  # erased after the rewrite if unused


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, Node) else None


def _single_user(node: Node) -> Optional[Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _other(node: Node, one: Any) -> Any:
    a, b = node.args[:2]
    return b if a is one else a if b is one else None


def _last_dim_mean(node: Any, rank: int) -> Optional[Node]:
    """The mean's input if ``node`` is ``mean(t, -1 or rank-1, keepdim=True)``."""
    if not is_call(node, torch.mean):
        return None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    keepdim = node.kwargs.get("keepdim", node.args[2] if len(node.args) > 2 else False)
    if keepdim is not True or dim not in (-1, rank - 1):
        return None
    return node.args[0]


def _squared(node: Any) -> Optional[Node]:
    if is_call(node, operator.pow) and node.args[1] == 2:
        return node.args[0]
    if is_call(node, operator.mul) and node.args[0] is node.args[1]:
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


def _normalized(root: Node) -> Optional[tuple[Node, Node, list[Node]]]:
    """For an ``rsqrt``/``sqrt`` node: (numerator, normalized node, nodes from the statistic)."""
    users = list(root.users)
    if is_call(root, torch.rsqrt):
        n = next((u for u in users if is_call(u, operator.mul) and _other(u, root) is not None), None)
        return (_other(n, root), n, []) if n is not None else None
    if is_call(root, torch.sqrt):
        n = next((u for u in users if is_call(u, operator.truediv) and u.args[1] is root), None)
        return (n.args[0], n, []) if n is not None else None
    return None


def _match_statistics(root: Node) -> _NormMatch | str:
    mean_node, eps = _eps_and_stat(root.args[0])
    if mean_node is None:
        return "the variance is not `mean(...) + eps` with a constant eps"
    normalized = _normalized(root)
    if normalized is None:
        return "rsqrt/sqrt result is not multiplied into (or divided out of) the input"
    numerator, n_node, _ = normalized
    value = _value(numerator)
    if value is None:
        return "no shape metadata"
    square = _last_dim_mean(mean_node, value.dim())
    if square is None or _squared(square) is not numerator:
        return "the statistic is not the mean of squares of the normalized tensor over the last axis"
    internal = [n_node, root, root.args[0], mean_node, square]
    if is_call(numerator, operator.sub):
        x, mean = numerator.args[:2]
        if isinstance(x, Node) and _last_dim_mean(mean, value.dim()) is x:
            return _NormMatch("layer", x, eps, output=n_node, internal=internal + [numerator, mean])
    upcast = is_call(numerator, "to") and numerator.args[1] == torch.float32
    x = numerator.args[0] if upcast else numerator
    return _NormMatch("rms", x, eps, output=n_node, internal=internal + ([numerator] if upcast else []))


def _cast_back(node: Node, dtype: torch.dtype) -> Optional[Node]:
    user = _single_user(node)
    if is_call(user, "to") and len(user.args) == 2 and user.args[1] == dtype:
        return user
    if is_call(user, "type_as") and getattr(_value(user.args[1]), "dtype", None) == dtype:
        return user
    return None


def _feature_vector(node: Any, hidden: int) -> bool:
    value = _value(node)
    return value is not None and tuple(value.shape) == (hidden,)


def _absorb_affine(match: _NormMatch) -> None:
    """Extend the match over the cast back, the weight multiply and the bias add that follow it."""
    x_value = _value(match.x)
    hidden, dtype = x_value.shape[-1], x_value.dtype
    cast = _cast_back(match.output, dtype)
    if cast is not None:
        match.internal.append(match.output)
        match.output, match.cast_before_weight = cast, True
    user = _single_user(match.output)
    if is_call(user, operator.mul) and _feature_vector(_other(user, match.output), hidden):
        match.internal.append(match.output)
        match.weight, match.output = _other(user, match.output), user
        user = _single_user(match.output)
        if match.kind == "layer" and is_call(user, operator.add) and _feature_vector(_other(user, match.output), hidden):
            match.internal.append(match.output)
            match.bias, match.output = _other(user, match.output), user
    if not match.cast_before_weight:
        cast = _cast_back(match.output, dtype)
        if cast is not None:
            match.internal.append(match.output)
            match.output = cast
    match.cast_before_weight &= match.weight is not None


def _functional_match(node: Node) -> _NormMatch | str | None:
    """``F.rms_norm(x, shape, w, eps)`` / ``F.layer_norm(x, shape, w, b, eps)`` over the last axis."""
    # dynamo records F.rms_norm / F.layer_norm as the torch.* builtins they call
    if is_call(node, F.rms_norm, torch.rms_norm):
        args = [*node.args, None, None, None][:4]
        x, shape, weight, eps = args
        eps = node.kwargs.get("eps", eps)
        kind, bias = "rms", None
    elif is_call(node, F.layer_norm, torch.layer_norm):
        x, shape, weight, bias, eps = [*node.args, None, None, 1e-5][:5]
        kind = "layer"
    else:
        return None
    weight, bias = node.kwargs.get("weight", weight), node.kwargs.get("bias", bias)
    value = _value(x)
    if value is None or len(tuple(shape)) != 1 or tuple(shape)[0] != value.shape[-1]:
        return "normalizes over more than the last axis"
    if eps is None:
        eps = torch.finfo(value.dtype).eps  # F.rms_norm's default
    return _NormMatch(kind, x, float(eps), weight=weight, bias=bias, output=node)


def _residual(match: _NormMatch) -> Optional[tuple[Node, Node]]:
    """(a, b) if the norm's input is ``a + b`` of two same-shaped tensors that is used elsewhere too."""
    x = match.x
    if not is_call(x, operator.add) or len(x.users) < 2:
        return None
    a, b = x.args[:2]
    va, vb, vx = _value(a), _value(b), _value(x)
    if va is None or vb is None or vx is None:
        return None
    same = va.shape == vb.shape == vx.shape and va.dtype == vb.dtype == vx.dtype
    return (a, b) if same else None


@register_pass
class NormPass(GraphPass):
    name = "norms"
    description = "RMSNorm / LayerNorm (hand-written or functional) and residual add + norm -> fused norm ops"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        for found in candidates(gm.graph.nodes, self._match, result):
            result.rewrite(found.location, self._rewrite(gm, found.match))
        return result

    @staticmethod
    def _match(node: Node) -> _NormMatch | str | None:
        match = _functional_match(node)
        if match is None and is_call(node, torch.rsqrt, torch.sqrt):
            match = _match_statistics(node)
            if isinstance(match, _NormMatch):
                _absorb_affine(match)
        if isinstance(match, _NormMatch):
            return _unsupported(match) or match
        return match

    @staticmethod
    def _rewrite(gm: torch.fx.GraphModule, match: _NormMatch) -> str:
        from kernel_pytorch.ops import layer_norm, rms_norm

        graph, residual = gm.graph, _residual(match)
        x, extra = (residual[0], {"residual": residual[1]}) if residual else (match.x, {})
        if match.kind == "rms":
            target, args = rms_norm, (x, match.weight)
            kwargs = {"eps": match.eps, **extra, "cast_before_weight": match.cast_before_weight}
        else:
            target, args, kwargs = layer_norm, (x, match.weight, match.bias), {"eps": match.eps, **extra}
        # After the last of its inputs, so that the residual stream it returns can serve every later user.
        with graph.inserting_after(_last_defined(graph, [*args, *extra.values()])):
            call = graph.call_function(target, args, kwargs)
        if residual:  # the call returns (normed, summed); each getitem below takes the value it replaces
            set_example_value(gm, call)
        with graph.inserting_after(call):
            normed = graph.call_function(operator.getitem, (call, 0)) if residual else call
        normed.meta = dict(match.output.meta)
        match.output.replace_all_uses_with(normed)
        if residual:
            with graph.inserting_after(normed):
                summed = graph.call_function(operator.getitem, (call, 1))
            summed.meta = dict(match.x.meta)
            position = {n: i for i, n in enumerate(graph.nodes)}
            match.x.replace_all_uses_with(summed, delete_user_cb=lambda user: position[user] > position[summed])
        erase_unused(graph, [match.output, *match.internal, match.x if residual else None])
        parts = [f"{'RMSNorm' if match.kind == 'rms' else 'LayerNorm'}(eps={match.eps:g}"]
        parts += ["weight"] if match.weight is not None else []
        parts += ["bias"] if match.bias is not None else []
        parts += ["residual add fused"] if residual else []
        parts += ["cast before weight"] if match.cast_before_weight else []
        return ", ".join(parts) + ")"


def _last_defined(graph: torch.fx.Graph, inputs: list[Any]) -> Node:
    nodes = [n for n in inputs if isinstance(n, Node)]
    position = {n: i for i, n in enumerate(graph.nodes)}
    return max(nodes, key=position.__getitem__)


def _unsupported(match: _NormMatch) -> str | None:
    x_value, out_value = _value(match.x), _value(match.output)
    if x_value is None or out_value is None:
        return "no shape metadata"
    if out_value.dtype != x_value.dtype:
        return f"output dtype {out_value.dtype} differs from input dtype {x_value.dtype} (mixed-precision weight)"
    if tuple(out_value.shape) != tuple(x_value.shape):
        return "output shape differs from the input's"
    return None
