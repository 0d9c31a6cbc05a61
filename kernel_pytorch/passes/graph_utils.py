"""Small helpers shared by the graph passes and the capture backend."""

from __future__ import annotations

import functools
import operator
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx import Node
from torch.fx._lazy_graph_module import _make_graph_module

from kernel_pytorch.passes.shape_constants import example_value, static_int

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = [
    "layout_of",
    "block_of",
    "blocks_reordering",
    "calls_per_block",
    "checkpointed_subgraphs",
    "is_checkpointed_region",
    "clone_graph_module",
    "count_calls",
    "erase_unused",
    "nodes_between",
    "evaluate_fake",
    "fake_mode_of",
    "FUSED_LINEARS",
    "gemm_rows",
    "is_view",
    "module_path_of",
    "operand_value",
    "set_example_value",
    "writes_in_place",
]

# node.meta key of a linear that computes several modules' linears at once (the horizontal GEMM fusion):
# their module paths, which later passes (FP8) judge the fused linear by.
FUSED_LINEARS = "fused_linears"

# Dynamo records module paths as "L['self'].layers.0.attn" (the root is the forward's first argument).
_ROOT_PREFIX = re.compile(r"^L\['[^']*'\]\.?")


# Ops whose result may share the input's storage (``contiguous`` too: it returns its input when it can).
VIEW_FUNCTIONS = (operator.getitem, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze, torch.flatten,
                  torch.reshape, torch.chunk, torch.split, torch.narrow, torch.select, torch.unbind,
                  torch.movedim, torch.diagonal)
VIEW_METHODS = ("view", "view_as", "reshape", "reshape_as", "transpose", "permute", "unsqueeze", "squeeze",
                "expand", "expand_as", "flatten", "unflatten", "contiguous", "narrow", "select", "t", "split",
                "chunk", "unbind", "as_strided", "detach", "movedim", "diagonal", "__getitem__")


def is_view(node: Any) -> bool:
    """Whether ``node`` is a call whose result may be a view of its first argument."""
    if not isinstance(node, Node):
        return False
    if node.op == "call_function":
        return node.target in VIEW_FUNCTIONS
    return node.op == "call_method" and node.target in VIEW_METHODS


def clone_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy whose graph can be rewritten without touching ``gm``.

    Nodes are copied, not deep-copied: ``meta`` (with its FakeTensors) is shared shallowly, and
    attributes (constants, submodules) are shared with ``gm``, so the copy costs no tensor memory.
    """
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    value_map: dict[torch.fx.Node, torch.fx.Node] = {}
    output = graph.graph_copy(gm.graph, value_map)
    graph.output(output)
    # Lazy where TorchDynamo's compile turned lazy graph modules on (around every backend call): a pass that
    # rewrites nothing then generates no Python code for the copy.
    copy = _make_graph_module(gm, graph, class_name=type(gm).__name__)
    copy.meta = dict(getattr(gm, "meta", {}))
    for name, body in checkpointed_subgraphs(copy):  # rewritten too: each copy gets its own
        setattr(copy, name, clone_graph_module(body))
    return copy


def is_checkpointed_region(node: torch.fx.Node) -> bool:
    """Whether ``node`` runs an activation-checkpointed region: Dynamo's ``tag_activation_checkpoint``
    higher-order op, whose first argument is the region's body module."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "tag_activation_checkpoint"


