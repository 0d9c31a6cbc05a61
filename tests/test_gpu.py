"""On an NVIDIA GPU (``pytest -m gpu``): real detection, and optimize() with Inductor in bf16."""

from __future__ import annotations

import pytest
import torch

from kernel_pytorch import detect_hardware, optimize, report_of
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

from .conftest import rel_err, twin

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("gpu tests were selected (-m gpu) but torch.cuda.is_available() is False")


def test_detects_the_nvidia_gpu():
    hardware = detect_hardware()
    assert hardware.vendor == "nvidia"
    assert hardware.compute_capability == torch.cuda.get_device_capability()
    assert hardware.triton_usable and hardware.bf16
    if hardware.compute_capability >= (8, 9):
        assert hardware.fp8 and "float8_e4m3fn" in hardware.fp8_formats
    if hardware.compute_capability >= (8, 0):
        assert hardware.cudnn_attention == (torch.backends.cudnn.version() >= 90000)


def _model(dtype):
    torch.manual_seed(0)
    config = LlamaStyleConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=704,
                              max_seq_len=256)
    return LlamaStyleLM(config).to(device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_with_inductor_matches(dtype):
    model = _model(dtype).eval()
    reference = twin(model)
    tokens = torch.randint(0, 512, (2, 64), device="cuda")
    optimize(model, example_inputs=(tokens,))
    report = report_of(model)
    assert report.compiler.startswith("inductor") and report.verification.passed, report.verification
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for seq in (64, 37, 128):
        t = torch.randint(0, 512, (3, seq), device="cuda")
        with torch.no_grad():
            assert rel_err(model(t), reference(t)) < tolerance, seq


def test_training_with_inductor_matches_in_bf16():
    model = _model(torch.bfloat16).train()
    reference = twin(model)
    tokens = torch.randint(0, 512, (2, 64), device="cuda")
    optimize(model, example_inputs=(tokens,))
    assert report_of(model).verification.compared_gradients
    model(tokens).float().square().mean().backward()
    reference(tokens).float().square().mean().backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, p_ref.grad) < 4e-2, name
