"""On an NVIDIA GPU (``pytest -m gpu``): transformers models with their default SDPA attention, whose calls the
attention pass hands to the dispatcher, which measures the fused kernels on the GPU. Outputs and gradients
against the unoptimized model in bf16; the kernel each call got; T5's trainable bias on a kernel that
returns its gradient."""

from __future__ import annotations

import pytest
import torch
import transformers

from kernel_pytorch import optimize, report_of

from .conftest import rel_err, twin

pytestmark = pytest.mark.gpu

_FUSED = ("cudnn", "flash", "efficient", "flash_attn", "cudnn_band", "flex")


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("gpu tests were selected (-m gpu) but torch.cuda.is_available() is False")


def _llama(sliding_window=None):
    torch.manual_seed(0)
    cls, config_cls = (transformers.MistralForCausalLM, transformers.MistralConfig) if sliding_window else \
        (transformers.LlamaForCausalLM, transformers.LlamaConfig)
    extra = {"sliding_window": sliding_window} if sliding_window else {}
    config = config_cls(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, **extra)
    return cls(config).to(device="cuda", dtype=torch.bfloat16)


def _tokens(batch, length, padded=False):
    inputs = {"input_ids": torch.randint(0, 512, (batch, length), device="cuda")}
    if padded:
        mask = torch.ones(batch, length, dtype=torch.long, device="cuda")
        mask[-1, length // 2:] = 0
        inputs["attention_mask"] = mask
    return inputs


def _attention_lines(model) -> list[str]:
    return [r.replacement for r in report_of(model).rewrites if r.pass_name == "attention"]


def _kernel(line: str) -> str:
    return line.split("[", 1)[1].split("]", 1)[0]


def test_llama_sdpa_calls_get_a_measured_kernel_in_inference():
    model = _llama().eval()
    reference = twin(model)
    inputs = _tokens(2, 512)
    optimize(model, example_inputs=inputs)
    lines = _attention_lines(model)
    assert len(lines) == 2 and all("SDPA call" in line and "causal" in line for line in lines), lines
    # measured, whichever wins: on an H100 at 2 x 512 PyTorch's own dispatch ("sdpa") beat cuDNN (0.069 ms)
    assert all(_kernel(line) in _FUSED + ("sdpa",) and "fastest measured" in line for line in lines), lines
    assert report_of(model).verification.passed
    fresh = _tokens(2, 512)
    with torch.no_grad():
        assert rel_err(model(**fresh).logits, reference(**fresh).logits) < 2e-2


# The case that found PyTorch's cuDNN backward plan reuse (docs/attention.md, "cuDNN's backward plan cache"):
# the rope kernel's contiguous outputs gave the model's own SDPA calls a second gradient layout.
def test_llama_sdpa_padded_training_gradients_match_in_bf16():
    model = _llama().train()
    reference = twin(model)
    inputs = _tokens(2, 256, padded=True)
    optimize(model, example_inputs=inputs)
    lines = _attention_lines(model)
    assert len(lines) == 2 and all("mask bool" in line and "gqa 4/2" in line for line in lines), lines
    fresh = _tokens(2, 256, padded=True)
    model(**fresh).logits.float().square().mean().backward()
    reference(**fresh).logits.float().square().mean().backward()
    errors = {name: rel_err(p.grad, p_ref.grad) for (name, p), p_ref in zip(model.named_parameters(),
                                                                           reference.parameters())}
    assert not {name: e for name, e in errors.items() if not e < 4e-2}, errors


def test_mistral_sliding_window_sdpa_call_is_recognized_and_matches():
    model = _llama(sliding_window=128).eval()
    reference = twin(model)
    inputs = _tokens(2, 512)
    optimize(model, example_inputs=inputs)
    lines = _attention_lines(model)
    assert len(lines) == 2 and all("causal sliding window 128" in line for line in lines), lines
    fresh = _tokens(2, 512)
    with torch.no_grad():
        assert rel_err(model(**fresh).logits, reference(**fresh).logits) < 2e-2


def test_t5_sdpa_bias_trains_on_a_kernel_with_a_mask_gradient():
    # float32: the relative bias's gradient sums many softmax gradients that nearly cancel, so in bf16 the
    # unoptimized model's own bias gradient is mostly rounding (a GPU run: 0.94 relative error between two
    # bf16 runs); the efficient kernel takes float32 and returns the bias gradient the same way.
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=512, d_model=256, d_kv=64, d_ff=512, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, dropout_rate=0.0)
    model = transformers.T5Model(config).to(device="cuda").train()
    reference = twin(model)
    inputs = {"input_ids": torch.randint(0, 512, (2, 256), device="cuda"),
              "decoder_input_ids": torch.randint(0, 512, (2, 128), device="cuda")}
    optimize(model, example_inputs=inputs)
    lines = _attention_lines(model)
    assert len(lines) == 6 and all("scale 1.0" in line for line in lines), lines
    assert all(_kernel(line) in ("efficient", "sdpa") for line in lines), lines  # cuDNN returns no bias gradient
    fresh = {name: torch.randint(0, 512, t.shape, device="cuda") for name, t in inputs.items()}
    out, expected = model(**fresh).last_hidden_state, reference(**fresh).last_hidden_state
    assert rel_err(out, expected) < 1e-3
    seed = torch.randn_like(out)
    (out * seed).sum().backward()
    (expected * seed).sum().backward()
    pairs = list(zip(model.named_parameters(), reference.parameters()))
    every = rel_err(torch.cat([p.grad.flatten() for _, p in pairs]), torch.cat([r.grad.flatten() for _, r in pairs]))
    assert every < 1e-3, every
    biases = {name: rel_err(p.grad, r.grad) for (name, p), r in pairs if "relative_attention_bias" in name}
    assert biases and all(e < 1e-2 for e in biases.values()), biases
