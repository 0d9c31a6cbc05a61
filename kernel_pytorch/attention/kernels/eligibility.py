"""Why an attention kernel cannot run a problem on the hardware found: the ``limits`` and ``requires`` of the
records in :mod:`kernel_pytorch.attention.kernels.registry`. Each ``limits`` function takes the kernel's own
record first, so the dtypes, head dims and features it names are the record's; the reasons go into the
optimization report as they are written here.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional

import torch

from kernel_pytorch.attention.kernels.cudnn_band import band_window
from kernel_pytorch.attention.kernels.problem import AttentionProblem

if TYPE_CHECKING:
    from kernel_pytorch.attention.kernels.record import AttentionKernel
    from kernel_pytorch.hardware import HardwareInfo

__all__ = ["no_limits", "aten_limits", "cudnn_limits", "flash_limits", "flex_limits", "flash_attn_limits",
           "cudnn_band_limits", "needs_cudnn_attention", "needs_ampere_on_nvidia", "needs_triton",
           "needs_flash_attn", "needs_cudnn_frontend", "dtype_names"]

# flash-attn 2.7.0 is the first release whose kernels are torch.library custom ops with fake implementations
# (Dao-AILab/flash-attention PR #1139, merged after 2.6.3): older ones call their CUDA extension directly,
# which torch.compile cannot trace (a graph break; an error with fullgraph=True or under AOTAutograd).
_FLASH_ATTN_MIN_VERSION = (2, 7)
# nvidia-cudnn-frontend 1.32: the release cudnn_band's graphs are built and tested with (pygraph.sdpa's diagonal
# band bounds, execute with ordered tensor_uids).
_CUDNN_FRONTEND_MIN_VERSION = (1, 32)
# flash-attn's README: head dim > 192 backward with dropout needs the shared memory of sm80/sm90 GPUs.
_FLASH_ATTN_BIG_HEAD_BWD_CC = ((8, 0), (9, 0))
_SHORT_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64"}


def dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    """``"fp16/bf16/fp32"``: the dtypes as the reasons name them."""
    return "/".join(_SHORT_NAMES.get(d, str(d)) for d in dtypes)


# ----------------------------------------------------------------------------------------- shared limits


def _dtype(kernel: AttentionKernel, p: AttentionProblem) -> Optional[str]:
    return None if p.dtype in kernel.dtypes else f"{kernel.name} needs {dtype_names(kernel.dtypes)}, not {p.dtype}"


def _head_dim_multiple(kernel: AttentionKernel, p: AttentionProblem) -> Optional[str]:
    multiple = kernel.head_dims.multiple_of
    if p.head_dim % multiple or p.value_dim % multiple:
        return f"head dim {p.head_dim} is not a multiple of {multiple}"
    return None


def _dtype_and_head_dim(kernel: AttentionKernel, p: AttentionProblem) -> Optional[str]:
    """The first limits of PyTorch's fused SDPA kernels, in their order."""
    return _dtype(kernel, p) or _head_dim_multiple(kernel, p)


def _bottom_right_causal(kernel: AttentionKernel, p: AttentionProblem) -> Optional[str]:
    if kernel.bottom_right_causal and p.is_causal and p.q_shape[-2] != p.k_shape[-2]:
        return f"{kernel.name}'s causal mask is bottom-right aligned when query and key lengths differ"
    return None


def _ampere(kernel: AttentionKernel, hardware: HardwareInfo) -> Optional[str]:
    cc = hardware.compute_capability
    if hardware.vendor == "nvidia" and (cc is None or cc < (8, 0)):
        return f"{kernel.name} needs compute capability >= 8.0"
    return None


def _mask_grad(kernel: AttentionKernel, p: AttentionProblem) -> Optional[str]:
    return f"{kernel.name} returns no gradient for the mask" if p.mask_requires_grad and not kernel.mask_grad else None


def _version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as ``"2.8.3"`` or ``"2.7.0.post2"``; () if unparsable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else ()


# ------------------------------------------------------------------------------------ limits per kernel


