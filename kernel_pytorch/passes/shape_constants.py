"""Shape-only subgraphs evaluated concretely: the masks, scales and biases model code builds from sizes.

Attention masks are usually computed from sizes alone (``full``, ``arange``, ``triu``, comparisons...).
:class:`ConstantEvaluator` runs such a subgraph on the CPU and says what it is, or why it cannot (it
reads a model input, an unknown op, symbolic sizes...). With :class:`Bindings` it also evaluates
subgraphs that read symbolic sizes or buffers, at the sizes and buffer contents of one call: the
attention pass uses that to decide ``is_causal`` at rewrite time and, through a runtime guard
(:mod:`kernel_pytorch.passes.causal_mask`), to re-check the decision for each new size or buffer state.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import sympy
import torch
import torch.fx
from torch.fx import Node

__all__ = ["Bindings", "ConstantEvaluator", "Evaluation", "example_value", "describe_node", "is_buffer",
           "static_int", "static_numel", "same_shape", "MAX_EVALUATED_ELEMENTS"]

# A mask intermediate bigger than this (elements) is not evaluated to check causality. 2**28 covers
# L = 16384 (a 1 GiB float32 intermediate, evaluated once per capture on the host), where a smaller cap
# left causal attention with a mask tensor, several times slower (benchmarks/results/attention.json,
# docs/passes.md).
MAX_EVALUATED_ELEMENTS = 1 << 28


def is_buffer(node: Node) -> bool:
    """A placeholder Dynamo made for a module buffer (its name carries ``_buffers_``), or a ``get_attr``."""
    return node.op == "get_attr" or (node.op == "placeholder" and (
        "_buffers_" in str(node.target).lower() or "_buffers_" in node.name))


@dataclass(frozen=True)
class Bindings:
    """Concrete values for what a shape-only subgraph may read besides Python constants: symbolic sizes
    (by sympy symbol) and buffers (by placeholder name). At rewrite time they come from the capture's
    example inputs (:meth:`from_graph`); at run time from each call's arguments."""

    sizes: Mapping[sympy.Symbol, int] = field(default_factory=dict)
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def from_graph(cls, graph: torch.fx.Graph, values: Mapping[str, Any]) -> "Bindings":
        """Bindings of ``graph``'s size and buffer placeholders to ``values`` (placeholder name -> value;
        a ``SymInt`` value counts by its hint)."""
        sizes, buffers = {}, {}
        for node in graph.nodes:
            if node.op != "placeholder" or node.name not in values:
                continue
            meta, value = example_value(node), values[node.name]
            if isinstance(meta, torch.SymInt) and isinstance(meta.node.expr, sympy.Symbol):
                value = value.node.hint if isinstance(value, torch.SymInt) else value
                if isinstance(value, int):
                    sizes[meta.node.expr] = value
            elif is_buffer(node) and isinstance(value, torch.Tensor):
                buffers[node.name] = value
        return cls(sizes, buffers)

    def size(self, value: Any) -> Optional[int]:
        """``value`` (an int or a SymInt) as an int under these bindings; None if it stays symbolic."""
        concrete = static_int(value)
        if concrete is not None or not isinstance(value, torch.SymInt) or not self.sizes:
            return concrete
        expr = sympy.sympify(value.node.expr).xreplace({k: sympy.Integer(v) for k, v in self.sizes.items()})
        return int(expr) if expr.is_Integer else None


