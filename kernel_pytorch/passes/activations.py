"""Find activations and gated MLPs in model code and call the fused activation ops.

Matched (canonical forms, after :mod:`normalize`; ``c`` are constants, operands in any order)::

    SiLU          F.silu(x)                  x * sigmoid(x)
    GELU (erf)    F.gelu(x)                  0.5 * x * (1 + erf(x / sqrt(2)))            (BERT's old gelu)
    GELU (tanh)   F.gelu(x, approximate="tanh")
                  0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x ** 3)))         (GPT-2's gelu_new)
    gated         act(gate) * up                               (Llama, Mistral, Qwen: separate linears)
                  gate, up = chunk(gate_up, 2, -1); act(gate) * up     (one concatenated projection)

and rewritten as ``gated_activation(gate, up, kind)``, ``gated_activation_packed(gate_up, kind, gate_first)``
(one kernel reads gate and up once and writes the product) or, for an activation alone,
``activation(x, kind)``. Written-out GELUs are recognized by meaning: the argument of ``tanh``/``erf`` is
read as a polynomial in ``x`` and its coefficients compared with GELU's (relative 1e-6), so any
grouping of the constants matches and a different constant does not.

An activation whose output is also used elsewhere, or multiplied by a tensor of another shape or dtype
(broadcasting), becomes ``activation`` alone; a chunk over another axis, separate ``gated_activation``.
Skipped, with the reason: a written-out GELU whose ``tanh``/``erf`` argument is not GELU's.

Numerics: the ops compute in fp32 and round once, where eager rounds after the activation and again
after the product; in fp32 the two agree to ~1e-7.
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

from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult, candidates
from kernel_pytorch.passes.graph_utils import erase_unused
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.shape_constants import example_value

__all__ = ["ActivationPass"]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_COEFFICIENT_RTOL = 1e-6


@dataclass
class _Activation:
    kind: str  # "silu" | "gelu" | "gelu_tanh"
    x: Node
    output: Node
    internal: list[Node] = field(default_factory=list)


# ------------------------------------------------------------------------- products, sums, polynomials

def _constant(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _factors(node: Any) -> tuple[float, list[Any]]:
    """``node`` as ``c * f1 * f2 ...``: the constant and the non-constant factors (flattening ``*`` and
    division by constants)."""
    if (c := _constant(node)) is not None:
        return c, []
    if is_call(node, operator.mul):
        c1, f1 = _factors(node.args[0])
        c2, f2 = _factors(node.args[1])
        return c1 * c2, f1 + f2
    if is_call(node, operator.truediv) and (d := _constant(node.args[1])) not in (None, 0.0):
        c, f = _factors(node.args[0])
        return c / d, f
    return 1.0, [node]


def _polynomial(node: Any, x: Node, depth: int = 0) -> Optional[dict[int, float]]:
    """``node`` as a polynomial in ``x`` (power -> coefficient), or None if it is not one."""
    if depth > 12:
        return None
    if (c := _constant(node)) is not None:
        return {0: c}
    if node is x:
        return {1: 1.0}
    if is_call(node, operator.add, operator.sub):
        a, b = (_polynomial(arg, x, depth + 1) for arg in node.args[:2])
        if a is None or b is None:
            return None
        sign = -1.0 if is_call(node, operator.sub) else 1.0
        return {p: a.get(p, 0.0) + sign * b.get(p, 0.0) for p in set(a) | set(b)}
    if is_call(node, operator.mul):
        a, b = (_polynomial(arg, x, depth + 1) for arg in node.args[:2])
        if a is None or b is None:
            return None
        product: dict[int, float] = {}
        for pa, ca in a.items():
            for pb, cb in b.items():
                product[pa + pb] = product.get(pa + pb, 0.0) + ca * cb
        return product
    if is_call(node, operator.truediv) and (d := _constant(node.args[1])) not in (None, 0.0):
        a = _polynomial(node.args[0], x, depth + 1)
        return None if a is None else {p: c / d for p, c in a.items()}
    if is_call(node, operator.pow, torch.pow) and node.args[0] is x and (e := _constant(node.args[1])) is not None \
            and e == int(e) and 0 < e <= 4:
        return {int(e): 1.0}
    return None


def _same_polynomial(a: Optional[dict[int, float]], b: dict[int, float]) -> bool:
    if a is None:
        return False
    a = {p: c for p, c in a.items() if c != 0.0}
    return set(a) == set(b) and all(math.isclose(a[p], b[p], rel_tol=_COEFFICIENT_RTOL) for p in b)


# --------------------------------------------------------------------------------------- activations

def _written_gelu(node: Node) -> _Activation | str | None:
    """``0.5 * x * (1 + tanh(...))`` or ``0.5 * x * (1 + erf(x / sqrt(2)))``, any grouping; a reason
    when the shape is GELU's but the argument of tanh/erf is not."""
    constant, factors = _factors(node)
    if not math.isclose(constant, 0.5, rel_tol=_COEFFICIENT_RTOL) or len(factors) != 2:
        return None
    for x, one_plus in (factors, factors[::-1]):
        if not isinstance(x, Node) or not is_call(one_plus, operator.add):
            continue
        special = next((a for a in one_plus.args[:2] if is_call(a, torch.tanh, torch.erf)), None)
        other = next((a for a in one_plus.args[:2] if a is not special), None)
        if special is None or _constant(other) != 1.0 or len(special.users) != 1 or len(one_plus.users) != 1:
            continue
        polynomial = _polynomial(special.args[0], x)
        if is_call(special, torch.tanh):
            kind, expected = "gelu_tanh", {1: _SQRT_2_OVER_PI, 3: _SQRT_2_OVER_PI * 0.044715}
        else:
            kind, expected = "gelu", {1: 1.0 / math.sqrt(2.0)}
        if _same_polynomial(polynomial, expected):
            return _Activation(kind, x, node, _products_between(node, x) + [one_plus, special] +
                               _ancestors_until(special.args[0], x))
        found = "not a polynomial in x" if polynomial is None else \
            " + ".join(f"{c:.6g}*x^{p}" for p, c in sorted(polynomial.items()) if c)
        return f"0.5 * x * (1 + {special.target.__name__}(u)) but u = {found}, not {kind}'s argument"
    return None


