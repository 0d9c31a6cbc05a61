"""The FP8 graph pass (``kernel_pytorch.passes.fp8_linear``) that ``optimize(model, fp8=...)`` runs, on the CPU.

``fp8={"mode": True, "emulate": True}`` runs FP8's quantization numerics in fp32, so the whole pipeline (conversion after the
q/k/v and gate/up fusion, per-graph and end-to-end checks with ``fp8_tolerance``, roll-back) runs here; the
``"auto"`` decision is checked with scripted timers on graphs captured by hand. The real ``_scaled_mm`` path
and the measured decision are in test_float8_conversion.py's GPU tests.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernel_pytorch
from kernel_pytorch.config import OptimizeConfig, Tolerance
from kernel_pytorch.hardware import detect_hardware
from kernel_pytorch.ops.float8_linear import float8_linear
from kernel_pytorch.passes import PassContext, PassResult, get_pass

from .conftest import capture_graph
from .test_float8_conversion import _llama, _scripted_timers, _tokens

FC = importlib.import_module("kernel_pytorch.float8_conversion")

# 6 x 64 = 384 tokens: enough for the CPU's horizontal fusion of q/k/v and gate/up (passes/horizontal_gemm.py)
FUSED_BATCH = 6


def _fp8_rewrites(report) -> dict[str, str]:
    return {r.location: r.replacement for r in report.rewrites if r.pass_name == "fp8"}


def test_emulated_fp8_converts_the_fused_linears_and_keeps_the_head():
    model = _llama().train()
    tokens = _tokens(model, batch=FUSED_BATCH, seq=64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "emulate": True}, example_inputs=(tokens,))
    report = kernel_pytorch.report_of(optimized)
    rewrites = _fp8_rewrites(report)
    # per layer: q+k+v fused (N = 64 + 32 + 32), o, gate+up fused (N = 2 x 128), down
    assert len(rewrites) == 8, rewrites
    assert "(M, K, N) = (384, 64, 128)" in rewrites["layers.0.attn"] and "q_proj + k_proj + v_proj" in rewrites["layers.0.attn"]
    assert "(M, K, N) = (384, 64, 256)" in rewrites["layers.1.mlp"]
    assert any(s.pass_name == "fp8" and s.location == "lm_head" and "output head" in s.reason for s in report.skipped)
    assert not report.rollbacks, report.rollbacks
    assert report.verification is not None and report.verification.passed, report.verification
    # fp8_tolerance judged it: FP8's ~3% would fail the float32 tolerance
    assert report.verification.tolerance in (pytest.approx(0.1), pytest.approx(0.15))
    assert all(torch.equal(v, state[k]) for k, v in optimized.state_dict().items())
    assert type(optimized.layers[0].attn.q_proj) is nn.Linear  # converted in the graph, modules untouched


def test_linears_inside_checkpointed_blocks_convert():
    """Full checkpointing puts each block in a checkpointed region: the pass runs in the regions' bodies too."""
    model = _llama().train()
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "emulate": True}, memory={"checkpointing": "full"},
                                        example_inputs=(_tokens(model, batch=FUSED_BATCH, seq=64),))
    report = kernel_pytorch.report_of(optimized)
    assert len(_fp8_rewrites(report)) == 8 and not report.rollbacks, report.rollbacks
    assert report.verification is not None and report.verification.passed, report.verification


def test_per_graph_checks_judge_the_kernel_passes_with_the_fp8_tolerance(monkeypatch):
    """In bf16 with FP8 layers, the kernel passes' rounding is amplified to FP8-sized differences: judged with
    bfloat16's tolerance (gradients 4e-2) the norm/rope/attention/activation rewrites were all rolled back
    (H100 e2e benchmark: "relative error 1.12e-01 exceeds tolerance 4e-02"). No float32 referee here: on the
    GPU it did not rescue them either."""
    graphs = importlib.import_module("kernel_pytorch.verify.graphs")
    monkeypatch.setattr(graphs, "referee_device", lambda *a, **k: (None, "no float32 referee in this test"))
    model = _llama(dtype=torch.bfloat16).train()
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "emulate": True}, example_inputs=(_tokens(model),))
    report = kernel_pytorch.report_of(optimized)
    assert not report.rollbacks, report.rollbacks
    assert {"norms", "rope", "attention", "activations", "fp8"} <= {r.pass_name for r in report.rewrites}
    assert report.verification is not None and report.verification.passed, report.verification


