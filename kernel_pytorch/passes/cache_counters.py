"""A decode step's per-layer cache counters: read by the fused RoPE + cache-write launch, advanced together at the end.

    # before (transformers' StaticLayer.update, each layer)      # after
    positions = arange(1) + counter_i                            q_rot = decode_rope_cache(..., counter_i.view(1))
    counter_i.add_(1)                                            ...
    q_rot = decode_rope_cache(..., positions)                    _foreach_add_([counter_0, ..., counter_n], 1)  # end

Each cache layer keeps its own token counter, and at one new token its write position is the counter's value. Left
in place, the two lines cost a launch per layer (Inductor fuses them into one small kernel: 1.3 us of a 1B model's
57 us layer on an H100), as long as the RoPE launch beside them. Read directly and advanced in one launch after the
last layer, they cost one launch per step.

Matched for each ``decode_rope_cache`` call: positions ``arange(1) + counter`` with ``counter`` a one-element integer
graph input of the positions' dtype, and after the positions nothing uses ``counter`` but one ``counter.add_(n)`` whose
result is unused. Counters shared by layers (one tensor read again after an earlier layer's ``add_``) do not match.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx
from torch.fx import Node

from kernel_pytorch.passes.graph_utils import erase_unused, set_example_value
from kernel_pytorch.passes.shape_constants import example_value

__all__ = ["advance_counters_together"]


def advance_counters_together(gm: torch.fx.GraphModule, launches: list[Node], position_arg: int) -> int:
    """For each of ``launches`` (its positions at ``args[position_arg]``) whose positions match (module docstring):
    the counter read in place of the positions and its ``add_`` moved into one ``_foreach_add_`` per amount at the
    graph's end. Returns how many counters moved."""
    graph = gm.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    moved: dict[int, list[Node]] = defaultdict(list)
    for launch in launches:
        positions = launch.args[position_arg]
        counter = _counter_of(positions) if isinstance(positions, Node) else None
        advance = _only_advance(counter, positions, order) if counter is not None else None
        if advance is None:
            continue
        with graph.inserting_before(launch):
            read = graph.call_method("view", (counter, 1)) if example_value(counter).dim() == 0 else counter
        if read is not counter:
            set_example_value(gm, read)
        launch.update_arg(position_arg, read)
        moved[advance.args[1]].append(counter)
        graph.erase_node(advance)
        erase_unused(graph, [positions, *positions.all_input_nodes])
    output = next(node for node in reversed(graph.nodes) if node.op == "output")
    for amount, counters in moved.items():
        with graph.inserting_before(output):
            graph.call_function(torch._foreach_add_, (counters, amount))  # no module path: the head's partition
    return sum(len(counters) for counters in moved.values())


def _counter_of(positions: Node) -> Node | None:
    """``counter`` of ``positions = arange(1) + counter`` (either order): a one-element integer graph input."""
    if positions.op != "call_function" or positions.target is not operator.add:  # normalize's one spelling of +
        return None
    if len(positions.args) != 2 or not all(isinstance(a, Node) for a in positions.args):
        return None
    first, second = positions.args
    counter = second if _is_arange_one(first) else first if _is_arange_one(second) else None
    if counter is None or counter.op != "placeholder":
        return None
    value, result = example_value(counter), example_value(positions)
    if not (isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor)):
        return None
    fits = value.dim() <= 1 and value.numel() == 1 and value.dtype == result.dtype and not value.is_floating_point()
    return counter if fits else None


def _is_arange_one(node: Node) -> bool:
    return (node.op == "call_function" and node.target is torch.arange and tuple(node.args) in ((1,), (0, 1))
            and set(node.kwargs) <= {"device", "dtype"})


def _only_advance(counter: Node, positions: Node, order: dict[Node, int]) -> Node | None:
    """The one ``counter.add_(n)`` (n an int, result unused) among the counter's users after ``positions``; None if
    anything else uses the counter after it."""
    after = len(order)  # a read this pass inserted (a positions node shared by two launches) comes after positions
    later = [user for user in counter.users if order.get(user, after) > order[positions]]
    if len(later) != 1:
        return None
    advance = later[0]
    if (advance.op == "call_method" and advance.target == "add_" and len(advance.args) == 2 and not advance.kwargs
            and advance.args[0] is counter and isinstance(advance.args[1], int) and not advance.users):
        return advance
    return None
