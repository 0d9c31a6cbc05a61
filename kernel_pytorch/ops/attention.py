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

What each kernel supports is its record (:mod:`kernel_pytorch.attention.kernels.registry`; a table in
``docs/attention.md``): device, dtypes, native GQA, ``attn_mask``, a mask gradient, dropout. The dispatcher
chooses; anything unsupported raises, nothing is computed differently from SDPA. ``flash`` and ``flash_attn``
refuse ``is_causal`` with ``Lq != Lk``: FlashAttention-2 aligns the causal mask to the bottom right, SDPA to
the top left (SDPA does not pick flash for that either). Dropout inside a fused kernel draws from the
kernel's own Philox stream, so its mask differs from eager ``F.dropout``'s (and from the math backend's) for
the same seed; it equals what SDPA gives when PyTorch picks the same kernel.

Head-dim and sequence-length limits are the dispatcher's business: the aten kernel raises on them (E % 8 != 0
in fp16/bf16 for cudnn and efficient; flash gets E padded to a multiple of 8, as SDPA does it).

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
from torch.nn.attention import SDPBackend

from kernel_pytorch.attention.kernels.record import AttentionKernel
from kernel_pytorch.attention.kernels.registry import KERNELS, PATTERN_KERNELS, kernel_record

__all__ = ["attention", "sparse_or_dense_attention", "ATTENTION_KERNELS", "PATTERN_KERNELS", "kernel_device",
           "to_4d"]

ATTENTION_KERNELS = tuple(KERNELS)


def kernel_device(kernel: str) -> str:
    """The device type a kernel runs on: ``"cuda"`` (also ROCm), ``"cpu"``, or ``"any"`` (``"sdpa"``, and
    ``"flex"``, which is fused on GPUs and forward-only on the CPU)."""
    return kernel_record(kernel).device


def _kernels_with(feature: str) -> str:
    """The kernels (but "sdpa") that have ``feature``, for the errors: "cpu_flash, cudnn, efficient"."""
    return ", ".join(sorted(name for name, k in KERNELS.items() if getattr(k, feature) and k.route != "sdpa"))


# ---------------------------------------------------------------------------------------------------------
# What a kernel would compute differently from SDPA, or not at all, is refused here with a clear message, in
# this order for every kernel; record.op_checks names the limits a kernel leaves to its own errors.
# ---------------------------------------------------------------------------------------------------------


def _refuse_unsupported(kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                        dropout_p: float, is_causal: bool, pattern: Optional[tuple] = None,
                        pattern_tensor: Optional[Tensor] = None, softcap: Optional[float] = None) -> None:
    _refuse_softcap(kernel, softcap)
    if attn_mask is not None and not kernel.takes_mask:
        # FlexAttention could read a mask tensor in a score_mod, but slower than the kernels taking a bias.
        raise ValueError(f"attention kernel {kernel.name!r} takes no attn_mask; use one of "
                         f"{_kernels_with('takes_mask')} or 'sdpa'")
    if "dropout" in kernel.op_checks and not kernel.dropout and dropout_p != 0.0:
        raise ValueError(f"attention kernel {kernel.name!r} has no dropout (got dropout_p={dropout_p}); "
                         "use another kernel")
    if kernel.pattern_check is not None:
        kernel.pattern_check(q, k, is_causal, pattern, pattern_tensor)
    if kernel.bottom_right_causal and is_causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"attention kernel {kernel.name!r} aligns is_causal to the bottom right when Lq != Lk, SDPA "
                         f"to the top left (got Lq={q.shape[-2]}, Lk={k.shape[-2]}); use another kernel")
    if "dtype" in kernel.op_checks and q.dtype not in kernel.dtypes:
        names = " and ".join(str(dtype).removeprefix("torch.") for dtype in kernel.dtypes)
        raise ValueError(f"attention kernel {kernel.name!r} supports {names}, got {q.dtype}")
    if "head_dims" in kernel.op_checks:
        _refuse_head_dims(kernel, q, v)
    if "device" in kernel.op_checks:  # last, so the refusals above also show on CPU tensors
        _refuse_device(kernel, q)


