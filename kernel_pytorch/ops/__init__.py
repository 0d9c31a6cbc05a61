"""Fused kernels as ``torch.library`` custom ops, each with a fake implementation and an autograd formula."""

from __future__ import annotations

from kernel_pytorch.ops.activations import activation, gated_activation, gated_activation_packed, linear_activation
from kernel_pytorch.ops.attention import ATTENTION_KERNELS, attention, kernel_device
from kernel_pytorch.ops.float8_linear import Float8Linear, float8_eligible, float8_linear
from kernel_pytorch.ops.layer_norm import LayerNorm, layer_norm
from kernel_pytorch.ops.rms_norm import RMSNorm, rms_norm
from kernel_pytorch.ops.rope import apply_rope
from kernel_pytorch.ops.triton_utils import MAX_HIDDEN

__all__ = ["attention", "ATTENTION_KERNELS", "kernel_device", "rms_norm", "RMSNorm", "layer_norm", "LayerNorm",
           "activation", "gated_activation", "gated_activation_packed", "linear_activation", "apply_rope",
           "Float8Linear", "float8_linear", "float8_eligible",
           "MAX_HIDDEN"]
