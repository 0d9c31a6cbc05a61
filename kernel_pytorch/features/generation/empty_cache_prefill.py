"""Prefills into an empty cache: causal attention over the prompt, not a mask over the static cache.

A lane's prefill over its static cache attends from every prompt token to every cache slot through a mask:
transformers drops the mask (SDPA's ``is_causal``: flash and cuDNN kernels that skip the blocks above the diagonal,
over the prompt's keys only) only where it can read on the host that the cache is empty and nothing is padded, which
a traced call over a static cache, whose token counter is a tensor, cannot. So the prompt runs into a fresh
``DynamicCache`` (:class:`EmptyCachePrefill`): its length is a Python 0 while tracing, and transformers passes
``is_causal`` or builds a causal mask over the prompt alone, which the attention pass proves causal.

Padding would need a mask, so each row is rolled first (:func:`rolled_prompt`): a left-padded row's tokens move to
the front, its padding (and a prompt bucket's, :mod:`~kernel_pytorch.features.generation.prefill_graphs`) after them,
where causal attention keeps it from every real token; positions count from 0 as the left-padded row's do. The logits
are read at each row's last real token. The fresh cache's layers keep nothing: each layer's keys and values go
straight to the lane's static cache, scattered back to the left-padded layout (:func:`scatter_into`), so the decode
steps see what a masked prefill would have left there, and no layer's prompt keys outlive its attention.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from kernel_pytorch.compiled_call import call_module
from kernel_pytorch.features.generation.model_calls import cache_keyword, is_encoder_decoder, takes_logits_to_keep

__all__ = ["EmptyCachePrefill", "RolledPrompt", "empty_cache_refusal", "static_layers_refusal", "is_left_padded",
           "rolled_prompt", "scatter_into"]


def empty_cache_refusal(model: nn.Module) -> str:
    """Why ``model``'s prompts cannot prefill into an empty cache, or ``""``."""
    if is_encoder_decoder(model):
        return "an encoder-decoder's decoder prompt is its start token"
    if not takes_logits_to_keep(model):
        return f"{type(model).__name__}.forward takes no logits_to_keep (the last real token's logits)"
    return ""


def static_layers_refusal(layers: list) -> str:
    """Why keys and values cannot be copied into these static cache layers (each needs its tensors and a token
    counter tensor), or ``""``."""
    for layer in layers:
        if not all(isinstance(getattr(layer, name, None), torch.Tensor)
                   for name in ("keys", "values", "cumulative_length")):
            return f"{type(layer).__name__} keeps no keys, values and token counter tensors"
    return ""


def is_left_padded(attention_mask: torch.Tensor) -> bool:
    """Whether each row of ``attention_mask`` is padding then tokens, with a token last (a host sync)."""
    steps = attention_mask[:, 1:].long() - attention_mask[:, :-1].long()
    return bool(((steps >= 0).all() & attention_mask[:, -1].bool().all()).item())


class RolledPrompt(NamedTuple):
    """A left-padded prompt's rows rolled to start with their tokens (``input_ids``, ``positions``: row by row from
    0), where each rolled column's slot in the left-padded layout is ``slot_of``, and each row's last token is
    ``last``; ``written``: the prompt's width, the slots the cache holds afterwards (one element)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor
    slot_of: torch.Tensor
    written: torch.Tensor


def rolled_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor, written: torch.Tensor) -> RolledPrompt:
    """The rows of a left-padded prompt (``input_ids``, ``attention_mask``: batch x S, the prompt in the first
    ``written`` columns and zeros after, as a prompt bucket pads it) rolled left by their padding; no host sync."""
    slots = input_ids.shape[1]
    tokens = attention_mask.sum(-1)
    columns = torch.arange(slots, device=input_ids.device)
    slot_of = (columns + (written - tokens).unsqueeze(1)) % slots
    positions = columns.repeat(input_ids.shape[0], 1)  # a tensor of its own: a view's base would be guarded on
    return RolledPrompt(input_ids.gather(1, slot_of), positions, tokens - 1, slot_of, written)


class EmptyCachePrefill(nn.Module):
    """``model`` run on prompt rows without padding (but at their end) with a fresh transformers ``DynamicCache``
    whose layers write through to ``static_layers`` (column ``j`` of row ``r`` at slot ``slot_of[r, j]``): returns
    the logits of each row's position ``last_position[row]``. The model is held, not registered (the report names its
    modules ``causal_lm.model.layers.0...``): this wrapper has no parameters or state of its own."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.__dict__["causal_lm"] = model  # not a submodule: this wrapper's state_dict and parameters() stay empty
        self.keyword = cache_keyword(model)
        self.write_through_layer = _write_through_layer_class()  # defined here: TorchDynamo cannot trace a class body

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, last_position: torch.Tensor,
                slot_of: torch.Tensor, static_layers: list) -> torch.Tensor:
        from transformers import DynamicCache

        cache = DynamicCache()
        cache.layers = [self.write_through_layer(layer, slot_of) for layer in static_layers]
        output = call_module(self.causal_lm, input_ids=input_ids, position_ids=position_ids, use_cache=True,
                             logits_to_keep=last_position, **{self.keyword: cache})
        # logits_to_keep picks the same positions in every row: row r's own is the diagonal's r-th
        return output.logits.diagonal(dim1=0, dim2=1).transpose(0, 1)


@functools.cache
def _write_through_layer_class() -> type:
    """A ``DynamicLayer`` that keeps nothing: an update goes to a static layer's slots, and the attention reads the
    prompt's own keys and values. Empty to transformers (a Python 0 while tracing), so it attends causally."""
    from transformers.cache_utils import DynamicLayer

    class WriteThroughLayer(DynamicLayer):
        def __init__(self, static_layer: Any, slot_of: torch.Tensor):
            super().__init__()
            self.static_layer, self.slot_of = static_layer, slot_of

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            scatter_into(self.static_layer, key_states, value_states, self.slot_of)
            return key_states, value_states

    return WriteThroughLayer


def scatter_into(layer: Any, key: torch.Tensor, value: torch.Tensor, slot_of: torch.Tensor) -> None:
    """A static layer's first slots set to a rolled prefill's keys and values, column ``j`` of row ``r`` at slot
    ``slot_of[r, j]`` (a permutation per row)."""
    index = slot_of[:, None, :, None].expand_as(key)
    length = key.shape[2]
    layer.keys[:, :, :length].scatter_(2, index, key)
    layer.values[:, :, :length].scatter_(2, index, value)
