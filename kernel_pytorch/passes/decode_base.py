"""What the passes for decode steps share: Triton kernels for NVIDIA and AMD GPUs, applied to inference graphs."""

from __future__ import annotations

from typing import ClassVar

from kernel_pytorch.passes.base import GraphPass

__all__ = ["DecodeStepPass"]

_VENDORS = ("nvidia", "amd")


class DecodeStepPass(GraphPass):
    """A graph pass whose kernel (``kernel``, in words) is a Triton kernel for NVIDIA and AMD GPUs."""

    kernel: ClassVar[str]

    def unavailable_reason(self, hardware) -> str | None:
        if hardware.vendor not in _VENDORS or not hardware.triton_usable:
            return f"{self.kernel} is a Triton kernel for NVIDIA and AMD GPUs; this is {hardware.vendor}"
        return None
