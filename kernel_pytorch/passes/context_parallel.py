"""Pass ``context_parallel``, after the rope and attention passes: the graph side of ``optimize(model,
context_parallel=group)``, for a graph that will run on this rank's zigzag shard of the sequence (the boundary,
sharding inputs and gathering outputs, is ``kernel_pytorch.distributed.context_parallel``).

Before::

    cos = rope_cos[:n]; q = apply_rope(q, k, cos, sin); out = attention(q, k, v, is_causal=True)

After::

    cos = rows_at_global_positions(rope_cos, n); ...; out = ring_attention_fwd(q, k, v, group, True, ...)[0]

The captured graph sees only the local shard, so everything that depends on positions must be made global:

* **RoPE**: the ``cos``/``sin`` of each ``apply_rope`` call must be the rows of the
  tokens' global positions. Proven, and rewritten, when a table is the first ``n`` rows of a 2-D graph input
  (a buffer ``rope_cos[:n]``, ``n`` the local length) reaching ``apply_rope`` through casts and leading
  unsqueezes only, with its rows at q's sequence dim (-2): the slice becomes ``rows at the zigzag
  positions`` of the same table.
* **Attention**: a fused ``attention`` call that is causal, or unmasked over
  equal query and key lengths, without dropout, becomes ``ring_attention(q, k, v, causal=...)`` over the
  group.

Anything else that depends on positions cannot be proven right on a shard: a masked attention (padding,
sliding window, arbitrary masks), dropout on the probabilities, attention the pass did not recognize, RoPE
tables computed in the graph (Hugging Face's from ``position_ids``), other position ops (``arange``,
``triu``/``tril``, ``cumsum``, a table sliced to its first rows). Those are refused: the passes cannot raise
(a pass that raises is skipped, which would leave local attention running silently), so a node inserted at
the top of the graph raises :class:`ContextParallelError` naming them all. It runs before any of the
graph's communication, and every rank captures the same graph, so every rank raises the same error.
The attention pass's result (``PassContext.earlier_results``) says why a softmax was left as it was, and
whether a causal mask was proven only behind a runtime guard.
"""

from __future__ import annotations

import math
import operator
from functools import cache

import torch
import torch.fx
from torch.fx import Node
from torch.fx.node import has_side_effect

from kernel_pytorch.distributed.block_attention import default_block_kernel
from kernel_pytorch.distributed.context_parallel import ContextParallelError
from kernel_pytorch.distributed.rank_group import RankGroup
from kernel_pytorch.distributed.ring_attention import ring_attention_fwd  # noqa: F401 (registers the op)
from kernel_pytorch.distributed.sequence_sharding import shard_sequence
from kernel_pytorch.ops.attention import attention
from kernel_pytorch.ops.rope import apply_rope
from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult
from kernel_pytorch.passes.graph_utils import module_path_of
from kernel_pytorch.passes.registry import register_pass

__all__ = ["ContextParallelPass", "refuse_context_parallel", "shard_attention_calls", "shard_rope_tables"]

# Ops after which row i of the result is row i of the operand: casts, and (checked by shape) leading unsqueezes.
_ROW_PRESERVING_METHODS = ("to", "float", "double", "half", "bfloat16", "type_as", "contiguous", "unsqueeze")
# Ops whose value depends on positions; on a shard they would see local positions.
_POSITION_FUNCTIONS = (torch.arange, torch.triu, torch.tril, torch.cumsum)
_POSITION_METHODS = ("triu", "tril", "cumsum")
# The op's overload, as graphs hold ops (importing ring_attention_fwd registers it).
_RING_ATTENTION_FWD = torch.ops.kernel_pytorch.ring_attention_fwd.default
_REFUSAL_HEADER = "optimize(context_parallel=...): this model cannot run on a shard of the sequence:"


@register_pass
class ContextParallelPass(GraphPass):
    name = "context_parallel"
    description = ("context parallelism: RoPE tables at the tokens' global positions, causal attention as ring "
                   "attention over the group; anything else positional refused")
    skipped_on_error = False  # skipped, the graph would run on its shard as if it were the whole sequence

    def reason_not_to_run(self, hardware, config) -> str | None:
        return None if config.context_parallel is not None else "context_parallel is off (no process group)"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        group = ctx.config.context_parallel
        shard_rope_tables(gm, group, result, apply_rope)
        shard_attention_calls(gm, group, result, attention, ctx.earlier_results.get("attention", PassResult()))
        return result


@has_side_effect  # no users: without this, dead-code elimination would drop it
def refuse_context_parallel(message: str) -> None:
    """The first node of a graph that cannot run on a sequence shard."""
    raise ContextParallelError(message)


