"""One record per attention kernel (:class:`~kernel_pytorch.attention.kernels.record.AttentionKernel`), the
vendors' preference orders, and the eligibility of a problem: what the op (:mod:`kernel_pytorch.ops.attention`),
the dispatcher (:mod:`kernel_pytorch.attention.dispatch`) and the backends' plans read. A kernel's name here is
its name everywhere: ``attention(..., kernel=name)``, the report's ``attention[name]``, the plan's line.

How each record's facts were found, and the measurements behind the preference order: ``docs/attention.md``.
Adding a kernel: ``docs/design.md``, "Adding a kernel".

Example::

    from kernel_pytorch.attention.kernels.registry import KERNELS, eligible_kernels
    KERNELS["cudnn"].takes_mask                     # True
    eligible, rejected = eligible_kernels(problem, hardware)
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernel_pytorch.attention.kernels import aten_sdpa
from kernel_pytorch.attention.kernels import eligibility as limits
from kernel_pytorch.attention.kernels.cudnn_band import band_window, check_band_call, cudnn_band_forward
from kernel_pytorch.attention.kernels.flash_attn import flash_attn_forward
from kernel_pytorch.attention.kernels.flex import FLEX_MAX_HEAD_DIM, FLEX_MIN_HEAD_DIM, flex_attention_forward
from kernel_pytorch.attention.kernels.problem import AttentionProblem
from kernel_pytorch.attention.kernels.record import AttentionKernel, HeadDims
from kernel_pytorch.attention.kernels.softcap import softcapped_attention_math

if TYPE_CHECKING:
    from kernel_pytorch.hardware import HardwareInfo

__all__ = ["KERNELS", "PREFERENCE", "MEASURED_ONLY", "PATTERN_KERNELS", "kernel_record", "eligible_kernels"]

_HALF = (torch.float16, torch.bfloat16)


# ------------------------------------------------------------- entry points of the directly called kernels


def _sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], dropout_p: float, is_causal: bool, *,
          scale: Optional[float], enable_gqa: bool, softcap: Optional[float] = None) -> Tensor:
    if softcap is not None:  # no SDPA kernel caps the scores: PyTorch's ops, as the model wrote them
        return softcapped_attention_math(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
                                         softcap=softcap)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


# The direct kernels' entry points take the soft cap too; only flex computes one (the others' records refuse it).
def _flex(q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, is_causal: bool, scale: Optional[float],
          pattern: Optional[tuple], pattern_tensor: Optional[Tensor], softcap: Optional[float] = None) -> Tensor:
    return flex_attention_forward(q, k, v, is_causal=is_causal, scale=scale, pattern=pattern,
                                  pattern_tensor=pattern_tensor, softcap=softcap)


def _flash_attn(q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, is_causal: bool, scale: Optional[float],
                pattern: Optional[tuple], pattern_tensor: Optional[Tensor], softcap: Optional[float] = None) -> Tensor:
    return flash_attn_forward(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def _cudnn_band(q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, is_causal: bool, scale: Optional[float],
                pattern: Optional[tuple], pattern_tensor: Optional[Tensor], softcap: Optional[float] = None) -> Tensor:
    return cudnn_band_forward(q, k, v, window=band_window(pattern, q.shape[-2], k.shape[-2]), scale=scale)


# ------------------------------------------------------------------------------------------ the records

SDPA = AttentionKernel(
    name="sdpa", description="torch.nn.functional.scaled_dot_product_attention's kernels for this device",
    device="any", route="sdpa", dtypes=(*_HALF, torch.float32, torch.float64),
    takes_mask=True, mask_grad=True,
    softcap=True,  # with PyTorch's ops (kernel_pytorch.attention.kernels.softcap): correct, not faster
    limits=limits.no_limits, forward=_sdpa)

CUDNN = AttentionKernel(
    name="cudnn", description="cuDNN fused attention (PyTorch's SDPA cuDNN kernel)",
    device="cuda", route="custom_op",
    # fp32: the aten kernel takes it and returns wrong numbers, so attention() refuses it (docs/attention.md).
    dtypes=_HALF, head_dims=HeadDims(high=128, multiple_of=8),  # 128: cuDNN's fused attention on sm80/sm90
    takes_mask=True, op_checks=frozenset({"dtype", "device"}),
    limits=limits.cudnn_limits, requires=limits.needs_cudnn_attention,
    forward=aten_sdpa.cudnn_forward, backward=aten_sdpa.cudnn_backward)

FLASH = AttentionKernel(
    name="flash", description="FlashAttention-2 (PyTorch's SDPA flash kernel)",
    device="cuda", route="custom_op", dtypes=_HALF,
    head_dims=HeadDims(high=256, multiple_of=8, value_equal=True, padded=True),
    bottom_right_causal=True, op_checks=frozenset({"device"}),  # aten raises on fp32 itself
    limits=limits.flash_limits, requires=limits.needs_ampere_on_nvidia,
    forward=aten_sdpa.flash_forward, backward=aten_sdpa.flash_backward)

EFFICIENT = AttentionKernel(
    name="efficient", description="memory-efficient attention (PyTorch's SDPA kernel; fp32, mask gradients)",
    device="cuda", route="custom_op", dtypes=(*_HALF, torch.float32), head_dims=HeadDims(multiple_of=8),
    takes_mask=True, mask_grad=True,  # its backward alone returns the additive mask's gradient
    native_gqa=False,  # aten: "Expected query.size(2) == key.size(2)"
    rng_on_host=True, op_checks=frozenset({"device"}),
    limits=limits.aten_limits, forward=aten_sdpa.efficient_forward, backward=aten_sdpa.efficient_backward)

CPU_FLASH = AttentionKernel(
    name="cpu_flash", description="PyTorch's CPU flash attention kernel",
    device="cpu", route="custom_op", dtypes=(*_HALF, torch.float32, torch.float64),
    head_dims=HeadDims(multiple_of=8), takes_mask=True,
    dropout=False,  # aten raises, and attention() lets it (SDPA falls back to its math then)
    op_checks=frozenset({"device"}),
    limits=limits.aten_limits, forward=aten_sdpa.cpu_flash_forward, backward=aten_sdpa.cpu_flash_backward)

# FlexAttention runs where PyTorch has it: fused by Inductor on CUDA/ROCm (and CPU), eagerly the unfused
# reference; no CPU backward (kernel_pytorch.attention.kernels.flex).
FLEX = AttentionKernel(
    name="flex", description="FlexAttention block-sparse kernels (Triton)",
    device="any", route="direct", dtypes=(*_HALF, torch.float32),
    head_dims=HeadDims(low=FLEX_MIN_HEAD_DIM, high=FLEX_MAX_HEAD_DIM), takes_pattern=True, dropout=False,
    softcap=True,  # a score_mod, fused forward and backward when compiled
    measured_only=True,  # fused only when compiled, and faster than the dense kernels only on sparse masks
    op_checks=frozenset({"dropout"}),
    limits=limits.flex_limits, requires=limits.needs_triton, forward=_flex)

FLASH_ATTN = AttentionKernel(
    name="flash_attn", description="the flash-attn package's kernels",
    device="cuda", route="direct", dtypes=_HALF, head_dims=HeadDims(high=256, value_equal=True),
    bottom_right_causal=True,  # flash-attn >= 2.1
    # The device is flash-attn's own check ("Input tensor must be on CUDA device"), which also keeps the
    # adapter testable on the CPU with a stand-in flash_attn module.
    op_checks=frozenset({"dtype", "head_dims"}),
    limits=limits.flash_attn_limits, requires=limits.needs_flash_attn, forward=_flash_attn)

CUDNN_BAND = AttentionKernel(
    name="cudnn_band", description="cuDNN's causal sliding-window attention (a graph of the cuDNN frontend)",
    device="cuda", route="direct", dtypes=_HALF, head_dims=HeadDims(high=128, multiple_of=8, value_equal=True),
    takes_pattern=True, pattern_check=check_band_call, dropout=False,
    trains_in_cuda_graphs=False,  # its backward's capture failed once another band problem had run
    measured_only=True,  # it computes only the windows the pass recognized, whose dense kernels it must beat
    op_checks=frozenset({"dropout", "dtype", "device"}),
    limits=functools.partial(limits.cudnn_band_limits, fused=CUDNN), requires=limits.needs_cudnn_frontend,
    forward=_cudnn_band)

# attention()'s kernels, in the order its errors list them.
KERNELS: dict[str, AttentionKernel] = {
    kernel.name: kernel for kernel in (SDPA, CUDNN, FLASH, EFFICIENT, CPU_FLASH, FLEX, FLASH_ATTN, CUDNN_BAND)}

# Kernels each vendor may use, fastest-first; "sdpa" (PyTorch's own dispatch) last, the universal fallback.
# nvidia: cuDNN first (fastest forward measured at hd128, benchmarks/results/attention.json); flash-attn
# before aten's flash: the same FlashAttention-2, usually a newer release. cudnn_band and flex (measured
# only) after the flash kernels, before the memory-efficient kernel, which both flash kernels beat
# (docs/attention.md, "Preference order"). amd: no cuDNN; flash-attn's ROCm build and FlexAttention
# (Triton runs on ROCm) in the same order. The CPU dispatch of PyTorch already picks its flash kernel where
# eligible, keeping mask gradients and dropout; XLA lowers SDPA itself.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "nvidia": ("cudnn", "flash_attn", "flash", "cudnn_band", "flex", "efficient", "sdpa"),
    "amd": ("flash_attn", "flash", "flex", "efficient", "sdpa"),
    "cpu": ("sdpa",),
    "intel": ("sdpa",),
    "tpu": ("sdpa",),
}

MEASURED_ONLY = frozenset(name for name, kernel in KERNELS.items() if kernel.measured_only)
PATTERN_KERNELS = frozenset(name for name, kernel in KERNELS.items() if kernel.takes_pattern)


def kernel_record(name: str) -> AttentionKernel:
    """The record of kernel ``name``; ``ValueError`` naming the valid kernels for any other name."""
    kernel = KERNELS.get(name)
    if kernel is None:
        raise ValueError(f"unknown attention kernel {name!r}; valid kernels: {', '.join(KERNELS)}")
    return kernel


def eligible_kernels(problem: AttentionProblem, hardware: HardwareInfo) -> tuple[list[str], dict[str, str]]:
    """The kernels that can run ``problem`` in ``hardware.vendor``'s preference order, and why each other
    one cannot."""
    eligible, rejected = [], {}
    for name in PREFERENCE[hardware.vendor]:
        reason = KERNELS[name].why_not(problem, hardware)
        if reason is None:
            eligible.append(name)
        else:
            rejected[name] = reason
    return eligible, rejected
