"""Intel GPUs (XPU): SDPA and Inductor."""

from __future__ import annotations

from kernel_pytorch.backends.base import Backend
from kernel_pytorch.backends.kernels import attention_kernels

__all__ = ["IntelBackend"]


class IntelBackend(Backend):
    vendor = "intel"
    compiler = "inductor"
    compile_by_default = True
    kernels = attention_kernels("intel")
