"""Kernel families that more than one backend can dispatch to."""

from __future__ import annotations

from kernel_pytorch.backends.base import Kernel

__all__ = ["triton_kernel", "flash_attn_kernel", "sdpa_kernel"]

triton_kernel = Kernel(
    "triton", "Triton kernels (kernel_pytorch's fused ops, Inductor's generated code)",
    lambda hw: None if hw.triton_usable else "Triton is not usable on this device",
)
flash_attn_kernel = Kernel(
    "flash-attn", "the flash-attn package's kernels",
    lambda hw: None if hw.flash_attn_version else "flash-attn is not installed (extra 'flash')",
)
sdpa_kernel = Kernel("sdpa", "torch.nn.functional.scaled_dot_product_attention's kernels for this device")
