"""Give every operation of a torch-level FX graph one spelling, so each later pattern is written once.

TorchDynamo records what the user wrote: ``x.softmax(-1)``, ``torch.softmax(x, -1)`` and
``F.softmax(x, dim=-1)`` are three different nodes, ``k.mT`` is ``getattr(k, "mT")``, ``x.float()`` is
``call_method "float"``, and ``torch.fx.symbolic_trace`` adds ``call_module`` nodes for ``nn.Linear`` and
friends. :class:`Normalize` respells them, in place, into the canonical forms below. It never changes
what the graph computes: a spelling whose meaning differs (``alpha=``, ``out=``, ``rounding_mode=``,
``inplace=True``, ``.to(device)``, ``F.softmax(x, dim=None)``, a submodule with hooks) is left alone.

Canonical forms (``F`` is ``torch.nn.functional``):

========================  ============================================================================
family                    canonical node
========================  ============================================================================
arithmetic                ``operator.add/sub/mul/truediv/matmul/pow(a, b)``, ``operator.neg(a)``
                          (``torch.bmm`` stays)
softmax                   ``torch.softmax(x, dim)`` / ``torch.log_softmax(x, dim)``, ``dtype=`` kwarg
                          only when one was given
linear                    ``F.linear(x, w, b)`` (three positional arguments, ``b`` may be ``None``);
                          ``F.linear is torch._C._nn.linear``
dtype cast                ``call_method "to"(x, dtype)``
unary math                ``torch.sigmoid/exp/rsqrt/sqrt/tanh/relu/erf/abs/reciprocal(x)``;
                          ``F.silu(x)``; ``F.gelu(x)`` (``approximate="tanh"`` kwarg when so)
reductions                ``torch.mean(x, ...)``, ``torch.sum(x, ...)`` with the arguments as written
transpose                 ``torch.transpose(x, d0, d1)``, ``d0 < d1`` when both have the same sign
                          (``k.mT`` and ``k.transpose(-1, -2)`` both become ``transpose(k, -2, -1)``)
permute                   ``torch.permute(x, (d0, d1, ...))``
shape functions           ``torch.unsqueeze/squeeze/flatten/repeat_interleave/masked_fill/chunk/split``
                          with the arguments as written; ``torch.cat([t0, t1, ...], dim)``
dropout                   ``F.dropout(x, p, training, False)``
SDPA                      ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
                          scale=scale, enable_gqa=enable_gqa)``, every argument given
in-place arithmetic       ``x += y`` (``operator.iadd``, ``x.add_(y)``; ``-= *= /=`` too) becomes
                          ``operator.add(x, y)`` where nobody else can see the write: ``x`` is a fresh
                          result (an arithmetic op or a product) read by this op alone, and the
                          out-of-place dtype is ``x``'s
view / reshape / expand   ``call_method`` with unpacked sizes: ``x.view(a, b)``; ``contiguous`` stays
========================  ============================================================================

Left as written on purpose: ``x.t()`` and ``x.T`` when no metadata (``example_value``, ``val``,
``tensor_meta``) says ``x`` is 2-D; ``x.mH`` / ``x.H`` (conjugate); ``x.__rtruediv__(tensor)`` (it is
``x.reciprocal() * other``, which rounds differently from a division); ``torch.add(x, 2, y)`` (the
deprecated ``x + 2 * y``); ``.to`` with a device, another tensor, or ``copy=``/``non_blocking=``/
``memory_format=``; ``.type("torch.FloatTensor")``; ``x.permute(n)`` with one runtime value;
``F.dropout1d/2d/3d`` and alpha dropout. ``nn.Dropout`` in a ``symbolic_trace`` graph becomes
``F.dropout`` with the module's ``training`` flag of the moment, as Dynamo records it; a later
``gm.train()`` / ``gm.eval()`` no longer reaches that node.

Example, a Dynamo-captured attention score and a symbolic-traced projection::

    # before                                         # after
    t = getattr(k, 'mT')                             t = torch.transpose(k, -2, -1)
    s = torch.matmul(q, t)                           s = operator.matmul(q, t)
    m = s.mul(0.125)                                 m = operator.mul(s, 0.125)
    f = m.float()                                    f = m.to(torch.float32)
    p = F.softmax(f, dim=-1)                         p = torch.softmax(f, -1)
    o = self.proj(p)          # call_module Linear   proj_weight = self.proj.weight   # get_attr
                                                     proj_bias = self.proj.bias       # get_attr
                                                     o = F.linear(p, proj_weight, proj_bias)

Later passes test canonical nodes with :func:`is_call`::

    if is_call(node, torch.softmax) and node.args[1] in (-1, rank - 1): ...
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult
from kernel_pytorch.passes.registry import register_pass

__all__ = ["Normalize", "is_call"]

Target = Union[Callable[..., Any], str]


def is_call(node: Any, *targets: Target) -> bool:
    """Whether ``node`` calls one of ``targets``: a ``call_function`` node whose target is one of the
    given functions, or a ``call_method`` node whose method name is one of the given strings.

    Example::

        is_call(node, operator.matmul)         # a @ b, after normalization
        is_call(node, "view", "reshape")       # x.view(...) or x.reshape(...)
    """
    if not isinstance(node, Node):
        return False
    if node.op == "call_function":
        return any(node.target is t for t in targets if not isinstance(t, str))
    if node.op == "call_method":
        return node.target in [t for t in targets if isinstance(t, str)]
    return False


# ---------------------------------------------------------------------------------------------------
# What a rule returns
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """The canonical spelling of one node."""

    op: str
    target: Target
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _Attr:
    """An attribute of the called submodule (``call_module`` rules), read by a new ``get_attr`` node."""

    name: str


def _function(target: Callable[..., Any], *args: Any, **kwargs: Any) -> _Call:
    return _Call("call_function", target, args, kwargs)


def _method(name: str, *args: Any, **kwargs: Any) -> _Call:
    return _Call("call_method", name, args, kwargs)


# A rule reads one node's arguments and returns its canonical call, or None to leave the node alone.
_Rule = Callable[[Node], Optional[_Call]]


def _key(source: Target) -> tuple[str, Target]:
    """How a node spells ``source``: a method name is a ``call_method``; anything else a ``call_function``."""
    return ("call_method", source) if isinstance(source, str) else ("call_function", source)


def _bind(signature: inspect.Signature, node: Node) -> Optional[inspect.BoundArguments]:
    """The node's arguments bound to ``signature`` (explicit ones only), or None if they do not fit."""
    try:
        return signature.bind(*node.args, **node.kwargs)
    except TypeError:
        return None


