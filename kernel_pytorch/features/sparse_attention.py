"""Content-aware top-k sparse attention as a feature: ``optimize(model, sparse_attention="topk")`` (the attention
pass applies it; ``kernel_pytorch.attention.kernels.topk_sparse`` holds the kernel side). An approximation: the config
turns ``verify='auto'`` off with it, and the attention rewrite lines give its error measured against dense."""

from __future__ import annotations

import torch.nn as nn

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.features.base import Feature, OptimizeRun, register_feature

__all__ = ["SparseAttentionFeature"]


@register_feature
class SparseAttentionFeature(Feature):
    name = "sparse_attention"

    @classmethod
    def enabled(cls, config: OptimizeConfig) -> bool:
        return config.sparse_attention is not None

    def install(self, model: nn.Module, run: OptimizeRun) -> None:
        run.report.notes.append("not verified: sparse_attention is an approximation (the config turns verify off "
                                "with it); the attention rewrite lines give its error measured against dense attention")
