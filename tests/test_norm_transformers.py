"""The norm pass on the norms of real transformers models built from tiny configs (no downloads): every
norm module is rewritten (counted by module path in the report), and the optimized model's outputs and
all its parameter gradients match the original's, in float32 and, where the CPU computes it, bfloat16.

Only ``normalize`` and ``norms`` run (the other graph passes are disabled): the test is about the norms,
and the whole pipeline on these models is tests/test_transformers_models.py's. ``verify=False``: this test
makes the end-to-end comparison itself, and a wrong rewrite must fail it rather than be rolled back."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from kernel_pytorch import OptimizeConfig, detect_hardware, optimize, report_of

from .conftest import rel_err, twin

VOCAB = 101
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
OTHER_PASSES = ("horizontal_gemm", "activations", "rope", "attention")


def _config(config_type, **fields):
    config = config_type(**fields)
    config._attn_implementation = "eager"
    return config


MODELS = {
    # the encoder only: the decoder's norms are the same T5LayerNorm, and Dynamo takes seconds over each stack
    "t5": lambda: T.T5EncoderModel(_config(
        T.T5Config, vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=1, num_heads=4, dropout_rate=0.0)),
    "llama": lambda: T.LlamaForCausalLM(_config(T.LlamaConfig, **DECODER)),
    "mistral": lambda: T.MistralForCausalLM(_config(T.MistralConfig, **DECODER)),
    "qwen3": lambda: T.Qwen3ForCausalLM(_config(T.Qwen3Config, head_dim=16, **DECODER)),
    "gemma": lambda: T.GemmaForCausalLM(_config(T.GemmaConfig, head_dim=16, **DECODER)),
    "gemma2": lambda: T.Gemma2ForCausalLM(_config(T.Gemma2Config, head_dim=16, **DECODER)),
    "olmo": lambda: T.OlmoForCausalLM(_config(T.OlmoConfig, **DECODER)),
    "olmo2": lambda: T.Olmo2ForCausalLM(_config(T.Olmo2Config, **DECODER)),
    "cohere": lambda: T.CohereForCausalLM(_config(T.CohereConfig, **DECODER)),
    "phi": lambda: T.PhiForCausalLM(_config(T.PhiConfig, **DECODER)),
    "falcon": lambda: T.FalconForCausalLM(_config(
        T.FalconConfig, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4)),
    "gpt2": lambda: T.GPT2LMHeadModel(_config(
        T.GPT2Config, vocab_size=VOCAB, n_embd=48, n_layer=1, n_head=4, n_positions=64, bos_token_id=1,
        eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "bert": lambda: T.BertModel(_config(
        T.BertConfig, vocab_size=VOCAB, hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=80, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)),
}
# bf16 where the CPU computes it natively (detect_hardware's bf16), on one model per norm spelling: T5's,
# Llama's (cast before weight), Gemma's (1 + w, one rounding), OLMo's (F.layer_norm on x upcast), Cohere's
# (LayerNorm written out in float32) and nn.LayerNorm (GPT-2); float32 on all.
BF16_MODELS = ("t5", "llama", "gemma", "olmo", "cohere", "gpt2") if detect_hardware("cpu").bf16 else ()
CASES = [(name, torch.float32) for name in MODELS] + [(name, torch.bfloat16) for name in BF16_MODELS]
# bf16 forward / gradient error against the original bf16 model: the norms round where the original does,
# the rest of the graph is the original's; what is left is float32 sum order, amplified through the model.
BF16_OUTPUT_TOLERANCE, BF16_GRADIENT_TOLERANCE = 2e-2, 5e-2


def _inputs():
    return {"input_ids": torch.randint(0, VOCAB, (2, 8))}


def _norm_modules(model):
    """The module paths of the model's norms: every module whose class is a LayerNorm or an RMSNorm."""
    return {path for path, module in model.named_modules() if "norm" in type(module).__name__.lower()}


def _forward_and_gradients(model, inputs, projection):
    model.zero_grad(set_to_none=True)
    output = model(**inputs)[0]  # logits / last_hidden_state
    (output.float() * projection).sum().backward()
    unused = [name for name, p in model.named_parameters() if p.grad is None]  # BERT's pooler
    gradients = [p.grad.float().flatten() for p in model.parameters() if p.grad is not None]
    return output.detach(), torch.cat(gradients), unused


@pytest.mark.parametrize("name, dtype", CASES, ids=lambda case: str(case).replace("torch.", ""))
def test_every_norm_is_rewritten_and_the_model_matches(name, dtype):
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype).train()
    reference = twin(model)
    optimize(model, OptimizeConfig(disable_passes=OTHER_PASSES, verify=False), example_inputs=_inputs())
    report = report_of(model)
    rewritten = [r.location for r in report.rewrites if r.pass_name == "norms"]
    norms = _norm_modules(model)
    assert len(norms) >= 2 and sorted(rewritten) == sorted(norms), report.skipped

    inputs = _inputs()  # fresh values, the capture's shapes
    with torch.no_grad():
        projection = torch.randn(reference(**inputs)[0].shape)
    output, gradients, unused = _forward_and_gradients(model, inputs, projection)
    expected_output, expected_gradients, expected_unused = _forward_and_gradients(reference, inputs, projection)
    assert unused == expected_unused
    if dtype == torch.float32:
        assert rel_err(output, expected_output) < 1e-5
        assert rel_err(gradients, expected_gradients) < 1e-4
        for (path, p), p_ref in zip(model.named_parameters(), reference.parameters()):
            assert p.grad is None or rel_err(p.grad, p_ref.grad) < 1e-4, path
    else:
        assert rel_err(output, expected_output) < BF16_OUTPUT_TOLERANCE
        assert rel_err(gradients, expected_gradients) < BF16_GRADIENT_TOLERANCE