def _sig(stub: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(stub)


def _rank(*nodes: Any) -> Optional[int]:
    """The rank of the first of ``nodes`` whose metadata (Dynamo's or ShapeProp's) records it."""
    for node in nodes:
        dim = _example_dim(node) if isinstance(node, Node) else None
        if dim is not None:
            return dim
    return None


def _example_dim(node: Node) -> Optional[int]:
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return value.dim()
    tensor_meta = node.meta.get("tensor_meta")
    shape = getattr(tensor_meta, "shape", None)
    return len(shape) if shape is not None else None


# ---------------------------------------------------------------------------------------------------
# Tables: source spellings -> canonical target
# ---------------------------------------------------------------------------------------------------

# Binary and unary arithmetic. Respelt only when called with exactly the operands and no keyword:
# alpha=, out= and rounding_mode= change the meaning, and torch.add(x, 2, y) is the deprecated x + 2*y.
_ARITHMETIC: dict[Callable[..., Any], tuple[Target, ...]] = {
    operator.add: (torch.add, torch.Tensor.add, "add", "__add__"),
    operator.sub: (torch.sub, torch.subtract, torch.Tensor.sub, "sub", "subtract", "__sub__"),
    operator.mul: (torch.mul, torch.multiply, torch.Tensor.mul, "mul", "multiply", "__mul__"),
    operator.truediv: (
        torch.div, torch.divide, torch.true_divide, torch.Tensor.div,
        "div", "divide", "true_divide", "__truediv__", "__div__",
    ),
    operator.matmul: (torch.matmul, torch.Tensor.matmul, "matmul", "__matmul__"),
    operator.pow: (torch.pow, torch.Tensor.pow, "pow", "__pow__"),
    operator.neg: (torch.neg, torch.negative, torch.Tensor.neg, "neg", "negative", "__neg__"),
}
_ARITY = {operator.neg: 1}

# x.__rsub__(c) is c - x; respelt as operator.sub(c, x) only for a Python number c, because then
# Python dispatches straight back to x.__rsub__(c) (Tensor.__rtruediv__ is x.reciprocal() * c, not a
# division, so a tensor c would change the result).
_REFLECTED: dict[str, Callable[..., Any]] = {
    "__radd__": operator.add,
    "__rsub__": operator.sub,
    "__rmul__": operator.mul,
    "__rtruediv__": operator.truediv,
    "__rdiv__": operator.truediv,
    "__rmatmul__": operator.matmul,
    "__rpow__": operator.pow,
}

# softmax / log_softmax: each source with the signature it is called with (positions differ:
# F.softmax's third parameter is _stacklevel, torch.softmax's is dtype).
_F_SOFTMAX = _sig(lambda input, dim=None, _stacklevel=3, dtype=None: None)
_TORCH_SOFTMAX = _sig(lambda input, dim, dtype=None: None)
_SPECIAL_SOFTMAX = _sig(lambda input, dim, *, dtype=None: None)
_SOFTMAX: dict[Callable[..., Any], dict[Target, inspect.Signature]] = {
    torch.softmax: {
        torch.softmax: _TORCH_SOFTMAX,
        torch.Tensor.softmax: _TORCH_SOFTMAX,
        "softmax": _TORCH_SOFTMAX,
        F.softmax: _F_SOFTMAX,
        torch.special.softmax: _SPECIAL_SOFTMAX,
    },
    torch.log_softmax: {
        torch.log_softmax: _TORCH_SOFTMAX,
        torch.Tensor.log_softmax: _TORCH_SOFTMAX,
        "log_softmax": _TORCH_SOFTMAX,
        F.log_softmax: _F_SOFTMAX,
        torch.special.log_softmax: _SPECIAL_SOFTMAX,
    },
}

_LINEAR = _sig(lambda input, weight, bias=None: None)

# dtype casts -> x.to(dtype)
_CASTS: dict[str, torch.dtype] = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
}
_TYPE = _sig(lambda self, dtype=None, non_blocking=False, **kwargs: None)

