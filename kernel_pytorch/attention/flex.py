"""The ``"flex"`` attention kernel: PyTorch's FlexAttention with a causal ``BlockMask`` or none.

``flex_attention`` is called directly, not through a custom op: it is a higher-order op that Dynamo and
AOTAutograd trace (and differentiate) natively, and that Inductor lowers to its fused Triton template
(forward and backward) when the graph is compiled, which is how ``optimize()`` runs graphs on GPUs. Run
eagerly, ``flex_attention`` is PyTorch's unfused reference: correct, but it materializes the (Lq, Lk)
scores, so it is slow and memory-hungry; the dispatcher measures it compiled, and never picks it unmeasured.

What it computes here is exactly SDPA's (the dispatcher keeps everything else away):

* ``is_causal`` as a block mask of ``q_idx >= kv_idx`` (top-left aligned, SDPA's convention), built per
  call for the call's lengths (``B=None, H=None``: broadcast over batch and heads). Under torch.compile
  the construction is traced into the graph; eagerly it costs one (Lq, Lk) boolean evaluation.
* ``scale`` (``None``: 1/sqrt(E)) and GQA (Hq a multiple of Hk) are FlexAttention's own arguments.
* No attention-mask tensor and no dropout: FlexAttention has no dropout, and a mask tensor read by a
  ``score_mod`` is slower than the fused SDPA kernels that take a bias (see ``dispatch``).

Limits found in torch 2.13's source (``torch/_inductor/kernel/flex/flex_attention.py`` and
``common.py``, ``torch/nn/attention/flex_attention.py``): the GPU template needs E and Ev >= 16
("tl.dot does not support embedding size less than 16"); head dims that are not powers of two are
padded to the next power of two with masked loads (``SAFE_HEAD_DIM=False``), correct but wasteful;
Inductor's default block configs are tuned for head dims <= 256. On the CPU, FlexAttention runs forward
only ("FlexAttention does not support backward on CPU", raised by ``flex_attention`` itself).
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

__all__ = ["flex_attention_forward", "causal_mask_mod", "FLEX_MIN_HEAD_DIM", "FLEX_MAX_HEAD_DIM"]

# Inductor's flex template raises NotImplementedError below 16 (tl.dot's minimum K); above 256 it falls
# back to small untuned blocks that may not fit shared memory (not measured), so the dispatcher stops there.
FLEX_MIN_HEAD_DIM = 16
FLEX_MAX_HEAD_DIM = 256


def causal_mask_mod(batch: Tensor, head: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Top-left aligned causal mask, as SDPA's ``is_causal``: query i sees keys 0..i."""
    return q_idx >= kv_idx


def flex_attention_forward(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: Optional[float]) -> Tensor:
    """``flex_attention`` on 4-D (B, H, L, E) inputs; K/V may have fewer heads (Hq % Hk == 0)."""
    block_mask = None
    if is_causal:
        # Rebuilt per call: the lengths (and, under torch.compile with dynamic shapes, their symbols) are
        # the call's own, so no cached mask can be stale.
        block_mask = create_block_mask(causal_mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3])
