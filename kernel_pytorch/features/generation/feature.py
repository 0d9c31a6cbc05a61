"""The generation feature: ``optimize`` replaces a transformers causal LM's ``generate`` by
:class:`~kernel_pytorch.features.generation.fast_generate.FastGenerate` (``generation=`` in the config)."""

from __future__ import annotations

import torch.nn as nn

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.features.base import Feature, OptimizeRun, register_feature
from kernel_pytorch.features.generation.empty_cache_prefill import empty_cache_refusal
from kernel_pytorch.features.generation.fast_generate import FastGenerate
from kernel_pytorch.features.generation.model_calls import why_not_generative

__all__ = ["GenerationFeature"]


@register_feature
class GenerationFeature(Feature):
    name = "generation"

    @classmethod
    def enabled(cls, config: OptimizeConfig) -> bool:
        return config.generation.enabled is not False

    def install(self, model: nn.Module, run: OptimizeRun) -> None:
        reason = why_not_generative(model)
        if reason:
            if run.config.generation.enabled is True:  # asked for by name: say why not; 'auto' stays quiet
                run.report.notes.append(f"generation: generate() left as it is: {reason}")
            return
        model.generate = FastGenerate(model, run.config.generation)
        config = run.config.generation
        graphs = "compiled" if config.cuda_graphs is False else "replayed from CUDA graphs" if \
            config.prefill_graphs is False else "and prefills (in prompt-length buckets) replayed from CUDA graphs"
        prefill = "" if empty_cache_refusal(model) else "; prompts prefill into an empty cache with causal attention"
        run.report.notes.append(f"generation: generate() (greedy, sampling) runs a static-KV-cache loop, decode "
                                f"steps {graphs} on CUDA{prefill} (kernel_pytorch.features.generation)")
