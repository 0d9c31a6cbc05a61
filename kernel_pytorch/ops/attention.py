"""Fused attention: ``attention(q, k, v, ...)`` has exactly the semantics of
``F.scaled_dot_product_attention``, with the implementation named by ``kernel=``.

``"sdpa"`` calls ``F.scaled_dot_product_attention`` (PyTorch chooses; autograd through PyTorch). The other
kernels call one of PyTorch's private fused attention kernels directly, forward and backward, wrapped as
two ``torch.library`` custom ops so rewritten graphs train and trace under ``torch.compile(fullgraph=True)``:

* ``kernel_pytorch::attention_fwd`` returns the output and what the backward needs (logsumexp, the RNG
  state of dropout); its autograd formula calls
* ``kernel_pytorch::attention_bwd``, the matching aten backward kernel (no recompute).

Both fake implementations are the real implementations run on fake tensors: every step is an aten call
with a registered meta kernel, so the fake shapes and strides (the efficient kernel's logsumexp padded to
a multiple of 32, its BLHE-strided output, ...) are the kernels' own, not hand-written rules.

What each kernel supports (the dispatcher chooses; anything unsupported raises, nothing is computed
differently from SDPA). Measured on torch 2.11 (H100, cuDNN 9.19) and, for cpu_flash, 2.11 and 2.13:

=============  ======  ===========  ==========  ===========  ===========  =============================
kernel         device  native GQA   attn_mask   mask grad    dropout      dtypes
=============  ======  ===========  ==========  ===========  ===========  =============================
``cudnn``      cuda    yes          yes         no (raises)  yes          fp16, bf16 (we raise on fp32:
                                                                          the aten kernel takes it and
                                                                          returns wrong numbers)
``flash``      cuda    yes          no (raises) --           yes          fp16, bf16 (aten raises)
``efficient``  cuda    no (expand)  yes         yes          yes          fp16, bf16, fp32
``cpu_flash``  cpu     yes          yes         no (raises)  no (aten     fp16, bf16, fp32, fp64
                                                             raises)
=============  ======  ===========  ==========  ===========  ===========  =============================

``flash`` also refuses ``is_causal`` with ``Lq != Lk``: FlashAttention-2 aligns the causal mask to the
bottom right, SDPA to the top left (SDPA does not pick flash for that either). Dropout inside a fused kernel
draws from the kernel's own Philox stream, so its mask differs from eager ``F.dropout``'s (and from the
math backend's) for the same seed; it equals what SDPA gives when PyTorch picks the same kernel.

Head-dim and sequence-length limits are the dispatcher's business: the aten kernel raises on them (on
2.11, E % 8 != 0 in fp16/bf16 for cudnn and efficient; flash gets E padded to a multiple of 8, as SDPA
does it).

Three kernels do not go through the custom ops, because they already trace and differentiate under
torch.compile on their own:

* ``flex``: PyTorch's FlexAttention (:mod:`kernel_pytorch.attention.kernels.flex`), with a top-left causal
  ``BlockMask`` or no mask. Inductor compiles it into a fused Triton kernel; run eagerly it is PyTorch's
  unfused reference (correct, slow: it materializes the scores), and on the CPU it has no backward
  (``flex_attention`` raises ``NotImplementedError`` for inputs that require grad). No ``attn_mask``, no
  dropout (both raise ``ValueError``); any device FlexAttention supports (CUDA/ROCm, CPU, XPU).
* ``flash_attn``: the flash-attn package's ``flash_attn_func`` (:mod:`kernel_pytorch.attention.kernels.flash_attn`),
  imported on first use. CUDA/ROCm, fp16/bf16, native GQA, dropout; no ``attn_mask``, and no
  ``is_causal`` with Lq != Lk (flash-attn aligns it to the bottom right), both ``ValueError``.
* ``cudnn_band``: cuDNN's causal sliding-window attention, a cuDNN graph built with the cuDNN frontend
  (:mod:`kernel_pytorch.attention.kernels.cudnn_band`), given the window as the mask pattern ``("band", 0, w - 1)``
  and nothing else: CUDA, fp16/bf16, native GQA, Lq == Lk; no ``attn_mask``, no ``is_causal`` (the band is
  causal), no dropout, all ``ValueError``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernel_pytorch.attention.kernels.cudnn_band import band_window, cudnn_band_forward
from kernel_pytorch.attention.kernels.flash_attn import flash_attn_forward
from kernel_pytorch.attention.kernels.flex import flex_attention_forward

__all__ = ["attention", "sparse_or_dense_attention", "ATTENTION_KERNELS", "PATTERN_KERNELS", "kernel_device",
           "to_4d"]

ATTENTION_KERNELS = ("sdpa", "cudnn", "flash", "efficient", "cpu_flash", "flex", "flash_attn", "cudnn_band")

# "flex" is "any": FlexAttention runs where PyTorch has it (CUDA/ROCm fused when compiled; CPU forward only).
_DEVICE = {"sdpa": "any", "cudnn": "cuda", "flash": "cuda", "efficient": "cuda", "cpu_flash": "cpu", "flex": "any",
           "flash_attn": "cuda", "cudnn_band": "cuda"}
# Kernels called directly by attention(), not through the custom ops: each traces under torch.compile and
# has its own autograd (FlexAttention's higher-order op; flash-attn's custom ops; cudnn_band's Function).
_DIRECT = frozenset({"flex", "flash_attn", "cudnn_band"})
# Kernels given a recognized mask pattern instead of a mask tensor (the dispatcher and the pass ask here).
PATTERN_KERNELS = frozenset({"flex", "cudnn_band"})
_FLASH_ATTN_MAX_HEAD_DIM = 256

# Kernels whose aten forward and backward take Hk != Hq (K/V head h serving query heads h*G .. h*G+G-1),
# each checked against the float64 reference, forward and gradients: flash and cudnn on torch 2.11 (H100,
# cuDNN 9.19), cpu_flash on 2.11 and 2.13. efficient raises "Expected query.size(2) == key.size(2)".
_NATIVE_GQA = frozenset({"flash", "cudnn", "cpu_flash"})
_TAKES_MASK = frozenset({"cudnn", "efficient", "cpu_flash"})
# Only the efficient backward returns a gradient for the additive mask (grad_input_mask[3]).
_MASK_GRAD = frozenset({"efficient"})
# Kernels that compute in fp16/bf16 only. cuDNN's aten kernel accepts float32 but returns wrong numbers for
# it (rel. error ~1 on torch 2.11, H100); flash-attn and the cuDNN frontend's band refuse it themselves.
_HALF_ONLY = frozenset({"cudnn", "flash_attn", "cudnn_band"})
_HALF = (torch.float16, torch.bfloat16)


def kernel_device(kernel: str) -> str:
    """The device type a kernel runs on: ``"cuda"`` (also ROCm), ``"cpu"``, or ``"any"`` (``"sdpa"``, and
    ``"flex"``, which is fused on GPUs and forward-only on the CPU)."""
    _check_kernel_name(kernel)
    return _DEVICE[kernel]


def _check_kernel_name(kernel: str) -> None:
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; valid kernels: {', '.join(ATTENTION_KERNELS)}")


# ---------------------------------------------------------------------------------------------------------
# The custom ops. Inputs are 4-D (B, H, L, E); K/V have Hk heads (expanded here for kernels without native
# GQA); the mask is additive, 4-D, broadcastable to (B, Hq, Lq, Lk), in any layout: under torch.compile
# Inductor keeps only the stride order of custom-op inputs, so whatever a kernel needs of the layout is
# made here, inside the op.
# ---------------------------------------------------------------------------------------------------------


def _check_supported(kernel: str, q: Tensor, k: Tensor, attn_mask: Optional[Tensor], is_causal: bool) -> None:
    """Refuse what a kernel would compute differently from SDPA (or not at all) with a clear message."""
    _check_kernel_name(kernel)
    if kernel == "sdpa" or kernel in _DIRECT:
        raise ValueError(f"kernel {kernel!r} does not go through the custom ops; "
                         f"call attention(..., kernel={kernel!r})")
    if attn_mask is not None and kernel not in _TAKES_MASK:
        raise ValueError(f"attention kernel {kernel!r} takes no attn_mask; use one of "
                         f"{', '.join(sorted(_TAKES_MASK))} or 'sdpa'")
    if kernel == "flash" and is_causal and q.shape[-2] != k.shape[-2]:
        raise ValueError("attention kernel 'flash' aligns is_causal to the bottom right when Lq != Lk, SDPA to "
                         f"the top left (got Lq={q.shape[-2]}, Lk={k.shape[-2]}); use another kernel")
    _check_dtype(kernel, q)
    # Last, so the refusals above also show on CPU tensors.
    _check_device(kernel, q)


def _check_dtype(kernel: str, q: Tensor) -> None:
    if kernel in _HALF_ONLY and q.dtype not in _HALF:
        raise ValueError(f"attention kernel {kernel!r} supports float16 and bfloat16, got {q.dtype}")


def _check_device(kernel: str, q: Tensor) -> None:
    """``"meta"`` tensors (shape propagation) pass: they reach fake implementations, which answer for any kernel."""
    if q.device.type not in (_DEVICE[kernel], "meta"):
        raise ValueError(f"attention kernel {kernel!r} runs on {_DEVICE[kernel]} tensors, got {q.device.type}")


def _expand_kv(kernel: str, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """K/V with Hq heads for kernels without native GQA (SDPA's repeat_interleave on the head dim)."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1 or kernel in _NATIVE_GQA:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(grad: Tensor, heads_kv: int) -> Tensor:
    """Sum the gradient of repeat_interleave'd K or V back over each group of query heads."""
    if grad.shape[1] == heads_kv:
        return grad
    return grad.unflatten(1, (heads_kv, grad.shape[1] // heads_kv)).sum(2)


def _efficient_bias(attn_mask: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
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


def _rng_outputs(q: Tensor, seed: Optional[Tensor], offset: Optional[Tensor], dropout_p: float):
    """The dropout RNG state, passed on to the backward kernel as the forward kernel returned it.

    With dropout: flash returns (rng_state uint64[2], unused uint64[]) and cuDNN (philox_seed,
    philox_offset) as GPU tensors; efficient returns (philox_seed, philox_offset) as CPU tensors outside
    CUDA-graph capture, which its backward dereferences on the host (a GPU copy segfaults it), so they
    stay where they are (see _attention_fwd_fake). Without dropout no backward reads them (checked with
    empty ones for each kernel), so return empty placeholders rather than the efficient kernel's CPU ones.
    """
    if dropout_p == 0.0 or seed is None or offset is None:
        empty = torch.empty(0, dtype=torch.int64, device=q.device)
        return empty, empty.clone()  # two tensors: custom-op outputs may not alias each other
    return seed, offset


def _attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    kernel: str,
    compute_log_sumexp: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(output, logsumexp, rng_state_a, rng_state_b) of the aten forward kernel named by ``kernel``."""
    _check_supported(kernel, q, k, attn_mask, is_causal)
    k, v = _expand_kv(kernel, q, k, v)
    aten = torch.ops.aten
    seed = offset = None
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    elif kernel == "flash":
        # -> (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask);
        # cum_seq_* are None for dense (non-nested) inputs.
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, dropout_p, is_causal, False,  # return_debug_mask
            scale=scale)
    elif kernel == "cudnn":
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q, k, v, attn_mask, compute_log_sumexp, dropout_p, is_causal, False,  # return_debug_mask
            scale=scale)
    else:  # efficient; logsumexp comes padded to a multiple of 32 queries (empty without compute_log_sumexp)
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, _efficient_bias(attn_mask, q, k), compute_log_sumexp, dropout_p, is_causal, scale=scale)
    return (out, lse, *_rng_outputs(q, seed, offset, dropout_p))


def _attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    rng_a: Tensor,
    rng_b: Tensor,
    dropout_p: float,
    is_causal: bool,
    scale: Optional[float],
    kernel: str,
    mask_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_q, grad_k, grad_v, grad_mask) from the aten backward kernel; grad_mask is empty unless
    ``mask_grad`` (efficient only). ``k``/``v`` are the unexpanded inputs of attention_fwd."""
    _check_supported(kernel, q, k, attn_mask, is_causal)
    if mask_grad and kernel not in _MASK_GRAD:
        raise ValueError(f"attention kernel {kernel!r} cannot return a gradient for attn_mask")
    heads_kv = k.shape[1]
    k, v = _expand_kv(kernel, q, k, v)  # again, rather than saving Hq/Hk times more K/V in the forward
    aten = torch.ops.aten
    max_q, max_k = q.shape[2], k.shape[2]  # the padded-batch sequence lengths; dense inputs: the lengths
    grad_mask = None
    if kernel == "cpu_flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    elif kernel == "flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse,
            None, None,  # cum_seq_q, cum_seq_k: undefined selects the dense (non-varlen) kernel
            max_q, max_k, dropout_p, is_causal,
            rng_a, rng_b,  # "philox_seed, philox_offset": the forward's (rng_state, unused)
            scale=scale)
    elif kernel == "cudnn":
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse, rng_a, rng_b,
            attn_mask,  # declared `Tensor attn_bias` (not optional); None passes an undefined tensor
            None, None,  # cum_seq_q, cum_seq_k, as for flash
            max_q, max_k, dropout_p, is_causal, scale=scale)
    else:
        dq, dk, dv, grad_mask = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v,
            _efficient_bias(attn_mask, q, k),  # `Tensor attn_bias` here too; None when there is no mask
            out, lse, rng_a, rng_b, dropout_p,
            [True, True, True, mask_grad],  # grad_input_mask: which of q, k, v, attn_bias to differentiate
            is_causal, scale=scale)
    if grad_mask is None:
        grad_mask = q.new_empty(0)  # a custom op returns tensors only; the autograd formula maps it to None
    else:  # (B, Hq, Lq, Lk) -> the mask's own broadcast shape
        grad_mask = grad_mask.sum_to_size(attn_mask.shape)
    return dq, _reduce_kv_grad(dk, heads_kv), _reduce_kv_grad(dv, heads_kv), grad_mask


attention_fwd = torch.library.custom_op("kernel_pytorch::attention_fwd", _attention_fwd, mutates_args=())
attention_bwd = torch.library.custom_op("kernel_pytorch::attention_bwd", _attention_bwd, mutates_args=())


def _attention_fwd_fake(q, k, v, attn_mask, dropout_p, is_causal, scale, kernel, compute_log_sumexp):
    """The real implementation on fake tensors: every step is an aten call with a meta kernel (or plain
    tensor code), so this gives the kernels' own output shapes, strides and dtypes. One correction: aten's
    meta kernel puts the efficient kernel's dropout seed/offset on the GPU, the kernel on the CPU (outside
    CUDA-graph capture; PyTorch's own fake-tensor cross-checks exempt exactly these outputs)."""
    out, lse, rng_a, rng_b = _attention_fwd(q, k, v, attn_mask, dropout_p, is_causal, scale, kernel,
                                            compute_log_sumexp)
    if kernel == "efficient" and dropout_p != 0.0:
        rng_a, rng_b = rng_a.to("cpu"), rng_b.to("cpu")
    return out, lse, rng_a, rng_b


attention_fwd.register_fake(_attention_fwd_fake)
attention_bwd.register_fake(_attention_bwd)  # as above: the real implementation on fake tensors


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, attn_mask, dropout_p, is_causal, scale, kernel, _ = inputs
    out, lse, rng_a, rng_b = output
    ctx.save_for_backward(q, k, v, attn_mask, out, lse, rng_a, rng_b)
    ctx.params = (dropout_p, is_causal, scale, kernel)


def _backward(ctx, grad_out, _grad_lse, _grad_rng_a, _grad_rng_b):
    q, k, v, attn_mask, out, lse, rng_a, rng_b = ctx.saved_tensors
    dropout_p, is_causal, scale, kernel = ctx.params
    mask_grad = attn_mask is not None and ctx.needs_input_grad[3]
    dq, dk, dv, grad_mask = attention_bwd(
        grad_out, q, k, v, attn_mask, out, lse, rng_a, rng_b, dropout_p, is_causal, scale, kernel, mask_grad)
    return dq, dk, dv, (grad_mask if mask_grad else None), None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------------------
# The public function: SDPA's argument conventions -> what the kernels take.
# ---------------------------------------------------------------------------------------------------------


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    kernel: str = "sdpa",
    pattern: Optional[tuple] = None,
    pattern_tensor: Optional[Tensor] = None,
) -> Tensor:
    """``F.scaled_dot_product_attention`` computed by the fused kernel ``kernel``.

    Arguments are SDPA's: ``q`` (..., Hq, Lq, E), ``k`` (..., Hk, Lk, E), ``v`` (..., Hk, Lk, Ev);
    ``attn_mask`` bool (True = attend) or float (added to the scores), broadcastable to (..., Hq, Lq, Lk);
    ``is_causal`` masks top-left aligned (query i sees keys 0..i); ``scale=None`` is 1/sqrt(E);
    ``enable_gqa`` lets Hq be a multiple of Hk. ``pattern`` (``kernel="flex"`` only, with no ``attn_mask``
    and no ``is_causal``) is a block-structured mask given by its rule instead of a tensor, and
    ``pattern_tensor`` the document ids or allowed positions it reads (:mod:`kernel_pytorch.attention.kernels.flex`);
    ``("topk", ...)`` (:func:`kernel_pytorch.attention.kernels.topk_sparse.topk_pattern`, ``is_causal`` allowed) is
    top-k block-sparse attention, an approximation (:mod:`kernel_pytorch.attention.kernels.topk_sparse`).
    ``kernel`` is one of :data:`ATTENTION_KERNELS`; a kernel
    that cannot compute the call as SDPA would (see the module docstring) raises ``ValueError``, and an
    ``attn_mask`` that requires grad is refused by every kernel but ``"efficient"`` and ``"sdpa"``.

    Example::

        q = torch.randn(2, 8, 128, 64)
        k = v = torch.randn(2, 2, 128, 64)
        out = attention(q, k, v, is_causal=True, enable_gqa=True, kernel="cpu_flash")  # (2, 8, 128, 64)
    """
    _check_kernel_name(kernel)
    if (pattern is not None or pattern_tensor is not None) and kernel not in PATTERN_KERNELS:
        raise ValueError(f"a mask pattern is computed by kernels {' and '.join(map(repr, sorted(PATTERN_KERNELS)))} "
                         f"only (got kernel={kernel!r}); pass the mask as attn_mask to the other kernels")
    if kernel == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    _check_shapes(q, k, v, enable_gqa)
    if kernel in _DIRECT:
        return _direct_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, kernel, pattern, pattern_tensor)
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled() and kernel not in _MASK_GRAD:
        raise ValueError(f"attention kernel {kernel!r} cannot return a gradient for attn_mask, which requires "
                         f"grad; use one of {', '.join(sorted(_MASK_GRAD))} or 'sdpa', or detach the mask")
    out_shape = (*q.shape[:-1], v.shape[-1])
    mask = _prepare_mask(attn_mask, q, k)
    q, k, v = to_4d(q), to_4d(k), to_4d(v)
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    if kernel == "flash" and head_dim % 8:
        # As SDPA does: FlashAttention-2 needs E % 8 == 0, zero columns change no score; the scale stays
        # that of the real head dim. Done out here so autograd handles the pad and the slice.
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        q, k, v = (F.pad(t, (0, 8 - head_dim % 8)) for t in (q, k, v))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, mask))
    out = attention_fwd(q, k, v, mask, dropout_p, is_causal, scale, kernel, needs_grad)[0]
    return out[..., :value_dim].reshape(out_shape)


