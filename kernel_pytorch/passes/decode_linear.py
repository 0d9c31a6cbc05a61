"""Linears of a few token rows (decode steps) -> :func:`kernel_pytorch.ops.decode_linear.grouped_linear`.

    # before (a decode step of one token)            # after
    q = F.linear(x, w_q, None)                       qkv = grouped_linear(x, [w_q, w_k, w_v], [])
    k = F.linear(x, w_k, None)                       parts = torch.split(qkv, [2048, 512, 512], -1)
    v = F.linear(x, w_v, None)                       q, k, v = parts[0], parts[1], parts[2]
    o = F.linear(attn, w_o, None)                    o = grouped_linear(attn, [w_o], [])

Linears that read one input are grouped (up to three: q/k/v, gate/up), in graph order; the others become
groups of one. A group is one launch of the grouped GEMV kernel, which reads each weight where it is (no
copy: horizontal_gemm's concatenation does not pay at a few tokens, and packing the parameters into one
tensor would change the model's storage).

Matched: ``F.linear`` in an inference graph whose input has at most ``MAX_ROWS`` token rows, all static sizes
(a step compiled for batch 1), 2-D weights and biases of the input's dtype. A graph whose batch is a symbolic size
(the step for batches above 1, which serves up to 32 rows) is left alone unless ``generation.symbolic_batch_gemv``
is on: then each group is timed at ``SYMBOLIC_ROWS`` from the most down, and the kernel serves calls of up to the
first count it won at (``grouped_linear(max_rows=...)``), cuBLAS the larger ones. Decided by measurement on CUDA:
each group's kernel against one ``F.linear`` per weight (cuBLAS), timed as CUDA-graph replays at the group's shapes on
weights read from memory (``timing.fastest_cuda_graph_ms``, ``timing.weight_copies``); the faster is kept and the
report says so. Runs after ``fp8``: a linear the FP8 pass converted is no ``F.linear``.
"""

from __future__ import annotations

import functools
import math
import operator

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx import Node

from kernel_pytorch.ops import decode_linear as gemv
from kernel_pytorch.passes.base import PassContext, PassResult
from kernel_pytorch.passes.decode_base import DecodeStepPass
from kernel_pytorch.passes.graph_utils import erase_unused, gemm_rows, module_path_of
from kernel_pytorch.passes.horizontal_gemm import (NodeBuilder, linears_by_input, modified_in_place,
                                                  reordering_barrier, replace_by_part)
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.shape_constants import example_value, static_int

__all__ = ["DecodeLinearPass", "SYMBOLIC_ROWS"]


# Row counts a graph whose rows are symbolic (a decode step for batches above 1) is timed at, with the option on.
SYMBOLIC_ROWS = (2, 8, 16)


def _rows(x: Node, symbolic: bool = False) -> tuple[int, ...] | None:
    """The row counts to time a linear's launch at: its token rows when every size is static and there are at most
    MAX_ROWS; with ``symbolic``, ``SYMBOLIC_ROWS`` for a symbolic batch (the first size) of at most MAX_ROWS tokens
    each (a prefill's symbolic length is left alone). None otherwise."""
    rows = gemm_rows(x, static_only=True)
    if rows is not None:
        return (rows,) if 0 < rows <= gemv.MAX_ROWS else None
    value = example_value(x)
    if not symbolic or not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    tokens = [static_int(size) for size in value.shape[1:-1]]
    return SYMBOLIC_ROWS if None not in tokens and math.prod(tokens) <= gemv.MAX_ROWS else None


def _linear_operands(node: Node) -> tuple[Node, Node | None] | None:
    """(weight, bias) of a canonical ``F.linear(x, w, b)`` whose weight (and bias) suit the kernel."""
    if len(node.args) < 2 or node.kwargs:
        return None
    weight, bias = node.args[1], node.args[2] if len(node.args) > 2 else None
    if not all(isinstance(t, Node) and t.op in ("placeholder", "get_attr") for t in (weight, bias) if t is not None):
        return None  # a weight computed in the graph may be defined after the group's first linear
    x_value, w_value, out_value = example_value(node.args[0]), example_value(weight), example_value(node)
    if not (isinstance(w_value, torch.Tensor) and w_value.dim() == 2 and w_value.dtype == x_value.dtype):
        return None
    if getattr(out_value, "requires_grad", False):
        return None  # an eval-mode call with grad enabled: the kernel has no backward
    if bias is not None and not isinstance(example_value(bias), torch.Tensor):
        return None
    return weight, bias


def _groups(graph: torch.fx.Graph, symbolic: bool) -> list[list[Node]]:
    """Linears by input, in graph order, chunked into groups of at most MAX_WEIGHTS that agree on having a
    bias and have no in-place write or grad/autocast switch between them."""
    groups = []
    for linears in linears_by_input(graph, min_linears=1).values():
        current: list[Node] = []
        for linear in linears:
            if _rows(linear.args[0], symbolic) is None or _linear_operands(linear) is None:
                continue
            if modified_in_place(linear):  # split's views may not be written: a group of its own
                groups.append([linear])
                continue
            if current and (len(current) == gemv.MAX_WEIGHTS or _has_bias(linear) != _has_bias(current[0])
                            or reordering_barrier(graph, [current[0], linear]) is not None):
                groups.append(current)
                current = []
            current.append(linear)
        if current:
            groups.append(current)
    return groups


