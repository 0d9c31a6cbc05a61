"""CPUs: SDPA's CPU kernels, fused native ops; Inductor's C++ backend on request (``compile=True``)."""

from __future__ import annotations

from kernel_pytorch.backends.base import Backend, Kernel
from kernel_pytorch.backends.kernels import attention_kernels

__all__ = ["CpuBackend"]


class CpuBackend(Backend):
    vendor = "cpu"
    compiler = "inductor"
    # Compiling costs seconds to minutes of C++ builds per graph; off unless asked for.
    compile_by_default = False
    kernels = (
        *attention_kernels("cpu"),
        Kernel("native-fused", "fused native CPU ops (F.rms_norm, F.layer_norm)"),
        Kernel("amx", "AMX tiles for bf16 matmuls (oneDNN)",
               lambda hw: None if "amx_bf16" in hw.cpu_isa else "this CPU has no AMX"),
    )