def no_limits(kernel: AttentionKernel, p: AttentionProblem, hardware: HardwareInfo) -> Optional[str]:
    """``"sdpa"``: PyTorch's own dispatch runs every problem."""
    return None


def aten_limits(kernel: AttentionKernel, p: AttentionProblem, hardware: HardwareInfo) -> Optional[str]:
    """PyTorch's memory-efficient and CPU flash kernels."""
    return _dtype_and_head_dim(kernel, p) or _mask_grad(kernel, p)


def cudnn_limits(kernel: AttentionKernel, p: AttentionProblem, hardware: HardwareInfo) -> Optional[str]:
    """PyTorch's cuDNN kernel; also the limits of cuDNN's fused attention under ``cudnn_band``."""
    if reason := _dtype_and_head_dim(kernel, p):
        return reason
    if not hardware.cudnn_attention:
        return "cuDNN attention unavailable on this GPU"
    if p.head_dim > kernel.head_dims.high:
        return f"cuDNN attention here is limited to head dim {kernel.head_dims.high} (got {p.head_dim})"
    if p.mask_requires_grad:
        return "cuDNN attention returns no gradient for the mask"
    return _ampere(kernel, hardware)


def flash_limits(kernel: AttentionKernel, p: AttentionProblem, hardware: HardwareInfo) -> Optional[str]:
    """PyTorch's FlashAttention-2 kernel."""
    if reason := _dtype_and_head_dim(kernel, p):
        return reason
    if p.mask is not None:
        return f"{kernel.name} takes no mask"
    if p.head_dim > kernel.head_dims.high or p.value_dim != p.head_dim:
        return f"{kernel.name} needs head dim <= {kernel.head_dims.high} and equal for q/k and v"
    return _bottom_right_causal(kernel, p) or _ampere(kernel, hardware) or _mask_grad(kernel, p)


def flex_limits(kernel: AttentionKernel, p: AttentionProblem, hardware: HardwareInfo) -> Optional[str]:
    """FlexAttention's limits (see :mod:`kernel_pytorch.attention.kernels.flex` for where each was found)."""
    cc = hardware.compute_capability
    dims = kernel.head_dims
    if p.mask is not None and p.sparsity is None:
        return ("flex takes no mask tensor here: FlexAttention could read it in a score_mod, but that is slower "
                "than the fused SDPA kernels that take a bias")
    if p.dropout and not kernel.dropout:
        return f"{kernel.name} has no dropout"
    if reason := _dtype(kernel, p):
        return reason
    if not (dims.low <= p.head_dim <= dims.high and dims.low <= p.value_dim <= dims.high):
        return f"flex needs head dims in [{dims.low}, {dims.high}] (got {p.head_dim} for q/k, {p.value_dim} for v)"
    if not hardware.triton_usable:
        return "flex needs Triton (its fused kernel is an Inductor Triton template); Triton is not usable here"
    if not p.compiled:
        return "flex is fused only in a compiled graph; eagerly it is the unfused reference (scores materialized)"
    if hardware.vendor == "nvidia" and (cc is None or cc < (7, 0)):
        return "flex needs compute capability >= 7.0 (Triton)"
    if hardware.vendor == "nvidia" and p.dtype == torch.bfloat16 and cc < (8, 0):
        return "flex in bf16 needs compute capability >= 8.0 (Triton's bf16 dot)"
    return None


