"""A decode GEMV's RMSNorm before it and gated activation after it -> one launch
(:func:`kernel_pytorch.ops.decode_fused_linear.decode_fused_linear`).

    # before (after the norms, activations and decode_linear passes)   # after
    normed, h = rms_norm(x, w_norm, eps, residual=r)                   gated, h = decode_fused_linear(
    gate_up = grouped_linear(normed, [w_gate, w_up])                       x, [w_gate, w_up], norm_weight=w_norm,
    gate, up = split(gate_up, [n, n], -1)                                  eps=eps, residual=r, activation="silu")
    gated = gated_activation(gate, up, "silu")

A decode step at batch 1 runs each of these as a launch of a few microseconds; the GEMV reads its whole input
anyway, so it can norm it, and it can reduce the gate and up rows of one index in one program.

Matched: a ``grouped_linear`` (the decode_linear pass's GEMV launch) whose input is an ``rms_norm`` output read
by nothing else (the norm's optional residual sum ``h`` may have any readers), and/or whose two equal-shape
outputs are split and read only by one ``gated_activation`` (or whose one packed gate/up output is read only by
``gated_activation_packed``: its weight's two row halves become the gate and up weights, as views). Norms computing
FP8 scales are left alone. Decided by measurement on CUDA: the fused launch (at one token row also with twice its
tile's weight rows a program) against the unfused ones at the group's shapes, timed as CUDA-graph replays on weights
read from memory (``timing.weight_copies``); the fastest is kept and the report says so.
"""

from __future__ import annotations

import functools
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx
from torch.fx import Node

from kernel_pytorch.ops import decode_linear as gemv
from kernel_pytorch.ops.activations import gated_activation, gated_activation_packed
from kernel_pytorch.ops.decode_fused_linear import decode_fused_linear, unfused
from kernel_pytorch.ops.rms_norm import rms_norm
from kernel_pytorch.passes.base import PassContext, PassResult
from kernel_pytorch.passes.decode_base import DecodeStepPass
from kernel_pytorch.passes.graph_utils import (erase_unused, gemm_rows, module_path_of, nodes_between,
                                              set_example_value)
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.shape_constants import example_value

__all__ = ["DecodeFusionPass"]


@dataclass
class _Norm:
    node: Node  # the rms_norm call
    normed: Node  # its normed output (the call itself, or getitem 0 with a residual)
    x: Node
    weight: Node
    eps: float
    residual: Optional[Node]
    cast_before_weight: bool
    weight_offset: float = 0.0  # the norm multiplies by weight + weight_offset (the norms pass's Gemma form)


@dataclass
class _Gated:
    split: Node | None  # None: one packed gate/up weight, read by gated_activation_packed
    node: Node  # the gated_activation call
    kind: str
    gate_first: bool = True


def _bound(node: Node, fn: Any) -> dict[str, Any] | None:
    try:
        bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _norm_before(launch: Node) -> _Norm | None:
    """The rms_norm whose normed output is the launch's input and nothing else's."""
    normed = launch.args[0]
    if not isinstance(normed, Node) or _only_user(normed) is not launch:
        return None
    node = normed
    if normed.target is operator.getitem and normed.args[1] == 0:
        node = normed.args[0]
    if not isinstance(node, Node) or node.target is not rms_norm:
        return None
    args = _bound(node, rms_norm)
    if args is None or args["fp8_amax"] or args["grad_amax_slot"] is not None or not isinstance(args["weight"], Node):
        return None
    if (args["residual"] is None) != (node is normed):
        return None  # with a residual the norm returns (normed, h): its output is read through getitem 0
    before_launch = set(nodes_between(node, launch))
    if any(user in before_launch for getter in node.users if getter is not normed for user in getter.users):
        return None  # h is read before the launch, where the fused call is placed
    return _Norm(node, normed, args["x"], args["weight"], float(args["eps"]), args["residual"],
                 bool(args["cast_before_weight"]), float(args["weight_offset"]))


