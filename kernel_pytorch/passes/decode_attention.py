"""SDPA of one query token against a KV cache -> :func:`kernel_pytorch.ops.decode_attention.decode_attention`.

A decode step of a transformers model (SDPA attention, a static cache) calls, per layer::

    # before (normalized)                                   # after
    k_rep = k_cache[:, :, None].expand(B, Hkv, G, L, D)     o = decode_attention(q, k_cache, v_cache,
    k_rep = k_rep.reshape(B, Hkv * G, L, D)    # repeat_kv                       mask, scale)
    v_rep = ...                                # the same
    o = F.scaled_dot_product_attention(q, k_rep, v_rep, mask, 0.0, False, scale=s, enable_gqa=False)

``repeat_kv`` copies the whole cache G-fold per layer and token, more bytes than the attention reads, and
SDPA's kernels are built for many query tokens: the decode op reads the cache once per query-head group,
split over the GPU's SMs, and skips blocks the mask hides (the unfilled tail of a static cache).

Matched: a (normalized) SDPA call whose query has one token (size 1 at the capture, as Dynamo specializes
it), in an inference graph, read by the attention pass's own SDPA matcher (:func:`sdpa_match.match_sdpa_call`:
constant ``scale``, ``dropout_p`` and ``is_causal``, the mask as one term, K/V repeated per head by
``repeat_kv`` or ``repeat_interleave`` read through to the cache), with no dropout and ``is_causal=False``
(with one query token, SDPA's top-left causal mask would hide every key but the first: not a decode step).

Decided by measurement on CUDA: the decode op against the SDPA call as captured (its ``repeat_kv``
included), both timed as CUDA-graph replays at the capture's sizes with every position attended (the
decode op's worst case: it skips masked blocks); the faster is kept, and the report says so. Off CUDA the
op runs PyTorch's SDPA with ``enable_gqa`` on the unexpanded cache (no copy), so the rewrite is kept.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx import Node

from kernel_pytorch.ops import decode_attention as decode_ops
from kernel_pytorch.passes.attention_match import NotAttention
from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult, candidates
from kernel_pytorch.passes.graph_utils import erase_unused, set_example_value
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.sdpa_match import is_sdpa_call, match_sdpa_call
from kernel_pytorch.passes.shape_constants import example_value, static_int

__all__ = ["DecodeAttentionPass", "DecodeCall"]


@dataclass(frozen=True)
class DecodeCall:
    """A matched SDPA call: the query, the unexpanded cache, the mask and scale, and the nodes of ``repeat_kv``."""

    q: Node
    k: Node
    v: Node
    mask: Node | None
    scale: float | None
    expansions: tuple[Node, ...]
    shape: tuple[int, int, int, int, int]  # (B, Hq, Hkv, L, D) at the capture's sizes


def _hint(size: Any) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _match(node: Node, ctx: PassContext) -> DecodeCall | str | None:
    """The SDPA call as :mod:`sdpa_match` reads it (constants, mask term, ``repeat_kv`` undone), if it is a
    decode step's."""
    if not is_sdpa_call(node):
        return None
    q_value = example_value(node.args[0])
    # static_int: comparing a symbolic length (a prefill's) with 1 would guard the graph on it
    if not isinstance(q_value, torch.Tensor) or q_value.dim() != 4 or static_int(q_value.shape[2]) != 1:
        return None  # not one query token: the attention pass's case
    if ctx.training or q_value.requires_grad:
        return "a training graph (the decode kernel has no backward)"
    try:
        match = match_sdpa_call(node)
    except NotAttention as reason:
        return str(reason)
    if match.dropout_p or match.is_causal:
        return f"dropout_p={match.dropout_p}, is_causal={match.is_causal} (a decode step has neither)"
    mask = match.terms[0].node if match.terms else None
    repeats = tuple(n for n in match.removable if n is not node)
    return _checked_call(match.q.node, match.k.node, match.v.node, mask, match.scale, repeats, q_value)


