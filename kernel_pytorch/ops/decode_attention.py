"""Attention of one new token per sequence against a KV cache ("flash-decoding"), as a ``torch.library`` op
with a split-KV Triton kernel.

    out[b, h] = softmax(q[b, h] · K[b, h // G]ᵀ · scale + mask[b, h]) · V[b, h // G]      q: (B, Hq, 1, D)

``K`` and ``V`` are the cache as it is, ``(B, Hkv, L, D)`` with ``G = Hq / Hkv`` query heads per cache head
(GQA): nothing is expanded to ``Hq`` heads. What a decode step of transformers' SDPA path does instead
(``repeat_kv``, then SDPA) copies the whole cache once per layer and token, more bytes than the attention
itself reads.

Why a kernel of our own: at batch 1 the ``B·Hkv`` (query-head-group) programs of a plain kernel would leave
most of the GPU idle, so the cache length is split over programs too (``SPLITS`` per group, each keeping a
running max, sum and weighted values in float32), and a second launch combines the splits. Each program
holds its ``G`` query heads together, so a cache block is read once for all of them. A block whose mask
hides every position is not read at all: a static cache of 4k positions holding 600 tokens reads 600.

Masks: None, a bool mask (True = attend) or an additive float mask, broadcastable to ``(B, Hq, 1, L)``
(read through broadcast strides). Additive values below ``-1e30`` (``-inf``, ``finfo.min``) count as
masked. A row with every position masked gives zeros (PyTorch's SDPA gives zeros for an all-``False`` bool
mask too, a uniform average for an all-``finfo.min`` additive one); a decode step's row always sees its own
token.

Numerics: scores, softmax and the weighted sum in float32; the probabilities are rounded to V's dtype
before the product with V, as flash attention does; one rounding of the output to q's dtype.

Inference only: the op has no autograd formula (a decode step does not train); the graph pass that inserts
it (:mod:`kernel_pytorch.passes.decode_attention`) leaves training graphs alone. CPU tensors and other
devices run PyTorch's SDPA with ``enable_gqa``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernel_pytorch.ops import triton_utils as tu
from kernel_pytorch.ops.programmatic_launch import pdl_arguments, wait_for_previous_grid
from kernel_pytorch.ops.triton_utils import tl

__all__ = ["decode_attention", "decode_splits", "TRITON_DTYPES"]

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
_BLOCK_N = 64  # cache positions per loop iteration
_MAX_SPLITS = 64
# Features per combine program: a (splits x 128) float32 tile per (sequence, head) left 16 programs at batch 1 on a
# 132-SM H100 (3.6 us a launch, 151-164 registers); 32 gives 4x the programs, each reading a quarter.
_COMBINE_BLOCK_D = 32
_MASKED_BELOW = -1e30  # an additive mask value under this counts as masked (-inf, finfo.min)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(device: torch.device, kv_heads: int) -> int:
    """How many programs share one cache head's positions: enough for about two programs per SM at batch 1.
    A function of the head count only, not of the cache length or the batch, so a step compiled with
    dynamic sizes does not guard (and recompile) on them."""
    multiprocessors = _multiprocessors(device.index or 0) if device.type == "cuda" else 4
    return max(1, min(_MAX_SPLITS, tu.cdiv(2 * multiprocessors, kv_heads)))


# ------------------------------------------------------------------------------------------- kernels

@tu.jit
def _decode_split_kernel(
    Q, K, V, MASK, M_OUT, L_OUT, ACC_OUT,
    sq_b, sq_h, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_d, sm_b, sm_h, sm_n,
    kv_heads, kv_len, split_len, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_KIND: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """One (sequence, cache head, split): the running max ``m``, sum ``l`` and weighted values ``acc`` of its
    ``GROUP`` query heads over the split's positions, in the log2 domain. MASK_KIND: 0 none, 1 bool,
    2 additive. IEEE: float32 products without TF32. UPCAST: 16-bit operands multiplied in float32 (Triton's
    interpreter, whose 16-bit ``dot`` is wrong). PDL: see ops/programmatic_launch.py."""
    wait_for_previous_grid(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    b = pid // kv_heads
    kv_head = pid % kv_heads
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d, mask=g_ok[:, None] & d_ok[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = g_ok[:, None] & (n < end)[None, :]
        if MASK_KIND == 1:
            allowed = tl.load(MASK + b * sm_b + heads[:, None] * sm_h + n[None, :] * sm_n, mask=live, other=0)
            live = live & (allowed != 0)
        if MASK_KIND == 2:
            bias = tl.load(MASK + b * sm_b + heads[:, None] * sm_h + n[None, :] * sm_n, mask=live,
                           other=float("-inf")).to(tl.float32)
            live = live & (bias > -1e30)
        if tl.max(live.to(tl.int32)) > 0:  # a block the mask hides entirely is not read
            n_ok = n < end
            k = tl.load(K + b * sk_b + kv_head * sk_h + n[:, None] * sk_n + d[None, :] * sk_d,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            # V's load is issued with K's, before the scores: one memory round trip a block instead of two
            v = tl.load(V + b * sv_b + kv_head * sv_h + n[:, None] * sv_n + d[None, :] * sv_d,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = (scores * scale_log2).to(tl.float32)  # Inductor may pass the scale as a float64
            if MASK_KIND == 2:
                scores += tl.where(live, bias, 0.0) * 1.4426950408889634  # masked: -inf below anyway
            scores = tl.where(live, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if UPCAST:
                p = p.to(v.dtype).to(tl.float32)  # the rounding the GPU path does, then a float32 product
                v = v.to(tl.float32)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    row = (b * kv_heads * GROUP + heads) * num_splits + split  # partials laid out (B, Hq, SPLITS)
    tl.store(M_OUT + row, m_i, mask=g_ok)
    tl.store(L_OUT + row, l_i, mask=g_ok)
    tl.store(ACC_OUT + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@tu.jit
def _decode_combine_kernel(M_IN, L_IN, ACC_IN, OUT, so_b, so_h, so_d, q_heads, num_splits,
                           HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One (sequence, query head) and ``BLOCK_D`` of its features: the splits' partials weighed by
    ``2^(m_s - max m)``, normalized once."""
    wait_for_previous_grid(PDL)
    pid = tl.program_id(0)
    b = pid // q_heads
    h = pid % q_heads
    s = tl.arange(0, BLOCK_S)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    d_ok = d < HEAD_DIM
    m = tl.load(M_IN + pid * num_splits + s, mask=s_ok, other=float("-inf"))
    lsum = tl.load(L_IN + pid * num_splits + s, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denominator = tl.sum(weight * lsum, 0)
    acc = tl.load(ACC_IN + (pid * num_splits + s[:, None]) * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(denominator == 0.0, 1.0, denominator)
    tl.store(OUT + b * so_b + h * so_h + d * so_d, out.to(OUT.dtype.element_ty), mask=d_ok)


# ------------------------------------------------------------------------------------------ launchers

def decode_fwd(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """The two Triton launches (module docstring)."""
    batch, q_heads, _, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    splits = decode_splits(q.device, kv_heads)
    # Positions per split: a whole number of blocks, from sizes alone (no guard on the cache length).
    split_len = (kv_len + splits * _BLOCK_N - 1) // (splits * _BLOCK_N) * _BLOCK_N
    partial = q.new_empty((batch * q_heads * splits,), dtype=torch.float32)
    sums = torch.empty_like(partial)
    acc = q.new_empty((batch * q_heads * splits * head_dim,), dtype=torch.float32)
    out = q.new_empty((batch, q_heads, 1, head_dim))
    mask_kind, mask_arg, mask_strides = _mask_operand(mask, q, kv_len)
    block_g, block_d = max(16, tu.next_power_of_2(group)), max(16, tu.next_power_of_2(head_dim))
    with tu.device_guard(q):
        tu.launch(_decode_split_kernel)[(batch * kv_heads, splits)](
            q, k, v, mask_arg, partial, sums, acc,
            q.stride(0), q.stride(1), q.stride(3), *_strides(k), *_strides(v), *mask_strides,
            kv_heads, kv_len, split_len, scale * _LOG2E,
            GROUP=group, HEAD_DIM=head_dim, MASK_KIND=mask_kind, IEEE=q.dtype == torch.float32,
            UPCAST=q.device.type != "cuda",
            BLOCK_G=block_g, BLOCK_N=_BLOCK_N, BLOCK_D=block_d, num_warps=4, **pdl_arguments(q))
        combine_d = min(block_d, _COMBINE_BLOCK_D)
        tu.launch(_decode_combine_kernel)[(batch * q_heads, tu.cdiv(head_dim, combine_d))](
            partial, sums, acc, out, out.stride(0), out.stride(1), out.stride(3), q_heads, splits,
            HEAD_DIM=head_dim, BLOCK_S=max(2, tu.next_power_of_2(splits)), BLOCK_D=combine_d, num_warps=4,
            **pdl_arguments(q))
    return out


def _strides(cache: Tensor) -> tuple:
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)


def _mask_operand(mask: Optional[Tensor], q: Tensor, kv_len) -> tuple[int, Tensor, tuple]:
    """(MASK_KIND, the tensor to pass, its batch/head/position strides; 0 along broadcast dims)."""
    if mask is None:
        return 0, tu.unused_pointer(q), (0, 0, 0)
    expanded = mask.expand(q.shape[0], q.shape[1], 1, kv_len)  # a view: broadcast dims get stride 0
    kind = 1 if mask.dtype == torch.bool else 2
    return kind, expanded, (expanded.stride(0), expanded.stride(1), expanded.stride(3))


def decode_native(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """PyTorch's SDPA on the unexpanded cache (``enable_gqa``): the path off CUDA, and the reference."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    # enable_gqa=True also for equal head counts (then a no-op): no comparison of sizes that may be symbolic
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _use_triton(q: Tensor, k: Tensor) -> bool:
    return tu.use_triton(q) and q.dtype in TRITON_DTYPES and k.dtype == q.dtype


# ------------------------------------------------------------------------------------------ custom op
# ``triton_op``, as in rope.py: under torch.compile Inductor traces the body and calls the kernels from its
# generated code (and a CUDA graph captures them like any other launch).

@torch.library.triton_op("kernel_pytorch::decode_attention", mutates_args=())
def _decode_attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    forward = decode_fwd if _use_triton(q, k) else decode_native
    return forward(q, k, v, mask, scale)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
                     scale: Optional[float] = None) -> Tensor:
    """Attention of one query token per sequence and head against a KV cache (module docstring).

    ``q`` (B, Hq, 1, D); ``k``, ``v`` (B, Hkv, L, D) with Hq a multiple of Hkv, any strides; ``mask`` None,
    bool (True = attend) or additive, broadcastable to (B, Hq, 1, L); ``scale`` defaults to ``D ** -0.5``.
    Returns (B, Hq, 1, D) in q's dtype. Inference only (no gradient).

    >>> q, k, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 300, 64), torch.randn(1, 2, 300, 64)
    >>> decode_attention(q, k, v, torch.arange(300) < 120).shape   # 120 cached tokens of 300
    torch.Size([1, 8, 1, 64])
    """
    _check(q, k, v)
    return _decode_attention_op(q, k, v, mask, float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]))


def _check(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"decode_attention takes one query token per head, q of shape (B, H, 1, D); "
                         f"got {tuple(q.shape)}")
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"decode_attention: k and v must be (B, Hkv, L, D) like q (B, H, 1, D); "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"decode_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} cache heads")
