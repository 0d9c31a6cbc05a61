"""Prefills of unpadded prompts into an empty cache: causal attention over the prompt, not a mask over the cache.

A lane's prefill over its static cache attends from every prompt token to every cache slot through a mask:
transformers drops the mask (SDPA's ``is_causal``: flash and cuDNN kernels that skip the blocks above the diagonal,
over the prompt's keys only) only where it can read on the host that the cache is empty, which a traced call over a
static cache, whose token counter is a tensor, cannot. So a prompt whose rows have no padding runs into a fresh
``DynamicCache`` (:class:`EmptyCachePrefill`): its length is a Python 0 while tracing, and transformers passes
``is_causal`` or builds a causal mask over the prompt alone, which the attention pass proves causal. Its keys and
values are then copied into the lane's static cache (:func:`fill_static_cache`).

Prompt buckets (prefill graphs) pad such a prompt on the right, where causal attention keeps the padding from every
real token: the logits are read at the last real token, the cache's counters stop after it, and decoding overwrites
the padding's slots (masked until then). Left-padded batches keep the masked prefill over the static cache.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kernel_pytorch.compiled_call import call_module
from kernel_pytorch.features.generation.model_calls import cache_keyword, is_encoder_decoder, takes_logits_to_keep

__all__ = ["EmptyCachePrefill", "empty_cache_refusal", "static_layers_refusal", "fill_static_cache"]


def empty_cache_refusal(model: nn.Module) -> str:
    """Why ``model``'s unpadded prompts cannot prefill into an empty cache, or ``""``."""
    if is_encoder_decoder(model):
        return "an encoder-decoder's decoder prompt is its start token"
    if not takes_logits_to_keep(model):
        return f"{type(model).__name__}.forward takes no logits_to_keep (the last real token's logits)"
    try:
        from transformers import DynamicCache  # noqa: F401
    except ImportError:
        return "this transformers version has no DynamicCache"
    return ""


def static_layers_refusal(layers: list) -> str:
    """Why keys and values cannot be copied into these static cache layers (each needs its tensors and a token
    counter tensor), or ``""``."""
    for layer in layers:
        if not all(isinstance(getattr(layer, name, None), torch.Tensor)
                   for name in ("keys", "values", "cumulative_length")):
            return f"{type(layer).__name__} keeps no keys, values and token counter tensors"
    return ""


class EmptyCachePrefill(nn.Module):
    """``model`` run on a prompt with no padding into a fresh transformers ``DynamicCache``: returns the logits of
    position ``last_position`` (a one-element index tensor: the last real token of a right-padded prompt) and each
    layer's keys and values. The model is held, not registered (the report names its modules
    ``causal_lm.model.layers.0...``): this wrapper has no parameters or state of its own."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.__dict__["causal_lm"] = model  # not a submodule: this wrapper's state_dict and parameters() stay empty
        self.keyword = cache_keyword(model)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, last_position: torch.Tensor
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        from transformers import DynamicCache

        cache = DynamicCache()
        output = call_module(self.causal_lm, input_ids=input_ids, position_ids=position_ids, use_cache=True,
                             logits_to_keep=last_position, **{self.keyword: cache})
        layers = cache.layers
        return (output.logits[:, 0], tuple(layer.keys for layer in layers), tuple(layer.values for layer in layers))


def fill_static_cache(layers: list, keys: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...],
                      tokens: torch.Tensor) -> None:
    """Each static layer's first slots set to the prefill's keys and values, and its token counter to ``tokens`` (a
    one-element tensor: the real tokens, so the next token goes right after them)."""
    count = tokens.reshape(())
    for layer, key, value in zip(layers, keys, values, strict=True):
        length = key.shape[2]
        layer.keys[:, :, :length].copy_(key)
        layer.values[:, :, :length].copy_(value)
        layer.cumulative_length.copy_(count)
