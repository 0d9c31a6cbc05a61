"""The ``"flex"`` attention kernel: PyTorch's FlexAttention with a causal or block-sparse ``BlockMask``, or none.

``flex_attention`` is called directly, not through a custom op: it is a higher-order op that Dynamo and
AOTAutograd trace (and differentiate) natively, and that Inductor lowers to its fused Triton template
(forward and backward) when the graph is compiled, which is how ``optimize()`` runs graphs on GPUs. Run
eagerly, ``flex_attention`` is PyTorch's unfused reference: correct, but it materializes the (Lq, Lk)
scores, so it is slow and memory-hungry; the dispatcher measures it compiled, and never picks it unmeasured,
and a call outside torch.compile on a GPU (a verification run of a rewritten graph) runs it compiled on its own.

What it computes here is exactly SDPA's (the dispatcher keeps everything else away):

* ``is_causal`` as the pattern ``("band", 0, None)``: ``q_idx >= kv_idx``, top-left aligned (SDPA's
  convention), broadcast over batch and heads; its BlockMask, like every band's, comes from its tiles' corners
  (:mod:`~kernel_pytorch.attention.kernels.band_blocks`).
* ``scale`` (``None``: 1/sqrt(E)) and GQA (Hq a multiple of Hk) are FlexAttention's own arguments.
* A **mask pattern** instead of a mask tensor (what the attention pass recognized, see
  :mod:`kernel_pytorch.passes.mask_pattern`), a tuple of plain values so a graph can carry it:
  ``("band", lo, hi)``: key j is seen by query i iff ``lo <= i - j <= hi`` (``None``: unbounded), e.g.
  causal sliding window w is ``("band", 0, w - 1)``; ``("document", lo, hi)``: the same band and
  ``doc[b, i] == doc[b, j]`` for a per-token document-id tensor ``doc`` (B, L); ``("blocks",)``: a bool
  (Bm, Hm, Lq, Lk) tensor of allowed positions read in the ``mask_mod`` (any block structure). The
  ``BlockMask`` (which 128x128 tiles to visit) is built once per (pattern, lengths, device, tensor state)
  and cached, so every layer and every later call with the same lengths reuses it; under torch.compile the
  construction is traced into the graph instead (its tensors are fake there; the cache holds real ones).
  ``("topk", topk, keep_ratio, local_blocks, sink_blocks, block)`` is content-aware (an approximation,
  combinable with ``is_causal``): the key blocks are chosen per call from q and k
  (:mod:`kernel_pytorch.attention.kernels.topk_sparse`), so nothing is cached.
* ``softcap`` (Gemma-2's soft-capping of the scores, ``cap * tanh(score / cap)`` after the scale, before
  the mask) as the ``score_mod`` (:mod:`kernel_pytorch.attention.kernels.softcap`).
* No attention-mask tensor and no dropout: FlexAttention has no dropout, and a mask tensor read by a
  ``score_mod`` is slower than the fused SDPA kernels that take a bias (see ``dispatch``).

Limits found in torch 2.13's source (``torch/_inductor/kernel/flex/flex_attention.py`` and
``common.py``, ``torch/nn/attention/flex_attention.py``): the GPU template needs E and Ev >= 16
("tl.dot does not support embedding size less than 16"); head dims that are not powers of two are
padded to the next power of two with masked loads (``SAFE_HEAD_DIM=False``), correct but wasteful;
Inductor's default block configs are tuned for head dims <= 256. On the CPU, FlexAttention runs forward
only ("FlexAttention does not support backward on CPU", raised by ``flex_attention`` itself): there,
when gradients are needed, the pattern's ``mask_mod`` is evaluated densely (``create_mask``) and SDPA's
math runs with it: the same mask, PyTorch's reference path, differentiable.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._guards import active_fake_mode
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask, flex_attention

from kernel_pytorch.attention.kernels.band_blocks import FLEX_BLOCK_SIZE, band_block_mask
from kernel_pytorch.attention.kernels.softcap import softcap_score_mod, softcapped_attention_math
from kernel_pytorch.attention.kernels.topk_sparse import TOPK_PATTERN_KIND, topk_attention, topk_options
from kernel_pytorch.timing import measurement_compiles

__all__ = ["flex_attention_forward", "pattern_mask_mod", "pattern_block_mask", "CAUSAL_PATTERN",
           "PATTERN_KINDS", "FLEX_MIN_HEAD_DIM", "FLEX_MAX_HEAD_DIM", "FLEX_BLOCK_SIZE"]

PATTERN_KINDS = ("band", "document", "blocks")
CAUSAL_PATTERN = ("band", 0, None)  # SDPA's is_causal: query i sees keys 0..i
# BlockMasks kept per process: one per (pattern, lengths, device, tensor state); a model serves a few
# lengths at once, and each entry holds O((L/128)^2) ints.
_BLOCK_MASK_CACHE_ENTRIES = 64
_BLOCK_MASKS: "OrderedDict[tuple, BlockMask]" = OrderedDict()
_FUSED_FLEX: Optional[Callable[..., Tensor]] = None  # made on first use (_fused_flex_attention)

# Inductor's flex template raises NotImplementedError below 16 (tl.dot's minimum K); above 256 it falls
# back to small untuned blocks that may not fit shared memory (not measured), so the dispatcher stops there.
FLEX_MIN_HEAD_DIM = 16
FLEX_MAX_HEAD_DIM = 256


def _band(lo: Optional[int], hi: Optional[int]) -> Callable[[Tensor, Tensor], Optional[Tensor]]:
    """``lo <= q - kv <= hi`` as a function of the index tensors (None: no condition at all)."""
    def allowed(q_idx: Tensor, kv_idx: Tensor) -> Optional[Tensor]:
        distance = q_idx - kv_idx
        low = None if lo is None else distance >= lo
        high = None if hi is None else distance <= hi
        if low is None or high is None:
            return low if high is None else high
        return low & high
    return allowed


def pattern_mask_mod(pattern: tuple, tensor: Optional[Tensor]) -> Callable[..., Tensor]:
    """The FlexAttention ``mask_mod`` of a mask pattern (module docstring); ``tensor`` is the document ids
    (B, L) for ``"document"``, the allowed positions (Bm, Hm, Lq, Lk) for ``"blocks"``, else None."""
    kind = pattern[0]
    if kind not in PATTERN_KINDS:
        raise ValueError(f"unknown mask pattern {pattern!r}; kinds: {', '.join(PATTERN_KINDS)}")
    if kind == "blocks":
        if tensor is None or tensor.dim() != 4 or tensor.dtype != torch.bool:
            raise ValueError("a 'blocks' mask pattern needs a 4-D bool tensor of allowed positions")
        per_batch, per_head = tensor.shape[0] > 1, tensor.shape[1] > 1

        def blocks(b, h, q_idx, kv_idx):
            return tensor[b if per_batch else 0, h if per_head else 0, q_idx, kv_idx]
        return blocks
    band = _band(pattern[1], pattern[2])
    if kind == "band":
        def banded(b, h, q_idx, kv_idx):
            allowed = band(q_idx, kv_idx)
            return (q_idx >= 0) if allowed is None else allowed  # no bound at all: every position
        return banded
    if tensor is None or tensor.dim() != 2:
        raise ValueError("a 'document' mask pattern needs the (B, L) document ids")
    per_batch = tensor.shape[0] > 1

    def document(b, h, q_idx, kv_idx):
        ids = tensor[b if per_batch else 0]
        same = ids[q_idx] == ids[kv_idx]
        allowed = band(q_idx, kv_idx)
        return same if allowed is None else same & allowed
    return document


def _mask_batch_heads(pattern: tuple, tensor: Optional[Tensor]) -> tuple[Optional[int], Optional[int]]:
    """BlockMask's B and H: None (broadcast) unless the pattern's tensor varies along them."""
    if tensor is None or pattern[0] == "band":
        return None, None
    batch = tensor.shape[0] if tensor.shape[0] > 1 else None
    heads = tensor.shape[1] if pattern[0] == "blocks" and tensor.shape[1] > 1 else None
    return batch, heads


def _tracing(*tensors: Tensor) -> bool:
    """Under torch.compile, or on fake/functional tensors: build in the graph, never touch the cache.

    Neither ``torch.compiler.is_compiling()`` nor ``detect_fake_mode()``: inside a Dynamo backend, where
    optimize verifies a rewritten graph on real tensors, both say yes (the tracing context is still
    open), and every verification call ran FlexAttention eagerly, unfused. AOTAutograd's traces run
    on fake or functional tensors, which the tensors' types and the active fake mode show."""
    return torch.compiler.is_dynamo_compiling() or active_fake_mode() is not None or any(
        type(t) is not torch.Tensor for t in tensors if t is not None)


