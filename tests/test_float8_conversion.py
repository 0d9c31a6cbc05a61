"""Module-level FP8 conversion (``kernel_pytorch.float8_conversion``) and ``optimize(model, fp8=...)`` on the GPU;
the graph pass that ``optimize`` runs is tested on the CPU in test_fp8_pass.py.

On the CPU the layers run FP8's numerics emulated (``emulate=True``); the GPU tests run the real
``_scaled_mm`` path, the measured ``"auto"`` decision, and a 100-step convergence run against bf16.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernel_pytorch
from kernel_pytorch.ops import Float8Linear
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

from .triton_interpreter import cuda_device

FC = importlib.import_module("kernel_pytorch.float8_conversion")


def _llama(dim=64, ffn=128, layers=2, vocab=128, device="cpu", dtype=torch.float32) -> LlamaStyleLM:
    torch.manual_seed(0)
    config = LlamaStyleConfig.tiny(dim=dim, ffn_dim=ffn, n_layers=layers, vocab_size=vocab, n_heads=4, n_kv_heads=2)
    return LlamaStyleLM(config).to(device=device, dtype=dtype)


def _tokens(model: LlamaStyleLM, batch=2, seq=32, device="cpu") -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, seq), device=device)


class Odd(nn.Module):
    """One eligible layer, one with a dimension that is not a multiple of 16, and a head."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 40)
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        h = F.relu(self.up(x))
        aux = self.odd(h)
        return self.head(h) + aux[..., :16]


def test_candidates_head_and_reasons():
    model = Odd()
    plan = FC.convert_to_float8(model, decide=True, emulate=True, example_inputs=(torch.randn(8, 32),))
    assert plan.converted == ["up"] and isinstance(model.up, Float8Linear)
    reasons = {d.fqn: d.reason for d in plan.decisions if not d.converted}
    assert "out_features=40 not a multiple of 16" in reasons["odd"]
    assert "output head" in reasons["head"] and type(model.head) is nn.Linear
    assert {d.fqn: d.shape for d in plan.decisions}["up"] == (8, 32, 64)


def test_head_is_the_last_linear_called_not_registered():
    class Reordered(Odd):
        def forward(self, x):  # registered order up, odd, head; called order head, up
            return self.up(F.relu(self.head(x)).repeat(1, 2))

    model = Reordered()
    plan = FC.convert_to_float8(model, decide=True, emulate=True, example_inputs=(torch.randn(4, 64),))
    assert "up" not in plan.converted and "head" in plan.converted


def test_filter_fn_and_include_head():
    model = _llama()
    plan = FC.convert_to_float8(model, decide=True, emulate=True, example_inputs=(_tokens(model),),
                                filter_fn=lambda module, fqn: "mlp" in fqn, include_output_head=True)
    assert plan.converted and all("mlp" in fqn for fqn in plan.converted)
    skipped = {d.fqn: d.reason for d in plan.decisions if not d.converted}
    assert any("attn" in fqn and reason == "excluded by filter_fn" for fqn, reason in skipped.items())


def test_state_dict_parameters_and_undo():
    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = list(model.parameters())
    plan = FC.convert_to_float8(model, decide=True, emulate=True)
    assert len(plan.converted) == 2 * 7  # q, k, v, o, gate, up, down per layer; the head excluded
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    plan.undo()
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    assert all(a is b for a, b in zip(model.parameters(), params_before))