def test_the_fp8_tolerance_applies_only_to_graphs_with_fp8_rewrites():
    model = _llama().train()
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "emulate": True}, example_inputs=(_tokens(model),))
    optimizer = optimized._kernel_pytorch.graph_optimizer  # its FP8 feature gives the tolerance rule
    fp8, norms = get_pass("fp8"), get_pass("norms")
    unchanged = optimizer._judged_by([(norms, PassResult(changed=3)), (fp8, PassResult())])
    assert unchanged is optimizer.config
    judged = optimizer._judged_by([(norms, PassResult(changed=3)), (fp8, PassResult(changed=1))])
    assert judged.tolerance_for(torch.float32) == judged.fp8.tolerance == optimizer.config.fp8.tolerance
    assert optimizer.config.tolerance_for(torch.float32) == kernel_pytorch.config.DEFAULT_TOLERANCES["float32"]


def test_a_conversion_beyond_the_fp8_tolerance_is_rolled_back():
    model = _llama().train()
    tokens = _tokens(model)
    expected = model(tokens)
    tight = Tolerance(outputs=1e-6, gradients=1e-6)  # FP8 cannot meet it
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "emulate": True, "tolerance": tight},
                                        example_inputs=(tokens,))
    report = kernel_pytorch.report_of(optimized)
    assert [r.pass_name for r in report.rollbacks] == ["fp8"], report.rollbacks
    assert not _fp8_rewrites(report)
    assert report.verification is not None and report.verification.passed, report.verification
    torch.testing.assert_close(optimized(tokens), expected, rtol=1e-4, atol=1e-4)


def test_on_a_cpu_without_emulation_the_pass_is_skipped_with_the_reason():
    model = _llama()
    tokens = _tokens(model)
    optimized = kernel_pytorch.optimize(model, fp8=True, example_inputs=(tokens,))
    report = kernel_pytorch.report_of(optimized)
    skipped = [s for s in report.skipped if s.pass_name == "fp8"]
    assert len(skipped) == 1 and "compute capability >= 8.9" in skipped[0].reason, skipped
    assert not _fp8_rewrites(report)


def test_emulation_needs_fp8_true():
    with pytest.raises(ValueError, match="emulate=True runs FP8 numerics"):
        OptimizeConfig(fp8={"mode": "auto", "emulate": True})
    assert OptimizeConfig(fp8={"mode": True, "emulate": True}).fp8.emulate


# --------------------------------------------------------------------------- the pass on hand-captured graphs

def _run_passes(model: nn.Module, inputs: tuple, config: OptimizeConfig, compiled: bool = True,
                names=("normalize", "horizontal_gemm", "fp8")) -> dict[str, PassResult]:
    gm, example = capture_graph(model, inputs)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    ctx = PassContext(hardware=detect_hardware("cpu"), config=config, training=model.training,
                      example_inputs=dict(zip(placeholders, example)), compiled=compiled,
                      fp8_targets=FC.linear_targets(model, config, inputs))
    results = {}
    for name in names:
        results[name] = get_pass(name).run(gm, ctx)
        gm.graph.lint()
    gm.recompile()
    return results


def test_auto_decides_on_the_fused_shapes_by_gpu_time_when_compiled(monkeypatch):
    used = _scripted_timers(monkeypatch)  # FP8 2x faster by GPU time, 2x slower per call
    model = _llama().train()
    tokens = _tokens(model, batch=FUSED_BATCH, seq=64)
    result = _run_passes(model, (tokens,), OptimizeConfig(fp8="auto"), compiled=True)["fp8"]
    rewrites = {r.location: r.replacement for r in result.rewrites}
    assert len(rewrites) == 8 and set(used) == {"graph"}
    assert "fp8 measured 2.00x (GPU time (CUDA graph)) at (M, K, N) = (384, 64, 256)" in rewrites["layers.0.mlp"]
    # three shapes per layer (q/k/v and o share none; gate/up, down): each measured once per process
    assert len(used) == len({(384, 64, 128), (384, 64, 64), (384, 64, 256), (384, 128, 64)})


def test_auto_keeps_what_measures_slower_per_call_when_eager(monkeypatch):
    _scripted_timers(monkeypatch)
    model = _llama().train()
    result = _run_passes(model, (_tokens(model),), OptimizeConfig(fp8="auto"), compiled=False)["fp8"]
    assert not result.rewrites
    reasons = {s.location: s.reason for s in result.skipped}
    assert reasons["layers.0.attn.o_proj"] == "fp8 measured 0.50x (per call) at (M, K, N) = (64, 64, 64), below 1.05x"