def _has_bias(linear: Node) -> bool:
    return len(linear.args) > 2 and linear.args[2] is not None


# ---------------------------------------------------------------------------------------- measurement

@functools.lru_cache(maxsize=256)
def _measured(rows: int, sizes: tuple[int, ...], k: int, bias: bool, dtype: torch.dtype,
              device_index: int) -> tuple[bool, str]:
    """(whether the kernel wins, the timings) for one group's shapes on a GPU."""
    from kernel_pytorch.timing import fastest_cuda_graph_ms, rotating, weight_copies

    device = torch.device("cuda", device_index)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    copies = weight_copies(lambda: [torch.randn(n, k, device=device, dtype=dtype) for n in sizes],
                           sum(sizes) * k * x.element_size(), device)
    biases = [torch.randn(n, device=device, dtype=dtype) for n in sizes] if bias else None
    timings = fastest_cuda_graph_ms({
        "cuBLAS": rotating(lambda ws: [F.linear(x, w, biases[i] if biases else None) for i, w in enumerate(ws)],
                           copies),
        "gemv": rotating(lambda ws: gemv.grouped_linear(x, ws, biases), copies)})
    return timings.faster("gemv", "cuBLAS"), timings.in_microseconds()


def _decision(group: list[Node], rows: tuple[int, ...]) -> tuple[int, str]:
    """(the most rows the kernel serves, 0 for none; why): timed from the most of ``rows`` down, the first count at
    which it measured faster than cuBLAS. Fewer rows read the same weights, and both launches' times were flat
    from 2 to 16 rows on an H100 (docs/kernels.md): one timing a group where the kernel wins at the most."""
    x_value = example_value(group[0].args[0])
    if x_value.device.type != "cuda":
        return gemv.MAX_ROWS, "F.linear per weight off CUDA"
    sizes = tuple(int(example_value(n.args[1]).shape[0]) for n in group)
    k = int(example_value(group[0].args[1]).shape[1])
    reasons = []
    for count in sorted(rows, reverse=True):
        wins, timings = _measured(count, sizes, k, _has_bias(group[0]), x_value.dtype, x_value.device.index or 0)
        reasons.append(timings if len(rows) == 1 else f"{count} rows: {timings}")
        if wins:
            return count, "; ".join(reasons)
    return 0, "; ".join(reasons)


# ---------------------------------------------------------------------------------------------- the pass

@register_pass
class DecodeLinearPass(DecodeStepPass):
    """Linears of a few token rows -> the grouped GEMV kernel (module docstring)."""

    kernel = "the grouped GEMV"
    name = "decode_linear"
    description = "linears of a few token rows (decode steps) -> one grouped GEMV launch per input"

    def rewrite_step(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> PassResult:
        symbolic = ctx.config.generation.symbolic_batch_gemv
        for group in _groups(gm.graph, symbolic):
            rows = _rows(group[0].args[0], symbolic)
            location = module_path_of(group[0], "(model)")
            names = " + ".join(module_path_of(n, "linear").rpartition(".")[2] for n in group)
            what = f"{names} ({rows[0]} rows)" if len(rows) == 1 else f"{names} (symbolic rows)"
            served, how = _decision(group, rows)
            if not served:
                result.skip(location, f"{what}: cuBLAS kept, faster here ({how})")
                continue
            symbolic_rows = len(rows) > 1
            _rewrite(gm, group, served if symbolic_rows else gemv.MAX_ROWS)
            up_to = f" up to {served} rows, cuBLAS above" if symbolic_rows else ""
            result.rewrite(location, f"{what} -> grouped_linear{up_to}: {how}")
        return result


def _rewrite(gm: torch.fx.GraphModule, group: list[Node], max_rows: int) -> None:
    for member in group[1:]:
        for operand in member.args[1:3]:
            if isinstance(operand, Node) and operand.op == "get_attr":
                group[0].prepend(operand)  # a get_attr reads nothing: moving it before the first linear is safe
    build = NodeBuilder(gm, group[0], group[0].meta.get("nn_module_stack", {}))
    weights = [n.args[1] for n in group]
    biases = [n.args[2] for n in group] if _has_bias(group[0]) else None
    arguments = (group[0].args[0], weights, biases) + ((max_rows,) if max_rows < gemv.MAX_ROWS else ())
    fused = build.call(gemv.grouped_linear, arguments)
    if len(group) == 1:
        group[0].replace_all_uses_with(fused)
    else:
        sizes = [int(example_value(w).shape[0]) for w in weights]
        parts = build.call(torch.split, (fused, sizes, -1))
        for index, member in enumerate(group):
            stack = member.meta.get("nn_module_stack", {})
            replace_by_part(gm, member, build.call(operator.getitem, (parts, index), stack=stack), build, stack)
    erase_unused(gm.graph, group)