def _refuse_softcap(kernel: AttentionKernel, softcap: Optional[float]) -> None:
    if softcap is not None and not kernel.softcap:
        raise ValueError(f"attention kernel {kernel.name!r} has no soft cap; use one of {_kernels_with('softcap')} "
                         "or 'sdpa'")


def _refuse_head_dims(kernel: AttentionKernel, q: Tensor, v: Tensor) -> None:
    high = kernel.head_dims.high
    if (high is not None and q.shape[-1] > high) or (kernel.head_dims.value_equal and v.shape[-1] != q.shape[-1]):
        raise ValueError(f"attention kernel {kernel.name!r} needs head dims <= {high}, equal for q/k and v "
                         f"(got {q.shape[-1]} and {v.shape[-1]})")


def _refuse_device(kernel: AttentionKernel, q: Tensor) -> None:
    """``"meta"`` tensors (shape propagation) pass: they reach fake implementations, which answer for any kernel."""
    if q.device.type not in (kernel.device, "meta"):
        raise ValueError(f"attention kernel {kernel.name!r} runs on {kernel.device} tensors, got {q.device.type}")


# ---------------------------------------------------------------------------------------------------------
# The custom ops. Inputs are 4-D (B, H, L, E); K/V have Hk heads (expanded here for kernels without native
# GQA); the mask is additive, 4-D, broadcastable to (B, Hq, Lq, Lk), in any layout: under torch.compile
# Inductor keeps only the stride order of custom-op inputs, so whatever a kernel needs of the layout is
# made here, inside the op.
# ---------------------------------------------------------------------------------------------------------


def _custom_op_kernel(kernel: str, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                      is_causal: bool) -> AttentionKernel:
    """The record of ``kernel``, refusing what it would compute differently from SDPA (or not at all)."""
    record = kernel_record(kernel)
    if record.route != "custom_op":
        raise ValueError(f"kernel {kernel!r} does not go through the custom ops; "
                         f"call attention(..., kernel={kernel!r})")
    _refuse_unsupported(record, q, k, v, attn_mask, 0.0, is_causal)
    return record