def flash_attn_limits(kernel: AttentionKernel, p: AttentionProblem, hardware: HardwareInfo) -> Optional[str]:
    """flash-attn 2's limits (its README and ``flash_attn_interface.py``)."""
    cc = hardware.compute_capability
    if hardware.flash_attn_version is None:
        return "flash_attn: the flash-attn package is not installed"
    if _version_tuple(hardware.flash_attn_version) < _FLASH_ATTN_MIN_VERSION:
        return (f"flash_attn: flash-attn {hardware.flash_attn_version} is older than 2.7, whose kernels are the first "
                "that torch.compile can trace")
    if p.mask is not None:
        return "flash_attn takes no mask tensor"
    if reason := _dtype(kernel, p):
        return reason
    if p.head_dim > kernel.head_dims.high or p.value_dim != p.head_dim:
        return (f"flash_attn needs head dim <= {kernel.head_dims.high} and equal for q/k and v "
                f"(got {p.head_dim} and {p.value_dim})")
    if reason := _bottom_right_causal(kernel, p):  # flash-attn >= 2.1 aligns causal to the bottom right
        return reason
    if hardware.vendor == "nvidia":
        if cc is None or cc < (8, 0):
            return "flash_attn needs compute capability >= 8.0 (FlashAttention-2)"
        if p.training and p.dropout and p.head_dim > 192 and cc not in _FLASH_ATTN_BIG_HEAD_BWD_CC:
            return "flash_attn's backward for head dim > 192 with dropout needs an sm80/sm90 GPU"
    return None


def cudnn_band_limits(kernel: AttentionKernel, p: AttentionProblem, hardware: HardwareInfo, *,
                      fused: AttentionKernel) -> Optional[str]:
    """The cuDNN frontend's banded attention: a causal sliding window with equal lengths, then the limits of
    cuDNN's fused attention itself (``fused``: the ``"cudnn"`` record: dtypes, head dims, GPU)."""
    pattern = None if p.sparsity is None else p.sparsity[:3]
    if band_window(pattern, p.q_shape[-2], p.k_shape[-2]) is None:
        return "cudnn_band computes a causal sliding window (a recognized band 0 <= i - j <= w, Lq == Lk) only"
    if hardware.cudnn_frontend_version is None:
        return "cudnn_band: the nvidia-cudnn-frontend package is not installed (extra 'cudnn')"
    if _version_tuple(hardware.cudnn_frontend_version) < _CUDNN_FRONTEND_MIN_VERSION:
        minimum = ".".join(map(str, _CUDNN_FRONTEND_MIN_VERSION))
        return (f"cudnn_band: nvidia-cudnn-frontend {hardware.cudnn_frontend_version} is older than {minimum}, the "
                "release its cuDNN graphs are built and tested with")
    if p.dropout and not kernel.dropout:
        return f"{kernel.name} has no dropout"
    if p.training and p.cuda_graphs and not kernel.trains_in_cuda_graphs:
        # Its backward's CUDA-graph capture failed once another band problem had run (docs/attention.md).
        return "cudnn_band trains without CUDA graphs only (its backward failed CUDA-graph capture on the H100)"
    if p.value_dim != p.head_dim:
        return f"cudnn_band needs equal q/k and v head dims (got {p.head_dim} and {p.value_dim})"
    reason = fused.why_not(p, hardware)
    return None if reason is None else f"cudnn_band runs cuDNN's fused attention: {reason}"


# ------------------------------------------------------------------------- what the hardware must have


def needs_cudnn_attention(hardware: HardwareInfo) -> Optional[str]:
    return None if hardware.cudnn_attention else "needs cuDNN >= 9 and compute capability >= 8.0"


def needs_ampere_on_nvidia(hardware: HardwareInfo) -> Optional[str]:
    """PyTorch's flash kernel: FlashAttention-2 on NVIDIA from sm80; ROCm builds have their own."""
    cc = hardware.compute_capability
    if hardware.vendor == "nvidia" and (cc is None or cc < (8, 0)):
        return f"flash SDPA needs compute capability >= 8.0 (this GPU: {cc})"
    return None


def needs_triton(hardware: HardwareInfo) -> Optional[str]:
    return None if hardware.triton_usable else "needs Triton"


def needs_flash_attn(hardware: HardwareInfo) -> Optional[str]:
    return None if hardware.flash_attn_version else "flash-attn is not installed (extra 'flash')"


def needs_cudnn_frontend(hardware: HardwareInfo) -> Optional[str]:
    return None if hardware.cudnn_frontend_version else "nvidia-cudnn-frontend is not installed (extra 'cudnn')"
