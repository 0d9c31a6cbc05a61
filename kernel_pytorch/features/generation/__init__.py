"""Fast ``generate()`` for transformers causal LMs: a static KV cache, one compiled decode step per (batch, cache
length) lane, replayed from a CUDA graph on NVIDIA GPUs (docs/usage.md, "Generation")."""

from kernel_pytorch.features.generation.decoder import Decoder, GenerationLimitError
from kernel_pytorch.features.generation.fast_generate import FastGenerate
from kernel_pytorch.features.generation.feature import GenerationFeature

__all__ = ["Decoder", "FastGenerate", "GenerationFeature", "GenerationLimitError"]
