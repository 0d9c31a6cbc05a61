"""The grouped GEMV of decode steps (kernel_pytorch/ops/decode_linear.py) and the decode_linear pass: the kernel
under Triton's interpreter and on the GPU against float64, one to three weights, biases, one and several token
rows; the pass's groups (q/k/v, gate/up, singles) on a transformers decode step, what it leaves alone, and
numerics of the rewritten graph.

As in tests/test_norm_ops.py, the ``test_interp_*`` tests run in a child pytest started with
``TRITON_INTERPRET=1`` (``test_triton_kernels_in_a_subprocess``).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.features.generation.lane import DecodeLane
from kernel_pytorch.features.generation.model_entries import ModelCalls
from kernel_pytorch.hardware import detect_hardware
from kernel_pytorch.passes import PassContext, PassManager, get_pass
from kernel_pytorch.passes.graph_utils import clone_graph_module
from kernel_pytorch.passes.shape_constants import example_value

from .conftest import capture_graph
from .generation_models import causal_lm
from .triton_interpreter import INTERPRETED, cuda_device, interp, run_interpreted_tests

DL = importlib.import_module("kernel_pytorch.ops.decode_linear")
FUSED = importlib.import_module("kernel_pytorch.ops.decode_fused_linear")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (token rows, out features of each weight, in features, bias): K not a multiple of the 512 tile, N not of 8
CASES = {"qkv-1row": (1, (40, 9, 9), 700, False), "gate_up-3rows-bias": (3, (24, 24), 100, True),
         "single-16rows": (16, (33,), 64, True)}


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected).norm() / expected.norm())


def check(case: str, dtype: torch.dtype, device="cpu") -> None:
    rows, sizes, k, bias = CASES[case]
    torch.manual_seed(len(case))
    x = torch.randn(1, rows, k, device=device, dtype=dtype)
    weights = [torch.randn(n, k, device=device, dtype=dtype) for n in sizes]
    biases = [torch.randn(n, device=device, dtype=dtype) for n in sizes] if bias else None
    out = DL.grouped_linear(x, weights, biases)
    expected = torch.cat([F.linear(x.double(), w.double(), biases[i].double() if bias else None)
                          for i, w in enumerate(weights)], -1)
    assert out.shape == expected.shape and out.dtype == dtype
    assert rel(out, expected) < TOL[dtype]


@interp
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interp_kernel_matches_float64(gemv_on_cpu, dtype, case):
    check(case, dtype)
    assert gemv_on_cpu == {"grouped_gemv": 1}


@interp
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_interp_weights_read_before_the_wait_match_float64(gemv_on_cpu, monkeypatch, gated):
    """The one-row kernel's first weight chunk read before its PDL wait (as under CUDA-graph capture)."""
    monkeypatch.setattr(DL, "read_weights_early", lambda launch: True)
    torch.manual_seed(1)
    x, weights = torch.randn(1, 700), [torch.randn(40, 700), torch.randn(40, 700)]
    out, _ = DL.grouped_gemv(x, weights, None, activation="silu" if gated else None)
    gate, up = (F.linear(x.double(), w.double()) for w in weights)
    expected = F.silu(gate.float()).double() * up if gated else torch.cat([gate, up], -1)
    assert rel(out, expected) < TOL[torch.float32]


@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_* tests itself")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to interpret")
def test_triton_kernels_in_a_subprocess(interpreted_tests):
    run_interpreted_tests(__file__, interpreted_tests)


@pytest.mark.parametrize("case", CASES)
def test_native_path_matches_float64(case):
    check(case, torch.float32)


@interp
@pytest.mark.parametrize("max_rows, launches", [(2, {}), (3, {"grouped_gemv": 1})])
def test_interp_calls_over_max_rows_take_f_linear(gemv_on_cpu, max_rows, launches):
    torch.manual_seed(0)
    x, weights = torch.randn(3, 64), [torch.randn(24, 64), torch.randn(8, 64)]
    out = DL.grouped_linear(x, weights, max_rows=max_rows)
    expected = torch.cat([F.linear(x.double(), w.double()) for w in weights], -1)
    assert rel(out, expected) < TOL[torch.float32]
    assert gemv_on_cpu == launches


