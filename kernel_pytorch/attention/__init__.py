"""Attention dispatch: which fused kernel runs a given attention problem on the hardware found.

Kernels beyond PyTorch's own fused SDPA kernels live beside the dispatcher: FlexAttention
(:mod:`kernel_pytorch.attention.flex`) and the flash-attn package (:mod:`kernel_pytorch.attention.flash_attn`).
"""

from __future__ import annotations

from kernel_pytorch.attention.dispatch import (
    MEASURED_ONLY,
    PREFERENCE,
    AttentionProblem,
    choose_kernel,
    eligible_kernels,
)

__all__ = ["AttentionProblem", "choose_kernel", "eligible_kernels", "PREFERENCE", "MEASURED_ONLY"]
