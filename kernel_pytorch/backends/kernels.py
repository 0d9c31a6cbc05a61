"""Kernel families that more than one backend can dispatch to: Triton, and the attention kernels of each
vendor, read from their records (:mod:`kernel_pytorch.attention.kernels.registry`)."""

from __future__ import annotations

from kernel_pytorch.attention.kernels.registry import KERNELS, PREFERENCE
from kernel_pytorch.backends.base import Kernel

__all__ = ["triton_kernel", "attention_kernels"]

triton_kernel = Kernel(
    "triton", "Triton kernels (kernel_pytorch's fused ops, Inductor's generated code)",
    lambda hw: None if hw.triton_usable else "Triton is not usable on this device",
)


def attention_kernels(vendor: str) -> tuple[Kernel, ...]:
    """The attention kernels the dispatcher may choose on ``vendor``'s hardware, in its preference order.

    Example::

        kernels = (triton_kernel, *attention_kernels("nvidia"))
    """
    records = (KERNELS[name] for name in PREFERENCE[vendor])
    return tuple(Kernel(record.name, record.description, record.requires) for record in records)
