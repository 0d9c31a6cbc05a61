"""What users do with a model after ``optimize``: hooks, copies, other call variants, grad modes, bad inputs,
``model.compile()`` / ``torch.compile`` on top, new modules and weights. Each test failed before its fix."""

from __future__ import annotations

import copy
import io
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernel_pytorch
from kernel_pytorch import compiled_call, report_of
from kernel_pytorch.compiled_call import CompiledCall, RecompileLimitWarning

from . import hf_models
from .conftest import rel_err, twin
from .generation_models import causal_lm, left_padded_prompts


class TwoLayers(nn.Module):
    """A model of the user's own class: Dynamo skipped hook guards on it (torch.nn containers were luckier)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(F.gelu(self.norm(self.a(x))))


def _optimized(train: bool = False, **options):
    torch.manual_seed(0)
    model = TwoLayers().train(train)
    reference = twin(model)
    x = torch.randn(3, 8)
    return kernel_pytorch.optimize(model, example_inputs=(x,), **options), reference, x


# -- hooks ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("train", [False, True])
def test_forward_hooks_added_after_optimize_run_and_edit_outputs(train):
    model, reference, x = _optimized(train)
    expected = reference(x).detach()
    handle = model.register_forward_hook(lambda module, args, out: out * 2)
    assert rel_err(model(x), 2 * expected) < 1e-5
    handle.remove()
    assert rel_err(model(x), expected) < 1e-5
    seen = []
    handle = model.a.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape) or (args[0] * 0,))
    assert rel_err(model(x), reference.b(F.gelu(reference.norm(reference.a(x * 0))))) < 1e-5
    assert seen == [x.shape]
    handle.remove()
    handle = model.norm.register_forward_hook(lambda module, args, kwargs, out: out + 1, with_kwargs=True)
    assert rel_err(model(x), reference.b(F.gelu(reference.norm(reference.a(x)) + 1))) < 1e-5
    handle.remove()


def test_backward_hooks_added_after_optimize_run():
    model, _, x = _optimized(train=True)
    seen = []
    handles = [model.a.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append("backward")),
               model.b.register_full_backward_pre_hook(lambda module, grad_out: seen.append("pre"))]
    model(x).sum().backward()
    assert sorted(seen) == ["backward", "pre"]
    for handle in handles:
        handle.remove()
    seen.clear()
    model(x).sum().backward()
    assert seen == []


def test_global_module_hooks_added_after_optimize_run():
    model, reference, x = _optimized()
    seen = []
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: seen.append(type(module).__name__))
    try:
        model(x)
    finally:
        handle.remove()
    assert sorted(seen) == ["LayerNorm", "Linear", "Linear", "TwoLayers"]
    assert any("global module hooks changed" in note for note in report_of(model).notes)
    seen.clear()
    assert rel_err(model(x), reference(x)) < 1e-5 and seen == []


def test_hooks_on_a_transformers_submodule_after_optimize():
    model, inputs, key = hf_models.llama()
    model.eval()
    expected = model(**inputs)[key].detach()
    model = kernel_pytorch.optimize(model, example_inputs=inputs)
    handle = model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 0)
    changed = model(**inputs)[key]
    handle.remove()
    assert rel_err(changed, expected) > 1e-3
    assert rel_err(model(**inputs)[key], expected) < 1e-5


# -- copies ---------------------------------------------------------------------------------------------------


def _saved_and_loaded(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("make_copy", [copy.deepcopy, _saved_and_loaded], ids=["deepcopy", "torch.save"])
def test_a_copy_stays_optimized_with_a_report_of_its_own(make_copy):
    model, reference, x = _optimized()
    graphs = report_of(model).graphs
    copied = make_copy(model)
    assert report_of(copied).graphs == 0 and report_of(copied) is not report_of(model)
    assert any("captured, rewritten and verified again at its first call" in n for n in report_of(copied).notes)
    assert rel_err(copied(x), reference(x)) < 1e-5
    assert isinstance(copied._compiled_call_impl, CompiledCall)
    assert report_of(copied).graphs == 1 and report_of(copied).rewrites
    assert report_of(model).graphs == graphs  # the copy's captures are its own
    with torch.no_grad():  # an EMA-style update of the copy leaves the original alone
        copied.b.bias.add_(1.0)
    assert rel_err(model(x), reference(x)) < 1e-5
    assert rel_err(copied(x), reference(x) + 1.0) < 1e-5


def test_a_copy_that_cannot_carry_the_optimization_is_plain_and_says_so():
    model, reference, x = _optimized(fp8={"filter": lambda module, name: True})  # a lambda: pickle refuses it
    loaded = _saved_and_loaded(model)
    assert loaded._compiled_call_impl is None
    assert any("runs unoptimized" in note and "optimize(copy)" in note for note in report_of(loaded).notes)
    assert not report_of(loaded).rewrites
    loaded = kernel_pytorch.optimize(loaded, example_inputs=(x,))
    assert isinstance(loaded._compiled_call_impl, CompiledCall) and report_of(loaded).rewrites
    assert rel_err(loaded(x), reference(x)) < 1e-5


def test_a_copy_of_a_model_whose_call_was_replaced_can_be_optimized_again():
    model, reference, x = _optimized()
    model.compile(backend="eager")
    report_of(model)  # notices the replaced call
    copied = copy.deepcopy(model)
    assert any("model.compile()" in note for note in report_of(copied).notes)
    copied = kernel_pytorch.optimize(copied)
    assert isinstance(copied._compiled_call_impl, CompiledCall)
    assert rel_err(copied(x), reference(x)) < 1e-5


def test_a_copy_of_a_rolled_back_model_is_plain():
    model, reference, x = _optimized()
    model._kernel_pytorch.roll_back_everything(model, "for the test")
    copied = copy.deepcopy(model)
    assert copied._compiled_call_impl is None and not copied._kernel_pytorch.active
    assert any("rolled back" in note for note in report_of(copied).notes)
    assert rel_err(copied(x), reference(x)) < 1e-6


# -- compile on top, new modules, weights, dtypes ------------------------------------------------------------------


def test_model_compile_after_optimize_is_reported_and_optimize_installs_again():
    model, reference, x = _optimized()
    model.compile(backend="eager")
    notes = report_of(model).notes
    assert any("model.compile()" in note and "without kernel_pytorch's rewrites" in note for note in notes)
    model = kernel_pytorch.optimize(model)
    assert isinstance(model._compiled_call_impl, CompiledCall)
    assert rel_err(model(x), reference(x)) < 1e-5


def test_torch_compile_on_top_keeps_the_rewrites():
    model, reference, x = _optimized()
    graphs = report_of(model).graphs
    outer = torch.compile(model, backend="eager")
    bigger = torch.randn(5, 8)
    assert rel_err(outer(bigger), reference(bigger)) < 1e-5
    assert report_of(model).graphs == graphs + 1  # the new shape went through kernel_pytorch's backend


def test_new_submodule_new_weights_and_new_dtype_after_optimize():
    model, reference, x = _optimized()
    model.b = reference.b = nn.Linear(16, 4)
    assert rel_err(model(x), reference(x)) < 1e-5
    state = {name: torch.randn_like(value) for name, value in reference.state_dict().items()}
    model.load_state_dict(state)
    reference.load_state_dict(state)
    assert rel_err(model(x), reference(x)) < 1e-5
    model.double()
    reference.double()
    assert rel_err(model(x.double()), reference(x.double())) < 1e-10


def test_a_model_optimized_for_inference_then_trained_gets_training_graphs():
    model, reference, x = _optimized(train=False)
    model.train()
    reference.train()
    model(x).square().mean().backward()
    reference(x).square().mean().backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())]
    assert all(a is not None and rel_err(a, b) < 1e-5 for a, b in grads)
    assert any("gradients flowing" in note for note in report_of(model).notes)


# -- the recompile limit -------------------------------------------------------------------------------------------


def test_reaching_the_recompile_limit_warns_and_reports(monkeypatch):
    monkeypatch.setattr(compiled_call, "RECOMPILE_LIMIT", 2)  # the model's own limit (torch >= 2.13)
    model, reference, x = _optimized(dynamic=False)
    # Dynamo's own limit, which applies where torch.compile takes no per-region one (before 2.13).
    with torch._dynamo.config.patch(recompile_limit=2), \
            pytest.warns(RecompileLimitWarning, match="recompile limit.*dynamic=True") as caught:
        outs = [(model(torch.randn(b, 8)), b) for b in (4, 5, 6)]
    assert len(caught) == 1  # once per function, not per call
    assert any("recompile limit" in note and "size mismatch" in note for note in report_of(model).notes)
    assert all(out.shape == (b, 4) for out, b in outs)


def test_a_generation_call_reaching_the_recompile_limit_warns_and_reports(monkeypatch):
    # The lanes' prefill and step are compiled entries of their own, called without the model's call: on an H100
    # their prefill reached Dynamo's limit of 8 with no line anywhere (compile_layers_once's 10 warm-up graphs).
    monkeypatch.setattr(compiled_call, "RECOMPILE_LIMIT", 1)
    model = causal_lm("llama")
    reference = copy.deepcopy(model)
    model = kernel_pytorch.optimize(model, generation=True)
    warned = "inside the generation (prefill into an empty cache|decode step) of Llama"
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(RecompileLimitWarning, match=warned) as caught:
        for batch in (1, 3):  # batch 1's graphs, then batch 2+'s: a second variant of each entry
            input_ids, attention_mask = left_padded_prompts(batch, 6)
            tokens = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)
            expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)
            assert torch.equal(tokens, expected), batch  # unoptimized past the limit, still right
    assert len(caught) == 2  # the prefill and the step, once each
    assert sum("recompile limit" in note for note in report_of(model).notes) == 2


@pytest.mark.skipif(not compiled_call._compile_takes_recompile_limit(),
                    reason="this torch's torch.compile takes no per-region recompile limit (torch < 2.13)")
def test_serving_and_generate_variants_stay_under_the_models_recompile_limit():
    model, inputs, key = hf_models.llama()
    model = kernel_pytorch.optimize(model.eval(), example_inputs=inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileLimitWarning)
        with torch.no_grad():
            for batch, length in ((1, 5), (3, 7), (2, 9), (1, 1), (4, 12)):
                model(input_ids=torch.randint(0, 101, (batch, length)))
            ids = torch.randint(0, 101, (2, 8))
            model(input_ids=ids, attention_mask=torch.ones_like(ids))  # other arguments: variants of their own
            model(input_ids=ids, labels=ids)
            for batch, use_cache in ((2, True), (3, True), (1, False)):
                prompt = torch.randint(0, 101, (batch, 6))
                model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False,
                               use_cache=use_cache)
    assert report_of(model).graphs > torch._dynamo.config.recompile_limit  # Dynamo's 8 would have been reached
    assert not any("recompile limit" in note for note in report_of(model).notes)


# -- grad modes and devices --------------------------------------------------------------------------------------


def test_optimize_under_no_grad_in_train_mode_compares_gradients():
    with torch.no_grad():
        model, _, _ = _optimized(train=True)
    verification = report_of(model).verification
    assert verification.passed and verification.gradients_compared == len(list(model.parameters()))
    assert verification.compared_gradients and not verification.not_compared


def test_optimize_under_inference_mode_says_gradients_were_not_compared():
    with torch.inference_mode():
        model, _, _ = _optimized(train=True)
    verification = report_of(model).verification
    assert verification.passed and verification.outputs_compared == 1
    assert verification.gradients_compared == 0 and not verification.compared_gradients
    assert "inference_mode" in verification.not_compared


def test_a_model_on_the_meta_device_is_optimized_unverified_with_a_note():
    model = TwoLayers().to("meta")
    model = kernel_pytorch.optimize(model, example_inputs=(torch.randn(2, 8, device="meta"),))
    assert model(torch.randn(5, 8, device="meta")).shape == (5, 4)
    assert any("meta device" in note for note in report_of(model).notes)
    assert report_of(model).verification is None


# -- bad inputs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["feature size", "dtype", "integers"])
def test_a_bad_input_raises_the_models_own_error_without_logs(bad, caplog):
    model, reference, _ = _optimized()
    x = {"feature size": torch.randn(3, 5), "dtype": torch.randn(3, 8, dtype=torch.float64),
         "integers": torch.ones(3, 8, dtype=torch.long)}[bad]
    with pytest.raises(Exception) as eager:
        reference(x)
    with caplog.at_level(logging.DEBUG), pytest.raises(Exception) as optimized:
        model(x)
    assert type(optimized.value) is type(eager.value)
    assert str(optimized.value).splitlines()[0] == str(eager.value).splitlines()[0]
    assert not any(record.levelno >= logging.WARNING for record in caplog.records)


def test_a_bad_input_to_a_transformers_model_names_the_model_and_argument():
    model, inputs, key = hf_models.llama()
    model = kernel_pytorch.optimize(model.eval(), example_inputs=inputs)
    with pytest.raises(RuntimeError, match="Expected tensor for argument #1 'indices'") as raised:
        model(input_ids=torch.randn(2, 10))
    assert "TorchRuntimeError" not in str(raised.value) and "BackendCompilerFailed" not in str(raised.value)
    notes = getattr(raised.value, "__notes__", [])
    assert any("LlamaForCausalLM" in note and "input_ids=Tensor[2, 10] float32" in note for note in notes)


def test_a_misspelt_example_inputs_suggests_the_right_name():
    with pytest.raises(TypeError, match="did you mean 'example_inputs'"):
        kernel_pytorch.optimize(TwoLayers(), example_input=(torch.randn(2, 8),))


class CountsCalls(nn.Module):
    """Updates a buffer in place, then breaks the graph: a second graph follows the first."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        y = self.lin(x)
        torch._dynamo.graph_break()
        return y.relu()


