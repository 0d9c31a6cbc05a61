"""Small helpers shared by the graph passes and the capture backend."""

from __future__ import annotations

import re

import torch.fx

__all__ = ["clone_graph_module", "checkpointed_subgraphs", "module_path_of", "count_calls", "erase_unused"]

# Dynamo records module paths as "L['self'].layers.0.attn" (the root is the forward's first argument).
_ROOT_PREFIX = re.compile(r"^L\['[^']*'\]\.?")


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
    copy = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy.meta = dict(getattr(gm, "meta", {}))
    for name, body in checkpointed_subgraphs(copy):  # rewritten too: each copy gets its own
        setattr(copy, name, clone_graph_module(body))
    return copy


def checkpointed_subgraphs(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """The bodies of activation-checkpointed regions in ``gm``: Dynamo captures a non-reentrant
    ``torch.utils.checkpoint`` (``kernel_pytorch.memory.apply_checkpointing``) as a
    ``tag_activation_checkpoint`` call on a subgraph module, which the graph passes rewrite too."""
    bodies = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and getattr(target, "__name__", "") == "tag_activation_checkpoint":
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
