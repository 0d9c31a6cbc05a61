"""Hugging Face models built from tiny configs (no downloads), eager attention: (model, inputs, output key)."""

from __future__ import annotations

import torch
import transformers


def llama():
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config), {"input_ids": torch.randint(0, 101, (2, 10))}, "logits"


def gpt2():
    config = transformers.GPT2Config(vocab_size=101, n_embd=48, n_layer=2, n_head=4, n_positions=64)
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config), {"input_ids": torch.randint(0, 101, (2, 9))}, "logits"


def bert():
    config = transformers.BertConfig(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=80, max_position_embeddings=64)
    config._attn_implementation = "eager"
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0  # a padded sequence
    inputs = {"input_ids": torch.randint(0, 101, (2, 11)), "attention_mask": mask}
    return transformers.BertModel(config), inputs, "last_hidden_state"


def vit():
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=80, num_labels=5)
    config._attn_implementation = "eager"
    return transformers.ViTForImageClassification(config), {"pixel_values": torch.randn(2, 3, 32, 32)}, "logits"
