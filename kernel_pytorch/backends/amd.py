"""AMD ROCm GPUs: Triton kernels, SDPA, FP8 in the fnuz formats on MI300, Inductor."""

from __future__ import annotations

from kernel_pytorch.backends.base import Backend, Kernel
from kernel_pytorch.backends.kernels import attention_kernels, triton_kernel

__all__ = ["AmdBackend"]


class AmdBackend(Backend):
    vendor = "amd"
    compiler = "inductor"
    compile_by_default = True
    kernels = (
        triton_kernel,
        *attention_kernels("amd"),
        Kernel("fp8-scaled-mm", "FP8 matmuls through torch._scaled_mm (fnuz formats on MI300)",
               lambda hw: None if hw.fp8 else f"no FP8 matrix cores on {hw.gfx_arch or 'this GPU'}"),
    )