# Unary math -> torch.<fn>(x). F.relu's inplace=True is left alone (it writes its input).
_UNARY_STUB = _sig(lambda input: None)
_INPLACE_STUB = _sig(lambda input, inplace=False: None)
_UNARY: dict[Callable[..., Any], dict[Target, inspect.Signature]] = {
    torch.sigmoid: {"sigmoid": _UNARY_STUB, torch.Tensor.sigmoid: _UNARY_STUB, F.sigmoid: _UNARY_STUB,
                    torch.special.expit: _UNARY_STUB},
    torch.tanh: {"tanh": _UNARY_STUB, torch.Tensor.tanh: _UNARY_STUB, F.tanh: _UNARY_STUB},
    torch.relu: {"relu": _UNARY_STUB, torch.Tensor.relu: _UNARY_STUB, F.relu: _INPLACE_STUB},
    torch.exp: {"exp": _UNARY_STUB, torch.Tensor.exp: _UNARY_STUB},
    torch.rsqrt: {"rsqrt": _UNARY_STUB, torch.Tensor.rsqrt: _UNARY_STUB},
    torch.sqrt: {"sqrt": _UNARY_STUB, torch.Tensor.sqrt: _UNARY_STUB},
    torch.erf: {"erf": _UNARY_STUB, torch.Tensor.erf: _UNARY_STUB},
    torch.abs: {"abs": _UNARY_STUB, torch.Tensor.abs: _UNARY_STUB},
    torch.reciprocal: {"reciprocal": _UNARY_STUB, torch.Tensor.reciprocal: _UNARY_STUB},
}
_GELU = _sig(lambda input, *, approximate="none": None)

