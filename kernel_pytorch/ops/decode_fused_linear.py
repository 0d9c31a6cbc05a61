"""A decode step's norm, projections and gated activation in one GEMV launch.

    out, h = decode_fused_linear(x, [w_gate, w_up], norm_weight=w, eps=eps, residual=r, activation="silu")
    # computes what these three launches compute
    normed, h = rms_norm(x, w, eps, residual=r)                     # h = x + r
    gate, up = grouped_linear(normed, [w_gate, w_up]).split(...)
    out = gated_activation(gate, up, "silu")

At batch 1 a decoder layer's small kernels (the norms, the activation) each cost a launch and a gap of the
order of a small weight's GEMV. Here the grouped GEMV of :mod:`~kernel_pytorch.ops.decode_linear` norms its input
in the same pass over it: the products take ``h * norm_weight`` (h = x + residual, rounded as the norm op rounds
it; program 0 writes it), each row's sum of squares accumulates beside them, and ``1 / sqrt(mean(h²) + eps)``
scales the sums at the end, so no program waits for the statistic before reading weights. With ``activation`` a
program reduces the same rows of the gate and the up weight and writes ``act(gate) * up``.

Numerics: the unfused ops round the normed input to the input's dtype before the products (twice with
``cast_before_weight``); the kernel does not, so in bf16 its outputs differ from theirs by that rounding
(relative ~1e-3; tested at 1e-2), and in float32 by summation order. Each projection and the activation's
product are rounded where the unfused ops round them.

Inference only (no autograd formula), like the grouped GEMV. Off CUDA, or for shapes without a kernel, the
unfused ops' native paths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from kernel_pytorch.ops import decode_linear as gemv
from kernel_pytorch.ops.activations import ACTIVATION_KINDS, gated_activation
from kernel_pytorch.ops.rms_norm import rms_norm

__all__ = ["decode_fused_linear", "unfused"]


def unfused(x: Tensor, norm: Optional[gemv.NormInput], weights: list[Tensor], biases: Optional[list[Tensor]],
            activation: str, linear: Callable[..., Tensor] = gemv.grouped_linear_native) -> tuple[Tensor, Tensor]:
    """What the fused launch replaces, as separate ops: the norm, ``linear(x, weights, biases)`` (the native
    linears for the op's own fallback; the grouped GEMV launch when the decode_fusion pass times them), the
    activation. Returns (out, h), h empty without a residual."""
    h = x.new_empty(0)
    if norm is not None:
        normed = rms_norm(x, norm.weight, norm.eps, norm.residual, cast_before_weight=norm.cast_before_weight,
                          weight_offset=norm.weight_offset)
        x, h = normed if norm.residual is not None else (normed, h)
    out = linear(x, weights, biases)
    if activation:
        gate, up = out.split([w.shape[0] for w in weights], -1)
        out = gated_activation(gate, up, activation)
    return out, h


@torch.library.triton_op("kernel_pytorch::decode_fused_linear", mutates_args=())
def _decode_fused_linear_op(x: Tensor, residual: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
                            cast_before_weight: bool, weights: list[Tensor], biases: list[Tensor],
                            activation: str, norm_weight_offset: float = 0.0,
                            block_n: int = 0) -> tuple[Tensor, Tensor]:
    """``biases``: one per weight or empty; ``activation``: '' or a key of ACTIVATION_KINDS; ``block_n``: as
    :func:`~kernel_pytorch.ops.decode_linear.grouped_gemv`'s. Returns (out, h), h empty without a residual (an op's
    output may not alias its input)."""
    norm = (gemv.NormInput(norm_weight, eps, cast_before_weight, residual, norm_weight_offset)
            if norm_weight is not None else None)
    usable = gemv.use_triton_kernel(x, weights) and (norm is None or norm_weight.is_contiguous()) and (
        residual is None or (residual.shape == x.shape and residual.stride(-1) == 1 and residual.dtype == x.dtype))
    if not usable:
        return unfused(x, norm, weights, biases or None, activation)
    out, h = gemv.grouped_gemv(x, weights, biases or None, norm=norm, activation=activation or None, block_n=block_n)
    return out, (h if h is not None else x.new_empty(0))


def decode_fused_linear(x: Tensor, weights: list[Tensor], biases: Optional[list[Tensor]] = None, *,
                        norm_weight: Optional[Tensor] = None, eps: float = 1e-6, residual: Optional[Tensor] = None,
                        cast_before_weight: bool = False, activation: Optional[str] = None,
                        norm_weight_offset: float = 0.0, block_n: int = 0):
    """``grouped_linear(x, weights, biases)`` for a few token rows, one launch (module docstring), with

    - ``norm_weight``: the input normed first, ``rms_norm(x, norm_weight, eps, residual, cast_before_weight=...,
      weight_offset=norm_weight_offset)``; with ``residual`` the result is ``(output, x + residual)``;
    - ``activation`` (two weights of one shape: gate, up): ``act(gate) * up`` instead of the concatenation;
    - ``block_n``: the weight rows each program of the launch reduces (a power of two; 0: the default tile's), which
      the decode_fusion pass picks by measurement.

    ``x`` (..., K) of at most MAX_ROWS rows. Inference only.

    >>> x, w = torch.randn(1, 1, 64), torch.ones(64)
    >>> gate, up = torch.randn(96, 64), torch.randn(96, 64)
    >>> decode_fused_linear(x, [gate, up], norm_weight=w, activation="silu").shape
    torch.Size([1, 1, 96])
    """
    if not 1 <= len(weights) <= gemv.MAX_WEIGHTS:
        raise ValueError(f"decode_fused_linear takes 1 to {gemv.MAX_WEIGHTS} weights, got {len(weights)}")
    if activation is not None and (activation not in ACTIVATION_KINDS or len(weights) != 2
                                   or weights[0].shape != weights[1].shape):
        raise ValueError(f"decode_fused_linear: activation={activation!r} takes two weights of one shape (gate, up) "
                         f"and one of {sorted(ACTIVATION_KINDS)}")
    if biases is not None and len(biases) != len(weights):
        raise ValueError(f"decode_fused_linear: {len(biases)} biases for {len(weights)} weights")
    if block_n and (block_n < 1 or block_n & (block_n - 1)):
        raise ValueError(f"decode_fused_linear: block_n={block_n} is not a power of two")
    if (residual is not None or norm_weight_offset) and norm_weight is None:
        raise ValueError("decode_fused_linear: a residual or a weight offset belongs to the norm; it needs norm_weight")
    lead, k = x.shape[:-1], x.shape[-1]
    flat_residual = residual.reshape(-1, k) if residual is not None else None
    out, h = _decode_fused_linear_op(x.reshape(-1, k), flat_residual, norm_weight, float(eps), bool(cast_before_weight),
                                     list(weights), list(biases) if biases is not None else [], activation or "",
                                     float(norm_weight_offset), int(block_n))
    out = out.view(*lead, out.shape[-1])
    return (out, h.view(*lead, k)) if residual is not None else out
