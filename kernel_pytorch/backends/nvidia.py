"""NVIDIA GPUs: Triton kernels, cuDNN / flash SDPA, FP8 from compute capability 8.9, Inductor."""

from __future__ import annotations

from kernel_pytorch.backends.base import Backend, Kernel
from kernel_pytorch.backends.kernels import flash_attn_kernel, triton_kernel

__all__ = ["NvidiaBackend"]


def _needs_capability(major: int, minor: int, what: str):
    def requires(hardware) -> str | None:
        cc = hardware.compute_capability
        if cc is None or cc < (major, minor):
            return f"{what} needs compute capability >= {major}.{minor} (this GPU: {cc})"
        return None

    return requires


class NvidiaBackend(Backend):
    vendor = "nvidia"
    compiler = "inductor"
    compile_by_default = True
    kernels = (
        triton_kernel,
        Kernel("sdpa-cudnn", "cuDNN fused attention through SDPA (fastest measured on H100: 613 TFLOP/s)",
               lambda hw: None if hw.cudnn_attention else "needs cuDNN >= 9 and compute capability >= 8.0"),
        Kernel("sdpa-flash", "FlashAttention-2 through SDPA", _needs_capability(8, 0, "flash SDPA")),
        Kernel("sdpa-efficient", "memory-efficient SDPA (any dtype, arbitrary masks)"),
        Kernel("flex-attention", "FlexAttention block-sparse kernels (Triton)",
               lambda hw: None if hw.triton_usable else "needs Triton"),
        Kernel("fp8-scaled-mm", "FP8 matmuls through torch._scaled_mm", _needs_capability(8, 9, "FP8")),
        flash_attn_kernel,
        Kernel("cudnn-band-attention", "cuDNN's causal sliding-window attention (a graph of the cuDNN frontend)",
               lambda hw: None if hw.cudnn_frontend_version
               else "nvidia-cudnn-frontend is not installed (extra 'cudnn')"),
        Kernel("transformer-engine", "transformer-engine FP8 modules and recipes",
               lambda hw: None if hw.transformer_engine_version else "transformer-engine is not installed (extra 'te')"),
    )
