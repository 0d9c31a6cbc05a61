"""Linears that read the same input -> one linear against their weights concatenated in the graph.

Matched (canonical forms, after :mod:`normalize`): two or more ``F.linear(x, w_i, b_i)`` on one ``x``,
each ``w_i`` a 2-D module parameter (a lifted-parameter placeholder or a ``get_attr``), with no bias or
all with a bias parameter: the q/k/v projections of attention (GQA: q wider than k and v) and the
gate/up projections of a gated MLP. Rewritten as::

    # before                                  # after
    q = F.linear(x, w_q, None)                w = torch.cat([w_q, w_k, w_v], 0)
    k = F.linear(x, w_k, None)                qkv = F.linear(x, w, None)
    v = F.linear(x, w_v, None)                parts = torch.split(qkv, [2048, 512, 512], -1)
                                              q, k, v = parts[0], parts[1], parts[2]

    g = F.linear(x, w_gate, None)             w = torch.cat([w_gate, w_up], 0)
    u = F.linear(x, w_up, None)               gate_up = F.linear(x, w, None)
    h = F.silu(g) * u                         halves = torch.chunk(gate_up, 2, -1)
                                              h = F.silu(halves[0]) * halves[1]

Equal widths are split with ``torch.chunk`` (the spelling the activations pass reads as one packed
gate/up projection, so ``silu(gate) * up`` then becomes ``gated_activation_packed``, whose gradient is one
tensor); unequal ones with ``torch.split``. The parts are views of the fused output; a ``view`` of one
that its strides do not allow gets a ``contiguous()`` first. The originals stay the model's parameters:
``state_dict`` is untouched, and autograd takes the fused weight's gradient back through the ``cat``
into each original weight (a split into views, no copy).

Linears of different modules that read one input are fused too (the k/v projections of every decoder
layer reading the encoder's output): their outputs then exist from the first one's position on.

Skipped, with the reason: a linear whose weight is not a parameter, or not 2-D, or whose bias is not a
parameter; linears that differ in bias (some with, some without), weight dtype or device from the others
reading the same input (those that agree are still fused); a linear left alone by those rules; outputs
modified in place (autograd forbids in-place edits of ``split``'s views); an in-place write or a
grad/autocast switch between the linears; and groups too small for the weight copy to pay (below).

Cost. The ``cat`` copies the weights at every call (``2·N·K·e`` bytes read and written, for out-features N,
in-features K and element size e); the fused GEMM does ``2·T·N·K`` FLOPs for T tokens. The copy's share
of the GEMM time is ``e·balance / (passes·T)``, with ``balance`` the device's GEMM FLOP/s over its copy
bytes/s (:data:`MACHINE_BALANCE`) and ``passes`` 3 in training (the backward's two GEMMs share the
forward's copy), 1 in inference: N and K cancel, so the threshold is one on tokens. A group is fused only
when that share is at most :data:`MAX_COPY_SHARE`; at small batch the copy costs more than the GEMM and
the group is skipped. Not in the estimate: in training the backward of ``split`` concatenates the parts'
gradients, a cost of eager graphs only (Inductor writes them into one buffer). The worked figures for a
Llama block and the GPU measurement (``benchmarks/results/block_fusion.json``) are in ``docs/passes.md``.
Inference at small batch would need another design (the originals as views of one fused storage, no
copy), not this pass.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx import Node
from torch.utils.checkpoint import CheckpointPolicy

from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult, candidates
from kernel_pytorch.passes.graph_utils import (
    FUSED_LINEARS,
    blocks_reordering,
    erase_unused,
    evaluate_fake,
    gemm_rows,
    is_view,
    module_path_of,
    operand_value,
    set_example_value,
    writes_in_place,
)
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.shape_constants import describe_node

__all__ = ["MACHINE_BALANCE", "MAX_COPY_SHARE", "HorizontalGemmPass", "NodeBuilder", "linears_by_input",
           "modified_in_place", "reordering_barrier", "replace_by_part", "weight_copy_share"]

# The largest share of the fused GEMM's time the weight copy may take. The fusion's gain (fewer
# launches, bigger GEMM tiles, x read once) is not modelled; 10% is a starting point, not a tuned optimum
# (one GPU measurement: benchmarks/results/block_fusion.json, docs/passes.md).
MAX_COPY_SHARE = 0.10

# GEMM FLOP/s per copy byte/s (bytes read + written), by vendor, for 16-bit weights and for wider ones:
# nvidia 16-bit from a measured bf16 matmul and copy, the rest estimated from spec sheets (docs/passes.md).
MACHINE_BALANCE: dict[str, tuple[float, float]] = {
    "nvidia": (259.0, 22.0),
    "amd": (259.0, 22.0),
    "intel": (259.0, 22.0),
    "cpu": (20.0, 20.0),
}


@dataclass(frozen=True)
class _Linear:
    node: Node
    weight: Node
    bias: Node | None
    path: str
    out_features: int
    in_features: int
    element_size: int
    # What the members of one fused linear share: bias or not, weight dtype, bias dtype, device.
    key: tuple


# --------------------------------------------------------------------------------------------- matching

def linears_by_input(graph: torch.fx.Graph, min_linears: int = 2) -> dict[Node, list[Node]]:
    """Inputs read by at least ``min_linears`` linears, with those linears in graph order."""
    found: dict[Node, list[Node]] = {}
    for node in graph.nodes:
        if is_call(node, F.linear) and node.args and isinstance(node.args[0], Node):
            found.setdefault(node.args[0], []).append(node)
    return {x: linears for x, linears in found.items() if len(linears) >= min_linears}


def reordering_barrier(graph: torch.fx.Graph, nodes: list[Node]) -> Node | None:
    """The first node between the earliest and the latest of ``nodes`` that no computation may move across (an
    in-place write, a grad/autocast switch), or None."""
    order = list(graph.nodes)
    position = {n: i for i, n in enumerate(order)}
    first, last = min(position[n] for n in nodes), max(position[n] for n in nodes)
    return next((n for n in order[first + 1:last] if blocks_reordering(n)), None)


def weight_copy_share(tokens: int, element_size: int, balance: float, training: bool) -> float:
    """The weight copy's time over the fused GEMM's (forward, plus backward in training): ``e·balance /
    (passes·T)``, independent of the GEMM's N and K (see the module docstring)."""
    passes = 3 if training else 1
    return element_size * balance / (passes * tokens)


