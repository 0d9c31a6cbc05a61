"""Intel GPUs (XPU): SDPA and Inductor."""

from __future__ import annotations

from kernel_pytorch.backends.base import Backend
from kernel_pytorch.backends.kernels import sdpa_kernel

__all__ = ["IntelBackend"]


class IntelBackend(Backend):
    vendor = "intel"
    compiler = "inductor"
    compile_by_default = True
    kernels = (sdpa_kernel,)
