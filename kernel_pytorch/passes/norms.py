"""Find RMSNorm and LayerNorm in model code, with the residual add feeding them, and call the fused ops.

Matched (by :mod:`~kernel_pytorch.passes.norms_match`, on the canonical forms of :mod:`normalize`, with the
rules for which dtype flows are the kernels' own), starting from each inverse square root::

    RMSNorm     n = x * rsqrt(mean(x32 ** 2, -1, keepdim=True) + eps)    x32: x or x.to(float32)
                (or x / sqrt(...), x * (...) ** -0.5); y = weight * n.to(x.dtype)  (casts and weight optional)
    LayerNorm   d = x - mean(x, -1, keepdim=True)
                n = d * rsqrt(mean(d ** 2, -1, keepdim=True) + eps)      (or var(x, -1, unbiased=False))
                y = n * weight + bias                                      (optional)
    F.rms_norm / F.layer_norm over the last dimension (nn.RMSNorm, nn.LayerNorm as dynamo records them)

and rewritten as (``h`` is the residual stream when ``x = a + b``)::

    y = rms_norm(x, weight, eps, cast_before_weight=...)         # or
    y, h = rms_norm(a, weight, eps, residual=b)                   # one kernel reads a and b once
    y = rms_norm(x, w, eps, weight_offset=1.0)                    # a weight computed as 1 + w.float() (Gemma)

Hugging Face Llama and T5 round the normalized value to the input dtype before the weight multiply, while
``F.rms_norm`` rounds once at the end; the op takes ``cast_before_weight`` so each model keeps its own
rounding. Anything the matcher cannot prove (another reduction axis, a mean without keepdim, a weight that
is not one value per feature, a rounding the kernel does not make) is skipped with the reason.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx
from torch.fx import Node

from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult, candidates
from kernel_pytorch.passes.graph_utils import erase_unused, set_example_value
from kernel_pytorch.passes.norms_match import NormMatch, cast_target, match_norm
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.registry import register_pass

__all__ = ["NormPass"]


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, Node) else None


def _residual(match: NormMatch) -> Optional[tuple[Node, Node]]:
    """(a, b) if the norm's input is ``a + b`` of two tensors of its shape and dtype. Fused whether or not the
    sum is used after the norm: one kernel reading a and b beats an add kernel and a norm reading its sum."""
    x = match.x
    if match.upcast_input is not None or not is_call(x, operator.add):
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
    def _match(node: Node) -> NormMatch | str | None:
        return match_norm(node)

    @staticmethod
    def _rewrite(gm: torch.fx.GraphModule, match: NormMatch) -> str:
        from kernel_pytorch.ops import layer_norm, rms_norm

        graph, residual = gm.graph, _residual(match)
        x, extra = (residual[0], {"residual": residual[1]}) if residual else (_kernel_input(gm, match), {})
        offset = 0.0
        if match.kind == "rms":
            weight, offset = _weight_and_offset(match)
            target, args = rms_norm, (x, weight)
            kwargs = {"eps": match.eps, **extra, "cast_before_weight": match.cast_before_weight}
            kwargs.update({"weight_offset": offset} if offset else {})
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
        if offset:  # the weight's sum and cast, unless something else reads them
            erase_unused(graph, [match.weight, *match.weight.all_input_nodes])
        parts = [f"{'RMSNorm' if match.kind == 'rms' else 'LayerNorm'}(eps={match.eps:g}"]
        parts += [f"weight + {offset:g} in the kernel" if offset else "weight"] if match.weight is not None else []
        parts += ["bias"] if match.bias is not None else []
        parts += ["residual add fused"] if residual else []
        parts += ["cast before weight"] if match.cast_before_weight else []
        parts += [f"input upcast to {match.upcast_input}"] if match.upcast_input is not None else []
        return ", ".join(parts) + ")"


def _weight_and_offset(match: NormMatch) -> tuple[Any, float]:
    """``(w, c)`` for an RMSNorm weight computed as ``c + w.float()`` (either order; Gemma's ``1 + w``), which the
    kernel computes as it loads w, in float32 as the model does, instead of a kernel of its own per norm; else
    ``(weight, 0.0)``. Only where the sum is float32 and x is not float64 (the kernel's ACC is then float32), and
    not with ``cast_before_weight``."""
    weight = match.weight
    if match.cast_before_weight or not is_call(weight, operator.add) or weight.kwargs:
        return weight, 0.0
    constants = [a for a in weight.args[:2] if isinstance(a, (int, float)) and not isinstance(a, bool)]
    nodes = [a for a in weight.args[:2] if isinstance(a, Node)]
    if len(constants) != 1 or len(nodes) != 1:
        return weight, 0.0
    base = nodes[0].args[0] if cast_target(nodes[0]) == torch.float32 else nodes[0]  # w.float(), canonical
    base_value, sum_value, x_value = _value(base), _value(weight), _value(match.x)
    if not (isinstance(base_value, torch.Tensor) and base_value.dim() == 1 and base_value.is_floating_point()
            and base_value.dtype != torch.float64 and getattr(sum_value, "dtype", None) == torch.float32
            and getattr(x_value, "dtype", None) != torch.float64):
        return weight, 0.0
    return base, float(constants[0])


def _last_defined(graph: torch.fx.Graph, inputs: list[Any]) -> Node:
    nodes = [n for n in inputs if isinstance(n, Node)]
    position = {n: i for i, n in enumerate(graph.nodes)}
    return max(nodes, key=position.__getitem__)


def _kernel_input(gm: torch.fx.GraphModule, match: NormMatch) -> Node:
    """``match.x``, or ``match.x.to(dtype)`` where the norm's output is wider than x (an exact upcast: the
    kernel then computes and writes in that dtype, as the model did)."""
    if match.upcast_input is None:
        return match.x
    with gm.graph.inserting_after(match.x):
        upcast = gm.graph.call_method("to", (match.x, match.upcast_input))
    set_example_value(gm, upcast)
    return upcast