@cache
def _global_rows_for(group):
    """The graph's replacement of ``table[:local_length]``: the table's rows at the zigzag positions."""

    def rows_at_global_positions(table: torch.Tensor, local_length: int) -> torch.Tensor:
        length = local_length * RankGroup.of(group).size
        if length > table.shape[0]:
            raise ContextParallelError(f"context_parallel: a RoPE table has {table.shape[0]} rows, the global "
                                       f"sequence needs {length}")
        positions = shard_sequence(torch.arange(length, device=table.device), 0, group)
        return table.index_select(0, positions)

    return rows_at_global_positions


# ---------------------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------------------


def shard_rope_tables(gm: torch.fx.GraphModule, group, result, rope_op) -> None:
    """Make the tables of every ``rope_op`` call the rows of the global positions (module docstring)."""
    problems, found = [], []
    for call in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is rope_op]:
        for table_use in call.args[2:4]:
            slice_and_reader = _table_slice(table_use, call.args[0])
            if slice_and_reader is None:
                problems.append(f"{module_path_of(call, '(model)')}: the RoPE cos/sin tables are not the first rows "
                                "of a table input (e.g. computed in the graph from position ids), so their global "
                                "rows are unknown")
            else:
                found.append(slice_and_reader)
    # Rewritten after all are found: calls share tables (one slice feeds every layer).
    rows_of = {}
    for sliced, reader in found:
        if sliced not in rows_of:
            with gm.graph.inserting_after(sliced):
                rows_of[sliced] = gm.graph.call_function(_global_rows_for(group), (sliced.args[0],
                                                                                    _row_stop_of_slice(sliced)))
            rows_of[sliced].meta.update(sliced.meta)
        reader.replace_input_with(sliced, rows_of[sliced])
    for sliced in rows_of:
        if not sliced.users:
            gm.graph.erase_node(sliced)
    if rows_of:
        result.rewrite("(model)", f"context parallel: {len(rows_of)} RoPE table(s) indexed at the global positions")
    _refuse_in(gm, problems, result)


def _table_slice(node, x) -> tuple[Node, Node] | None:
    """(the ``table[:n]`` node, the node reading it on the way to ``apply_rope``) when ``node`` is such a
    slice of a 2-D graph input reached through row-preserving ops, its rows at x's dim -2; else None."""
    value, x_value = _example(node), _example(x)
    if value is None or x_value is None or value.dim() < 2 or x_value.dim() < 2:
        return None
    consumer = None
    while isinstance(node, Node):
        if _row_stop_of_slice(node) is not None:
            table = _example(node.args[0])
            rows = _example(node)
            if table.dim() != 2 or value.shape[-2:] != rows.shape or value.shape[-2] != x_value.shape[-2] or \
                    any(size != 1 for size in value.shape[:-2]):
                return None
            return node, consumer
        if node.op == "call_method" and node.target in _ROW_PRESERVING_METHODS or \
                node.op == "call_function" and node.target is torch.unsqueeze:
            node, consumer = node.args[0], node
            continue
        return None
    return None


def _row_stop_of_slice(node: Node):
    """``n`` when ``node`` is ``input[:n]`` / ``input[0:n]`` along dim 0 of a placeholder, else None."""
    if not (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], Node)
            and node.args[0].op in ("placeholder", "get_attr")):
        return None
    index = node.args[1]
    first = index[0] if isinstance(index, tuple) and index else index
    rest = index[1:] if isinstance(index, tuple) else ()
    if not isinstance(first, slice) or first.start not in (None, 0) or first.step not in (None, 1) or first.stop is None:
        return None
    if any(part not in (Ellipsis,) and part != slice(None) for part in rest):
        return None
    return first.stop


# ---------------------------------------------------------------------------------------------------------
# Attention, and everything else position-dependent
# ---------------------------------------------------------------------------------------------------------


def shard_attention_calls(gm: torch.fx.GraphModule, group, result, attention_op, attention_result) -> None:
    """Ring attention for every provable ``attention_op`` call; refuse the graph if anything positional is
    left (module docstring). ``attention_result``: what the attention pass did to this graph."""
    problems, count = [], 0
    for call in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is attention_op]:
        location = module_path_of(call, "(model)")
        reason = _unshardable_attention(call, attention_result)
        if reason is not None:
            problems.append(f"{location}: {reason}")
            continue
        with gm.graph.inserting_before(call):
            ring = gm.graph.call_function(operator.getitem, (_ring_attention_node(gm, call, group), 0))
        ring.meta.update(call.meta)
        call.replace_all_uses_with(ring)
        gm.graph.erase_node(call)
        count += 1
    if count:
        result.rewrite("(model)", f"context parallel: {count} attention call(s) -> ring_attention over the group")
    problems += _positional_leftovers(gm, attention_result)
    _refuse_in(gm, problems, result)


