"""optimize() on Hugging Face models built from configs (no downloads): capture works where
symbolic_trace fails, outputs and gradients match, state_dict keys are kept."""

from __future__ import annotations

import pytest
import torch

from kernel_pytorch import optimize, report_of

from .conftest import rel_err, twin
from .hf_models import bert as _bert, gpt2 as _gpt2, llama as _llama, vit as _vit


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
