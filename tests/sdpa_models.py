"""Hugging Face models built from tiny configs (no downloads) with their default attention implementation
(SDPA in transformers 5.x; Gemma-2 has no SDPA path there: eager, for its soft-capping) and dropout off, so
that an optimized model and its twin compute the same. Each factory returns (model, inputs, attention calls
per forward); ``padded=True`` adds an attention_mask with a padded second sequence."""

from __future__ import annotations

from typing import Callable

import torch
import transformers

VOCAB = 101


def _decoder_config(cls, **extra):
    return cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, **extra)


def _token_inputs(length: int, padded: bool) -> dict:
    inputs = {"input_ids": torch.randint(0, VOCAB, (2, length))}
    if padded:
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, length - 3:] = 0  # the second sequence padded on the right; every query still sees a key
        inputs["attention_mask"] = mask
    return inputs


def llama(padded: bool = False):
    return transformers.LlamaForCausalLM(_decoder_config(transformers.LlamaConfig)), _token_inputs(10, padded), 2


def qwen2(padded: bool = False):
    return transformers.Qwen2ForCausalLM(_decoder_config(transformers.Qwen2Config)), _token_inputs(10, padded), 2


def qwen3(padded: bool = False):
    model = transformers.Qwen3ForCausalLM(_decoder_config(transformers.Qwen3Config, head_dim=16))
    return model, _token_inputs(10, padded), 2


def mistral(padded: bool = False):
    """A sliding window of 4 over 10 tokens: a band mask, not causal."""
    model = transformers.MistralForCausalLM(_decoder_config(transformers.MistralConfig, sliding_window=4))
    return model, _token_inputs(10, padded), 2


def gpt2(padded: bool = False):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4, n_positions=64,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config), _token_inputs(9, padded), 2


def bert(padded: bool = False):
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=80, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    return transformers.BertModel(config), _token_inputs(11, padded), 2


def t5(padded: bool = False):
    """Encoder self-attention, decoder self-attention and cross-attention per layer: unscaled, with the
    relative position bias (trainable) as an additive mask."""
    config = transformers.T5Config(vocab_size=VOCAB, d_model=48, d_kv=12, d_ff=80, num_layers=1, num_decoder_layers=1,
                                   num_heads=4, dropout_rate=0.0)
    inputs = _token_inputs(9, padded)
    inputs["decoder_input_ids"] = torch.randint(0, VOCAB, (2, 7))
    return transformers.T5Model(config), inputs, 3


FAMILIES: dict[str, Callable] = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "mistral": mistral,
                                 "gpt2": gpt2, "bert": bert, "t5": t5}


def fresh_inputs(inputs: dict) -> dict:
    """New random tokens of the same shapes, and the padding moved (another padded sequence)."""
    fresh = {}
    for key, value in inputs.items():
        if key == "attention_mask":
            mask = torch.ones_like(value)
            mask[0, value.shape[1] - 2:] = 0
            fresh[key] = mask
        else:
            fresh[key] = torch.randint(0, VOCAB, value.shape)
    return fresh
