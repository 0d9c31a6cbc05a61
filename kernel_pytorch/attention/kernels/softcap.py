"""Soft-capped attention (Gemma-2's ``attn_logit_softcapping``): the scores pass through
``cap * tanh(score / cap)`` after scaling and before the mask, so no score leaves (-cap, cap).

No SDPA kernel computes that. FlexAttention does, as a ``score_mod`` (:func:`softcap_score_mod`, fused into
its Triton kernel forward and backward when compiled); everywhere else the ``"sdpa"`` kernel computes it with
PyTorch's own ops, as the model wrote it (:func:`softcapped_attention_math`): the same numbers, no gain,
differentiable (CPU, uncompiled graphs, a padding mask FlexAttention does not take).

Example::

    out = softcapped_attention_math(q, k, v, None, 0.0, is_causal=True, scale=0.0625, enable_gqa=False,
                                    softcap=50.0)
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["softcap_score_mod", "softcapped_attention_math"]


@functools.lru_cache(maxsize=None)
def softcap_score_mod(softcap: float) -> Callable[..., Tensor]:
    """FlexAttention's ``score_mod`` for a soft cap: the score (already scaled) -> ``cap * tanh(score / cap)``.
    One function per cap, so that a compiled ``flex_attention``, which guards on the function it is given, is not
    compiled again for each call's new closure."""
    def capped(score: Tensor, batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return softcap * torch.tanh(score / softcap)
    return capped


def softcapped_attention_math(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                              is_causal: bool, *, scale: Optional[float], enable_gqa: bool, softcap: float) -> Tensor:
    """SDPA's semantics with the scores soft-capped before the mask: ``attn_mask`` bool (True = attend) or
    additive, ``is_causal`` top-left aligned, ``scale=None`` 1/sqrt(E), K/V repeated per head group with
    ``enable_gqa``; the softmax in float32, as the models write it (Gemma-2's eager attention)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = softcap * torch.tanh(q @ k.transpose(-2, -1) * (scale / softcap))
    if is_causal:
        lq, lk = q.shape[-2], k.shape[-2]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return F.dropout(probs, dropout_p) @ v if dropout_p else probs @ v
