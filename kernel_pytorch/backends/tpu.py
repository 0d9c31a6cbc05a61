"""Google TPUs through torch_xla: no Triton, XLA-lowerable ops only, the openxla compiler."""

from __future__ import annotations

from kernel_pytorch.backends.base import Backend
from kernel_pytorch.backends.kernels import attention_kernels

__all__ = ["TpuBackend"]


class TpuBackend(Backend):
    vendor = "tpu"
    compiler = "openxla"
    compile_by_default = True
    # No norms, activations or rope passes: their ops are Triton or native custom ops, opaque to XLA,
    # which fuses such elementwise and row-wise code itself.
    graph_passes = ("normalize", "attention")
    kernels = attention_kernels("tpu")
