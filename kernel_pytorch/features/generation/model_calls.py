"""How a transformers model is called for generation: which models take the fast path (causal LMs, and
encoder-decoders such as T5), the keyword its forward takes the KV cache by, and the static caches. Everything
version-dependent about transformers is here."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

__all__ = ["why_not_generative", "cache_keyword", "takes_logits_to_keep", "new_static_cache", "cache_bytes",
           "default_max_length", "is_encoder_decoder", "decoder_start_token"]

_DEFAULT_MAX_LENGTH = 4096


def why_not_generative(model: nn.Module) -> str | None:
    """Why ``model`` cannot take the fast generate() path, or None when it can."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(model, "generate", None)):
        return f"{type(model).__name__} is not a transformers model with generate()"
    if is_encoder_decoder(model) and not _takes_encoder_outputs(model):
        return f"{type(model).__name__}.forward takes no encoder_outputs and decoder_input_ids"
    if not _static_cache_class():
        return "this transformers version has no StaticCache"
    if cache_keyword(model) is None:
        return f"{type(model).__name__}.forward takes no KV cache argument"
    if _has_sliding_layers(model):
        return ("attention layers with a rolling cache (chunked or other sliding kinds): transformers counts their "
                "tokens in a Python int, which a compiled or captured decode step would freeze")
    return None


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def _takes_encoder_outputs(model: nn.Module) -> bool:
    parameters = inspect.signature(model.forward).parameters
    return callable(getattr(model, "get_encoder", None)) and {"encoder_outputs", "decoder_input_ids",
                                                              "decoder_attention_mask"} <= parameters.keys()


def decoder_start_token(model: nn.Module) -> int:
    """The token an encoder-decoder's output starts with (its generation config's, else its config's, else 0)."""
    for source in (getattr(model, "generation_config", None), model.config):
        token = getattr(source, "decoder_start_token_id", None)
        if token is not None:
            return int(token)
    return 0


def _has_sliding_layers(model: nn.Module) -> bool:
    """Whether a static cache still has rolling layers once the sliding-window ones are made full length."""
    cache = _with_full_length_layers(_static_cache_class()(config=model.config, max_cache_len=1), 1)
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()))


def _with_full_length_layers(cache: Any, length: int) -> Any:
    """``cache`` with each sliding-window layer replaced by a full-length static layer.

    transformers' sliding-window layer rolls its window and counts tokens in a Python int: a compiled step would
    recompile at every token, a captured one would freeze the count. A full-length layer keeps every token at its
    absolute slot, and the model's sliding-window mask (built from absolute slots) hides the old ones, as it does
    over transformers' own dynamic cache. It holds ``length`` tokens instead of the window.
    """
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    for index, layer in enumerate(getattr(cache, "layers", ())):
        if type(layer) is StaticSlidingWindowLayer:
            cache.layers[index] = StaticLayer(max_cache_len=length)
    return cache


def cache_keyword(model: nn.Module) -> str | None:
    """'cache' (transformers >= 5.24) or 'past_key_values' (before): how forward takes the KV cache."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    return None


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether forward can compute the LM head on the last position only (the prefill needs no other logits)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def default_max_length(model: nn.Module) -> int:
    """The model's ``max_position_embeddings``: the longest cache a request may need (each request's lane is only
    as long as it needs, so the ceiling costs nothing until used)."""
    return getattr(model.config, "max_position_embeddings", None) or _DEFAULT_MAX_LENGTH


def new_static_cache(model: nn.Module, batch: int, length: int, device: torch.device, dtype: torch.dtype,
                     encoder_length: int | None = None) -> Any:
    """A transformers ``StaticCache`` of ``batch`` x ``length`` tokens, allocated now (with ``encoder_length``: an
    ``EncoderDecoderCache`` whose cross-attention cache holds that many encoder tokens); running out of memory for
    it is an error naming its size."""
    caches = [_allocated_cache(model, batch, n, device, dtype) for n in (length, encoder_length) if n]
    if encoder_length is None:
        return caches[0]
    from transformers import EncoderDecoderCache

    return EncoderDecoderCache(*caches)


def _allocated_cache(model: nn.Module, batch: int, length: int, device: torch.device, dtype: torch.dtype) -> Any:
    cache = _with_full_length_layers(_static_cache_class()(config=model.config, max_cache_len=length), length)
    layers, heads, head_dim = _kv_shape(model)
    try:
        cache.early_initialization(batch_size=batch, num_heads=heads, head_dim=head_dim, dtype=dtype, device=device)
    except torch.OutOfMemoryError as error:
        size = cache_bytes(model, batch, length, dtype) / 2**30
        raise torch.OutOfMemoryError(
            f"the static KV cache for generation ({batch} sequences x {length} tokens x {layers} layers, "
            f"{size:.2f} GiB) does not fit on {device}: lower generation.max_length or generation.batch_buckets"
        ) from error
    return cache


def _kv_shape(model: nn.Module) -> tuple[int, int, int]:
    """(decoder layers, key/value heads, head dim) of the model's caches."""
    config = model.config.get_text_config(decoder=True)
    heads = _kv_heads(config)
    head_dim = (getattr(config, "head_dim", None) or getattr(config, "d_kv", None)
                or config.hidden_size // config.num_attention_heads)
    layers = getattr(config, "num_decoder_layers", None) or config.num_hidden_layers
    return layers, heads, head_dim


def _kv_heads(config: Any) -> int:
    """Key/value heads per layer. Falcon names them ``num_kv_heads``, and its attention keeps one head where
    ``multi_query`` is set (its default) and every query head with ``new_decoder_architecture``."""
    if getattr(config, "model_type", None) == "falcon":
        if config.new_decoder_architecture:
            return config.num_attention_heads
        return 1 if config.multi_query else config.num_kv_heads
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def cache_bytes(model: nn.Module, batch: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values a static cache of ``batch`` x ``length`` tokens holds (sliding layers as full)."""
    layers, heads, head_dim = _kv_shape(model)
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * layers * batch * heads * length * head_dim * element


def _static_cache_class() -> Any:
    try:
        from transformers import StaticCache
    except ImportError:
        return None
    return StaticCache