def _expand_kv(kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """K/V with Hq heads for kernels without native GQA (SDPA's repeat_interleave on the head dim)."""
    groups = q.shape[1] // k.shape[1]
    if groups == 1 or kernel.native_gqa:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(grad: Tensor, heads_kv: int) -> Tensor:
    """Sum the gradient of repeat_interleave'd K or V back over each group of query heads."""
    if grad.shape[1] == heads_kv:
        return grad
    return grad.unflatten(1, (heads_kv, grad.shape[1] // heads_kv)).sum(2)


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
    record = _custom_op_kernel(kernel, q, k, v, attn_mask, is_causal)
    k, v = _expand_kv(record, q, k, v)
    out, lse, seed, offset = record.forward(q, k, v, attn_mask, dropout_p, is_causal, scale, compute_log_sumexp)
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
    record = _custom_op_kernel(kernel, q, k, v, attn_mask, is_causal)
    if mask_grad and not record.mask_grad:
        raise ValueError(f"attention kernel {kernel!r} cannot return a gradient for attn_mask")
    heads_kv = k.shape[1]
    k, v = _expand_kv(record, q, k, v)  # again, rather than saving Hq/Hk times more K/V in the forward
    dq, dk, dv, grad_mask = record.backward(grad_out, q, k, v, attn_mask, out, lse, rng_a, rng_b, dropout_p,
                                            is_causal, scale, mask_grad)
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
    if kernel_record(kernel).rng_on_host and dropout_p != 0.0:
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
    softcap: Optional[float] = None,
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
    ``softcap`` soft-caps the scaled scores before the mask, ``cap * tanh(score / cap)`` (Gemma-2; SDPA has no
    such argument): ``"flex"`` computes it in its kernel, ``"sdpa"`` with PyTorch's ops
    (:mod:`kernel_pytorch.attention.kernels.softcap`), the other kernels refuse it.
    ``kernel`` is one of :data:`ATTENTION_KERNELS`; a kernel
    that cannot compute the call as SDPA would (see the module docstring) raises ``ValueError``, and an
    ``attn_mask`` that requires grad is refused by every kernel but ``"efficient"`` and ``"sdpa"``.

    Example::

        q = torch.randn(2, 8, 128, 64)
        k = v = torch.randn(2, 2, 128, 64)
        out = attention(q, k, v, is_causal=True, enable_gqa=True, kernel="cpu_flash")  # (2, 8, 128, 64)
    """
    record = kernel_record(kernel)
    if (pattern is not None or pattern_tensor is not None) and not record.takes_pattern:
        raise ValueError(f"a mask pattern is computed by kernels {' and '.join(map(repr, sorted(PATTERN_KERNELS)))} "
                         f"only (got kernel={kernel!r}); pass the mask as attn_mask to the other kernels")
    if record.route == "sdpa" and _trains_on_pytorch_cudnn(q, k, v, attn_mask, dropout_p, is_causal, scale,
                                                          enable_gqa, softcap):
        # The same cuDNN kernel through the "cudnn" custom op, whose backward passes the output gradient in
        # one layout: PyTorch's reuses a plan cached for another layout (wrong gradients, docs/attention.md).
        record = kernel_record("cudnn")
    if record.route == "sdpa":
        return record.forward(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
                              softcap=softcap)
    _check_shapes(q, k, v, enable_gqa)
    if record.route == "direct":
        return _direct_attention(record, q, k, v, attn_mask, dropout_p, is_causal, scale, pattern, pattern_tensor,
                                 softcap)
    _refuse_softcap(record, softcap)
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled() and not record.mask_grad:
        raise ValueError(f"attention kernel {kernel!r} cannot return a gradient for attn_mask, which requires "
                         f"grad; use one of {_kernels_with('mask_grad')} or 'sdpa', or detach the mask")
    out_shape = (*q.shape[:-1], v.shape[-1])
    mask = _prepare_mask(attn_mask, q, k)
    q, k, v = to_4d(q), to_4d(k), to_4d(v)
    head_dim, value_dim = q.shape[-1], v.shape[-1]
    multiple = record.head_dims.multiple_of
    if record.head_dims.padded and head_dim % multiple:
        # As SDPA does for flash: zero columns change no score; the scale stays that of the real head dim.
        # Done out here so autograd handles the pad and the slice.
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        q, k, v = (F.pad(t, (0, multiple - head_dim % multiple)) for t in (q, k, v))
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, mask))
    out = attention_fwd(q, k, v, mask, dropout_p, is_causal, scale, record.name, needs_grad)[0]
    return out[..., :value_dim].reshape(out_shape)


def _trains_on_pytorch_cudnn(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                             is_causal: bool, scale: Optional[float], enable_gqa: bool,
                             softcap: Optional[float]) -> bool:
    """Whether ``F.scaled_dot_product_attention`` would run this call on cuDNN with a backward to come, in
    a form the "cudnn" kernel takes as it is (4-D, equal batch dims, no soft cap, no mask gradient). Under
    TorchDynamo the call stays SDPA's: PyTorch's choice is asked eagerly or while AOTAutograd traces."""
    if q.device.type != "cuda" or softcap is not None or torch.compiler.is_dynamo_compiling():
        return False
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return False
    if not q.dim() == k.dim() == v.dim() == 4 or not q.shape[0] == k.shape[0] == v.shape[0]:
        return False
    if attn_mask is not None and attn_mask.requires_grad:
        return False
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing():  # a decision taken while tracing, not an op of the traced graph
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    return choice == SDPBackend.CUDNN_ATTENTION.value


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


def _direct_attention(kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                      dropout_p: float, is_causal: bool, scale: Optional[float], pattern: Optional[tuple] = None,
                      pattern_tensor: Optional[Tensor] = None, softcap: Optional[float] = None) -> Tensor:
    """``flex``, ``flash_attn`` and ``cudnn_band``: refuse what they would compute differently from SDPA, call
    them on (B, H, L, E) views (autograd and tracing are theirs), and give the output q's leading dims back."""
    _refuse_unsupported(kernel, q, k, v, attn_mask, dropout_p, is_causal, pattern, pattern_tensor, softcap)
    out_shape = (*q.shape[:-1], v.shape[-1])
    q, k, v = to_4d(q), to_4d(k), to_4d(v)
    out = kernel.forward(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, pattern=pattern,
                         pattern_tensor=pattern_tensor, softcap=softcap)
    return out.reshape(out_shape)


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