# Tensor methods whose torch function takes the same arguments after the tensor.
_METHOD_TO_FUNCTION: dict[str, Callable[..., Any]] = {
    "mean": torch.mean,
    "sum": torch.sum,
    "unsqueeze": torch.unsqueeze,
    "squeeze": torch.squeeze,
    "flatten": torch.flatten,
    "repeat_interleave": torch.repeat_interleave,
    "masked_fill": torch.masked_fill,
    "chunk": torch.chunk,
    "split": torch.split,
}
# Keyword names that differ between the method and the function.
_RENAMED_KWARGS: dict[str, dict[str, str]] = {"split": {"split_size": "split_size_or_sections"}}

_TRANSPOSE_STUB = _sig(lambda input, dim0, dim1: None)
_SWAPAXES_STUB = _sig(lambda input, axis0, axis1: None)
_TRANSPOSE: dict[Target, inspect.Signature] = {
    torch.transpose: _TRANSPOSE_STUB,
    torch.Tensor.transpose: _TRANSPOSE_STUB,
    "transpose": _TRANSPOSE_STUB,
    torch.swapdims: _TRANSPOSE_STUB,
    torch.Tensor.swapdims: _TRANSPOSE_STUB,
    "swapdims": _TRANSPOSE_STUB,
    torch.swapaxes: _SWAPAXES_STUB,
    torch.Tensor.swapaxes: _SWAPAXES_STUB,
    "swapaxes": _SWAPAXES_STUB,
}
_TRANSPOSE_2D: tuple[Target, ...] = (torch.t, torch.Tensor.t, "t")  # only on tensors known to be 2-D

_CAT: dict[Callable[..., Any], inspect.Signature] = {
    torch.cat: _sig(lambda tensors, dim=0, *, out=None: None),
    torch.concat: _sig(lambda tensors, dim=0, *, out=None: None),
    torch.concatenate: _sig(lambda tensors, axis=0, *, out=None: None),
}

_DROPOUT: dict[Callable[..., Any], inspect.Signature] = {
    F.dropout: _sig(lambda input, p=0.5, training=True, inplace=False: None),
    torch.dropout: _sig(lambda input, p, train: None),
}

_SIZE_METHODS = ("view", "reshape", "expand")
_RESHAPE = _sig(lambda input, shape: None)

# F.scaled_dot_product_attention (torch._C._nn's): scale and enable_gqa are keyword-only there.
_SDPA = _sig(lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
             enable_gqa=False: None)

# In-place arithmetic -> its out-of-place operator (operator.iadd is how Dynamo records ``x += y``).
_IN_PLACE: dict[Target, Callable[..., Any]] = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, "add_": operator.add, "sub_": operator.sub, "mul_": operator.mul,
    "div_": operator.truediv,
}
# Results that are always a new tensor (never a view or the input itself, as ``x.to(x.dtype)`` is): writing
# one in place is seen by nobody but its readers.
_FRESH_RESULTS = (operator.add, operator.sub, operator.mul, operator.truediv, operator.matmul, torch.bmm)


# ---------------------------------------------------------------------------------------------------
# Rules: one small function per family
# ---------------------------------------------------------------------------------------------------


def _arithmetic(canonical: Callable[..., Any]) -> _Rule:
    def rule(node: Node) -> Optional[_Call]:
        if node.kwargs or len(node.args) != _ARITY.get(canonical, 2):
            return None
        return _function(canonical, *node.args)

    return rule


def _reflected(canonical: Callable[..., Any]) -> _Rule:
    def rule(node: Node) -> Optional[_Call]:
        if node.kwargs or len(node.args) != 2 or not isinstance(node.args[1], (int, float, bool)):
            return None
        self, other = node.args
        return _function(canonical, other, self)

    return rule


def _softmax(canonical: Callable[..., Any], signature: inspect.Signature) -> _Rule:
    def rule(node: Node) -> Optional[_Call]:
        bound = _bind(signature, node)
        if bound is None:
            return None
        args = bound.arguments
        if args.get("dim") is None:  # implicit dim: F.softmax picks one from the rank, with a warning
            return None
        dtype = args.get("dtype")
        return _function(canonical, bound.args[0], args["dim"], **({"dtype": dtype} if dtype is not None else {}))

    return rule


