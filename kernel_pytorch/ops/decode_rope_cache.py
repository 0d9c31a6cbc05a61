"""A decode step's RoPE and KV-cache write in one launch.

    q_rot = decode_rope_cache(q, k, v, cos, sin, k_cache, v_cache, cache_position)
    # does what these do
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    k_cache.index_copy_(2, cache_position, k_rot)
    v_cache.index_copy_(2, cache_position, v)

q, k and v are (B, H, S, D) views (the heads of a fused q/k/v projection's output, read in place), the caches
(B, Hkv, L, D) with unit feature stride, ``cache_position`` (S,) the slots the S new tokens take. One program
per (b, h, s) row of q, then of k: a q row is rotated into the contiguous output, a k row rotated into its
cache slot and the v row of the same index copied into its slot. At batch 1 that is 20-40 rows: one short
launch where the unfused ops take four (the table's copy, RoPE, two index copies).

Rotate-half RoPE (Llama, Qwen, Mistral, Gemma) over the first R = cos.shape[-1] features, the rest passed
through, with :mod:`~kernel_pytorch.ops.rope`'s numerics: fp32 math, one rounding to q's dtype. Inference only.
Off CUDA, the unfused ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernel_pytorch.ops import triton_utils as tu
from kernel_pytorch.ops.programmatic_launch import pdl_arguments, wait_for_previous_grid
from kernel_pytorch.ops.rope import apply_rope
from kernel_pytorch.ops.triton_utils import tl

__all__ = ["decode_rope_cache", "rope_cache_fwd"]


@tu.jit
def _rope_cache_kernel(
    Q, K, V, QO, KC, VC, COS, SIN, POS,
    n_q_rows, heads_q, heads_k, seq,
    sq0, sq1, sq2, sk0, sk1, sk2, sv0, sv1, sv2, skc0, skc1, skc2, svc0, svc1, svc2, sc0, sc2,
    head_dim, half,
    HAS_PASS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Program r < n_q_rows: q row r = (b, h, s) -> QO row r. Else k row (b, h, s) -> KC[b, h, POS[s]], and
    V's row -> VC[b, h, POS[s]]. cos / sin rows at b * sc0 + s * sc2 (broadcast over heads). PDL: see
    ops/programmatic_launch.py."""
    wait_for_previous_grid(PDL)
    row = tl.program_id(0)
    is_q = row < n_q_rows
    r = tl.where(is_q, row, row - n_q_rows).to(tl.int64)
    heads = tl.where(is_q, heads_q, heads_k)
    s = r % seq
    h = (r // seq) % heads
    b = r // (seq * heads)
    slot = tl.load(POS + s).to(tl.int64)
    if is_q:
        src = Q + b * sq0 + h * sq1 + s * sq2
        dst = QO + r * head_dim
    else:
        src = K + b * sk0 + h * sk1 + s * sk2
        dst = KC + b * skc0 + h * skc1 + slot * skc2
    cols = tl.arange(0, BLOCK_H)
    mask = cols < half
    table = b * sc0 + s * sc2
    x_a = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    x_b = tl.load(src + half + cols, mask=mask, other=0.0).to(tl.float32)
    cos_a = tl.load(COS + table + cols, mask=mask, other=0.0).to(tl.float32)
    cos_b = tl.load(COS + table + half + cols, mask=mask, other=0.0).to(tl.float32)
    sin_a = tl.load(SIN + table + cols, mask=mask, other=0.0).to(tl.float32)
    sin_b = tl.load(SIN + table + half + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + cols, (x_a * cos_a - x_b * sin_a).to(QO.dtype.element_ty), mask=mask)
    tl.store(dst + half + cols, (x_b * cos_b + x_a * sin_b).to(QO.dtype.element_ty), mask=mask)
    if HAS_PASS:  # features 2 * half .. head_dim: copied
        pcols = 2 * half + tl.arange(0, BLOCK_P)
        pmask = pcols < head_dim
        tl.store(dst + pcols, tl.load(src + pcols, mask=pmask), mask=pmask)
    if not is_q:
        all_cols = tl.arange(0, BLOCK_D)
        vmask = all_cols < head_dim
        value = tl.load(V + b * sv0 + h * sv1 + s * sv2 + all_cols, mask=vmask)
        tl.store(VC + b * svc0 + h * svc1 + slot * svc2 + all_cols, value, mask=vmask)


def _table_4d(table: Tensor, like: Tensor) -> Tensor:
    """cos or sin expanded (stride 0) to (B, 1, S, R) for q's (B, H, S, D)."""
    table = table[(None,) * (4 - table.dim())] if table.dim() < 4 else table
    return table.expand(like.shape[0], table.shape[1], like.shape[2], table.shape[-1])


def _usable(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    tensors = (q, k, v, k_cache, v_cache)
    return (tu.use_triton(q) and all(t.dim() == 4 and t.stride(-1) == 1 and t.dtype == q.dtype for t in tensors)
            and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= q.shape[-1] and cos.dim() <= 4
            and (cos.dim() < 4 or cos.shape[1] == 1))


def rope_cache_fwd(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                   cache_position: Tensor) -> Tensor:
    """The Triton launch (arguments as :func:`decode_rope_cache` takes them): the rotated q, the caches written."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cos4, sin4 = _table_4d(cos, q), _table_4d(sin, q)
    if cos4.stride() != sin4.stride() or cos4.stride(-1) != 1:  # the kernel reads both with cos's strides
        cos4, sin4 = cos4.contiguous(), sin4.contiguous()
    batch, heads_q, seq, head_dim = q.shape
    heads_k = k.shape[1]
    rotary = cos.shape[-1]
    n_q_rows = batch * heads_q * seq
    with tu.device_guard(q):
        tu.launch(_rope_cache_kernel)[(n_q_rows + batch * heads_k * seq,)](
            q, k, v, out, k_cache, v_cache, cos4, sin4, cache_position, n_q_rows, heads_q, heads_k, seq,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            cos4.stride(0), cos4.stride(2), head_dim, rotary // 2, HAS_PASS=rotary < head_dim,
            BLOCK_H=tu.next_power_of_2(rotary // 2), BLOCK_P=tu.next_power_of_2(max(head_dim - rotary, 1)),
            BLOCK_D=tu.next_power_of_2(head_dim), num_warps=1, **pdl_arguments(q))
    return out


@torch.library.triton_op("kernel_pytorch::decode_rope_cache", mutates_args=("k_cache", "v_cache"))
def _decode_rope_cache_op(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                          v_cache: Tensor, cache_position: Tensor) -> Tensor:
    if _usable(q, k, v, cos, k_cache, v_cache):
        return rope_cache_fwd(q, k, v, cos, sin, k_cache, v_cache, cache_position)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    k_cache.index_copy_(2, cache_position, k_rot)
    v_cache.index_copy_(2, cache_position, v)
    return q_rot


def decode_rope_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                      cache_position: Tensor) -> Tensor:
    """RoPE of q and k (rotate-half) with k and v written into the caches at ``cache_position`` along dim 2; returns
    the rotated q (module docstring). q, k, v: (B, H, S, D); caches (B, Hkv, L, D); cos / sin broadcast to
    (B, 1, S, R). Inference only.

    >>> q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    >>> cos, sin = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    >>> k_cache, v_cache = torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16)
    >>> decode_rope_cache(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([3])).shape
    torch.Size([1, 4, 1, 16])
    """
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or k_cache.shape[:2] != k.shape[:2]:
        raise ValueError(f"decode_rope_cache: k {tuple(k.shape)}, v {tuple(v.shape)} and the cache "
                         f"{tuple(k_cache.shape)} disagree")
    return _decode_rope_cache_op(q, k, v, cos, sin, k_cache, v_cache, cache_position)
