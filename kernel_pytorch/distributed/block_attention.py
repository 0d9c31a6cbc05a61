"""Attention of one query block against one key/value block, returning the log-sum-exp (LSE) of each
query row, and its backward given the *global* output and LSE: the per-block interface ring attention
is written against.

Why the LSE: ring attention sees one K/V block at a time; softmax over all keys is recovered by
merging block outputs weighted by ``exp(lse_block - lse_total)``. Why the backward takes the global
output and LSE: with them, each block's backward gives exactly that block's share of dQ, dK, dV
(P = exp(S - lse_total) and D = rowsum(dO * O_total) are the full softmax's), so the shares just add.

Kernels (``kernel=``):

* ``"math"``: plain torch, any device and dtype, scores in fp32 (fp64 for fp64 inputs); GQA by grouping
  the query heads of each K/V head, so K/V are never expanded. The CPU and float64 path.
* ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"cpu_flash"``: PyTorch's fused kernels, called through
  our ``kernel_pytorch::attention_fwd`` / ``attention_bwd`` custom ops (:mod:`kernel_pytorch.ops.attention`),
  which already handle GQA (native for flash/cudnn/cpu_flash, expanded for efficient) and refuse what a
  kernel would compute differently. Only the LSE layout differs per kernel; see ``_lse_from_kernel``.

Shapes: q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), Hq a multiple of Hkv; the LSE is
(B, Hq, Lq). ``causal`` masks top-left aligned (query i sees keys 0..i); ring attention uses it only on
square blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernel_pytorch.ops.attention import attention_bwd, attention_fwd

__all__ = [
    "BLOCK_KERNELS",
    "accumulation_dtype",
    "block_attention_backward",
    "block_attention_forward",
    "default_block_kernel",
]

BLOCK_KERNELS = ("math", "flash", "efficient", "cudnn", "cpu_flash")
_FUSED_KERNELS = frozenset(BLOCK_KERNELS) - {"math"}
# The efficient kernel returns its LSE padded to a multiple of 32 queries and its backward reads that
# shape (aten's meta kernel: Lq=6 -> (B, H, 32)).
_EFFICIENT_LSE_ALIGNMENT = 32


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where block outputs, LSEs and gradients are summed: fp32, or fp64 for fp64 inputs (so the float64
    tests can reach 1e-8 relative error)."""
    return torch.promote_types(dtype, torch.float32)


def default_block_kernel(q: Tensor) -> str:
    """flash for fp16/bf16 on CUDA, efficient for fp32 on CUDA (flash takes no fp32), math otherwise."""
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return "flash"
    if q.device.type == "cuda" and q.dtype == torch.float32:
        return "efficient"
    return "math"


def block_attention_forward(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float,
                            kernel: str) -> tuple[Tensor, Tensor]:
    """(output (B, Hq, Lq, Dv), lse (B, Hq, Lq)) of softmax(q k^T * scale) v over this block's keys."""
    if kernel == "math":
        return _math_forward(q, k, v, causal, scale)
    out, lse, _, _ = attention_fwd(q, k, v, None, 0.0, causal, scale, kernel, True)  # True: return the LSE
    return out, _lse_from_kernel(lse, q.shape[2])


def block_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                             causal: bool, scale: float, kernel: str) -> tuple[Tensor, Tensor, Tensor]:
    """This block's share of (dq, dk, dv), given the global ``out`` and ``lse`` of these query rows.
    dk/dv have K/V's Hkv heads."""
    if kernel == "math":
        return _math_backward(grad_out, q, k, v, out, lse, causal, scale)
    no_rng = torch.empty(0, dtype=torch.int64, device=q.device)  # no dropout: no backward reads the RNG state
    dq, dk, dv, _ = attention_bwd(grad_out, q, k, v, None, out, _lse_for_kernel(lse, kernel),
                                  no_rng, no_rng.clone(), 0.0, causal, scale, kernel, False)
    return dq, dk, dv


def _lse_from_kernel(lse: Tensor, seq_q: int) -> Tensor:
    """(B, H, Lq) from a kernel's LSE: cuDNN's is (B, H, Lq, 1), efficient's padded past Lq."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[..., :seq_q]


def _lse_for_kernel(lse: Tensor, kernel: str) -> Tensor:
    """The (B, H, Lq) LSE in the shape the kernel's backward reads (cuDNN reads any strides: its graph is
    built from the tensor's own; flash and cpu_flash take a dense (B, H, Lq)). Its dtype already is the
    kernel's: fp32, or fp64 from cpu_flash on fp64 inputs (see ``accumulation_dtype``)."""
    if kernel == "cudnn":
        return lse.unsqueeze(-1).contiguous()
    if kernel == "efficient":
        return F.pad(lse, (0, -lse.shape[-1] % _EFFICIENT_LSE_ALIGNMENT)).contiguous()
    return lse.contiguous()


# ---------------------------------------------------------------------------------------------------------
# The math path: GQA by viewing q as (B, Hkv, G, Lq, D) against K/V broadcast over G.
# ---------------------------------------------------------------------------------------------------------


def _grouped(t: Tensor, heads_kv: int) -> Tensor:
    """(B, Hq, L, E) -> (B, Hkv, G, L, E): query head h*G + g is served by K/V head h (SDPA's GQA order)."""
    return t.unflatten(1, (heads_kv, t.shape[1] // heads_kv))


def _scores(q5: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    scores = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * scale  # (B, Hkv, G, Lq, Lk)
    if causal:
        seq_q, seq_k = scores.shape[-2:]
        future = torch.ones(seq_q, seq_k, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    dtype = accumulation_dtype(q.dtype)
    heads_kv = k.shape[1]
    scores = _scores(_grouped(q.to(dtype), heads_kv), k.to(dtype), causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(dtype).unsqueeze(2))
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                   scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dtype = accumulation_dtype(q.dtype)
    heads_kv = k.shape[1]
    q5, k4, v4 = _grouped(q.to(dtype), heads_kv), k.to(dtype), v.to(dtype)
    grad5, out5 = _grouped(grad_out.to(dtype), heads_kv), _grouped(out.to(dtype), heads_kv)
    probs = torch.exp(_scores(q5, k4, causal, scale) - _grouped(lse.to(dtype), heads_kv).unsqueeze(-1))
    grad_probs = torch.matmul(grad5, v4.unsqueeze(2).transpose(-1, -2))
    # softmax backward: dS = P * (dP - rowsum(dO * O)), with the global O of these rows
    grad_scores = probs * (grad_probs - (grad5 * out5).sum(-1, keepdim=True)) * scale
    dq = torch.matmul(grad_scores, k4.unsqueeze(2)).flatten(1, 2)
    dk = torch.matmul(grad_scores.transpose(-1, -2), q5).sum(2)  # summed over the G query heads per K/V head
    dv = torch.matmul(probs.transpose(-1, -2), grad5).sum(2)
    return dq, dk, dv