def test_training_updates_the_original_parameters():
    model = _llama()
    twin = _llama()
    FC.convert_to_float8(model, decide=True, emulate=True)
    tokens = _tokens(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    moved = [name for (name, p), q in zip(model.named_parameters(), twin.parameters()) if not torch.equal(p, q)]
    assert any("q_proj" in n or "wq" in n or "attn" in n for n in moved), moved


def test_bad_options():
    model = Odd()
    with pytest.raises(ValueError, match="recipe"):
        FC.convert_to_float8(model, recipe="blockwise", decide=True)
    with pytest.raises(ValueError, match="example_inputs"):
        FC.convert_to_float8(model, decide="auto")
    with pytest.raises(ValueError, match="decide=True"):
        FC.convert_to_float8(model, decide="auto", emulate=True, example_inputs=(torch.randn(2, 32),))


def _scripted_timers(monkeypatch) -> list[str]:
    """FP8 twice as fast as GPU time, twice as slow per call (its Python, as measured on the H100), on any
    device: convert_to_float8(decide="auto") then runs on the CPU. Returns which timer each measure used."""
    used: list[str] = []
    timing = importlib.import_module("kernel_pytorch.timing")

    def graph_timer(steps, **_counts):
        used.append("graph")
        return timing.Timings({"base": 2.0, "fp8": 1.0}, timing.GRAPH_TIME)

    def per_call_timer(steps, **_counts):
        used.append("per call")
        return {"base": 1.0, "fp8": 2.0}

    monkeypatch.setattr(FC, "float8_hardware_reason", lambda device: None)
    monkeypatch.setattr(FC, "_measured", {})
    monkeypatch.setattr(FC, "fastest_cuda_graph_ms", graph_timer)
    monkeypatch.setattr(FC, "fastest_cuda_ms", per_call_timer)
    return used


def test_auto_compares_gpu_time_for_compiled_models_and_time_per_call_for_eager_ones(monkeypatch):
    used = _scripted_timers(monkeypatch)
    decisions = {}
    for compiled in (True, False):
        model = Odd()
        plan = FC.convert_to_float8(model, decide="auto", example_inputs=(torch.randn(64, 32),), compiled=compiled)
        decisions[compiled] = {d.fqn: d for d in plan.decisions}["up"]
    assert used == ["graph", "per call"]
    assert decisions[True].converted and decisions[True].reason == (
        "fp8 measured 2.00x (GPU time (CUDA graph)) at (M, K, N) = (64, 32, 64)")
    assert not decisions[False].converted and decisions[False].reason == (
        "fp8 measured 0.50x (per call) at (M, K, N) = (64, 32, 64), below 1.05x")
    assert (decisions[False].base_ms, decisions[False].fp8_ms) == (1.0, 2.0)
    # benchmarks/fp8.py and the graph pass take the same decision through measured_decision: cached
    shape, cpu = (64, 32, 64), torch.device("cpu")
    assert FC.measured_decision(shape, torch.float32, "tensorwise", True, cpu, compiled=True)[2:] == (2.0, 1.0)
    assert FC.measured_decision(shape, torch.float32, "tensorwise", True, cpu, False)[2:] == (1.0, 2.0)
    assert len(used) == 2


def test_auto_times_the_fp8_side_with_the_maxima_its_neighbours_compute(monkeypatch):
    """With the input's maximum from its producer and the gradient's from its consumer, the FP8 step that is
    timed gets both (x_amax, and the slot's gradient), so it runs as the model will: its own gradients are
    those of the step that finds them itself."""
    from kernel_pytorch.ops.float8_linear import float8_linear

    calls, grads = [], {}

    def emulated(x, weight, bias, recipe, emulate, fwd, bwd, x_amax, grad_amax_slot):
        calls.append((x_amax is not None, grad_amax_slot))
        return float8_linear(x, weight, bias, recipe, True, fwd, bwd, x_amax, grad_amax_slot)

    timing = importlib.import_module("kernel_pytorch.timing")

    def run_each_step_once(steps, **_counts):
        for step in steps.values():
            step()
        return timing.Timings({name: 1.0 for name in steps}, timing.GRAPH_TIME)

    real_grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda out, inputs, dy: grads.setdefault(len(grads), real_grad(
        out, inputs, dy)))
    monkeypatch.setattr(FC, "float8_hardware_reason", lambda device: None)
    monkeypatch.setattr(FC, "float8_dtypes_for", lambda device: (torch.float8_e4m3fn, torch.float8_e5m2))
    monkeypatch.setattr(FC, "_measured", {})
    monkeypatch.setattr(FC, "float8_linear", emulated)
    monkeypatch.setattr(FC, "fastest_cuda_graph_ms", run_each_step_once)
    for fused in (True, False):
        torch.manual_seed(0)  # the same layer and inputs
        FC.measured_decision((32, 64, 48), torch.float32, "tensorwise", True, torch.device("cpu"), True,
                             input_amax_fused=fused, grad_amax_fused=fused)
    assert calls == [(True, True), (False, False)]
    # grads: [base, fp8 fused, base, fp8 unfused], on the same random inputs
    assert all(torch.equal(a, b) for a, b in zip(grads[1], grads[3]))


