"""``AttentionProblem``: the shapes and options of one attention call, as the kernels' limits read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["AttentionProblem"]


@dataclass(frozen=True)
class AttentionProblem:
    """Shapes and options of one attention call; hashable, so choices are cached per problem.

    Example::

        problem = AttentionProblem.from_tensors(q, k, v, None, is_causal=True, dropout_p=0.0,
                                                enable_gqa=False, training=False)
    """

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    mask: Optional[str]  # None | "bool" | "additive"
    mask_shape: Optional[tuple[int, ...]]
    mask_requires_grad: bool
    is_causal: bool
    dropout: bool
    enable_gqa: bool
    training: bool
    # Whether the rewritten graph will be compiled (Inductor): FlexAttention is fused only then.
    compiled: bool = True
    # Whether that compiled graph runs as CUDA graphs (compile="reduce-overhead"): cudnn_band trains without them.
    cuda_graphs: bool = False
    # A block-structured mask the pass recognized: MaskPattern.sparsity, e.g. ("band", 0, 1023, 0.12) (the
    # pattern of kernel_pytorch.attention.kernels.flex and the 128x128 tile density, None when data-dependent).
    sparsity: Optional[tuple] = None
    # The scores' soft cap (cap * tanh(score / cap) before the mask; Gemma-2), None without one.
    softcap: Optional[float] = None

    @classmethod
    def from_tensors(cls, q, k, v, attn_mask, *, is_causal, dropout_p, enable_gqa, training,
                     compiled: bool = True, sparsity: Optional[tuple] = None,
                     cuda_graphs: bool = False, softcap: Optional[float] = None) -> AttentionProblem:
        mask_kind = None if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "additive")
        return cls(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device.type, mask_kind,
                   None if attn_mask is None else tuple(attn_mask.shape),
                   bool(attn_mask is not None and attn_mask.requires_grad and training), bool(is_causal),
                   bool(dropout_p > 0), bool(enable_gqa), bool(training), bool(compiled), bool(cuda_graphs),
                   None if sparsity is None else tuple(sparsity), None if softcap is None else float(softcap))

    @property
    def head_dim(self) -> int:
        return self.q_shape[-1]

    @property
    def value_dim(self) -> int:
        return self.v_shape[-1]