def _linear(node: Node) -> Optional[_Call]:
    bound = _bind(_LINEAR, node)
    if bound is None:
        return None
    args = bound.arguments
    return _function(F.linear, args["input"], args["weight"], args.get("bias"))


def _cast(dtype: torch.dtype) -> _Rule:
    def rule(node: Node) -> Optional[_Call]:
        if node.kwargs or len(node.args) != 1:  # memory_format= changes the result's strides
            return None
        return _method("to", node.args[0], dtype)

    return rule


def _to(node: Node) -> Optional[_Call]:
    """``x.to(dtype=d)`` -> ``x.to(d)``; devices, other tensors and copy=/non_blocking= are left alone."""
    if len(node.args) == 2 and not node.kwargs and isinstance(node.args[1], torch.dtype):
        return _method("to", *node.args)
    if len(node.args) == 1 and set(node.kwargs) == {"dtype"} and isinstance(node.kwargs["dtype"], torch.dtype):
        return _method("to", node.args[0], node.kwargs["dtype"])
    return None


def _type(node: Node) -> Optional[_Call]:
    """``x.type(torch.float32)`` -> ``x.to(torch.float32)``; type strings (may name a device) are left."""
    bound = _bind(_TYPE, node)
    if bound is None or set(bound.arguments) != {"self", "dtype"}:
        return None
    dtype = bound.arguments["dtype"]
    return _method("to", bound.arguments["self"], dtype) if isinstance(dtype, torch.dtype) else None


def _unary(canonical: Callable[..., Any], signature: inspect.Signature) -> _Rule:
    def rule(node: Node) -> Optional[_Call]:
        bound = _bind(signature, node)
        if bound is None or bound.arguments.get("inplace", False) is not False:
            return None
        return _function(canonical, bound.args[0])

    return rule


def _silu(node: Node) -> Optional[_Call]:
    bound = _bind(_INPLACE_STUB, node)
    if bound is None or bound.arguments.get("inplace", False) is not False:
        return None
    return _function(F.silu, bound.args[0])


def _gelu_call(input: Any, approximate: Any) -> _Call:
    return _function(F.gelu, input, **({} if approximate == "none" else {"approximate": approximate}))


def _gelu(node: Node) -> Optional[_Call]:
    bound = _bind(_GELU, node)
    if bound is None:
        return None
    return _gelu_call(bound.args[0], bound.arguments.get("approximate", "none"))


def _method_to_function(name: str) -> _Rule:
    function, renamed = _METHOD_TO_FUNCTION[name], _RENAMED_KWARGS.get(name, {})

    def rule(node: Node) -> Optional[_Call]:
        if not node.args:
            return None
        kwargs = {renamed.get(key, key): value for key, value in node.kwargs.items()}
        return _function(function, *node.args, **kwargs)

    return rule


def _transpose_call(input: Any, dim0: Any, dim1: Any) -> _Call:
    # transpose(x, a, b) and transpose(x, b, a) are the same view; order same-signed dims ascending.
    if isinstance(dim0, int) and isinstance(dim1, int) and (dim0 < 0) == (dim1 < 0) and dim0 > dim1:
        dim0, dim1 = dim1, dim0
    return _function(torch.transpose, input, dim0, dim1)


def _transpose(signature: inspect.Signature) -> _Rule:
    def rule(node: Node) -> Optional[_Call]:
        bound = _bind(signature, node)
        return None if bound is None else _transpose_call(*bound.args)

    return rule


def _transpose_2d(node: Node) -> Optional[_Call]:
    """``x.t()`` is a transpose only for 2-D ``x`` (0-D and 1-D: ``x`` itself)."""
    if node.kwargs or len(node.args) != 1 or _rank(node.args[0], node) != 2:
        return None
    return _transpose_call(node.args[0], 0, 1)