def pattern_block_mask(pattern: tuple, tensor: Optional[Tensor], lq: int, lk: int, device: torch.device) -> BlockMask:
    """The BlockMask of ``pattern`` for ``lq`` x ``lk`` scores, cached per (pattern, lengths, device and
    the tensor's identity and version: an in-place edit bumps ``_version``, so it is rebuilt)."""
    if _tracing(tensor):
        return _built_block_mask(pattern, tensor, lq, lk, device)
    state = None if tensor is None else (tensor.data_ptr(), tensor._version, tuple(tensor.shape), tensor.dtype)
    key = (pattern, int(lq), int(lk), str(device), state)
    block_mask = _BLOCK_MASKS.get(key)
    if block_mask is None:
        block_mask = _built_block_mask(pattern, tensor, lq, lk, device)
        if len(_BLOCK_MASKS) >= _BLOCK_MASK_CACHE_ENTRIES:
            _BLOCK_MASKS.popitem(last=False)
        _BLOCK_MASKS[key] = block_mask
    else:
        _BLOCK_MASKS.move_to_end(key)
    return block_mask


def _built_block_mask(pattern: tuple, tensor: Optional[Tensor], lq, lk, device) -> BlockMask:
    """A band's BlockMask from its tiles' corners (:mod:`.band_blocks`); any other pattern's from its
    ``mask_mod`` evaluated at every position."""
    mask_mod = pattern_mask_mod(pattern, tensor)
    if pattern[0] == "band":
        return band_block_mask(pattern[1], pattern[2], lq, lk, device, mask_mod)
    return create_block_mask(mask_mod, *_mask_batch_heads(pattern, tensor), lq, lk, device=device)