def _products_between(node: Node, x: Node) -> list[Node]:
    """The ``*`` / ``/`` nodes of ``node``'s product tree (erased with it when unused)."""
    if not is_call(node, operator.mul, operator.truediv) or node is x:
        return []
    return [node] + [n for arg in node.args[:2] if isinstance(arg, Node) for n in _products_between(arg, x)]


def _ancestors_until(node: Any, x: Node) -> list[Node]:
    if not isinstance(node, Node) or node is x:
        return []
    return [node] + [n for arg in node.args if isinstance(arg, Node) for n in _ancestors_until(arg, x)]


def _match_activation(node: Node) -> _Activation | str | None:
    if is_call(node, F.silu) and len(node.args) == 1 and not node.kwargs:
        return _Activation("silu", node.args[0], node)
    if is_call(node, F.gelu) and len(node.args) == 1:
        approximate = node.kwargs.get("approximate", "none")
        if set(node.kwargs) <= {"approximate"} and approximate in ("none", "tanh"):
            return _Activation("gelu" if approximate == "none" else "gelu_tanh", node.args[0], node)
        return None
    if is_call(node, operator.mul):
        a, b = node.args[:2]
        for x, s in ((a, b), (b, a)):
            if is_call(s, torch.sigmoid) and s.args[0] is x and len(s.users) == 1:
                return _Activation("silu", x, node, [s])
        return _written_gelu(node)
    return None


def _match_with_shape(node: Node) -> _Activation | str | None:
    """The activation at ``node``, provided its input has an example value to size the kernel by."""
    match = _match_activation(node)
    if isinstance(match, _Activation) and (not isinstance(example_value(match.x), torch.Tensor) or not match.x.meta):
        return "no shape metadata"
    return match