def _gated_after(launch: Node) -> _Gated | None:
    """The gated activation that reads the launch's two equal halves (two weights, or one packed gate/up weight),
    and nothing else reads them."""
    weights = launch.args[1]
    if len(weights) == 1:
        return _packed_gated_after(launch)
    if len(weights) != 2 or example_value(weights[0]).shape != example_value(weights[1]).shape:
        return None
    split = _only_user(launch)
    if split is None or split.target is not torch.split or split.args[1:] != (
            [int(example_value(weights[0]).shape[0])] * 2, -1):
        return None
    parts = sorted(split.users, key=lambda n: n.args[1] if n.target is operator.getitem else -1)
    if len(parts) != 2 or any(p.target is not operator.getitem for p in parts):
        return None
    node = _only_user(parts[0])
    if node is None or node is not _only_user(parts[1]) or node.target is not gated_activation:
        return None
    args = _bound(node, gated_activation)
    if args is None or args["fp8_amax"] or args["gate"] is not parts[0] or args["up"] is not parts[1]:
        return None
    return _Gated(split, node, args["kind"])


def _packed_gated_after(launch: Node) -> _Gated | None:
    """``gated_activation_packed`` reading a one-weight launch (Phi-3's gate_up_proj), and nothing else reading it."""
    node = _only_user(launch)
    if node is None or node.target is not gated_activation_packed or example_value(launch.args[1][0]).shape[0] % 2:
        return None
    args = _bound(node, gated_activation_packed)
    if args is None or args["fp8_amax"] or args["grad_amax_slot"] is not None or args["gate_up"] is not launch:
        return None
    return _Gated(None, node, args["kind"], bool(args["gate_first"]))


# ---------------------------------------------------------------------------------------- measurement

@functools.lru_cache(maxsize=256)
def _measured(rows: int, sizes: tuple[int, ...], k: int, bias: bool, norm: tuple[bool, bool] | None,
              activation: str | None, dtype: torch.dtype, device_index: int) -> tuple[bool, int, str]:
    """(whether a fused launch wins, its ``block_n`` (0: the default tile's), the timings) at one launch's shapes;
    ``norm``: (residual, cast before the weight) or None. At one token row the fused launch is also timed with twice
    the default tile's rows a program: each program reads its whole input, residual and norm weight besides its
    weight rows, and which count reads fastest differed by shape (q/k/v of the 1B and 7B models, H100)."""
    from kernel_pytorch.timing import fastest_cuda_graph_ms, rotating, weight_copies

    device = torch.device("cuda", device_index)
    x, r = (torch.randn(rows, k, device=device, dtype=dtype) for _ in range(2))
    copies = weight_copies(lambda: [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for n in sizes],
                           sum(sizes) * k * x.element_size(), device)
    biases = [torch.randn(n, device=device, dtype=dtype) for n in sizes] if bias else None
    normed = None if norm is None else gemv.NormInput(torch.rand(k, device=device, dtype=dtype) + 0.5, 1e-6, norm[1],
                                                      r if norm[0] else None)
    fused_norm = {} if normed is None else dict(norm_weight=normed.weight, eps=normed.eps, residual=normed.residual,
                                                cast_before_weight=normed.cast_before_weight)
    default_rows = gemv.gemv_tile(rows, sizes[0] if activation else sum(sizes), gated=activation is not None,
                                  normed=normed is not None, element_size=x.element_size()).block_n
    rows_tried = {"fused": 0} | ({f"fused {2 * default_rows} rows": 2 * default_rows} if rows == 1 else {})
    candidates = {"unfused": rotating(lambda ws: unfused(x, normed, ws, biases, activation or "", gemv.grouped_linear),
                                      copies)}
    candidates.update({name: rotating(lambda ws, block_n=block_n: decode_fused_linear(
        x, ws, biases, activation=activation, block_n=block_n, **fused_norm), copies)
        for name, block_n in rows_tried.items()})
    timings = fastest_cuda_graph_ms(candidates)
    fastest = min(rows_tried, key=lambda name: timings.ms.get(name, float("inf")))
    return timings.faster(fastest, "unfused"), rows_tried[fastest], timings.in_microseconds()