def _math_reference(q: Tensor, k: Tensor, v: Tensor, mask_mod: Callable[..., Tensor], batch: Optional[int],
                    heads: Optional[int], scale: Optional[float], softcap: Optional[float] = None) -> Tensor:
    """SDPA's math on the dense evaluation of ``mask_mod``: the CPU path when gradients are needed."""
    dense = create_mask(mask_mod, batch or 1, heads or 1, q.shape[-2], k.shape[-2], device=q.device)
    gqa = q.shape[-3] != k.shape[-3]
    if softcap is not None:
        return softcapped_attention_math(q, k, v, dense, 0.0, False, scale=scale, enable_gqa=gqa, softcap=softcap)
    return F.scaled_dot_product_attention(q, k, v, dense, scale=scale, enable_gqa=gqa)


def flex_attention_forward(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: Optional[float],
                           pattern: Optional[tuple] = None, pattern_tensor: Optional[Tensor] = None,
                           softcap: Optional[float] = None) -> Tensor:
    """``flex_attention`` on 4-D (B, H, L, E) inputs; K/V may have fewer heads (Hq % Hk == 0); ``pattern``
    (with ``pattern_tensor``) is a mask pattern (module docstring), exclusive with ``is_causal`` except the
    content-aware ``("topk", ...)``; ``softcap`` caps the scores (``score_mod``)."""
    if pattern is not None and pattern[0] == TOPK_PATTERN_KIND:  # content-aware: chosen from q and k per call
        if softcap is not None:
            raise ValueError("top-k sparse attention has no soft cap")
        return topk_attention(q, k, v, is_causal=is_causal, scale=scale, **topk_options(pattern))
    if pattern is not None and is_causal:
        raise ValueError("a mask pattern and is_causal are exclusive (causal is the pattern ('band', 0, None))")
    block_mask = None
    pattern = CAUSAL_PATTERN if is_causal else pattern
    if pattern is not None:
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if q.device.type == "cpu" and needs_grad:  # FlexAttention has no CPU backward (module docstring)
            return _math_reference(q, k, v, pattern_mask_mod(pattern, pattern_tensor),
                                   *_mask_batch_heads(pattern, pattern_tensor), scale, softcap)
        block_mask = pattern_block_mask(pattern, pattern_tensor, q.shape[-2], k.shape[-2], q.device)
    score_mod = None if softcap is None else softcap_score_mod(softcap)
    options = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3])
    if q.device.type == "cpu" or _tracing(q, k, v):
        return flex_attention(q, k, v, **options)
    with measurement_compiles():  # compiled inside optimize's capture: its lock and recompile limits
        return _fused_flex_attention()(q, k, v, **options)


def _fused_flex_attention() -> Callable[..., Tensor]:
    """``flex_attention`` compiled on its own, for calls outside ``torch.compile`` on a GPU (the verification's runs
    of a rewritten graph, ``optimize(compile=False)``): eagerly it is PyTorch's unfused reference, which
    materializes the (B, H, Lq, Lk) scores (17 GiB of float32 per layer for 16 heads at 16384 tokens) and is
    another kernel than the compiled graphs run; compiled it is the fused Triton kernel, forward and backward."""
    global _FUSED_FLEX
    if _FUSED_FLEX is None:
        _FUSED_FLEX = torch.compile(flex_attention)
    return _FUSED_FLEX