def checkpointed_subgraphs(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """The bodies of activation-checkpointed regions in ``gm``: Dynamo captures a non-reentrant
    ``torch.utils.checkpoint`` (``kernel_pytorch.memory.apply_checkpointing``) as a
    ``tag_activation_checkpoint`` call on a subgraph module, which the graph passes rewrite too."""
    bodies = []
    for node in gm.graph.nodes:
        if is_checkpointed_region(node):
            body = node.args[0] if node.args else None
            if isinstance(body, torch.fx.Node) and body.op == "get_attr":
                module = getattr(gm, str(body.target), None)
                if isinstance(module, torch.fx.GraphModule):
                    bodies.append((str(body.target), module))
    return bodies


def module_path_of(node: torch.fx.Node, default: str = "") -> str:
    """The path of the module ``node`` was traced in (e.g. ``"layers.0.attn"``), from dynamo's metadata.

    Graphs from ``symbolic_trace`` carry no stack; there a ``call_module`` node's target is its path.
    """
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, _module_type = list(stack.values())[-1]
        # A block whose forward was wrapped (activation checkpointing) is recorded through its bound method.
        return _ROOT_PREFIX.sub("", str(path)).replace(".forward.__self__", "") or default
    if node.op == "call_module":
        return str(node.target)
    return default


# The first index segment of a module path ends its block: "layers.3.attn.q_proj" -> "layers.3".
_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


def block_of(path: str) -> str:
    """The repeated block a module path lies in (``"layers.3.attn"`` -> ``"layers.3"``: the path up to its
    first index), or ``""`` outside any (embeddings, the head)."""
    match = _BLOCK.match(path)
    return match.group(1) if match else ""


def calls_per_block(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Operator nodes per repeated block (:func:`block_of`; ``""`` for the rest), checkpointed bodies
    included: what the block costs in graph operations before the compiler fuses them further."""
    counts: dict[str, int] = {}
    for graph in (gm, *(body for _, body in checkpointed_subgraphs(gm))):
        for node in graph.graph.nodes:
            if node.op in ("call_function", "call_method", "call_module"):
                block = block_of(module_path_of(node))
                counts[block] = counts.get(block, 0) + 1
    return counts


def count_calls(gm: torch.fx.GraphModule) -> int:
    """Operator nodes in the graph (calls of functions, methods and modules)."""
    return sum(node.op in ("call_function", "call_method", "call_module") for node in gm.graph.nodes)


def erase_unused(graph: torch.fx.Graph, candidates) -> int:
    """Erase the calls among ``candidates`` that nothing uses any more, users before their producers
    (so a chain left dead by a rewrite goes in one sweep); ``None`` entries are ignored. Returns how
    many were erased."""
    pending = {node for node in candidates if node is not None}
    erased = 0
    for node in reversed(list(graph.nodes)):
        if node in pending and not node.users and node.op in ("call_function", "call_method"):
            graph.erase_node(node)
            erased += 1
    return erased


def nodes_between(first: Node, last: Node) -> list[Node] | None:
    """The nodes strictly between ``first`` and ``last`` in graph order, walked from ``first``: the cost of the
    distance, not of the graph. None when ``last`` does not come after ``first``."""
    between, node = [], first.next
    while node is not last:
        if node.op == "root":  # past the end: the graph's nodes are a ring through its root
            return None
        between.append(node)
        node = node.next
    return between


def gemm_rows(x: Node, static_only: bool = False) -> int | None:
    """Rows of a linear's GEMM on input ``x`` (the product of its leading sizes) at the capture's sizes; a
    symbolic size counts at this call's value, or makes the answer None with ``static_only``. None when unknown."""
    value = example_value(x)
    if not isinstance(value, torch.Tensor) or value.dim() < 1:
        return None
    rows = 1
    for size in value.shape[:-1]:
        concrete = static_int(size)
        if concrete is None and isinstance(size, torch.SymInt) and not static_only:
            concrete = size.node.hint
        if concrete is None:
            return None
        rows *= int(concrete)
    return rows


# ------------------------------------------------------------------------ example values of new nodes

def fake_mode_of(gm: torch.fx.GraphModule) -> FakeTensorMode | None:
    """The FakeTensorMode of ``gm``'s example values (Dynamo puts them on every node); None when the
    graph has none (``symbolic_trace``).

    Not ``torch._guards.detect_fake_mode``: inside a Dynamo backend it returns the tracing context's
    mode, which on torch 2.13 is not the one the example values belong to, and computing on values of
    two modes raises "Mixing fake modes". Placeholders come first, so this usually reads one node.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves

    for node in gm.graph.nodes:
        for value in tree_leaves(example_value(node)):
            if isinstance(value, FakeTensor):
                return value.fake_mode
    return None


def operand_value(gm: torch.fx.GraphModule, node: Any) -> Any:
    """``node``'s example value; for a ``get_attr``, the attribute itself (a real tensor, which Dynamo
    gives no example value)."""
    if isinstance(node, Node) and node.op == "get_attr":
        try:
            return functools.reduce(getattr, str(node.target).split("."), gm)
        except AttributeError:
            return None
    return example_value(node)


def evaluate_fake(gm: torch.fx.GraphModule, target: Any, args: tuple, kwargs: dict | None = None, *,
                  method: bool = False) -> tuple[Any, str]:
    """``target(*args, **kwargs)`` (``args[0].target(...)`` with ``method``) on the example values of
    the argument nodes, under :func:`fake_mode_of` ``gm``: ``(value, "")``, or ``(None, why)`` when a
    value is missing or the call raises."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_map

    mode = fake_mode_of(gm)
    if mode is None:
        return None, "the graph has no FakeTensor example values"
    missing: list[Node] = []

    def read(node: Node) -> Any:
        value = operand_value(gm, node)
        if value is None:
            missing.append(node)
        return value

    values = torch.fx.node.map_arg((args, kwargs or {}), read)
    if missing:
        return None, f"no example value for {missing[0].name}"
    try:
        # Real tensors (get_attr constants) join the mode; fake ones must already be in it.
        fake_args, fake_kwargs = tree_map(
            lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) else v,
            values)
        with mode:
            if method:
                return getattr(fake_args[0], target)(*fake_args[1:], **fake_kwargs), ""
            return target(*fake_args, **fake_kwargs), ""
    except Exception as error:  # noqa: BLE001  the caller reports it or leaves the node unannotated
        return None, f"{type(error).__name__}: {error}"