def _getattr(node: Node) -> Optional[_Call]:
    """Dynamo and symbolic_trace record ``x.mT`` and ``x.T`` as ``getattr(x, "mT")``."""
    if node.kwargs or len(node.args) != 2 or not isinstance(node.args[0], Node):
        return None
    tensor, attribute = node.args
    if attribute == "mT":
        return _transpose_call(tensor, -2, -1)
    if attribute == "T" and _rank(tensor, node) == 2:  # on other ranks .T reverses all dims
        return _transpose_call(tensor, 0, 1)
    return None


def _permute_method(node: Node) -> Optional[_Call]:
    """``x.permute(0, 2, 1, 3)``, ``x.permute([0, 2, 1, 3])``, ``x.permute(dims=...)`` -> tuple form."""
    if not node.args:
        return None
    if node.kwargs:
        if set(node.kwargs) != {"dims"} or len(node.args) != 1:
            return None
        dims: Any = node.kwargs["dims"]
    elif len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
        dims = node.args[1]
    elif len(node.args) == 2 and isinstance(node.args[1], Node):
        return None  # one runtime value: a rank-1 dim or a whole dims list, cannot tell which
    else:
        dims = node.args[1:]
    if not isinstance(dims, (list, tuple)) or any(isinstance(d, (list, tuple)) for d in dims):
        return None
    return _function(torch.permute, node.args[0], tuple(dims))


def _permute_function(node: Node) -> Optional[_Call]:
    bound = _bind(_sig(lambda input, dims: None), node)
    if bound is None or not isinstance(bound.arguments["dims"], (list, tuple)):
        return None
    return _function(torch.permute, bound.arguments["input"], tuple(bound.arguments["dims"]))


def _cat(signature: inspect.Signature) -> _Rule:
    def rule(node: Node) -> Optional[_Call]:
        bound = _bind(signature, node)
        if bound is None or "out" in bound.arguments:
            return None
        tensors, dim = bound.args[0], (bound.args[1] if len(bound.args) > 1 else 0)
        if not isinstance(tensors, (list, tuple)):
            return None
        return _function(torch.cat, list(tensors), dim)

    return rule


def _dropout(signature: inspect.Signature) -> _Rule:
    def rule(node: Node) -> Optional[_Call]:
        bound = _bind(signature, node)
        if bound is None:
            return None
        bound.apply_defaults()
        if bound.arguments.get("inplace", False) is not False:
            return None
        input, p, training = bound.args[:3]
        return _function(F.dropout, input, p, training, False)

    return rule


def _unpacked_sizes(name: str, args: tuple, kwargs: dict) -> _Call:
    # x.view((a, b)) -> x.view(a, b). An empty tuple stays: x.view() is not a valid call.
    if len(args) == 2 and isinstance(args[1], (list, tuple)) and len(args[1]) > 0:
        args = (args[0], *args[1])
    return _method(name, *args, **kwargs)


def _size_method(name: str) -> _Rule:
    def rule(node: Node) -> Optional[_Call]:
        return _unpacked_sizes(name, node.args, dict(node.kwargs)) if node.args else None

    return rule


def _torch_reshape(node: Node) -> Optional[_Call]:
    bound = _bind(_RESHAPE, node)
    if bound is None:
        return None
    return _unpacked_sizes("reshape", (bound.arguments["input"], bound.arguments["shape"]), {})


def _contiguous(node: Node) -> Optional[_Call]:
    return _method("contiguous", *node.args, **node.kwargs) if node.args else None


def _sdpa(node: Node) -> Optional[_Call]:
    bound = _bind(_SDPA, node)
    if bound is None:
        return None
    bound.apply_defaults()
    a = bound.arguments
    return _function(F.scaled_dot_product_attention, a["query"], a["key"], a["value"], a["attn_mask"], a["dropout_p"],
                     a["is_causal"], scale=a["scale"], enable_gqa=a["enable_gqa"])


