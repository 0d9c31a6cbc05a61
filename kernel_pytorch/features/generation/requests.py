"""Which ``generate()`` calls the static-cache loop serves, read the way transformers reads them: a request
(``LoopRequest``: greedy or sampling), or the reason it goes to transformers' own loop."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from kernel_pytorch.features.generation.host_steps import stopping_criteria
from kernel_pytorch.features.generation.model_calls import is_encoder_decoder
from kernel_pytorch.features.generation.sampling import SamplingSettings

__all__ = ["LoopRequest", "loop_request"]

# GenerationConfig fields the loop honours; any other field away from its default sends the call to transformers.
_HONOURED_FIELDS = {"max_new_tokens", "max_length", "min_new_tokens", "min_length", "eos_token_id", "pad_token_id",
                    "bos_token_id", "decoder_start_token_id", "use_cache", "transformers_version", "_from_model_config",
                    "cache_implementation", "max_time", "stop_strings", "do_sample", "num_beams",
                    "num_return_sequences"}  # the last 3: checked by name
# Sampling settings that greedy decoding ignores (transformers warns about them and does the same); of them, the
# sampling loop honours the first three.
_SAMPLING_HONOURED = ("temperature", "top_k", "top_p")
_SAMPLING_ONLY = {*_SAMPLING_HONOURED, "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"}
# transformers' values for unset sampling settings (GenerationConfig's defaults before 5.x, its global defaults after)
_SAMPLING_DEFAULTS = SamplingSettings()
# generate() arguments that are not GenerationConfig fields and change the loop.
_LOOP_ARGUMENTS = ("logits_processor", "prefix_allowed_tokens_fn", "synced_gpus",
                   "assistant_model", "negative_prompt_ids", "negative_prompt_attention_mask",
                   "custom_generate", "assistant_tokenizer")


@dataclass
class LoopRequest:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    max_new_tokens: int
    min_new_tokens: int
    eos: list[int]
    pad: int
    sampling: SamplingSettings | None  # None: greedy
    streamer: Any = None  # a transformers streamer: the prompt, then each step's tokens
    criteria: list = field(default_factory=list)  # stopping criteria the host asks after each step (HostSteps)


def loop_request(model: nn.Module, inputs: Any, generation_config: Any, kwargs: dict[str, Any]) -> LoopRequest | str:
    """The request of ``model.generate(inputs, generation_config, **kwargs)``, or why the loop cannot serve it."""
    kwargs = dict(kwargs)
    streamer, user_criteria = kwargs.pop("streamer", None), kwargs.pop("stopping_criteria", None)
    tokenizer = kwargs.pop("tokenizer", None)  # transformers reads stop_strings with it
    for name in _LOOP_ARGUMENTS:
        if kwargs.pop(name, None) is not None:
            return f"generate({name}=...)"
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return "a call without an input_ids tensor of token ids (batch x length)"
    attention_mask = kwargs.pop("attention_mask", None)
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = config.update(**kwargs)
    if unused:
        return f"generate({', '.join(sorted(unused))}=...)"
    reason = _unhonoured_setting(config)
    if reason:
        return reason
    if config.stop_strings and tokenizer is None:  # transformers' own error then
        return "stop_strings without a tokenizer"
    prompt = 1 if is_encoder_decoder(model) else input_ids.shape[1]  # the decoder's length: its start token
    max_new = config.max_new_tokens if config.max_new_tokens is not None else (config.max_length or 20) - prompt
    if max_new <= 0:
        return f"max_length={config.max_length} leaves no new token after a prompt of {prompt}"
    eos = _token_list(config.eos_token_id)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    if attention_mask is None:
        attention_mask = _inferred_attention_mask(input_ids, config.pad_token_id, eos)
    copies = config.num_return_sequences or 1
    if copies > 1:  # sampled sequences per prompt: rows repeated in place, as transformers expands them
        input_ids, attention_mask = input_ids.repeat_interleave(copies, 0), attention_mask.repeat_interleave(copies, 0)
    min_new = config.min_new_tokens or max(0, (config.min_length or 0) - prompt)
    return LoopRequest(input_ids, attention_mask, max_new, min_new, eos, pad,
                       _sampling_settings(config) if config.do_sample else None, streamer,
                       stopping_criteria(user_criteria, config.max_time, config.stop_strings, tokenizer))


def _unhonoured_setting(config: Any) -> str | None:
    if config.do_sample:
        for name in sorted(_SAMPLING_ONLY - set(_SAMPLING_HONOURED)):
            if getattr(config, name, None) not in (None, 0.0, 1.0):
                return (f"sampling with {name}={getattr(config, name)!r} (the loop samples with temperature, top_k, "
                        "top_p)")
    if config.num_beams not in (None, 1):  # None: unset (transformers >= 5.2x), which means 1
        return f"beam search (num_beams={config.num_beams})"
    # transformers raises for it: in config.update above, or in its own generate where update does not validate
    if (config.num_return_sequences or 1) > 1 and not config.do_sample:
        return f"num_return_sequences={config.num_return_sequences} without sampling"
    if config.use_cache is False:
        return "use_cache=False"
    if config.cache_implementation not in (None, "static"):
        return f"cache_implementation={config.cache_implementation!r}"
    for name, value in config.to_diff_dict().items():
        # None and False leave a setting off, whichever of them this transformers version writes as its default
        if name not in _HONOURED_FIELDS and name not in _SAMPLING_ONLY and value not in (None, False, {}, []):
            return f"generation setting {name}={value!r}"
    return None


def _sampling_settings(config: Any) -> SamplingSettings:
    values = {name: getattr(config, name, None) for name in _SAMPLING_HONOURED}
    return SamplingSettings(**{name: getattr(_SAMPLING_DEFAULTS, name) if value is None else value
                               for name, value in values.items()})


def _token_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1)]
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _inferred_attention_mask(input_ids: torch.Tensor, pad: int | None, eos: list[int]) -> torch.Tensor:
    """transformers' rule: mask the pad tokens when the prompt holds some and pad is not an EOS token."""
    if pad is not None and pad not in eos and bool((input_ids == pad).any()):
        return input_ids.ne(pad).long()
    return torch.ones_like(input_ids)