def sparse_or_dense_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor] = None,
                              dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                              enable_gqa: bool = False, *, kernel: str = "sdpa", pattern: tuple,
                              min_length: int) -> Tensor:
    """SDPA's signature: top-k sparse attention (``attention(..., kernel="flex", pattern=pattern)``) when
    the query length is at least ``min_length``, else ``attention(..., kernel=kernel)`` (dense).

    What the attention pass puts in a graph for ``OptimizeConfig(sparse_attention=...)``. The length test
    is a Python condition on the call's own shape, decided per call: eagerly each call takes its branch;
    under torch.compile Dynamo specializes on it (a guard on the length, or on a symbolic length's range),
    so a later call of another length takes its own branch, never the one compiled for the first.

    Example::

        pattern = topk_pattern(topk=8)  # kernel_pytorch.attention.kernels.topk_sparse
        out = sparse_or_dense_attention(q, k, v, is_causal=True, pattern=pattern, min_length=4096)
    """
    if q.shape[-2] >= min_length:
        return attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, kernel="flex", pattern=pattern)
    return attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, kernel=kernel)


def _direct_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                      is_causal: bool, scale: Optional[float], kernel: str, pattern: Optional[tuple] = None,
                      pattern_tensor: Optional[Tensor] = None) -> Tensor:
    """``flex`` and ``flash_attn``: refuse what they would compute differently from SDPA, call them on
    (B, H, L, E) views (autograd and tracing are theirs), and give the output q's leading dims back."""
    if attn_mask is not None:
        # FlexAttention could read a mask tensor in a score_mod, but slower than the kernels taking a bias.
        raise ValueError(f"attention kernel {kernel!r} takes no attn_mask; use one of "
                         f"{', '.join(sorted(_TAKES_MASK))} or 'sdpa'")
    if kernel in ("flex", "cudnn_band") and dropout_p != 0.0:
        raise ValueError(f"attention kernel {kernel!r} has no dropout (got dropout_p={dropout_p}); use another kernel")
    window = _cudnn_band_window(q, k, is_causal, pattern, pattern_tensor) if kernel == "cudnn_band" else None
    if kernel == "flash_attn":
        if is_causal and q.shape[-2] != k.shape[-2]:
            raise ValueError("attention kernel 'flash_attn' aligns is_causal to the bottom right when Lq != Lk, SDPA "
                             f"to the top left (got Lq={q.shape[-2]}, Lk={k.shape[-2]}); use another kernel")
        _check_dtype(kernel, q)
        if q.shape[-1] > _FLASH_ATTN_MAX_HEAD_DIM or v.shape[-1] != q.shape[-1]:
            raise ValueError(f"attention kernel 'flash_attn' needs head dims <= {_FLASH_ATTN_MAX_HEAD_DIM}, equal for "
                             f"q/k and v (got {q.shape[-1]} and {v.shape[-1]})")
        # The device is flash-attn's own check ("Input tensor must be on CUDA device"), which also keeps
        # the adapter testable on the CPU with a stand-in flash_attn module.
    out_shape = (*q.shape[:-1], v.shape[-1])
    q, k, v = to_4d(q), to_4d(k), to_4d(v)
    if kernel == "flex":
        out = flex_attention_forward(q, k, v, is_causal=is_causal, scale=scale, pattern=pattern,
                                     pattern_tensor=pattern_tensor)
    elif kernel == "cudnn_band":
        out = cudnn_band_forward(q, k, v, window=window, scale=scale)
    else:
        out = flash_attn_forward(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return out.reshape(out_shape)


def _cudnn_band_window(q: Tensor, k: Tensor, is_causal: bool, pattern: Optional[tuple],
                       pattern_tensor: Optional[Tensor]) -> int:
    """The window of a ``cudnn_band`` call, refusing what it does not compute (see the module docstring)."""
    window = band_window(pattern, q.shape[-2], k.shape[-2])
    if window is None or is_causal or pattern_tensor is not None:
        raise ValueError("attention kernel 'cudnn_band' computes a causal sliding window given as the pattern "
                         f"('band', 0, w - 1) with Lq == Lk and no is_causal (got pattern={pattern!r}, "
                         f"is_causal={is_causal}, Lq={q.shape[-2]}, Lk={k.shape[-2]})")
    _check_dtype("cudnn_band", q)
    _check_device("cudnn_band", q)
    return window


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> None:
    if not q.dim() == k.dim() == v.dim() >= 2:
        raise ValueError(f"q, k, v must have the same number of dims (>= 2), got {q.dim()}, {k.dim()}, {v.dim()}")
    if q.dim() >= 3 and not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        raise ValueError("the fused attention kernels need equal batch dims in q, k, v (no broadcasting), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; use kernel='sdpa'")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"q/k head dims or k/v lengths differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dim() >= 3:
        heads_q, heads_k = q.shape[-3], k.shape[-3]
        if heads_k != v.shape[-3]:
            raise ValueError(f"k and v have different head counts: {heads_k}, {v.shape[-3]}")
        if heads_q != heads_k and not (enable_gqa and heads_q % heads_k == 0):
            raise ValueError(f"Hq={heads_q} and Hk={heads_k} differ; that needs enable_gqa=True and Hq % Hk == 0")


def to_4d(t: Tensor) -> Tensor:
    """(B, H, L, E): 2-D/3-D get leading size-1 dims (dim -3 stays the head dim, as SDPA's GQA has it);
    more than 4 dims are flattened into the batch."""
    if t.dim() < 4:
        return t[(None,) * (4 - t.dim())]
    if t.dim() == 4:
        return t
    return t.reshape(-1, *t.shape[-3:])


def _prepare_mask(attn_mask: Optional[Tensor], q: Tensor, k: Tensor) -> Optional[Tensor]:
    """SDPA's mask, as the custom op takes it: additive, 4-D like ``to_4d(q)``, broadcast dims kept at 1."""
    if attn_mask is None:
        return None
    full = (*q.shape[:-1], k.shape[-2])  # (..., Hq, Lq, Lk)
    if attn_mask.dim() > len(full) or any(
            m != 1 and m != f for m, f in zip(reversed(attn_mask.shape), reversed(full))):
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {full}")
    if attn_mask.dtype == torch.bool:
        # SDPA's convert_boolean_attn_mask. (SDPA gives cuDNN -65504 instead of -inf, which lets a fully
        # masked row attend uniformly; cuDNN takes -inf and gives that row 0, as SDPA's math does.)
        attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(q.dtype)
    if attn_mask.dim() < len(full):  # as many dims as q
        attn_mask = attn_mask[(None,) * (len(full) - attn_mask.dim())]
    if len(full) > 4:  # flatten the batch dims as to_4d(q) does; only those get materialized
        attn_mask = attn_mask.expand(*full[:-3], *attn_mask.shape[-3:]).flatten(0, len(full) - 4)
    return to_4d(attn_mask)
