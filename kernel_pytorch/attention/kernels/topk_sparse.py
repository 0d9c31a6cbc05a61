"""Content-aware (top-k) block-sparse attention: per query block, the key blocks with the largest pooled
q·k scores, plus the first ("sink") and the nearest ("local") blocks, run by FlexAttention.

An **approximation** of attention for long-context inference (issue 7), chosen by the user with
``OptimizeConfig(sparse_attention=...)``; it never replaces attention on its own, and
:func:`topk_relative_error` measures what it costs against dense attention on given inputs.

How the blocks are chosen, per (batch, query head, query block of ``block`` tokens):

1. q and k are mean-pooled over their ``block``-token blocks (the last, shorter block over its own
   tokens), in float32 (float64 for float64 inputs); K is repeated over its query-head group (GQA: each
   query head chooses its own blocks, the choice costs (Lq/block) x (Lk/block) dot products per head).
2. Block score = pooled_q · pooled_kᵀ x scale. Under ``is_causal`` the blocks after the diagonal are
   not candidates (query i sees keys 0..i, top-left aligned as SDPA).
3. The first ``sink_blocks`` key blocks (attention sinks: the first tokens take much of the probability
   mass in trained LLMs) and the ``local_blocks`` blocks ending at the diagonal (``|i - j| < local`` when
   not causal) are always kept; on top of them, the best-scoring other blocks (ties: the lower block
   index): ``topk`` of them per query block row, or ``ceil(keep_ratio x n)`` where n is the number of key
   blocks the row may see (with causal masking: the fraction of the row's causal blocks), as many as
   there are.

The selection is a dense (B, Hq, Lq/block, Lk/block) boolean (about 1M entries at 32k x 16 heads): from
it the ``BlockMask`` is built directly (``BlockMask.from_kv_blocks``): a selected block that lies before
the diagonal and inside the key length is *full* (no ``mask_mod`` evaluated), the diagonal block under
causal and a last, shorter key block are *partial*. The ``mask_mod`` itself reads the selection (and
``q_idx >= kv_idx`` under causal), so it alone defines what is computed: eager FlexAttention (its math
reference, which evaluates the ``mask_mod`` on every position and ignores the block lists) and the fused
kernel (which visits only the listed blocks) agree. Everything is tensor code without data-dependent
Python control flow, so it traces under ``torch.compile(fullgraph=True)``; the choice is not
differentiated (it is discrete): gradients flow through the attention over the chosen blocks.

On the CPU FlexAttention runs forward only; when gradients are needed there, the same selection is
expanded to a dense (B, Hq, Lq, Lk) mask and SDPA's math runs with it (as ``flex.py`` does for patterns).

Example::

    q = torch.randn(1, 8, 4096, 64); k = v = torch.randn(1, 2, 4096, 64)
    out = topk_attention(q, k, v, is_causal=True, topk=8)   # each query block: sink, diagonal and 8 more
    error = topk_relative_error(q, k, v, is_causal=True, topk=8)
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = ["TOPK_PATTERN_KIND", "topk_pattern", "parse_topk_pattern", "select_blocks", "topk_block_mask",
           "topk_attention", "topk_options", "topk_mask", "topk_relative_error", "TOPK_ERROR_QUERY_BLOCKS"]

TOPK_PATTERN_KIND = "topk"
# Query blocks whose rows topk_relative_error compares when asked to sample (rows=...): the error of the
# sampled rows is exact for them; 16 blocks of 128 rows cost 16/(L/128) of one dense attention.
TOPK_ERROR_QUERY_BLOCKS = 16


def topk_pattern(*, topk: Optional[int] = None, keep_ratio: Optional[float] = None, local_blocks: int = 1,
                 sink_blocks: int = 1, block: int = 128) -> tuple:
    """The pattern ``attention(..., kernel="flex", pattern=...)`` takes for top-k sparsity: a tuple of plain
    values, so an FX graph can carry it: ``("topk", topk, keep_ratio, local_blocks, sink_blocks, block)``."""
    return parse_topk_pattern((TOPK_PATTERN_KIND, topk, keep_ratio, local_blocks, sink_blocks, block))


def parse_topk_pattern(pattern: tuple) -> tuple:
    """``pattern`` checked (a clear ``ValueError`` for anything else), as the tuple it is."""
    if not (isinstance(pattern, tuple) and len(pattern) == 6 and pattern[0] == TOPK_PATTERN_KIND):
        raise ValueError(f"a top-k pattern is ('topk', topk, keep_ratio, local_blocks, sink_blocks, block), "
                         f"got {pattern!r}")
    _, topk, keep_ratio, local, sink, block = pattern
    if (topk is None) == (keep_ratio is None):
        raise ValueError(f"a top-k pattern takes exactly one of topk and keep_ratio, got {pattern!r}")
    if topk is not None and not (isinstance(topk, int) and topk >= 1):
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    if keep_ratio is not None and not (isinstance(keep_ratio, float) and 0.0 < keep_ratio <= 1.0):
        raise ValueError(f"keep_ratio must be a float in (0, 1], got {keep_ratio!r}")
    for name, value in (("local_blocks", local), ("sink_blocks", sink)):
        if not (isinstance(value, int) and value >= 0):
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if not (isinstance(block, int) and block >= 16):
        raise ValueError(f"block must be an int >= 16, got {block!r}")
    return pattern


def _pooled(x: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    """(B, H, L, E) -> (B, H, ceil(L/block), E): the mean over each block's own tokens, accumulated in
    ``dtype`` while reading ``x`` once (no converted or padded copy of it: at B 2, H 16, L 16384, hd128
    those were two 268 MB fp32 copies of q and two of k per call)."""
    length = x.shape[-2]
    whole = length // block
    x = x.detach()
    means = []
    if whole:
        means.append(x[..., :whole * block, :].unflatten(-2, (whole, block)).sum(-2, dtype=dtype) / block)
    if length % block:
        means.append(x[..., whole * block:, :].sum(-2, keepdim=True, dtype=dtype) / (length % block))
    return torch.cat(means, -2) if len(means) > 1 else means[0]


def select_blocks(q: Tensor, k: Tensor, *, is_causal: bool, scale: Optional[float], topk: Optional[int] = None,
                  keep_ratio: Optional[float] = None, local_blocks: int = 1, sink_blocks: int = 1,
                  block: int = 128) -> Tensor:
    """The chosen key blocks: bool (B, Hq, ceil(Lq/block), ceil(Lk/block)) (module docstring).

    ``q`` (B, Hq, Lq, E), ``k`` (B, Hk, Lk, E) with Hq % Hk == 0; ``scale`` None is 1/sqrt(E)."""
    working = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    pooled_q, pooled_k = _pooled(q, block, working), _pooled(k, block, working)
    if pooled_k.shape[1] != pooled_q.shape[1]:
        pooled_k = pooled_k.repeat_interleave(pooled_q.shape[1] // pooled_k.shape[1], dim=1)
    scores = pooled_q @ pooled_k.transpose(-2, -1) * scale
    n_q, n_k = scores.shape[-2], scores.shape[-1]
    rows = torch.arange(n_q, device=q.device)[:, None]
    cols = torch.arange(n_k, device=q.device)[None, :]
    valid = cols <= rows if is_causal else torch.ones_like(rows >= cols)
    distance = rows - cols if is_causal else (rows - cols).abs()
    forced = ((cols < sink_blocks) | ((distance >= 0) & (distance < local_blocks))) & valid
    inf = torch.tensor(math.inf, dtype=working, device=q.device)
    ranked = torch.where(forced, inf, torch.where(valid, scores, -inf))
    order = torch.argsort(ranked, dim=-1, descending=True, stable=True)
    rank = torch.argsort(order, dim=-1, stable=True)  # rank[..., j]: the place of block j in its row's order
    if topk is not None:
        budget = torch.full_like(rows, topk)
    else:
        seen = valid.sum(-1, keepdim=True)
        budget = torch.ceil(seen.to(torch.float64) * keep_ratio).to(rows.dtype)
    # The forced blocks rank first (+inf): the scored ones after them, `budget` of them.
    return ((rank < budget + forced.sum(-1, keepdim=True)) & valid) | forced


def _select_blocks_op(q: Tensor, k: Tensor, is_causal: bool, scale: Optional[float], topk: Optional[int],
                      keep_ratio: Optional[float], local_blocks: int, sink_blocks: int, block: int) -> Tensor:
    return select_blocks(q, k, is_causal=is_causal, scale=scale, topk=topk, keep_ratio=keep_ratio,
                         local_blocks=local_blocks, sink_blocks=sink_blocks, block=block)


# The selection as a custom op, opaque to the compiler: Inductor then hands FlexAttention's mask_mod a
# realized buffer. Traced as plain ops, the selection reached Inductor's CPU flex template as an unrealized
# Pointwise node, which it cannot read (torch 2.13: "NotImplementedError: Pointwise" in
# cpp_flex_attention_template, no valid choice for flex_attention). Its cost is a few small kernels:
# pooling reads q and k once; the rest is on (B, Hq, Lq/block, Lk/block) elements.
_select_blocks = torch.library.custom_op("kernel_pytorch::topk_select_blocks", _select_blocks_op, mutates_args=())


@_select_blocks.register_fake
def _select_blocks_fake(q, k, is_causal, scale, topk, keep_ratio, local_blocks, sink_blocks, block):
    n_q, n_k = -(-q.shape[-2] // block), -(-k.shape[-2] // block)
    return q.new_empty((q.shape[0], q.shape[1], n_q, n_k), dtype=torch.bool)


def topk_mask(selected: Tensor, lq: int, lk: int, *, is_causal: bool, block: int) -> Tensor:
    """The allowed positions of a selection, bool (B, Hq, Lq, Lk) (SDPA's mask: True = attend)."""
    dense = selected.repeat_interleave(block, dim=-2)[..., :lq, :].repeat_interleave(block, dim=-1)[..., :lk]
    if is_causal:
        dense = dense & torch.ones(lq, lk, dtype=torch.bool, device=selected.device).tril()
    return dense


def topk_block_mask(selected: Tensor, lq: int, lk: int, *, is_causal: bool, block: int) -> BlockMask:
    """The FlexAttention BlockMask of a selection: full blocks before the diagonal and inside the key
    length, partial the diagonal (causal) and a last, shorter key block; the mask_mod reads the selection."""
    n_k = selected.shape[-1]
    rows = torch.arange(selected.shape[-2], device=selected.device)[:, None]
    cols = torch.arange(n_k, device=selected.device)[None, :]
    whole = (cols + 1) * block <= lk  # a key block with `block` real keys
    if is_causal:
        whole = whole & (cols < rows)  # before the diagonal: every key precedes every query of the row
    full = selected & whole
    partial = selected & ~whole

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = selected[b, h, q_idx // block, kv_idx // block]
        return allowed & (q_idx >= kv_idx) if is_causal else allowed

    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(lq, lk))


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """(num_blocks, indices) of a block bool (..., rows, cols): the selected columns of each row first, in
    ascending order (as create_block_mask lists them)."""
    as_int = dense.to(torch.int32)
    return (as_int.sum(-1).to(torch.int32),
            torch.argsort(as_int, dim=-1, descending=True, stable=True).to(torch.int32))


def topk_attention(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False, scale: Optional[float] = None,
                   topk: Optional[int] = None, keep_ratio: Optional[float] = None, local_blocks: int = 1,
                   sink_blocks: int = 1, block: int = 128) -> Tensor:
    """Top-k block-sparse attention on (B, H, L, E) inputs (K/V may have fewer heads: Hq % Hk == 0);
    FlexAttention, or on the CPU with gradients SDPA's math with the same selection (module docstring)."""
    parse_topk_pattern((TOPK_PATTERN_KIND, topk, keep_ratio, local_blocks, sink_blocks, block))
    selected = _select_blocks(q, k, is_causal, scale, topk, keep_ratio, local_blocks, sink_blocks, block)
    lq, lk = q.shape[-2], k.shape[-2]
    gqa = q.shape[-3] != k.shape[-3]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if q.device.type == "cpu" and needs_grad:  # FlexAttention has no CPU backward
        mask = topk_mask(selected, lq, lk, is_causal=is_causal, block=block)
        return F.scaled_dot_product_attention(q, k, v, mask, scale=scale, enable_gqa=gqa)
    block_mask = topk_block_mask(selected, lq, lk, is_causal=is_causal, block=block)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def topk_options(pattern: tuple) -> dict[str, Any]:
    """A top-k pattern as :func:`topk_attention`'s keyword arguments."""
    _, topk, keep_ratio, local, sink, block = parse_topk_pattern(pattern)
    return {"topk": topk, "keep_ratio": keep_ratio, "local_blocks": local, "sink_blocks": sink, "block": block}


def topk_relative_error(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False, scale: Optional[float] = None,
                        pattern: Optional[tuple] = None, query_blocks: Optional[int] = None, **kwargs: Any) -> float:
    """``||topk - dense|| / ||dense||`` of the attention output on these inputs, computed in float64 after
    each side ran in the inputs' dtype; the options as :func:`topk_attention` (or a ``pattern``).

    ``query_blocks``: compare only that many query blocks spread evenly over the length (first and last
    included): both sides are computed for those rows only (SDPA with the selection as a mask, and dense
    SDPA), so the cost is query_blocks x block rows against all keys instead of the whole attention. The
    selection is the one the full call makes (it depends on each row's own query block only)."""
    options = topk_options(pattern) if pattern is not None else kwargs
    block = options.get("block", 128)
    gqa = q.shape[-3] != k.shape[-3]
    with torch.no_grad():
        if query_blocks is None:
            approx = topk_attention(q, k, v, is_causal=is_causal, scale=scale, **options)
            exact = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)
        else:
            selected = select_blocks(q, k, is_causal=is_causal, scale=scale, **options)
            n_q = selected.shape[-2]
            chosen = torch.linspace(0, n_q - 1, min(query_blocks, n_q)).round().long().unique().tolist()
            lq, lk = q.shape[-2], k.shape[-2]
            rows = torch.cat([torch.arange(b * block, min((b + 1) * block, lq)) for b in chosen]).to(q.device)
            mask = selected[:, :, rows // block].repeat_interleave(block, dim=-1)[..., :lk]
            if is_causal:
                mask = mask & (rows[:, None] >= torch.arange(lk, device=q.device)[None, :])
            q_rows = q[..., rows, :]
            approx = F.scaled_dot_product_attention(q_rows, k, v, mask, scale=scale, enable_gqa=gqa)
            causal = (rows[:, None] >= torch.arange(lk, device=q.device)[None, :]) if is_causal else None
            exact = F.scaled_dot_product_attention(q_rows, k, v, causal, scale=scale, enable_gqa=gqa)
    approx, exact = approx.double(), exact.double()
    return float((approx - exact).norm() / exact.norm().clamp_min(1e-300))

