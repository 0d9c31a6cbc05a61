"""Attention dispatch: which fused kernel runs a given attention problem on the hardware found."""

from __future__ import annotations

from kernel_pytorch.attention.dispatch import AttentionProblem, choose_kernel, eligible_kernels

__all__ = ["AttentionProblem", "choose_kernel", "eligible_kernels"]
