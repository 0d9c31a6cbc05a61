"""PyTorch's private fused SDPA kernels (cuDNN, flash, memory-efficient, CPU flash), called directly: the
forward and backward entry points of their records, which the ``kernel_pytorch::attention_fwd`` /
``attention_bwd`` custom ops of :mod:`kernel_pytorch.ops.attention` call.

Inputs are 4-D (B, H, L, E), K/V already repeated per query head for kernels without native GQA, the mask
additive and 4-D. Forward: ``(q, k, v, attn_mask, dropout_p, is_causal, scale, compute_log_sumexp) ->
(out, lse, rng_a, rng_b)``, the dropout RNG state as the kernel returned it (``None`` when it returns none).
Backward: ``(grad_out, q, k, v, attn_mask, out, lse, rng_a, rng_b, dropout_p, is_causal, scale, mask_grad)
-> (dq, dk, dv, grad_mask)``, ``grad_mask`` (B, Hq, Lq, Lk) from the efficient kernel, else ``None``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["in_strides_of", "sdpa_dispatch_without_cudnn", "cudnn_forward", "cudnn_backward", "flash_forward",
           "flash_backward", "efficient_forward", "efficient_backward", "cpu_flash_forward", "cpu_flash_backward",
           "efficient_bias"]


def efficient_bias(attn_mask: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """SDPA's preprocess_mask: the efficient kernel takes the bias only as (B, H, Lq, Lk) (expanded views
    are fine) with every stride but the last a multiple of 8 ("attn_bias is not correctly aligned"
    otherwise). A misaligned mask is copied, its broadcast dims left at size 1, into a buffer whose rows
    are padded to a multiple of 8, sliced back to Lk and expanded."""
    if attn_mask is None:
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    bias = attn_mask.expand(shape)
    if bias.stride(-1) == 1 and all(stride % 8 == 0 for stride in bias.stride()[:-1]):
        return bias
    seq_k = shape[-1]
    materialized = bias[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in bias.stride()[:-1])]
    return F.pad(materialized, (0, 8 - seq_k % 8))[..., :seq_k].expand(shape)


def cpu_flash_forward(q, k, v, attn_mask, dropout_p, is_causal, scale, compute_log_sumexp):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out, lse, None, None


def cpu_flash_backward(grad_out, q, k, v, attn_mask, out, lse, rng_a, rng_b, dropout_p, is_causal, scale, mask_grad):
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return dq, dk, dv, None


def flash_forward(q, k, v, attn_mask, dropout_p, is_causal, scale, compute_log_sumexp):
    # -> (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask);
    # cum_seq_* are None for dense (non-nested) inputs.
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False,  # return_debug_mask
        scale=scale)
    return out, lse, seed, offset


def flash_backward(grad_out, q, k, v, attn_mask, out, lse, rng_a, rng_b, dropout_p, is_causal, scale, mask_grad):
    max_q, max_k = q.shape[2], k.shape[2]  # the padded-batch sequence lengths; dense inputs: the lengths
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse,
        None, None,  # cum_seq_q, cum_seq_k: undefined selects the dense (non-varlen) kernel
        max_q, max_k, dropout_p, is_causal,
        rng_a, rng_b,  # "philox_seed, philox_offset": the forward's (rng_state, unused)
        scale=scale)
    return dq, dk, dv, None


def cudnn_forward(q, k, v, attn_mask, dropout_p, is_causal, scale, compute_log_sumexp):
    out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, attn_mask, compute_log_sumexp, dropout_p, is_causal, False,  # return_debug_mask
        scale=scale)
    return out, lse, seed, offset


def in_strides_of(grad_out: Tensor, out: Tensor) -> Tensor:
    """``grad_out`` with exactly ``out``'s strides (a copy only when they differ; ``out`` is dense).

    PyTorch caches the cuDNN backward plan by q/k/v's strides alone, and the plan fixes grad_out's strides
    too (torch 2.11, aten/src/ATen/native/cudnn/MHA.cpp): a call whose grad_out is laid out otherwise than
    the call that built the plan gets wrong gradients (docs/attention.md, "cuDNN's backward plan cache").
    The output's strides follow q's, which are in the key, so passing grad_out in them always is safe."""
    if grad_out.stride() == out.stride():
        return grad_out
    return torch.empty_like(out, dtype=grad_out.dtype).copy_(grad_out)


def sdpa_dispatch_without_cudnn() -> Any:
    """A context in which PyTorch's SDPA dispatch leaves its cuDNN kernel out (flash, efficient or math run
    instead). optimize's checks run the model's graphs in it: a graph whose SDPA calls were not rewritten
    may hand the cuDNN backward an output gradient laid out otherwise than the optimized model's own calls,
    and the plan that builds would be reused by theirs (see :func:`in_strides_of`). The "cudnn" kernel,
    called directly, is unaffected."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def cudnn_backward(grad_out, q, k, v, attn_mask, out, lse, rng_a, rng_b, dropout_p, is_causal, scale, mask_grad):
    max_q, max_k = q.shape[2], k.shape[2]
    grad_out = in_strides_of(grad_out, out)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse, rng_a, rng_b,
        attn_mask,  # declared `Tensor attn_bias` (not optional); None passes an undefined tensor
        None, None,  # cum_seq_q, cum_seq_k, as for flash
        max_q, max_k, dropout_p, is_causal, scale=scale)
    return dq, dk, dv, None


def efficient_forward(q, k, v, attn_mask, dropout_p, is_causal, scale, compute_log_sumexp):
    # logsumexp comes padded to a multiple of 32 queries (empty without compute_log_sumexp)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, efficient_bias(attn_mask, q, k), compute_log_sumexp, dropout_p, is_causal, scale=scale)


def efficient_backward(grad_out, q, k, v, attn_mask, out, lse, rng_a, rng_b, dropout_p, is_causal, scale, mask_grad):
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, k, v,
        efficient_bias(attn_mask, q, k),  # `Tensor attn_bias` here too; None when there is no mask
        out, lse, rng_a, rng_b, dropout_p,
        [True, True, True, mask_grad],  # grad_input_mask: which of q, k, v, attn_bias to differentiate
        is_causal, scale=scale)