def _checked_call(q, k, v, mask, scale, expansions, q_value) -> DecodeCall | str:
    k_value, v_value = example_value(k), example_value(v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (k_value, v_value)):
        return "K or V is not a 4-D tensor with an example value"
    batch, q_heads, _, head_dim = (_hint(s) for s in q_value.shape)
    _, kv_heads, length, _ = (_hint(s) for s in k_value.shape)
    if kv_heads == 0 or q_heads % kv_heads or k_value.dtype != q_value.dtype:
        return f"{q_heads} query heads over {kv_heads} cache heads of {k_value.dtype} (needs a multiple, q's dtype)"
    mask_value = example_value(mask) if isinstance(mask, Node) else None
    if mask is not None and not isinstance(mask_value, torch.Tensor):
        return "the mask is not a tensor with an example value"
    return DecodeCall(q, k, v, mask, scale, expansions, (batch, q_heads, kv_heads, length, head_dim))


# ---------------------------------------------------------------------------------------- measurement

@functools.lru_cache(maxsize=64)
def _measured(shape: tuple[int, ...], dtype: torch.dtype, device_index: int) -> tuple[bool, str]:
    """(whether the decode op wins, the timings) for (B, Hq, Hkv, L, D) on a GPU, SDPA as transformers calls it
    (``repeat_kv``, a bool mask) against the decode op, all positions attended."""
    from kernel_pytorch.timing import fastest_cuda_graph_ms

    batch, q_heads, kv_heads, length, head_dim = shape
    device = torch.device("cuda", device_index)
    q = torch.randn(batch, q_heads, 1, head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, device=device, dtype=dtype) for _ in range(2))
    mask = torch.ones(batch, 1, 1, length, device=device, dtype=torch.bool)
    group = q_heads // kv_heads

    def sdpa():
        expand = (batch, kv_heads, group, length, head_dim)
        k_rep = k[:, :, None].expand(expand).reshape(batch, q_heads, length, head_dim)
        v_rep = v[:, :, None].expand(expand).reshape(batch, q_heads, length, head_dim)
        return F.scaled_dot_product_attention(q, k_rep, v_rep, mask)

    timings = fastest_cuda_graph_ms({"sdpa": sdpa, "decode": lambda: decode_ops.decode_attention(q, k, v, mask)})
    return timings.faster("decode", "sdpa"), timings.in_microseconds()


def _decision(call: DecodeCall, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return True, "SDPA with enable_gqa on the unexpanded cache (no GPU kernel here)"
    if dtype not in decode_ops.TRITON_DTYPES or not decode_ops.tu.HAS_TRITON:
        return False, f"no decode kernel for {dtype} here"
    wins, timings = _measured(call.shape, dtype, device.index or 0)
    return wins, f"split-KV kernel ({timings})" if wins else f"SDPA kept, faster here ({timings})"


# ---------------------------------------------------------------------------------------------- the pass

@register_pass
class DecodeAttentionPass(GraphPass):
    """One-token SDPA calls against a cache -> the split-KV decode op (module docstring)."""

    name = "decode_attention"
    description = "SDPA of one query token against a KV cache (decode steps) -> split-KV decode attention"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        for found in candidates(gm.graph.nodes, lambda node: _match(node, ctx), result):
            call, node = found.match, found.node
            q_value = example_value(call.q)
            chosen, how = _decision(call, q_value.dtype, q_value.device)
            batch, q_heads, kv_heads, length, head_dim = call.shape
            what = f"SDPA of 1 token over a ({batch}, {kv_heads}, {length}, {head_dim}) cache, {q_heads} query heads"
            if not chosen:
                result.skip(found.location, f"{what}: {how}")
                continue
            _rewrite(gm, node, call)
            result.rewrite(found.location, f"{what} -> decode_attention: {how}")
        return result


def _rewrite(gm: torch.fx.GraphModule, node: Node, call: DecodeCall) -> None:
    with gm.graph.inserting_before(node):
        decode = gm.graph.call_function(decode_ops.decode_attention, (call.q, call.k, call.v, call.mask, call.scale))
    decode.meta.update({key: node.meta[key] for key in ("nn_module_stack", "stack_trace") if key in node.meta})
    set_example_value(gm, decode)
    node.replace_all_uses_with(decode)
    gm.graph.erase_node(node)
    erase_unused(gm.graph, call.expansions)