def example_value(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None


def describe_node(node: Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {target} ({node.name})"


def static_int(value: Any) -> Optional[int]:
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        return int(value) if is_concrete_int(value) else None
    return None


# ---------------------------------------------------------------------------------------------------
# Constants and shape-only subgraphs, evaluated concretely
# ---------------------------------------------------------------------------------------------------

# Functions that create a tensor from Python values only (their arguments hold no tensors).
_CREATORS = {torch.full, torch.ones, torch.zeros, torch.arange, torch.eye, torch.tensor, torch.scalar_tensor,
             torch.as_tensor, torch.ones_like, torch.zeros_like, torch.full_like}
# Of those, the ones that read only the shape and dtype of their first (tensor) argument.
_META_ONLY_FUNCTIONS = {torch.ones_like, torch.zeros_like, torch.full_like}
_META_ONLY_METHODS = {"new_ones", "new_zeros", "new_full"}
# Deterministic, side-effect free functions of their inputs' values.
_PURE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.neg, operator.invert, operator.and_, operator.or_, operator.xor, operator.lt, operator.le,
    operator.gt, operator.ge, operator.eq, operator.ne, operator.getitem,
    torch.triu, torch.tril, torch.where, torch.masked_fill, torch.unsqueeze, torch.squeeze, torch.transpose,
    torch.permute, torch.flatten, torch.cat, torch.stack, torch.flip, torch.broadcast_to, torch.reshape,
    torch.logical_not, torch.logical_and, torch.logical_or, torch.logical_xor, torch.bitwise_not,
    torch.bitwise_and, torch.bitwise_or, torch.eq, torch.ne, torch.lt, torch.le, torch.gt, torch.ge,
    torch.abs, torch.neg, torch.sqrt, torch.rsqrt, torch.exp, torch.log, torch.minimum, torch.maximum,
    torch.clamp, torch.add, torch.sub, torch.mul, torch.div, torch.sign, torch.reciprocal,
    # transformers' packed-sequence ids from position ids (masking_utils.find_packed_sequence_indices)
    torch.diff, torch.cumsum,
}
_PURE_METHODS = {
    "to", "view", "reshape", "expand", "expand_as", "contiguous", "clone", "bool", "int", "long", "float",
    "half", "bfloat16", "double", "type_as", "masked_fill", "triu", "tril", "unsqueeze", "squeeze",
    "transpose", "permute", "flip", "logical_not", "logical_and", "logical_or", "eq", "ne", "lt", "le", "gt",
    "ge", "__and__", "__or__", "__invert__", "__xor__", "add", "sub", "mul", "div", "neg", "abs", "sqrt",
    "rsqrt", "exp", "flatten", "repeat", "new_ones", "new_zeros", "new_full", "diff", "cumsum",
    # Operators as Dynamo records some of them (torch 2.11: transformers' ``a == b`` of packed-sequence ids)
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__sub__", "__mul__", "__neg__",
}
_META_ONLY_ARGUMENT_METHODS = {"expand_as", "type_as"}  # their second argument is read for shape/dtype


class _Unknown(Exception):
    pass


@dataclass(frozen=True)
class Evaluation:
    """A concretely evaluated node, or why it could not be (``kind`` says which sort of reason).

    ``bound`` names the size and buffer placeholders the value was computed from: empty for a true
    constant; otherwise the value holds for the bindings used, and a later call may differ."""

    value: Optional[torch.Tensor]
    reason: str = ""
    kind: str = ""  # "" | "input" | "buffer" | "symbolic" | "op" | "size"
    bound: frozenset[str] = frozenset()


class ConstantEvaluator:
    """Evaluates nodes that depend on no runtime tensor value (shape-only subgraphs), on the CPU.

    Leaves must create tensors from Python values (``full``, ``arange``, ``ones_like`` of any tensor...);
    a placeholder (a model input, parameter or buffer) or ``get_attr`` makes the node not constant,
    except the size and buffer placeholders ``bindings`` gives values for. Results are cached per node,
    since one mask usually feeds every layer.
    """

    def __init__(self, bindings: Optional[Bindings] = None, known: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        self._cache: dict[Node, Evaluation] = {}
        self.bindings = bindings or Bindings()
        # Placeholders whose value is a proven constant (an activation-checkpointed region's input that the
        # enclosing graph computes from shape-only ops): constants like any other, no guard needed.
        self.known = dict(known or {})

    def evaluate(self, node: Node) -> Evaluation:
        if node in self._cache:
            return self._cache[node]
        order, failure = self._ancestors(node)
        if failure is not None:
            self._cache[node] = failure
            return failure
        values: dict[Node, Any] = {}
        try:
            for current in order:
                values[current] = self._run(current, values)
        except _Unknown as error:
            result = Evaluation(None, str(error), "op")
        except Exception as error:  # an op that fails on the CPU copy: not a proof, so no constant
            result = Evaluation(None, f"could not evaluate ({type(error).__name__}: {error})", "op")
        else:
            value = values[node]
            if isinstance(value, (int, float, bool)):
                value = torch.tensor(value)
            bound = frozenset(n.name for n in order if n.op == "placeholder" and n.name not in self.known)
            result = Evaluation(value, bound=bound) if isinstance(value, torch.Tensor) else \
                Evaluation(None, "not a tensor", "op")
        self._cache[node] = result
        return result

    def ancestors(self, node: Node) -> list[Node]:
        """The nodes a constant ``node`` was computed from (itself included), in graph order."""
        order, failure = self._ancestors(node)
        return [] if failure is not None else order

    def _ancestors(self, root: Node) -> tuple[list[Node], Optional[Evaluation]]:
        """The nodes to evaluate, in graph order, or the reason the root is not a constant."""
        seen: set[Node] = set()
        stack = [root]
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            failure = self._leaf_failure(node)
            if failure is not None:
                return [], failure
            value = example_value(node)
            if isinstance(value, torch.Tensor):
                numel = self._numel(value)
                if numel is None:
                    return [], Evaluation(None, f"{node.name} has symbolic sizes", "symbolic")
                if numel > MAX_EVALUATED_ELEMENTS:
                    return [], Evaluation(None, f"{node.name} has {numel} elements, too many to evaluate", "size")
            for argument in self._value_arguments(node):
                stack.append(argument)
        order = [n for n in root.graph.nodes if n in seen]
        return order, None

    def _leaf_failure(self, node: Node) -> Optional[Evaluation]:
        if node.op == "placeholder" and node.name in self.known:
            return None
        if node.op == "placeholder":
            value = example_value(node)
            if not isinstance(value, torch.Tensor):
                if self.bindings.size(value) is not None:
                    return None
                return Evaluation(None, f"{node.name} is a symbolic size", "symbolic")
            if is_buffer(node):
                if node.name in self.bindings.buffers:
                    return None
                return Evaluation(None, f"held in buffer {node.target}", "buffer")
            return Evaluation(None, f"depends on the model input or parameter {node.target}", "input")
        if node.op == "get_attr":
            return Evaluation(None, f"held in buffer {node.target}", "buffer")
        if node.op == "call_function":
            if node.target in _CREATORS or node.target in _PURE_FUNCTIONS:
                return None
            return Evaluation(None, f"{describe_node(node)} is not a known shape-only op", "op")
        if node.op == "call_method":
            if node.target in _PURE_METHODS:
                return None
            return Evaluation(None, f"{describe_node(node)} is not a known shape-only op", "op")
        return Evaluation(None, f"{describe_node(node)} is not a known shape-only op", "op")

    @staticmethod
    def _value_arguments(node: Node) -> list[Node]:
        """The argument nodes whose values (not only metadata) the node reads."""
        nodes: list[Node] = []
        meta_only_first = node.target in _META_ONLY_FUNCTIONS or (
            node.op == "call_method" and node.target in _META_ONLY_METHODS)
        meta_only_second = node.op == "call_method" and node.target in _META_ONLY_ARGUMENT_METHODS
        for index, argument in enumerate(node.args):
            if (index == 0 and meta_only_first) or (index == 1 and meta_only_second):
                continue
            torch.fx.node.map_arg(argument, nodes.append)
        torch.fx.node.map_arg(dict(node.kwargs), nodes.append)
        return nodes

    def _run(self, node: Node, values: dict[Node, Any]) -> Any:
        meta_first = node.target in _META_ONLY_FUNCTIONS or (
            node.op == "call_method" and node.target in _META_ONLY_METHODS)
        meta_second = node.op == "call_method" and node.target in _META_ONLY_ARGUMENT_METHODS

        def load(argument: Node, meta_only: bool = False) -> Any:
            if meta_only:
                value = example_value(argument)
                shape = self._shape(value) if isinstance(value, torch.Tensor) else None
                if shape is None:
                    raise _Unknown(f"{argument.name} has no static shape")
                return torch.zeros(shape, dtype=value.dtype)
            return values[argument]

        if node.op == "placeholder":  # known, or a bound size or buffer (_leaf_failure let only those through)
            if node.name in self.known:
                return self.known[node.name]
            if node.name in self.bindings.buffers:
                return self.bindings.buffers[node.name].detach().cpu()
            return self.bindings.size(example_value(node))

        args = [torch.fx.node.map_arg(a, lambda n, i=i: load(n, (i == 0 and meta_first) or (i == 1 and meta_second)))
                for i, a in enumerate(node.args)]
        kwargs = {k: torch.fx.node.map_arg(v, load) for k, v in node.kwargs.items()}
        if "device" in kwargs:
            kwargs["device"] = "cpu"
        if node.op == "call_method" and node.target == "to":
            args = [a for a in args if not isinstance(a, (torch.device, str))]
            kwargs.pop("device", None)
            if len(args) == 1 and not kwargs:
                return args[0]
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        self_, *rest = args
        return getattr(self_, node.target)(*rest, **kwargs)

    def scalar(self, argument: Any) -> tuple[Optional[float], str]:
        """A Python number, or a constant one-element tensor, as a float; else (None, reason)."""
        if isinstance(argument, bool):
            return None, "a bool"
        if isinstance(argument, (int, float)):
            return float(argument), ""
        if not isinstance(argument, Node):
            return None, f"{type(argument).__name__} {argument!r}"
        value = example_value(argument)
        if not isinstance(value, torch.Tensor):
            return None, f"{argument.name} is a symbolic value"
        evaluation = self.evaluate(argument)
        if evaluation.value is None:
            return None, f"{argument.name} is a tensor that is not a provable constant ({evaluation.reason})"
        if evaluation.value.numel() != 1:
            return None, f"{argument.name} is a tensor of shape {tuple(evaluation.value.shape)}, not a scalar"
        return float(evaluation.value.reshape(()).item()), ""

    def _shape(self, value: torch.Tensor) -> Optional[list[int]]:
        sizes = [self.bindings.size(size) for size in value.shape]
        return None if any(size is None for size in sizes) else sizes

    def _numel(self, value: torch.Tensor) -> Optional[int]:
        shape = self._shape(value)
        return None if shape is None else int(torch.Size(shape).numel())


def _known_equal(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:  # sizes that cannot be compared count as different: the match is then skipped
        return False


def same_shape(a: Any, b: Any) -> bool:
    """Equal shapes, SymInts compared without adding guards (unknown counts as different)."""
    return len(a) == len(b) and all(_known_equal(x, y) for x, y in zip(a, b))


def static_numel(value: torch.Tensor) -> Optional[int]:
    """The element count of a tensor whose sizes are all concrete; None if any is symbolic."""
    return ConstantEvaluator()._numel(value)
