"""A decode step's RoPE and KV-cache write -> one launch
(:func:`kernel_pytorch.ops.decode_rope_cache.decode_rope_cache`).

    # before (after the rope pass; transformers' StaticCache.update)   # after
    q_rot, k_rot = apply_rope(q, k, cos, sin)                           q_rot = decode_rope_cache(q, k, v, cos, sin,
    keys.index_copy_(2, cache_position, k_rot)                                                    keys, values,
    values.index_copy_(2, cache_position, v)                                                      cache_position)

Matched: a rotate-half ``apply_rope`` whose rotated k is read only by an ``index_copy_`` along dim 2 of a 4-D
cache, the next ``index_copy_`` after it at the same positions writing v into another cache, a few new tokens (a static
sequence dim of at most ``MAX_TOKENS``), inference graphs. The fused call takes the place of the v copy; the
match is refused if anything reads or writes a cache between the two copies or reads the rotated q before that
place. Not timed: the fused launch reads and writes the same bytes minus the rotated k's round trip, in one launch
where the unfused ops take three or four. The layers' cache counters behind the positions are then read by the
launches and advanced together at the step's end (:mod:`~kernel_pytorch.passes.cache_counters`).
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx import Node

from kernel_pytorch.ops.decode_rope_cache import decode_rope_cache
from kernel_pytorch.ops.rope import apply_rope
from kernel_pytorch.passes.base import PassContext, PassResult
from kernel_pytorch.passes.cache_counters import advance_counters_together
from kernel_pytorch.passes.decode_base import DecodeStepPass
from kernel_pytorch.passes.graph_utils import erase_unused, module_path_of, nodes_between, set_example_value
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.shape_constants import example_value, static_int

__all__ = ["DecodeRopeCachePass", "MAX_TOKENS"]

MAX_TOKENS = 16  # new tokens per sequence of a decode step (a prefill keeps the RoPE kernel's row tiles)
_POSITIONS_ARG = 7  # decode_rope_cache(q, k, v, cos, sin, k_cache, v_cache, cache_position)


@dataclass
class _Match:
    rope: Node
    q_rot: Node
    k_rot: Node
    write_k: Node
    write_v: Node


def _cache_write(node: Node) -> tuple[Node, Node, Node] | None:
    """(cache, positions, source) of ``cache.index_copy_(2, positions, source)`` on a 4-D tensor."""
    if node.op != "call_method" or node.target != "index_copy_" or node.kwargs or len(node.args) != 4:
        return None
    cache, dim, positions, source = node.args
    value = example_value(cache)
    if not (isinstance(value, torch.Tensor) and value.dim() == 4 and dim in (2, -2)):
        return None
    return cache, positions, source


def _match(rope: Node) -> _Match | None:
    args = inspect.signature(apply_rope).bind(*rope.args, **rope.kwargs)
    args.apply_defaults()
    if args.arguments["interleaved"]:
        return None
    parts = {user.args[1]: user for user in rope.users if user.target is operator.getitem}
    if set(parts) != {0, 1} or len(rope.users) != 2 or len(parts[1].users) != 1:
        return None
    write_k = next(iter(parts[1].users))
    found = _cache_write(write_k)
    if found is None or found[2] is not parts[1]:
        return None
    keys, positions, _ = found
    writes_v = {user for user in positions.users
                if user is not write_k and (write := _cache_write(user)) is not None and write[0] is not keys}
    # the first after the k write: a positions tensor shared by every layer (transformers passing cache_position
    # down) has each layer's writes as users
    write_v = next((node for node in _after(write_k) if node in writes_v), None)
    if write_v is None:
        return None
    q_value = example_value(args.arguments["q"])
    tokens = static_int(q_value.shape[2]) if isinstance(q_value, torch.Tensor) and q_value.dim() == 4 else None
    if tokens is None or tokens > MAX_TOKENS:
        return None
    return _Match(rope, parts[0], parts[1], write_k, write_v)


def _after(node: Node) -> Iterator[Node]:
    while node.next.op != "root":
        node = node.next
        yield node


def _safe_to_move(match: _Match) -> bool:
    """Whether the k write may move to the v write's place: nothing touches a cache in between, and the rotated q
    is first read after it."""
    caches = {match.write_k.args[0], match.write_v.args[0]}
    if any(cache in node.all_input_nodes for node in nodes_between(match.write_k, match.write_v) for cache in caches):
        return False
    return not set(match.q_rot.users) & {match.write_k, *nodes_between(match.rope, match.write_v)}


@register_pass
class DecodeRopeCachePass(DecodeStepPass):
    """RoPE + the KV-cache write of a decode step -> one launch (module docstring)."""

    kernel = "the fused RoPE + cache write"
    name = "decode_rope_cache"
    description = "a decode step's RoPE and KV-cache write (index_copy_) -> one launch"

    def rewrite_step(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> PassResult:
        launches = []
        for rope in [n for n in gm.graph.nodes if n.target is apply_rope]:
            match = _match(rope)
            if match is None:
                continue
            location = module_path_of(rope, "(model)")
            if not _safe_to_move(match):
                result.skip(location, "a cache is read or written between the k and v copies, or the rotated q "
                                      "is read before them")
                continue
            launches.append(_rewrite(gm, match))
            result.rewrite(location, "apply_rope + k/v index_copy_ -> decode_rope_cache")
        moved = advance_counters_together(gm, launches, _POSITIONS_ARG)
        if moved:
            result.rewrite("(model)", f"{moved} cache counters read by the RoPE launches, advanced in one launch at "
                                      "the step's end")
        return result


def _rewrite(gm: torch.fx.GraphModule, match: _Match) -> Node:
    graph = gm.graph
    args = inspect.signature(apply_rope).bind(*match.rope.args, **match.rope.kwargs).arguments
    keys, positions, _ = _cache_write(match.write_k)
    values, _, v = _cache_write(match.write_v)
    with graph.inserting_after(match.write_v):
        fused = graph.call_function(decode_rope_cache, (args["q"], args["k"], v, args["cos"], args["sin"], keys,
                                                        values, positions))
    fused.meta["nn_module_stack"] = dict(match.rope.meta.get("nn_module_stack", {}))
    set_example_value(gm, fused)
    match.q_rot.replace_all_uses_with(fused)
    erase_unused(graph, [match.write_k, match.write_v, match.q_rot, match.k_rot, match.rope])
    return fused