def _parameter(node: Any, gm: torch.fx.GraphModule, ctx: PassContext) -> bool:
    """Whether ``node`` is a module parameter: a ``get_attr`` of one, or a placeholder Dynamo lifted one
    into (its example input is an ``nn.Parameter``; inside a checkpointed region, where the operands are
    the outer graph's, its name keeps Dynamo's ``_parameters_`` spelling)."""
    if not isinstance(node, Node):
        return False
    if node.op == "get_attr":
        return isinstance(operand_value(gm, node), nn.Parameter)
    if node.op != "placeholder":
        return False
    if isinstance(ctx.example_inputs.get(node.name), nn.Parameter):
        return True
    return (isinstance(node.type, type) and issubclass(node.type, nn.Parameter)) or "_parameters_" in node.name


def _member(linear: Node, gm: torch.fx.GraphModule, ctx: PassContext) -> _Linear | str:
    """``linear`` as a member of a fused group, or why it cannot be one."""
    if len(linear.args) < 2 or linear.kwargs:
        return "a linear with keyword arguments (not in normalize's canonical form)"
    weight, bias = linear.args[1], linear.args[2] if len(linear.args) > 2 else None
    if not _parameter(weight, gm, ctx):
        return f"its weight is not a module parameter ({_describe(weight)})"
    value, bias_value = operand_value(gm, weight), operand_value(gm, bias)
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return f"its weight is not 2-D (shape {tuple(getattr(value, 'shape', ()))})"
    if bias is not None and (not _parameter(bias, gm, ctx) or not isinstance(bias_value, torch.Tensor)):
        return f"its bias is not a module parameter ({_describe(bias)})"
    if modified_in_place(linear):
        return "its output or a view of it is modified in place (split's views cannot be)"
    out_features, in_features = (int(size) for size in value.shape)
    key = (bias is not None, value.dtype, getattr(bias_value, "dtype", None), value.device)
    return _Linear(linear, weight, bias, module_path_of(linear, "(model)"), out_features, in_features,
                   value.element_size(), key)


def _describe(node: Any) -> str:
    return describe_node(node) if isinstance(node, Node) else type(node).__name__


