"""tests/test_after_optimize.py's points on an NVIDIA GPU, where optimize compiles with Inductor by default and
``compile="reduce-overhead"`` replays CUDA graphs: hooks, copies and bad inputs go through those paths."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import kernel_pytorch
from kernel_pytorch import report_of
from kernel_pytorch.compiled_call import CompiledCall

from . import hf_models
from .conftest import rel_err

pytestmark = pytest.mark.gpu

# bf16 models whose rewrites (fused norms, attention) round differently from eager.
_BF16_OUTPUTS = 3e-2


def _llama_on_gpu(compile_mode):
    torch.manual_seed(0)
    model, inputs, key = hf_models.llama()
    model = model.to("cuda", torch.bfloat16).eval()
    inputs = {name: value.cuda() for name, value in inputs.items()}
    expected = model(**inputs)[key].float()
    optimized = kernel_pytorch.optimize(model, example_inputs=inputs, compile=compile_mode)
    assert report_of(optimized).hardware.vendor == "nvidia"
    return optimized, inputs, key, expected


@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead"])
def test_hooks_added_after_optimize_run_under_inductor_and_cuda_graphs(compile_mode):
    model, inputs, key, expected = _llama_on_gpu(compile_mode)
    with torch.no_grad():
        handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 0)
        zeroed = model(**inputs)[key].float()
        handle.remove()
        seen = []
        handles = [model.register_forward_pre_hook(lambda module, args: seen.append("top")),
                   model.lm_head.register_forward_hook(lambda module, args, out: out * 2)]
        doubled = model(**inputs)[key].float()
        for handle in handles:
            handle.remove()
        again = model(**inputs)[key].float()
    assert rel_err(zeroed, expected) > 0.05
    assert seen == ["top"]
    assert rel_err(doubled, 2 * expected) < _BF16_OUTPUTS
    assert rel_err(again, expected) < _BF16_OUTPUTS


def test_a_deep_copy_on_the_gpu_stays_optimized():
    model, inputs, key, expected = _llama_on_gpu("default")
    copied = copy.deepcopy(model)
    with torch.no_grad():
        out = copied(**inputs)[key].float()
    assert isinstance(copied._compiled_call_impl, CompiledCall)
    assert report_of(copied).graphs >= 1 and report_of(copied).rewrites
    assert rel_err(out, expected) < _BF16_OUTPUTS


def test_a_bad_input_under_inductor_raises_the_models_own_error(caplog):
    model, inputs, key, _ = _llama_on_gpu("default")
    bad = {"inputs_embeds": torch.randn(2, 10, 60, device="cuda", dtype=torch.bfloat16)}
    with pytest.raises(RuntimeError) as eager:
        model._call_impl(**bad)
    with caplog.at_level(logging.DEBUG), pytest.raises(RuntimeError) as optimized:
        model(**bad)
    assert str(optimized.value).splitlines()[0] == str(eager.value).splitlines()[0]
    assert not any(record.levelno >= logging.WARNING for record in caplog.records)