# ------------------------------------------------------------------------------------------- gating

def _chunk_half(node: Node) -> Optional[tuple[Node, int]]:
    """``(gate_up, index)`` when ``node`` is half ``index`` of ``chunk(gate_up, 2, -1)``."""
    if not (is_call(node, operator.getitem) and is_call(node.args[0], torch.chunk)):
        return None
    chunk, index = node.args
    source = chunk.args[0]
    chunks = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
    dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
    value = example_value(source)
    if chunks != 2 or index not in (0, 1) or not isinstance(value, torch.Tensor):
        return None
    if dim not in (-1, value.dim() - 1) or not isinstance(value.shape[-1], int) or value.shape[-1] % 2:
        return None
    return source, index


def _biased_linear_feeding(match: _Activation) -> Optional[Node]:
    """The ``F.linear(x, w, b)`` with a bias whose only use is this tanh GELU (the one activation
    cuBLASLt fuses into the GEMM), else None."""
    x = match.x
    if match.kind != "gelu_tanh" or not is_call(x, F.linear) or len(x.args) < 3 or x.args[2] is None:
        return None
    users = set(x.users) - set(match.internal) - {match.output}
    return x if not users else None


def _same_tensor_type(a: Any, b: Any) -> bool:
    va, vb = example_value(a), example_value(b)
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and \
        tuple(va.shape) == tuple(vb.shape)


@register_pass
class ActivationPass(GraphPass):
    name = "activations"
    description = "SiLU / GELU (functional or written out) and gated MLPs act(gate) * up -> fused activation ops"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        for found in candidates(gm.graph.nodes, _match_with_shape, result):
            result.rewrite(found.location, self._rewrite(gm.graph, found.match))
        return result

    @staticmethod
    def _rewrite(graph: torch.fx.Graph, match: _Activation) -> str:
        from kernel_pytorch.ops.activations import (activation, gated_activation, gated_activation_packed,
                                                    linear_activation)

        user = next(iter(match.output.users)) if len(match.output.users) == 1 else None
        up = None
        if is_call(user, operator.mul) and match.output in user.args[:2]:
            up = user.args[1] if user.args[0] is match.output else user.args[0]
            up = up if isinstance(up, Node) and up is not match.output and _same_tensor_type(up, match.x) else None
        linear = _biased_linear_feeding(match)
        if up is None and linear is not None:
            # linear_activation: cuBLASLt's GEMM + bias + GELU epilogue where nothing needs a gradient
            # (inference on CUDA), F.linear + the activation kernel otherwise (ops/activations.py).
            with graph.inserting_after(match.output):
                call = graph.call_function(linear_activation, (*linear.args[:3], match.kind))
            replaced, description = match.output, f"linear + {match.kind} (GEMM epilogue in inference)"
            match.internal.append(linear)
        elif up is None:
            with graph.inserting_after(match.output):
                call = graph.call_function(activation, (match.x, match.kind))
            replaced, description = match.output, f"{match.kind}"
        else:
            gate_half, up_half = _chunk_half(match.x), _chunk_half(up)
            packed = gate_half and up_half and gate_half[0] is up_half[0] and gate_half[1] != up_half[1]
            with graph.inserting_after(user):
                if packed:
                    call = graph.call_function(gated_activation_packed, (gate_half[0], match.kind),
                                               {"gate_first": gate_half[1] == 0})
                else:
                    call = graph.call_function(gated_activation, (match.x, up, match.kind))
            replaced = user
            description = f"gated {match.kind} ({'one packed projection' if packed else 'separate gate and up'})"
        call.meta = dict(replaced.meta)
        replaced.replace_all_uses_with(call)
        erase_unused(graph, [replaced, match.output, *match.internal])
        if up is not None and packed:
            erase_unused(graph, [match.x, up, match.x.args[0]])
        return description
