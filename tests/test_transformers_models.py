"""optimize() on Hugging Face models built from configs (no downloads): capture works where
symbolic_trace fails, outputs and gradients match, state_dict keys are kept."""

from __future__ import annotations

import pytest
import torch
import transformers

from kernel_pytorch import optimize, report_of

from .conftest import rel_err, twin


def _llama():
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config), {"input_ids": torch.randint(0, 101, (2, 10))}, "logits"


def _gpt2():
    config = transformers.GPT2Config(vocab_size=101, n_embd=48, n_layer=2, n_head=4, n_positions=64)
    config._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(config), {"input_ids": torch.randint(0, 101, (2, 9))}, "logits"


def _bert():
    config = transformers.BertConfig(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=80, max_position_embeddings=64)
    config._attn_implementation = "eager"
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0  # a padded sequence
    inputs = {"input_ids": torch.randint(0, 101, (2, 11)), "attention_mask": mask}
    return transformers.BertModel(config), inputs, "last_hidden_state"


def _vit():
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=80, num_labels=5)
    config._attn_implementation = "eager"
    return transformers.ViTForImageClassification(config), {"pixel_values": torch.randn(2, 3, 32, 32)}, "logits"


MODELS = {"llama": _llama, "gpt2": _gpt2, "bert": _bert, "vit": _vit}


@pytest.mark.parametrize("name", MODELS)
def test_hf_model_inference_matches(name):
    torch.manual_seed(0)
    model, inputs, key = MODELS[name]()
    model.eval()
    reference = twin(model)
    keys = list(model.state_dict())
    optimize(model, example_inputs=inputs)
    report = report_of(model)
    assert report.graphs >= 1 and report.verification.passed, report.verification
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        assert rel_err(getattr(model(**inputs), key), getattr(reference(**inputs), key)) < 1e-5


def test_hf_llama_training_gradients_match():
    torch.manual_seed(0)
    model, inputs, _ = _llama()
    model.train()
    reference = twin(model)
    optimize(model, example_inputs=inputs)
    assert report_of(model).verification.compared_gradients
    labels = torch.randint(0, 101, inputs["input_ids"].shape)
    model(**inputs, labels=labels).loss.backward()
    reference(**inputs, labels=labels).loss.backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, p_ref.grad) < 1e-4, name