def _in_place(canonical: Callable[..., Any]) -> _Rule:
    """``x op= y`` -> ``op(x, y)`` when the write is invisible (see the table in the module docstring)."""
    def rule(node: Node) -> Optional[_Call]:
        if len(node.args) != 2 or node.kwargs:
            return None
        target, other = node.args
        if not (isinstance(target, Node) and target.op == "call_function" and target.target in _FRESH_RESULTS
                and len(target.users) == 1):
            return None
        value = target.meta.get("example_value")
        other_value = other.meta.get("example_value") if isinstance(other, Node) else other
        if not isinstance(value, torch.Tensor) or not isinstance(other_value, (torch.Tensor, int, float)) \
                or isinstance(other_value, bool):
            return None
        # x += y keeps x's dtype; x + y promotes (fp16 + fp32 is fp32): respelt only where they agree.
        if torch.result_type(value, other_value) != value.dtype:
            return None
        return _function(canonical, target, other)

    return rule


def _build_rules() -> dict[tuple[str, Target], _Rule]:
    rules: dict[tuple[str, Target], _Rule] = {}
    for canonical, sources in _ARITHMETIC.items():
        rules.update({_key(source): _arithmetic(canonical) for source in sources})
    rules.update({_key(name): _reflected(canonical) for name, canonical in _REFLECTED.items()})
    for canonical, signatures in _SOFTMAX.items():
        rules.update({_key(source): _softmax(canonical, sig) for source, sig in signatures.items()})
    rules[_key(F.linear)] = _linear
    for name, dtype in _CASTS.items():
        rules[_key(name)] = rules[_key(getattr(torch.Tensor, name))] = _cast(dtype)
    rules[_key("to")] = rules[_key(torch.Tensor.to)] = _to
    rules[_key("type")] = rules[_key(torch.Tensor.type)] = _type
    for canonical, signatures in _UNARY.items():
        rules.update({_key(source): _unary(canonical, sig) for source, sig in signatures.items()})
    rules[_key(F.silu)] = _silu
    rules[_key(F.gelu)] = _gelu
    for name in _METHOD_TO_FUNCTION:
        rules[_key(name)] = rules[_key(getattr(torch.Tensor, name))] = _method_to_function(name)
    rules.update({_key(source): _transpose(sig) for source, sig in _TRANSPOSE.items()})
    rules.update({_key(source): _transpose_2d for source in _TRANSPOSE_2D})
    rules[_key(getattr)] = _getattr
    rules[_key("permute")] = rules[_key(torch.Tensor.permute)] = _permute_method
    rules[_key(torch.permute)] = _permute_function
    rules.update({_key(source): _cat(sig) for source, sig in _CAT.items()})
    rules.update({_key(source): _dropout(sig) for source, sig in _DROPOUT.items()})
    for name in _SIZE_METHODS:
        rules[_key(name)] = rules[_key(getattr(torch.Tensor, name))] = _size_method(name)
    rules[_key(torch.reshape)] = _torch_reshape
    rules[_key(torch.Tensor.contiguous)] = _contiguous
    rules[_key(F.scaled_dot_product_attention)] = _sdpa
    rules.update({_key(source): _in_place(canonical) for source, canonical in _IN_PLACE.items()})
    return rules


_RULES = _build_rules()


# ---------------------------------------------------------------------------------------------------
# call_module (symbolic_trace graphs): leaf modules -> the functional call their forward makes
# ---------------------------------------------------------------------------------------------------

_ModuleRule = Callable[[Any, Any], Optional[_Call]]  # (module, input) -> canonical call


def _linear_module(module: nn.Linear, input: Any) -> _Call:
    return _function(F.linear, input, _Attr("weight"), _Attr("bias") if module.bias is not None else None)


def _dropout_module(module: nn.Dropout, input: Any) -> Optional[_Call]:
    # The training flag is read now, as Dynamo bakes it in; gm.train()/eval() later no longer reaches it.
    return None if module.inplace else _function(F.dropout, input, module.p, module.training, False)


def _softmax_module(canonical: Callable[..., Any]) -> _ModuleRule:
    return lambda module, input: None if module.dim is None else _function(canonical, input, module.dim)