# ----------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ("tensorwise", "rowwise"))
def test_gpu_optimize_fp8_true(recipe):
    device = cuda_device()
    model = _llama(dim=256, ffn=512, vocab=512, device=device, dtype=torch.bfloat16).train()
    tokens = _tokens(model, batch=4, seq=64, device=device)
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "recipe": recipe}, example_inputs=(tokens,))
    report = kernel_pytorch.report_of(optimized)
    assert report.verification.passed, report.verification
    assert sum(r.pass_name == "fp8" for r in report.rewrites) == 14, report.skipped  # 256 tokens: no q/k/v fusion
    assert FC.CUDA_GRAPHS_NOTE in report.notes  # trained through Inductor's default mode
    optimized(tokens).float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in optimized.parameters())


@pytest.mark.gpu
def test_gpu_auto_measures_and_keeps_small_layers_in_bf16():
    """Tiny layers (M = 256) are launch-bound: FP8 adds quantization passes, so 'auto' must keep them."""
    device = cuda_device()
    model = _llama(dim=256, ffn=512, vocab=512, device=device, dtype=torch.bfloat16).train()
    tokens = _tokens(model, batch=4, seq=64, device=device)
    plan = FC.convert_to_float8(model, decide="auto", example_inputs=(tokens,))
    measured = [d for d in plan.decisions if d.base_ms is not None]
    assert len(measured) == 14 and all(d.fp8_ms > 0 for d in measured)
    for d in measured:
        assert d.converted == (d.base_ms / d.fp8_ms >= FC.MIN_SPEEDUP), d
    assert not plan.converted, [(d.fqn, d.base_ms, d.fp8_ms) for d in measured]


@pytest.mark.gpu
def test_gpu_convergence_within_two_percent_of_bf16():
    device = cuda_device()
    losses = {}
    for fp8 in (False, True):
        model = _llama(dim=256, ffn=768, layers=2, vocab=256, device=device, dtype=torch.bfloat16).train()
        if fp8:
            FC.convert_to_float8(model, decide=True)
        gen = torch.Generator(device=device).manual_seed(0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for _ in range(100):
            # A learnable task: the next token is the current one plus one.
            tokens = torch.randint(0, 255, (8, 64), device=device, generator=gen)
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), (tokens + 1).flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses[fp8] = curve
    bf16, fp8 = torch.tensor(losses[False]), torch.tensor(losses[True])
    assert torch.isfinite(fp8).all()
    assert bf16[-10:].mean() < 0.5 * bf16[:10].mean()  # it learned
    assert abs(fp8[-10:].mean() - bf16[-10:].mean()) <= 0.02 * bf16[-10:].mean(), (fp8[-10:], bf16[-10:])


@pytest.mark.gpu
def test_gpu_auto_for_a_compiled_model_times_cuda_graphs():
    """The FP8 and bf16 training steps (Triton casts, _scaled_mm, autograd) capture into CUDA graphs: no
    decision fell back to time per call."""
    device = cuda_device()
    model = _llama(dim=256, ffn=512, vocab=512, device=device, dtype=torch.bfloat16).train()
    tokens = _tokens(model, batch=4, seq=64, device=device)
    plan = FC.convert_to_float8(model, decide="auto", example_inputs=(tokens,), compiled=True)
    measured = [d for d in plan.decisions if d.base_ms is not None]
    assert len(measured) == 14 and all(d.fp8_ms > 0 and d.base_ms > 0 for d in measured)
    assert all("(GPU time (CUDA graph))" in d.reason for d in measured), [d.reason for d in measured]
