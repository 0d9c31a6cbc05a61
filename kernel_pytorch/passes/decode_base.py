"""What the passes for decode steps share: Triton kernels for NVIDIA and AMD GPUs, applied to inference graphs."""

from __future__ import annotations

from typing import ClassVar

import torch.fx

from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult

__all__ = ["DecodeStepPass"]

_VENDORS = ("nvidia", "amd")


class DecodeStepPass(GraphPass):
    """A graph pass whose kernel (``kernel``, in words) is a Triton kernel for NVIDIA and AMD GPUs, without a
    backward: training graphs are left alone (a decode step does not train; they have many rows anyway), the
    others go to :meth:`rewrite_step`."""

    kernel: ClassVar[str]

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        return result if ctx.training else self.rewrite_step(gm, ctx, result)

    def rewrite_step(self, gm: torch.fx.GraphModule, ctx: PassContext, result: PassResult) -> PassResult:
        raise NotImplementedError

    def unavailable_reason(self, hardware) -> str | None:
        if hardware.vendor not in _VENDORS or not hardware.triton_usable:
            return f"{self.kernel} is a Triton kernel for NVIDIA and AMD GPUs; this is {hardware.vendor}"
        return None