_MODULES: dict[type, _ModuleRule] = {
    nn.Linear: _linear_module,
    nn.Dropout: _dropout_module,
    nn.ReLU: lambda module, input: None if module.inplace else _function(torch.relu, input),
    nn.Sigmoid: lambda module, input: _function(torch.sigmoid, input),
    nn.Tanh: lambda module, input: _function(torch.tanh, input),
    nn.SiLU: lambda module, input: None if module.inplace else _function(F.silu, input),
    nn.GELU: lambda module, input: _gelu_call(input, module.approximate),
    nn.Softmax: _softmax_module(torch.softmax),
    nn.LogSoftmax: _softmax_module(torch.log_softmax),
    nn.Flatten: lambda module, input: _function(torch.flatten, input, module.start_dim, module.end_dim),
}


def _has_hooks(module: nn.Module) -> bool:
    """Hooks run when the submodule is called; the functional call would skip them."""
    glob = nn.modules.module
    hooks = (
        module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
        glob._global_forward_hooks, glob._global_forward_pre_hooks, glob._global_backward_hooks,
        glob._global_backward_pre_hooks,
    )
    return any(len(h) > 0 for h in hooks)


def _call_module(node: Node, gm: torch.fx.GraphModule) -> Optional[_Call]:
    if node.kwargs or len(node.args) != 1 or not isinstance(node.target, str):
        return None
    try:
        module = gm.get_submodule(node.target)
    except AttributeError:
        return None
    for cls in type(module).__mro__:
        if cls in _MODULES:
            # A subclass that overrides forward computes something else; hooks would be skipped.
            if type(module).forward is not cls.forward or _has_hooks(module):
                return None
            return _MODULES[cls](module, node.args[0])
    return None


# ---------------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------------


def _canonical(node: Node, gm: torch.fx.GraphModule) -> Optional[_Call]:
    if node.op == "call_module":
        return _call_module(node, gm)
    if node.op not in ("call_function", "call_method"):
        return None
    try:
        rule = _RULES.get((node.op, node.target))
    except TypeError:  # an unhashable target
        return None
    return None if rule is None else rule(node)


def _same(a: Any, b: Any) -> bool:
    """Structural equality that tells 1, 1.0 and True apart and compares nodes and tensors by identity."""
    if isinstance(a, (Node, torch.Tensor)) or isinstance(b, (Node, torch.Tensor)):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (isinstance(a, list) == isinstance(b, list)) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and (a is b or a == b)


def _is_spelt(node: Node, call: _Call) -> bool:
    return (
        node.op == call.op
        and (node.target is call.target or node.target == call.target)
        and _same(tuple(node.args), call.args)
        and _same(dict(node.kwargs), call.kwargs)
    )


def _respell(gm: torch.fx.GraphModule, node: Node, call: _Call) -> None:
    """Edit ``node`` in place (its name, users and meta stay); read submodule attributes by get_attr."""
    if any(isinstance(a, _Attr) for a in call.args):
        module_path = node.target
        carried = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}

        def attr(value: Any) -> Any:
            if not isinstance(value, _Attr):
                return value
            with gm.graph.inserting_before(node):
                getter = gm.graph.get_attr(f"{module_path}.{value.name}")
            getter.meta.update(carried)
            return getter

        call = _Call(call.op, call.target, tuple(attr(a) for a in call.args), call.kwargs)
    node.op = call.op
    node.target = call.target
    node.args = call.args
    node.kwargs = call.kwargs


@register_pass
class Normalize(GraphPass):
    """Respell a torch-level FX graph so each operation has one canonical form (see the module docstring).

    Runs first: the attention, norm, RoPE and MLP matchers only know the canonical forms. Nodes are
    edited in place, so names, users and ``node.meta`` (``example_value``, ``nn_module_stack``,
    ``stack_trace``) are kept. ``result.changed`` counts the respelt nodes; no ``Rewrite`` records are
    added, since respellings change nothing a user would want listed.

    Example::

        gm = torch.fx.symbolic_trace(model)
        result = Normalize().run(gm, ctx)
        gm.graph.lint(); gm.recompile()
    """

    name = "normalize"
    description = "respell torch-level graph operations into one canonical form each (matched by later passes)"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        for node in list(gm.graph.nodes):
            call = _canonical(node, gm)
            if call is None or _is_spelt(node, call):
                continue
            _respell(gm, node, call)
            result.changed += 1
        return result