def _failing_backend_at(monkeypatch, failing_graph: int):
    """The model's backend raises while compiling its ``failing_graph``-th graph (a compiler bug, say)."""
    from kernel_pytorch.capture import GraphOptimizer

    real = GraphOptimizer._optimized

    def optimized(self, gm, example_inputs):
        if self.report.graphs == failing_graph:
            raise RuntimeError("a compiler failure for the test")
        return real(self, gm, example_inputs)

    monkeypatch.setattr(GraphOptimizer, "_optimized", optimized)


def test_a_call_that_fails_to_compile_runs_eagerly_once_with_a_warning(monkeypatch):
    model = kernel_pytorch.optimize(CountsCalls().eval())
    _failing_backend_at(monkeypatch, failing_graph=0)
    x = torch.randn(2, 4)
    with pytest.warns(kernel_pytorch.UnoptimizedCallWarning, match="could not be compiled"):
        out = model(x)
    assert torch.equal(out, model.lin(x).relu()) and model.calls.item() == 1  # the update ran once
    assert any("ran unoptimized (eager)" in note for note in report_of(model).notes)


def test_a_failure_after_a_graph_ran_is_raised_not_run_twice(monkeypatch):
    model = kernel_pytorch.optimize(CountsCalls().eval())
    _failing_backend_at(monkeypatch, failing_graph=1)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="a compiler failure for the test") as raised:
        model(torch.randn(2, 4))
    assert model.calls.item() == 1  # the first graph's in-place update, not repeated by an eager re-run
    assert any("after some of its graphs ran" in note for note in getattr(raised.value, "__notes__", []))


def test_a_call_shape_that_failed_to_compile_is_not_captured_again(monkeypatch):
    model = kernel_pytorch.optimize(CountsCalls().eval())
    _failing_backend_at(monkeypatch, failing_graph=0)
    x = torch.randn(2, 4)
    with pytest.warns(kernel_pytorch.UnoptimizedCallWarning, match="RuntimeError: a compiler failure for the test"):
        model(x)
    graphs = report_of(model).graphs
    assert torch.equal(model(x), model.lin(x).relu()) and model.calls.item() == 2
    assert report_of(model).graphs == graphs  # the second call went straight to the eager forward


def test_global_hook_sets_keep_a_bounded_number_of_compiled_entries():
    model, reference, x = _optimized()
    for _ in range(compiled_call._MAX_ENTRIES + 3):
        handle = nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
        model(x)
        handle.remove()
    assert len(model._compiled_call_impl.entries) <= compiled_call._MAX_ENTRIES
    assert rel_err(model(x), reference(x)) < 1e-5
