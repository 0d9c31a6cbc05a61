"""NVIDIA GPUs: Triton kernels, cuDNN / flash attention, FP8 from compute capability 8.9, Inductor."""

from __future__ import annotations

from kernel_pytorch.backends.base import Backend, Kernel
from kernel_pytorch.backends.kernels import attention_kernels, triton_kernel

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
        *attention_kernels("nvidia"),
        Kernel("fp8-scaled-mm", "FP8 matmuls through torch._scaled_mm", _needs_capability(8, 9, "FP8")),
        Kernel("transformer-engine", "transformer-engine FP8 modules and recipes",
               lambda hw: None if hw.transformer_engine_version else "transformer-engine is not installed (extra 'te')"),
    )