def set_example_value(gm: torch.fx.GraphModule, node: Node) -> str:
    """Give ``node`` (a call a pass inserted into ``gm``) its example value, computed by running its
    target on its inputs' example values; returns "" or why it could not (the node then has none:
    still correct, but later passes and kernel choices that read its shape treat it as unknown).
    A call of one of our ops on inputs laid out as an earlier call's reuses that call's output layout
    (:func:`_our_op_call_key`)."""
    if node.op not in ("call_function", "call_method"):
        return f"a {node.op} node is not evaluated"
    key = _our_op_call_key(gm, node)
    earlier_calls = _our_op_outputs(gm) if key is not None else None
    earlier = earlier_calls.get(key) if earlier_calls is not None else None
    if earlier is not None:
        node.meta["example_value"] = _fresh_like(earlier)
        return ""
    value, why = evaluate_fake(gm, node.target, node.args, dict(node.kwargs), method=node.op == "call_method")
    if value is not None:
        node.meta["example_value"] = value  # Dynamo's key: what the passes read (shape_constants.example_value)
        if earlier_calls is not None and _owns_its_storage(value, gm, node):
            earlier_calls[key] = value
    return why


def _owns_its_storage(value: Any, gm: torch.fx.GraphModule, node: Node) -> bool:
    """Whether each output tensor in ``value`` is a tensor of its own: not a view, sharing storage with no other
    output and no input. Only such outputs are reused as fresh tensors: a pass reading an example value's storage
    (the attention pass's V copy) sees the same for every layer."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._pytree import tree_leaves

    inputs = [operand_value(gm, n) for n in node.all_input_nodes]
    storages = {StorageWeakRef(t.untyped_storage()) for t in inputs if isinstance(t, torch.Tensor)}
    for leaf in tree_leaves(value):
        if not isinstance(leaf, torch.Tensor):
            continue
        storage = StorageWeakRef(leaf.untyped_storage())
        if leaf._is_view() or storage in storages:
            return False
        storages.add(storage)
    return True


def _our_op_outputs(gm: torch.fx.GraphModule) -> dict | None:
    """The outputs of our ops' calls evaluated so far in ``gm``'s fake mode, by :func:`_our_op_call_key` (kept on the
    mode: it lives as long as the capture's example values). A pass inserts the same op on the same layouts in every
    layer, and each fake run executes the op's whole body on fake tensors (18 ms a call on the CPU, most of the
    passes' time on a 16-layer Llama's generation graphs)."""
    mode = fake_mode_of(gm)
    if mode is None:
        return None
    if not hasattr(mode, "_kernel_pytorch_op_outputs"):
        mode._kernel_pytorch_op_outputs = {}
    return mode._kernel_pytorch_op_outputs


def _our_op_call_key(gm: torch.fx.GraphModule, node: Node) -> tuple | None:
    """What the output layout of a call of one of our ops (:func:`_is_our_op`) depends on: the op and each
    argument's :func:`layout_of` (and a tensor's ``requires_grad``); None for other targets, or an argument without
    an example value."""
    if not _is_our_op(node.target):
        return None
    missing: list[Node] = []

    def layout(argument: Node) -> Any:
        value = operand_value(gm, argument)
        if value is None:
            missing.append(argument)
        return (*layout_of(value), value.requires_grad) if isinstance(value, torch.Tensor) else layout_of(value)

    arguments = torch.fx.node.map_arg((node.args, dict(node.kwargs)), layout)
    return None if missing else (node.target, repr(arguments))


def layout_of(value: Any) -> tuple:
    """What a compilation or an op's output layout can depend on in a value: a tensor's shape, strides, storage
    offset, dtype and device (symbolic sizes by their expressions); anything else by its type and text."""
    if not isinstance(value, torch.Tensor):
        return ("value", type(value).__name__, str(value))
    return ("tensor", str(tuple(value.shape)), str(value.stride()), str(value.storage_offset()), str(value.dtype),
            str(value.device))


def _is_our_op(target: Any) -> bool:
    """A ``kernel_pytorch::`` custom op, or one of the functions of :mod:`kernel_pytorch.ops` that call them (what
    the passes insert)."""
    target = getattr(target, "_opoverload", target)  # a torch.library custom op: its overload
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace == "kernel_pytorch"
    return callable(target) and getattr(target, "__module__", "").startswith("kernel_pytorch.ops.")


def _fresh_like(value: Any) -> Any:
    """New fake tensors laid out as those in ``value`` (nested in tuples or lists), in their fake mode."""
    from torch.utils._pytree import tree_map

    def fresh(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        with leaf.fake_mode:
            copy = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype, device=leaf.device)
        return copy.requires_grad_(leaf.requires_grad)

    return tree_map(fresh, value)


# ---------------------------------------------------------------- what a computation may not move across

# Calls that change how later ops run: moving a read or a computation across one would change what
# autograd, autocast or inference mode does with it.
_STATE_CHANGES = frozenset({"_set_grad_enabled", "set_grad_enabled", "_enter_autocast", "_exit_autocast",
                            "_enter_inference_mode", "_exit_inference_mode"})
_IN_PLACE_OPERATORS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ipow, operator.imatmul)


def _name(node: Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def writes_in_place(node: Node) -> bool:
    """Whether ``node`` may write a tensor in place (conservative: a module call may)."""
    if node.op not in ("call_function", "call_method"):
        return node.op == "call_module"
    name = _name(node)
    if node.target in _IN_PLACE_OPERATORS or name == "__setitem__" or name.startswith("__i"):
        return True
    if name.endswith("_") and not name.endswith("__"):  # add_, copy_, index_put_ ...
        return True
    if "out" in node.kwargs or node.kwargs.get("inplace", False) is True:
        return True
    # normalize's canonical dropout, F.dropout(x, p, training, inplace), with inplace given positionally
    return node.op == "call_function" and node.target is F.dropout and len(node.args) > 3 and node.args[3] is True


def blocks_reordering(node: Node) -> bool:
    """Whether a computation may not be moved across ``node``: it may write a tensor in place, or it
    switches grad, autocast or inference mode."""
    return (node.op in ("call_function", "call_method") and _name(node) in _STATE_CHANGES) or writes_in_place(node)
