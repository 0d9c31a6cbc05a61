"""The matcher for existing ``F.scaled_dot_product_attention`` calls: from an SDPA call (as
:mod:`kernel_pytorch.passes.normalize` spells it: ``F.scaled_dot_product_attention(q, k, v, attn_mask,
dropout_p, is_causal, scale=..., enable_gqa=...)``) to the same :class:`AttentionMatch` the hand-written
matcher gives, so that the attention pass decides its mask and kernel the same way.

* ``attn_mask`` becomes one mask term, as a hand-written ``masked_fill`` or ``+ mask`` would: a bool mask
  (True = attend) a ``-inf`` fill where it is False, a float mask an addition. The pass then recognizes a
  causal mask (``is_causal=True``, no tensor), a sliding window or block pattern, or keeps the tensor.
* ``k``/``v`` repeated per head before the call (transformers' ``repeat_kv``, ``repeat_interleave``) are
  used un-repeated with ``enable_gqa=True``.
* ``dropout_p``, ``is_causal``, ``scale`` and ``enable_gqa`` must be constants; ``scale=None`` stays None
  (SDPA's 1/sqrt(E)).

Nothing here edits the graph.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from kernel_pytorch.passes.attention_match import AttentionMatch, MaskTerm, NotAttention, Operand, unrepeated_heads
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.shape_constants import example_value, same_shape, static_int

__all__ = ["is_sdpa_call", "match_sdpa_call"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_sdpa_call(node: Any) -> bool:
    """Whether ``node`` is an ``F.scaled_dot_product_attention`` call in the canonical spelling."""
    return is_call(node, F.scaled_dot_product_attention) and len(node.args) == 6 and \
        set(node.kwargs) == {"scale", "enable_gqa"}


def _tensor(node: Any, what: str) -> torch.Tensor:
    value = example_value(node) if isinstance(node, Node) else None
    if not isinstance(value, torch.Tensor):
        raise NotAttention(f"SDPA call whose {what} has no shape metadata")
    return value


def _constant(value: Any, kinds: tuple[type, ...], what: str) -> Any:
    if isinstance(value, Node) or not isinstance(value, kinds):
        raise NotAttention(f"SDPA call with a {what} that is not a constant ({value!r}): the kernel choice needs it")
    return value


def _mask_term(mask: Node, call: Node) -> MaskTerm:
    """SDPA's ``attn_mask`` as the hand-written matcher's mask term (bool: True = attend)."""
    value = _tensor(mask, "attn_mask")
    if value.dtype == torch.bool:
        return MaskTerm("fill", mask, fill=-math.inf, masked_value=False, blocking=True, source=call)
    if value.dtype not in _FLOAT_DTYPES:
        raise NotAttention(f"SDPA call with an attn_mask of dtype {value.dtype}")
    return MaskTerm("additive", mask, multiplier=1.0, source=call)


def _gqa(q: torch.Tensor, k: Operand, v: Operand, enable_gqa: bool) -> tuple[Operand, Operand, bool, list[Node]]:
    """K and V un-repeated (``enable_gqa=True``) where the call's K/V repeat each head in place."""
    if enable_gqa:
        return k, v, True, []
    k_source, v_source = unrepeated_heads(k), unrepeated_heads(v)
    if k_source and v_source and k_source[1] == v_source[1] > 1 and q.dim() == 4:
        return Operand(k_source[0]), Operand(v_source[0]), True, k_source[2] + v_source[2]
    return k, v, False, []


def _heads(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int] | None:
    hq, hk = static_int(q.shape[-3]), static_int(k.shape[-3])
    if hq is None or hk is None or hq == hk:
        return None
    if hq % hk:
        raise NotAttention(f"SDPA call with enable_gqa and {hq} query heads, {hk} key/value heads: not a multiple")
    return hq, hk


def match_sdpa_call(call: Node) -> AttentionMatch:
    """The attention record of an SDPA call; raises :class:`NotAttention` with the reason otherwise."""
    q_node, k_node, v_node, mask, dropout_p, is_causal = call.args
    scale = call.kwargs["scale"]
    dropout_p = float(_constant(dropout_p, (int, float), "dropout_p"))
    is_causal = _constant(is_causal, (bool,), "is_causal")
    enable_gqa = _constant(call.kwargs["enable_gqa"], (bool,), "enable_gqa")
    if scale is not None:
        scale = float(_constant(scale, (int, float), "scale"))
    q, k_value, v_value = (_tensor(n, name) for n, name in ((q_node, "query"), (k_node, "key"), (v_node, "value")))
    if len({q.dtype, k_value.dtype, v_value.dtype}) != 1 or q.dtype not in _FLOAT_DTYPES:
        raise NotAttention(f"SDPA call with query, key, value of dtypes {q.dtype}, {k_value.dtype}, {v_value.dtype}")
    if not q.dim() == k_value.dim() == v_value.dim() >= 3:
        raise NotAttention(f"SDPA call with query, key, value of ranks {q.dim()}, {k_value.dim()}, {v_value.dim()} "
                           "(the fused kernels take equal ranks with a head axis)")
    if not same_shape(q.shape[:-3], k_value.shape[:-3]):
        raise NotAttention(f"SDPA call whose query {tuple(q.shape)} and key {tuple(k_value.shape)} broadcast "
                           "their batch axes")
    if mask is not None and is_causal:
        raise NotAttention("SDPA call with both attn_mask and is_causal (SDPA itself refuses it)")
    terms = [] if mask is None else [_mask_term(mask, call)]
    k, v, enable_gqa, repeats = _gqa(q, Operand(k_node), Operand(v_node), enable_gqa)
    heads = _heads(q, example_value(k.node)) if enable_gqa else None
    scores_shape = (*q.shape[:-1], k_value.shape[-2])
    return AttentionMatch(softmax=None, qk=None, pv=call, q=Operand(q_node), k=k, v=v, scale=scale,
                          scores_shape=scores_shape, terms=terms, dropout_p=dropout_p, enable_gqa=enable_gqa,
                          heads=heads, removable=[call, *repeats], is_causal=is_causal, source="sdpa")