def _ring_attention_node(gm: torch.fx.GraphModule, call: Node, group) -> Node:
    """``ring_attention_fwd(q, k, v, group name, causal, scale, kernel)`` for the attention ``call``: the
    custom op itself, not the Python ``ring_attention``, so the graph holds a traceable op with constants
    and the compiler (AOTAutograd, Inductor) never sees the point-to-point exchanges. The public function's
    per-call shape all_gather is left out on purpose (a host sync per layer on GPUs): the boundary checked
    that every rank passed the same input shapes, and every rank runs the same graph, so q, k, v agree too.
    The local checks are the pass's own (``_unshardable_attention``) and the boundary's (even lengths)."""
    q, k, v = call.args[:3]
    example = _example(q)
    scale = call.kwargs.get("scale")
    scale = 1.0 / math.sqrt(example.shape[-1]) if scale is None else float(scale)
    causal = bool(call.kwargs.get("is_causal"))
    return gm.graph.call_function(_RING_ATTENTION_FWD, (q, k, v, RankGroup.of(group).name, causal, scale,
                                                        default_block_kernel(example)))


def _unshardable_attention(call: Node, result) -> str | None:
    q, k = _example(call.args[0]), _example(call.args[1])
    kwargs = call.kwargs
    if len(call.args) > 3 and call.args[3] is not None or kwargs.get("pattern") is not None:
        return "attention with a mask (padding, window or arbitrary) cannot be split along the sequence"
    if kwargs.get("dropout_p", 0.0):
        return f"attention with dropout {kwargs['dropout_p']} on the probabilities (not in ring attention)"
    if kwargs.get("softcap") is not None:
        return f"soft-capped attention (cap {kwargs['softcap']}): ring attention has no cap"
    if result.guards:
        return ("the causal mask was proven only for the captured sizes (a runtime guard, whose fallback would "
                "run local attention); capture with static shapes (dynamic=False)")
    if q is None or k is None or q.dim() != 4 or k.dim() != 4:
        return "attention on tensors that are not 4-D (batch, heads, sequence, dim)"
    if q.shape[2] != k.shape[2]:
        return f"cross-attention (query length {q.shape[2]}, key length {k.shape[2]}): its keys are not the sequence"
    return None


def _positional_leftovers(gm: torch.fx.GraphModule, result) -> list[str]:
    """Live nodes that depend on positions and were not made global: unrewritten attention (a softmax the
    attention pass skipped), position ops, tables sliced to their first rows."""
    skipped = {s.location: s.reason for s in result.skipped}
    problems = []
    for node in _live_nodes(gm.graph):
        location = module_path_of(node, "(model)")
        if node.op == "call_function" and node.target is torch.softmax:
            why = skipped.get(location, "not recognized as attention")
            problems.append(f"{location}: a softmax the attention pass did not rewrite ({why}); if it is attention, "
                            "it would attend within the local shard only")
        elif node.op == "call_function" and node.target in _POSITION_FUNCTIONS or \
                node.op == "call_method" and node.target in _POSITION_METHODS:
            problems.append(f"{location}: {getattr(node.target, '__name__', node.target)} computes positions or a "
                            "mask, which would be local positions on a shard")
        elif _row_stop_of_slice(node) is not None:
            problems.append(f"{location}: a table input sliced to its first rows ({node.args[0].name}) would give "
                            "local positions on a shard (a position embedding or mask table?)")
    return problems


def _live_nodes(graph: torch.fx.Graph) -> list[Node]:
    """Nodes the output depends on, in graph order."""
    live, stack = set(), [n for n in graph.nodes if n.op == "output"]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack += node.all_input_nodes
    return [n for n in graph.nodes if n in live]


def _refuse_in(gm: torch.fx.GraphModule, problems: list[str], result) -> None:
    """Report each problem, and raise them all from one node at the top of the graph (after its
    placeholders); a refusal an earlier pass inserted gets these problems added."""
    if not problems:
        return
    for problem in problems:
        location, _, reason = problem.partition(": ")
        result.skip(location, f"context parallel: {reason}")
    existing = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target is refuse_context_parallel),
                    None)
    earlier = existing.args[0].split("\n  ")[1:] if existing is not None else []
    message = "\n  ".join([_REFUSAL_HEADER, *dict.fromkeys([*earlier, *problems])])
    if existing is not None:
        existing.args = (message,)
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where = gm.graph.inserting_after(placeholders[-1]) if placeholders else \
        gm.graph.inserting_before(next(iter(gm.graph.nodes)))
    with where:
        gm.graph.call_function(refuse_context_parallel, (message,))


def _example(node):
    value = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None
