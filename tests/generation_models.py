"""Causal LMs of several transformers families and a T5 from tiny configs (default attention, no downloads), and
prompts with left padding, for the generation tests."""

from __future__ import annotations

import torch
import transformers

_SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              vocab_size=128, pad_token_id=0, eos_token_id=5, max_position_embeddings=512)

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, _SMALL),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, _SMALL),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(_SMALL, sliding_window=None)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(_SMALL, head_dim=16)),
    # sliding windows shorter than the prompts and generations of the tests
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(_SMALL, head_dim=16, sliding_window=8)),
    "mistral_sliding": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(_SMALL, sliding_window=8)),
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
             dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, pad_token_id=0, eos_token_id=5, bos_token_id=1)),
    # a mixture of experts: routing that depends on the token's values in every decode step
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(_SMALL, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    # multi-query attention by default: one key/value head, which its config names in its own way
    "falcon": (transformers.FalconConfig, transformers.FalconForCausalLM,
               dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, pad_token_id=0,
                    eos_token_id=5)),
}


def causal_lm(family: str, seed: int = 0, layers: int | None = None, vocab_size: int | None = None) -> torch.nn.Module:
    """``layers``: that many decoder layers instead of the config's 2; ``vocab_size`` instead of 128."""
    config_class, model_class, fields = FAMILIES[family]
    if layers is not None:
        fields = {**fields, "n_layer" if "n_layer" in fields else "num_hidden_layers": layers}
    if vocab_size is not None:
        fields = {**fields, "vocab_size": vocab_size}
    torch.manual_seed(seed)
    return model_class(config_class(**fields)).eval()


def t5_model(vocab_size: int = 64, seed: int = 0) -> transformers.T5ForConditionalGeneration:
    """A two-layer T5 (encoder-decoder with a cross-attention cache), eval mode, on the CPU."""
    config = transformers.T5Config(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.T5ForConditionalGeneration(config).eval()


def left_padded_prompts(batch: int, length: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids above the EOS and pad ids; row i > 0 has i % 3 + 1 padding tokens on the left."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(6, 128, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(1, batch):
        padding = min(row % 3 + 1, length - 1)
        input_ids[row, :padding] = 0
        attention_mask[row, :padding] = 0
    return input_ids, attention_mask


def byte_level_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of 294 tokens trained here on a few words (no downloads): what transformers'
    ``stop_strings`` need to read tokens as text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["hello world, the user said stop here. Assistant: ok"] * 50, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


class RecordingStreamer(transformers.generation.streamers.BaseStreamer):
    """Every call a streamer gets, with its tokens: ("put", tokens) and ("end",)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def put(self, value):
        self.calls.append(("put", value.clone()))

    def end(self):
        self.calls.append(("end",))


class StopAfterToken(transformers.StoppingCriteria):
    """Stops each row whose last token is ``token``."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token