def _decision(launch: Node, norm: _Norm | None, gated: _Gated | None) -> tuple[bool, int, str]:
    """(whether to fuse, the fused launch's ``block_n``, why)."""
    x_value = example_value(launch.args[0])
    if x_value.device.type != "cuda":
        return True, 0, "the unfused ops' native paths off CUDA"
    weights = [example_value(w) for w in launch.args[1]]
    sizes = tuple(int(w.shape[0]) for w in weights)
    if gated is not None and gated.split is None:  # a packed gate/up weight: timed as its two halves
        sizes = (sizes[0] // 2,) * 2
    rows = x_value.numel() // x_value.shape[-1]
    norm_key = (norm.residual is not None, norm.cast_before_weight) if norm else None
    return _measured(rows, sizes, int(weights[0].shape[1]),
                     launch.args[2] is not None, norm_key, gated.kind if gated else None, x_value.dtype,
                     x_value.device.index or 0)


# ---------------------------------------------------------------------------------------------- the pass

@register_pass
class DecodeFusionPass(DecodeStepPass):
    """A decode GEMV with its RMSNorm and gated activation -> one launch (module docstring)."""

    kernel = "the fused GEMV"
    name = "decode_fusion"
    description = "a decode GEMV's RMSNorm before it and gated activation after it -> one launch"

    def rewrite_step(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> PassResult:
        for launch in [n for n in gm.graph.nodes if n.target is gemv.grouped_linear]:
            if gemm_rows(launch.args[0], static_only=True) is None:
                continue  # a symbolic batch (generation.symbolic_batch_gemv): timed per row count, not fused
            norm, gated = _norm_before(launch), _gated_after(launch)
            if norm is None and gated is None:
                continue
            location = module_path_of(launch, "(model)")
            what = " + ".join(part for part, found in (("rms_norm", norm), ("grouped_linear", True),
                                                      (f"gated {gated.kind if gated else ''}", gated)) if found)
            chosen, block_n, how = _decision(launch, norm, gated)
            if not chosen:
                result.skip(location, f"{what}: the unfused launches kept, faster here ({how})")
                continue
            _rewrite(gm, launch, norm, gated, block_n)
            result.rewrite(location, f"{what} -> decode_fused_linear: {how}")
        return result


def _rewrite(gm: torch.fx.GraphModule, launch: Node, norm: _Norm | None, gated: _Gated | None,
             block_n: int) -> None:
    graph, stack = gm.graph, launch.meta.get("nn_module_stack", {})
    x, weights, biases = launch.args
    if gated is not None and gated.split is None:
        weights, biases = _halves(gm, launch, weights[0], gated.gate_first), biases and _halves(
            gm, launch, biases[0], gated.gate_first)
    kwargs: dict[str, Any] = {"activation": gated.kind if gated else None}
    kwargs.update({"block_n": block_n} if block_n else {})
    if norm is not None:
        x = norm.x
        kwargs.update(norm_weight=norm.weight, eps=norm.eps, residual=norm.residual,
                      cast_before_weight=norm.cast_before_weight)
        kwargs.update({"norm_weight_offset": norm.weight_offset} if norm.weight_offset else {})
    inserted = [_call(graph, launch, decode_fused_linear, (x, weights, biases), kwargs, stack)]
    output = inserted[0]
    sums = _residual_sums(norm)
    if norm is not None and norm.residual is not None:  # the fused call returns (output, h)
        output = _call(graph, launch, operator.getitem, (inserted[0], 0), {}, stack)
        inserted.append(output)
    if sums:
        h = _call(graph, launch, operator.getitem, (inserted[0], 1), {}, stack)
        inserted.append(h)
        for user in sums:
            user.replace_all_uses_with(h)
    for node in inserted:
        set_example_value(gm, node)
    (gated.node if gated else launch).replace_all_uses_with(output)
    dead = [launch] + ([gated.node, *gated.split.users, gated.split] if gated and gated.split else
                       [gated.node] if gated else [])
    dead += [norm.node, norm.normed, *sums] if norm else []
    erase_unused(graph, dead)


def _halves(gm: torch.fx.GraphModule, launch: Node, packed: Node, gate_first: bool) -> list[Node]:
    """[gate, up] as row views of a packed gate/up weight (or bias): contiguous, read in place."""
    rows = int(example_value(packed).shape[0]) // 2
    stack = launch.meta.get("nn_module_stack", {})
    first, second = (_call(gm.graph, launch, operator.getitem, (packed, part), {}, stack)
                     for part in (slice(0, rows), slice(rows, 2 * rows)))
    for node in (first, second):
        set_example_value(gm, node)
    return [first, second] if gate_first else [second, first]


def _call(graph: torch.fx.Graph, before: Node, target: Any, args: tuple, kwargs: dict, stack: dict) -> Node:
    with graph.inserting_before(before):
        node = graph.call_function(target, args, kwargs)
    node.meta["nn_module_stack"] = dict(stack)
    return node


def _residual_sums(norm: _Norm | None) -> list[Node]:
    """The reads of the norm's ``h = x + residual`` output (getitem 1), which the fused launch then gives."""
    if norm is None or norm.residual is None:
        return []
    return [user for user in norm.node.users if user.target is operator.getitem and user.args[1] == 1]
