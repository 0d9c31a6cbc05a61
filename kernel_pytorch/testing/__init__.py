"""Reference models written the plain way, as model code in the wild spells them.

Tests, demos and benchmarks use these to check that ``optimize`` finds and rewrites real patterns;
they are public so that users can reproduce the project's measurements.
"""

from __future__ import annotations

from kernel_pytorch.testing.llama_style import (
    LlamaStyleAttention,
    LlamaStyleBlock,
    LlamaStyleConfig,
    LlamaStyleLM,
    LlamaStyleMLP,
    RMSNorm,
    apply_rotary,
    rotary_tables,
)

__all__ = ["LlamaStyleConfig", "LlamaStyleLM", "LlamaStyleBlock", "LlamaStyleAttention", "LlamaStyleMLP",
           "RMSNorm", "apply_rotary", "rotary_tables"]