def test_auto_on_a_cpu_keeps_every_linear_and_says_it_could_not_measure():
    model = _llama().train()
    result = _run_passes(model, (_tokens(model),), OptimizeConfig(fp8="auto"))["fp8"]
    assert not result.rewrites
    assert all("could not measure" in s.reason for s in result.skipped if s.location != "lm_head"), result.skipped


class DirectLinear(nn.Module):
    """``F.linear`` on a bare parameter (no nn.Linear), and an nn.Linear under autocast."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 32))
        self.inner = nn.Linear(32, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        h = F.linear(x, self.weight)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.inner(h)
        return self.head(h.float())


def test_linears_that_are_not_candidates_are_left_with_the_reason():
    model = DirectLinear()
    result = _run_passes(model, (torch.randn(8, 32),), OptimizeConfig(fp8={"mode": True, "emulate": True}),
                         names=("normalize", "fp8"))["fp8"]
    assert not result.rewrites
    reasons = {s.location: s.reason for s in result.skipped}
    assert reasons["(model)"].startswith("not an nn.Linear's call"), reasons
    assert reasons["inner"].startswith("runs under autocast"), reasons
    assert "output head" in reasons["head"]


def test_the_rewritten_graph_calls_float8_linear_with_the_recipe():
    model = _llama().train()
    tokens = _tokens(model, batch=FUSED_BATCH, seq=64)
    gm, example = capture_graph(model, (tokens,))
    config = OptimizeConfig(fp8={"mode": True, "emulate": True, "recipe": "rowwise"})
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    ctx = PassContext(hardware=detect_hardware("cpu"), config=config, training=True,
                      example_inputs=dict(zip(placeholders, example)), fp8_targets=FC.linear_targets(model, config))
    expected = gm(*example)[0]
    for name in ("normalize", "horizontal_gemm", "fp8"):
        get_pass(name).run(gm, ctx)
    gm.recompile()
    calls = [n for n in gm.graph.nodes if n.target is float8_linear]
    assert len(calls) == 8 and all(n.kwargs["recipe"] == "rowwise" and n.kwargs["emulate"] for n in calls)
    assert all("example_value" in n.meta for n in calls)
    out = gm(*example)[0]
    error = (out - expected).norm() / expected.norm()
    assert 1e-4 < error < 0.1, error  # FP8's rounding (not exact), within fp8_tolerance


# ---------------------------------------------------------------- quantization fused into the producer

class NormThenLinears(nn.Module):
    """One RMSNorm feeding two linears (run with the horizontal fusion off), and a SwiGLU of the second's
    output halves feeding a third."""

    def __init__(self, dim=64):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.a, self.b = nn.Linear(dim, 32, bias=False), nn.Linear(dim, 128)
        self.down = nn.Linear(64, dim, bias=False)
        self.head = nn.Linear(dim, 16)

    def forward(self, x):
        y = self.norm(x)
        gate, up = self.b(y).chunk(2, dim=-1)
        return self.head(self.down(F.silu(gate) * up) + self.a(y).repeat(1, 1, 2))


def test_norm_and_gated_activation_compute_their_fp8_linears_input_maximum():
    torch.manual_seed(0)
    model, x = NormThenLinears().train(), torch.randn(4, 24, 64)
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "emulate": True}, example_inputs=(x,),
                                        disable_passes=("horizontal_gemm",))
    rewrites = _fp8_rewrites(kernel_pytorch.report_of(optimized))
    assert set(rewrites) == {"a", "b", "down"}, rewrites
    assert all("maximum from the rms_norm kernel" in rewrites[n] for n in ("a", "b")), rewrites
    assert "maximum from the gated_activation_packed kernel" in rewrites["down"], rewrites
    # The FP8 linears given the producers' maxima compute what the unfused ones do, bit for bit.
    rms, act = importlib.import_module("kernel_pytorch.ops.rms_norm"), importlib.import_module("kernel_pytorch.ops.activations")
    y = rms.rms_norm(x, model.norm.weight, 1e-6)
    gate_up = float8_linear(y, model.b.weight, model.b.bias, emulate=True)
    h = float8_linear(act.gated_activation_packed(gate_up, "silu"), model.down.weight, emulate=True)
    expected = model.head(h + float8_linear(y, model.a.weight, emulate=True).repeat(1, 1, 2))
    assert torch.equal(optimized(x), expected)


def test_gated_activation_backward_computes_the_fp8_gate_up_gradient_maximum():
    torch.manual_seed(1)
    model, x = NormThenLinears().train(), torch.randn(4, 24, 64)
    reference = copy.deepcopy(model)
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "emulate": True}, example_inputs=(x,),
                                        disable_passes=("horizontal_gemm",))
    rewrites = _fp8_rewrites(kernel_pytorch.report_of(optimized))
    grad_note = "its gradient's maximum from the gated_activation_packed backward kernel"
    assert grad_note in rewrites["b"] and not any(grad_note in rewrites[n] for n in ("a", "down")), rewrites
    # The gradients are the unfused FP8 path's, bit for bit (both emulated).
    rms, act = importlib.import_module("kernel_pytorch.ops.rms_norm"), importlib.import_module("kernel_pytorch.ops.activations")
    y = rms.rms_norm(x, reference.norm.weight, 1e-6)
    gate_up = float8_linear(y, reference.b.weight, reference.b.bias, emulate=True)
    h = float8_linear(act.gated_activation_packed(gate_up, "silu"), reference.down.weight, emulate=True)
    reference.head(h + float8_linear(y, reference.a.weight, emulate=True).repeat(1, 1, 2)).square().sum().backward()
    optimized(x).square().sum().backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(ours.grad, theirs.grad), name


def test_in_inference_no_gradient_maximum_is_wired():
    model, x = NormThenLinears().eval(), torch.randn(4, 24, 64)
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "emulate": True}, example_inputs=(x,),
                                        disable_passes=("horizontal_gemm",))
    rewrites = _fp8_rewrites(kernel_pytorch.report_of(optimized))
    assert set(rewrites) == {"a", "b", "down"} and not any("gradient's maximum" in r for r in rewrites.values())


def test_rowwise_fp8_linears_find_their_own_input_maximum():
    model = _llama().train()
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "emulate": True, "recipe": "rowwise"},
                                        example_inputs=(_tokens(model, batch=FUSED_BATCH, seq=64),))
    rewrites = _fp8_rewrites(kernel_pytorch.report_of(optimized))
    assert len(rewrites) == 8 and not any("maximum from" in r for r in rewrites.values()), rewrites


def test_fused_llama_layers_name_the_kernel_that_finds_their_input_maximum():
    model = _llama().train()
    optimized = kernel_pytorch.optimize(model, fp8={"mode": True, "emulate": True},
                                        example_inputs=(_tokens(model, batch=FUSED_BATCH, seq=64),))
    rewrites = _fp8_rewrites(kernel_pytorch.report_of(optimized))
    assert "maximum from the rms_norm kernel" in rewrites["layers.0.attn"]  # q/k/v after input_layernorm
    assert "maximum from the rms_norm kernel" in rewrites["layers.1.mlp"]  # gate/up after the residual-fused norm
    assert "maximum from the gated_activation_packed kernel" in rewrites["layers.0.mlp.down_proj"]
    assert "input's maximum" not in rewrites["layers.0.attn.o_proj"]  # attention's output: no such producer
    # the fused gate/up feeds only the packed SwiGLU, o_proj and down_proj only the next residual-fused RMSNorm:
    # those kernels' backwards find the gradients' maxima; q/k/v's gradient comes from attention and RoPE
    assert "gradient's maximum from the gated_activation_packed backward" in rewrites["layers.1.mlp"], rewrites
    for name in ("layers.0.attn.o_proj", "layers.0.mlp.down_proj", "layers.1.mlp.down_proj"):
        assert "gradient's maximum from the rms_norm backward" in rewrites[name], (name, rewrites)
    assert "gradient's maximum" not in rewrites["layers.0.attn"]


def _graph_calling(kwargs: dict) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output(graph.call_function(float8_linear, (x, w, None), kwargs))
    return torch.fx.GraphModule(nn.Module(), graph)


def test_cuda_graphs_note_is_for_training_fp8_graphs_without_cuda_graphs():
    real, emulated = _graph_calling({"emulate": False}), _graph_calling({"emulate": True})
    assert FC.cuda_graphs_note(real, training=True, inductor_without_graphs=True) == FC.CUDA_GRAPHS_NOTE
    assert FC.cuda_graphs_note(real, training=False, inductor_without_graphs=True) is None
    assert FC.cuda_graphs_note(real, training=True, inductor_without_graphs=False) is None
    assert FC.cuda_graphs_note(emulated, training=True, inductor_without_graphs=True) is None
    outer = torch.fx.GraphModule(nn.Module(), torch.fx.Graph())  # an FP8 call inside a checkpointed region
    outer.add_submodule("region", real)
    assert FC.cuda_graphs_note(outer, training=True, inductor_without_graphs=True) == FC.CUDA_GRAPHS_NOTE