def test_bad_weight_counts_get_a_clear_error():
    x = torch.randn(1, 8)
    with pytest.raises(ValueError, match="1 to 3 weights"):
        DL.grouped_linear(x, [torch.randn(4, 8)] * 4)
    with pytest.raises(ValueError, match="2 biases for 1 weights"):
        DL.grouped_linear(x, [torch.randn(4, 8)], [torch.randn(4)] * 2)
    with pytest.raises(ValueError, match="max_rows=17 is outside 1 to 16"):
        DL.grouped_linear(x, [torch.randn(4, 8)], max_rows=17)


# ---------------------------------------------------------------------------------------------- the pass

class DecodeBlock(nn.Module):
    """The linears of a Llama decoder layer around a stand-in for attention: q/k/v on one input, o, gate/up on
    one input, down."""

    def __init__(self, dim=32, kv=8, ffn=48, qkv_bias=False):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(dim, dim, qkv_bias), nn.Linear(dim, kv, qkv_bias), \
            nn.Linear(dim, kv, qkv_bias), nn.Linear(dim, dim, False)
        self.gate, self.up, self.down = nn.Linear(dim, ffn, False), nn.Linear(dim, ffn, False), nn.Linear(ffn, dim, False)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        h = x + self.o(q * (k.sum(-1, keepdim=True) + v.mean(-1, keepdim=True)))
        return h + self.down(F.silu(self.gate(h)) * self.up(h))


def _rewritten(module: nn.Module, x: torch.Tensor, training: bool):
    gm, example = capture_graph(module, (x,))
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    ctx = PassContext(hardware=detect_hardware("cpu"), config=OptimizeConfig(), training=training,
                      example_inputs=dict(zip(names, example)))
    results = PassManager([get_pass("normalize"), get_pass("decode_linear")]).run(gm, ctx)
    return gm, dict((p.name, r) for p, r in results)["decode_linear"], example


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2-biases"])
def test_decode_step_linears_become_grouped_launches(qkv_bias):
    torch.manual_seed(0)
    module = DecodeBlock(qkv_bias=qkv_bias).eval()
    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        gm, result, example = _rewritten(module, x, training=False)
    launches = [n for n in gm.graph.nodes if n.target is DL.grouped_linear]
    assert sorted(len(n.args[1]) for n in launches) == [1, 1, 2, 3]  # o, down, gate+up, q+k+v
    assert [n.args[2] is not None for n in launches if len(n.args[1]) == 3] == [qkv_bias]
    assert not any(n.target is F.linear for n in gm.graph.nodes)
    assert len(result.rewrites) == 4
    with torch.no_grad():
        torch.testing.assert_close(gm(*example)[0], module(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape, training, grad", [((2, 40, 32), False, False), ((1, 1, 32), True, True),
                                                   ((1, 1, 32), False, True)],
                         ids=["many-rows", "training", "eval-with-grad"])
def test_many_rows_training_and_graphs_that_need_a_backward_are_left_alone(shape, training, grad):
    with torch.set_grad_enabled(grad):
        gm, result, _ = _rewritten(DecodeBlock().train(training), torch.randn(shape), training)
    assert not result.rewrites and not any(n.target is DL.grouped_linear for n in gm.graph.nodes)


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_kernel_matches_float64(dtype, case):
    check(case, dtype, cuda_device())


@pytest.mark.gpu
@pytest.mark.parametrize("max_rows", [2, 16])
def test_gpu_calls_over_max_rows_match_float64(max_rows):
    torch.manual_seed(0)
    device = cuda_device()
    x = torch.randn(3, 256, device=device, dtype=torch.bfloat16)
    weights = [torch.randn(24, 256, device=device, dtype=torch.bfloat16) for _ in range(2)]
    out = DL.grouped_linear(x, weights, max_rows=max_rows)  # 3 rows: F.linear at 2, the kernel at 16
    expected = torch.cat([F.linear(x.double(), w.double()) for w in weights], -1)
    assert rel(out, expected) < TOL[torch.bfloat16]


# ------------------------------------------------------------------------------- transformers decode steps

