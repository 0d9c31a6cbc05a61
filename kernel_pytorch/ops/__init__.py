"""Fused kernels as ``torch.library`` custom ops, each with a fake implementation and an autograd formula."""

from __future__ import annotations

from kernel_pytorch.ops.attention import ATTENTION_KERNELS, attention, kernel_device
from kernel_pytorch.ops.layer_norm import LayerNorm, layer_norm
from kernel_pytorch.ops.rms_norm import RMSNorm, rms_norm
from kernel_pytorch.ops.triton_utils import MAX_HIDDEN

__all__ = ["attention", "ATTENTION_KERNELS", "kernel_device", "rms_norm", "RMSNorm", "layer_norm", "LayerNorm",
           "MAX_HIDDEN"]
