"""Fused kernels as ``torch.library`` custom ops, each with a fake implementation and an autograd formula."""

from __future__ import annotations

from kernel_pytorch.ops.attention import ATTENTION_KERNELS, attention, kernel_device

__all__ = ["attention", "ATTENTION_KERNELS", "kernel_device"]