def _step_graph(model: nn.Module, within_capture=None, batch: int = 1):
    """The graph of ``model``'s decode step as a generation lane compiles it (batch 1, one token; a batch above 1 is a
    symbolic size), with its inputs. ``within_capture(gm, example_inputs)`` runs inside the backend, where
    TorchDynamo's tracing context is, on the prefill's graph and then on the step's."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        if within_capture is not None:
            within_capture(gm, example_inputs)
        return gm.forward

    lane = DecodeLane(model, ModelCalls.of(model, backend), batch, 256, cuda_graphs=False)
    prompt = torch.randint(6, 128, (batch, 9))
    with torch.no_grad():
        lane.prefill(prompt, torch.ones_like(prompt))
        lane.step(torch.full((batch,), 7))
    gm, example = graphs[-1]
    return gm, _hinted(example)


def _prefill_graph(model: nn.Module, batch: int, tokens: int):
    """The graph of ``model``'s prefill of ``tokens`` (a symbolic length) as a generation lane compiles it, with its
    inputs."""
    graphs = []
    lane = DecodeLane(model, ModelCalls.of(model, lambda gm, inputs: graphs.append((gm, inputs)) or gm.forward),
                      batch, 256, cuda_graphs=False)
    with torch.no_grad():
        lane.prefill(torch.randint(6, 128, (batch, tokens)), torch.ones(batch, tokens, dtype=torch.long))
    gm, example = graphs[0]
    return gm, _hinted(example)


def _hinted(example: list) -> list:
    return [int(e.node.hint) if isinstance(e, torch.SymInt) else e for e in example]  # sizes: their values


def _context(gm: torch.fx.GraphModule, example: list, config: OptimizeConfig | None = None) -> PassContext:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return PassContext(hardware=detect_hardware("cpu"), config=config or OptimizeConfig(), training=False,
                       example_inputs=dict(zip(names, example)))


def _phi3() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Phi3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=128, vocab_size=128, pad_token_id=0, max_position_embeddings=512)
    return transformers.Phi3ForCausalLM(config).eval()


@pytest.mark.parametrize("family, groups_per_layer", [("llama", [1, 1, 2, 3]), ("qwen2", [1, 1, 2, 3]),
                                                      ("phi3", [1, 1, 1, 1])])
def test_transformers_decode_steps_get_grouped_launches(family, groups_per_layer):
    model = _phi3() if family == "phi3" else causal_lm(family)
    gm, example = _step_graph(model)
    original = clone_graph_module(gm)
    ctx = _context(gm, example)
    with torch.no_grad():
        PassManager([get_pass("normalize"), get_pass("decode_linear")]).run(gm, ctx)
        launches = sorted(len(n.args[1]) for n in gm.graph.nodes if n.target is DL.grouped_linear)
        layers = model.config.num_hidden_layers
        # per layer: q/k/v (or Phi-3's packed qkv_proj), o, gate/up (or gate_up_proj), down; and the LM head
        assert launches == sorted(groups_per_layer * layers + [1])
        assert not any(n.target is F.linear for n in gm.graph.nodes)
        torch.testing.assert_close(gm(*example)[0], original(*example)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("enabled", [False, True])
def test_a_step_of_symbolic_batch_gets_grouped_launches_only_with_the_option(enabled):
    model = causal_lm("llama")
    gm, example = _step_graph(model, batch=2)
    original = clone_graph_module(gm)
    ctx = _context(gm, example, OptimizeConfig(generation={"symbolic_batch_gemv": enabled}))
    with torch.no_grad():
        PassManager([get_pass("normalize"), get_pass("decode_linear"), get_pass("decode_fusion")]).run(gm, ctx)
        launches = [n for n in gm.graph.nodes if n.target is DL.grouped_linear]
        layers = model.config.num_hidden_layers
        assert len(launches) == (4 * layers + 1 if enabled else 0)  # q/k/v, o, gate/up, down; the head
        assert not any(n.target is FUSED.decode_fused_linear for n in gm.graph.nodes)  # not fused at a symbolic batch
        torch.testing.assert_close(gm(*example)[0], original(*example)[0], rtol=1e-5, atol=1e-5)


def test_a_prefill_of_symbolic_length_keeps_cublas_with_the_option():
    gm, example = _prefill_graph(causal_lm("llama"), batch=2, tokens=40)
    ctx = _context(gm, example, OptimizeConfig(generation={"symbolic_batch_gemv": True}))
    with torch.no_grad():
        PassManager([get_pass("normalize"), get_pass("decode_linear")]).run(gm, ctx)
    launched = [example_value(n.args[0]).shape for n in gm.graph.nodes if n.target is DL.grouped_linear]
    assert all(shape[1] == 1 for shape in launched), launched  # at most the head on the last position