def modified_in_place(node: Node) -> bool:
    """Whether an in-place op writes ``node`` or a view of it (followed through view-like ops). Being the source of
    an in-place op is no write: a StaticCache's ``keys.index_copy_(2, position, k)`` reads k."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        for user in current.users:
            if writes_in_place(user) and _may_write(user, current):
                return True
            if user not in seen and (is_view(user)):
                seen.add(user)
                pending.append(user)
    return False


def _may_write(op: Node, tensor: Node) -> bool:
    """Whether in-place ``op`` may write ``tensor``: it is the ``out=`` or first argument (or in a list there, as for
    the ``_foreach_*_`` ops); a module call may write anything."""
    if op.op == "call_module":
        return True
    written = op.kwargs["out"] if "out" in op.kwargs else (op.args[0] if op.args else None)
    if isinstance(written, (list, tuple)):
        return tensor in written
    return written is tensor


def _partition(members: list[_Linear]) -> tuple[list[list[_Linear]], list[tuple[_Linear, str]]]:
    """Members grouped by what a fused linear needs them to share; groups of one come back with why."""
    groups: dict[tuple, list[_Linear]] = {}
    for member in members:
        groups.setdefault(member.key, []).append(member)
    ordered = sorted(groups.values(), key=len, reverse=True)
    fused = [group for group in ordered if len(group) > 1]
    alone = []
    for group in ordered:
        if len(group) == 1 and len(ordered) > 1:  # compared with the largest other group
            reference = next(other for other in ordered if other is not group)
            alone.append((group[0], _difference(group[0], reference)))
    return fused, alone


def _difference(member: _Linear, reference: list[_Linear]) -> str:
    others = ", ".join(_short(m.path) for m in reference)
    has_bias, dtype, bias_dtype, device = member.key
    ref_bias, ref_dtype, _, ref_device = reference[0].key
    if has_bias != ref_bias:
        return f"mixed bias: it has {'a' if has_bias else 'no'} bias, {others} {'do' if ref_bias else 'have none'}"
    if dtype != ref_dtype:
        return f"weight dtype {_dtype(dtype)} differs from {_dtype(ref_dtype)} of {others}"
    if device != ref_device:
        return f"weight on {device}, {others} on {ref_device}"
    return f"bias dtype {_dtype(bias_dtype)} differs from that of {others}"


def _dtype(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def _short(path: str) -> str:
    return path.rpartition(".")[2] or path


# ------------------------------------------------------------------------------------ rewriting helpers

def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for names in zip(*parts):
        if any(n != names[0] for n in names):
            break
        common.append(names[0])
    return ".".join(common)


def _common_stack(nodes: list[Node]) -> dict:
    """The ``nn_module_stack`` entries all ``nodes`` share (the module that holds the fused linears)."""
    stacks = [list(n.meta.get("nn_module_stack", {}).items()) for n in nodes]
    common = []
    for entries in zip(*stacks):
        if any(e != entries[0] for e in entries):
            break
        common.append(entries[0])
    return dict(common)


class NodeBuilder:
    """Adds nodes before ``anchor`` with an example value and the given module stack."""

    def __init__(self, gm: torch.fx.GraphModule, anchor: Node, stack: dict):
        self.gm, self.anchor, self.stack = gm, anchor, stack

    def call(self, target: Any, args: tuple, method: bool = False, stack: dict | None = None) -> Node:
        graph = self.gm.graph
        with graph.inserting_before(self.anchor):
            node = graph.call_method(target, args) if method else graph.call_function(target, args)
        node.meta["nn_module_stack"] = dict(self.stack if stack is None else stack)
        set_example_value(self.gm, node)  # left without one if it cannot be computed: still correct
        return node


# ---------------------------------------------------------------------------------------------- the pass

@register_pass
class HorizontalGemmPass(GraphPass):
    """Fuse linears that read the same input into one GEMM (module docstring: what, when, the cost)."""

    name = "horizontal_gemm"
    description = "linears reading one input (q/k/v, gate/up) -> one linear on their concatenated weights"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        for x, linears in linears_by_input(gm.graph).items():
            members = [found.match for found in candidates(linears, lambda linear: _member(linear, gm, ctx), result)]
            if len(members) == 1:
                result.skip(members[0].path, "the only linear left to fuse with on this input")
                continue
            groups, alone = _partition(members)
            for member, reason in alone:
                result.skip(member.path, reason)
            for group in groups:
                self._fuse_or_skip(gm, ctx, x, group, result)
        return result

    def _fuse_or_skip(self, gm: torch.fx.GraphModule, ctx: PassContext, x: Node, group: list[_Linear],
                      result: PassResult) -> None:
        location = _common_prefix([m.path for m in group]) or "(model)"
        names = " + ".join(_short(m.path) for m in group)
        reason = self._unprofitable(ctx, x, group) or self._blocked(gm.graph, group)
        if reason is None:
            _, reason = evaluate_fake(gm, F.linear, (x, group[0].weight, group[0].bias))
            reason = f"the linear cannot be evaluated on its example values ({reason})" if reason else None
        if reason is not None:
            result.skip(location, f"{names}: {reason}")
            return
        result.rewrite(location, f"{names} -> one linear, {self._rewrite(gm, x, group)}")

    @staticmethod
    def _unprofitable(ctx: PassContext, x: Node, group: list[_Linear]) -> str | None:
        tokens = gemm_rows(x)
        if tokens is None:
            return "no shape metadata for the input (token count unknown)"
        size = group[0].element_size
        balance = MACHINE_BALANCE.get(ctx.hardware.vendor, MACHINE_BALANCE["nvidia"])[size > 2]
        share = weight_copy_share(tokens, size, balance, ctx.training)
        if share <= MAX_COPY_SHARE:
            return None
        needed = weight_copy_share(1, size, balance, ctx.training) / MAX_COPY_SHARE
        copied = _copied_bytes(group)
        return (f"{tokens} tokens are too few for the in-graph weight copy to pay: {copied / 1e6:.3g} MB "
                f"copied per call, ~{share:.0%} of the fused GEMM's time on {ctx.hardware.vendor} "
                f"(at most {MAX_COPY_SHARE:.0%}: needs >= {needed:.0f} tokens in {'training' if ctx.training else 'inference'})")

    @staticmethod
    def _blocked(graph: torch.fx.Graph, group: list[_Linear]) -> str | None:
        """Why the later linears may not be computed where the first one is, if they may not."""
        barrier = reordering_barrier(graph, [m.node for m in group])
        if barrier is not None:
            return f"{_describe(barrier)} lies between the linears (an in-place write or a grad/autocast switch)"
        return None

    @staticmethod
    def _rewrite(gm: torch.fx.GraphModule, x: Node, group: list[_Linear]) -> str:
        graph = gm.graph
        anchor = group[0].node  # the first in graph order: every later linear's operands are placed here
        for member in group:
            for operand in (member.weight, member.bias):
                if operand is not None and operand.op == "get_attr":
                    anchor.prepend(operand)  # a get_attr reads nothing, so moving it earlier is safe
        build = NodeBuilder(gm, anchor, _common_stack([m.node for m in group]))
        weight = _recomputed(build.call(torch.cat, ([m.weight for m in group], 0)))
        bias = None
        if group[0].bias is not None:
            bias = _recomputed(build.call(torch.cat, ([m.bias for m in group], 0)))
        fused = build.call(F.linear, (x, weight, bias))
        fused.meta[FUSED_LINEARS] = [m.path for m in group]
        sizes = [m.out_features for m in group]
        if len(set(sizes)) == 1:  # the activations pass reads chunk(gate_up, 2, -1) as a packed projection
            parts = build.call(torch.chunk, (fused, len(sizes), -1))
        else:
            parts = build.call(torch.split, (fused, sizes, -1))
        for index, member in enumerate(group):
            stack = member.node.meta.get("nn_module_stack", {})
            part = build.call(operator.getitem, (parts, index), stack=stack)
            if "stack_trace" in member.node.meta:
                part.meta["stack_trace"] = member.node.meta["stack_trace"]
            replace_by_part(gm, member.node, part, build, stack)
        erase_unused(graph, [m.node for m in group])
        return (f"out {'+'.join(map(str, sizes))}, in {group[0].in_features}, "
                f"{'bias' if bias is not None else 'no bias'}; weights concatenated in the graph "
                f"({_copied_bytes(group) / 1e6:.3g} MB copied per call)")


def _recomputed(concatenation: Node) -> Node:
    """Tags the weight concatenation for AOTAutograd's partitioner to recompute in the backward rather than
    save: the partitioner otherwise keeps each block's concatenated weights alive from forward to backward
    (the peak memory it cost is in docs/passes.md). The recompute
    costs one more weight copy per block in the backward; the tag is the one selective activation
    checkpointing uses, which node metadata carries from this graph to the traced ATen graph."""
    concatenation.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    concatenation.meta["ac_graph_id"] = 0
    return concatenation


def _copied_bytes(group: list[_Linear]) -> int:
    """Bytes the weight (and bias) concatenation reads and writes per call."""
    elements = sum(m.out_features * (m.in_features + (m.bias is not None)) for m in group)
    return 2 * elements * group[0].element_size


def replace_by_part(gm: torch.fx.GraphModule, original: Node, part: Node, build: NodeBuilder, stack: dict) -> None:
    """Point ``original``'s users at ``part``, through ``contiguous()`` where a ``view`` of the strided
    part would fail (the original output was contiguous)."""
    needs_copy = False
    for user in original.users:
        if user.op == "call_method" and user.target in ("view", "view_as"):
            args = tuple(part if a is original else a for a in user.args)
            value, _ = evaluate_fake(gm, user.target, args, dict(user.kwargs), method=True)
            needs_copy |= value is None
    if needs_copy:
        part = build.call("contiguous", (part,), method=True, stack=stack)
    original.replace_all_uses_with(part)
