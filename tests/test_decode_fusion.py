"""The fused decode GEMV (kernel_pytorch/ops/decode_fused_linear.py: RMSNorm before, gated activation after) and
the decode_fusion pass: the kernel under Triton's interpreter and on the GPU against the unfused ops, the native
path against float64, clear errors; on transformers decode steps of several families, which launches the pass
fuses, numerics of the rewritten graph, and what it leaves alone.

As in tests/test_decode_linear.py, the ``test_interp_*`` tests run in a child pytest started with
``TRITON_INTERPRET=1`` (``test_triton_kernels_in_a_subprocess``).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.hardware import detect_hardware
from kernel_pytorch.passes import PassContext, PassManager, get_pass
from kernel_pytorch.passes.graph_utils import clone_graph_module

from .conftest import capture_graph
from .generation_models import causal_lm
from .test_decode_linear import _step_graph
from .triton_interpreter import INTERPRETED, cuda_device, interp, run_interpreted_tests

DL = importlib.import_module("kernel_pytorch.ops.decode_linear")
FUSED = importlib.import_module("kernel_pytorch.ops.decode_fused_linear")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")

# (token rows, out features per weight, in features, bias, norm: None | (residual, cast before weight[, weight
# offset: Gemma's 1 + w]), activation[, block_n: weight rows a program, as the pass may pick])
CASES = {
    "qkv-1row-residual-hf-rounding": (1, (40, 9, 9), 700, False, (True, True), None),
    "gate_up-3rows-bias-residual-silu": (3, (24, 24), 100, True, (True, False), "silu"),
    "gate_up-1row-gelu_tanh-no-norm": (1, (24, 24), 100, False, None, "gelu_tanh"),
    "lm_head-2rows-norm-no-residual": (2, (33,), 64, False, (False, True), None),
    "gate_up-1row-residual-gemma-offset-gelu_tanh": (1, (24, 24), 100, False, (True, False, 1.0), "gelu_tanh"),
    "qkv-1row-residual-16-rows-a-program": (1, (40, 9, 9), 700, False, (True, False), None, 16),
    "gate_up-1row-residual-silu-16-rows-a-program": (1, (40, 40), 300, False, (True, False), "silu", 16),
}
# The kernel against the unfused ops, which round at the same places: float32 differs by summation order; 16-bit
# by an occasional rounding flip of a normed input or a projection (Triton's interpreter also rounds bf16 its own way).
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-2}
TOL_GPU = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm())


def _inputs(case: str, dtype: torch.dtype, device):
    rows, sizes, k, bias, norm, activation, *block_n = CASES[case]
    torch.manual_seed(len(case))
    x = torch.randn(1, rows, k, device=device, dtype=dtype)
    weights = [(torch.randn(n, k, device=device) / k**0.5).to(dtype) for n in sizes]
    options = {"biases": [torch.randn(n, device=device, dtype=dtype) for n in sizes] if bias else None,
               "activation": activation, "block_n": block_n[0] if block_n else 0}
    if norm is not None:
        options.update(norm_weight=(torch.rand(k, device=device) + 0.5).to(dtype), eps=1e-5,
                       residual=torch.randn(1, rows, k, device=device, dtype=dtype) if norm[0] else None,
                       cast_before_weight=norm[1])
        options.update({"norm_weight_offset": norm[2]} if len(norm) > 2 else {})
    return x, weights, options


def _unfused(x, weights, options, dtype=None):
    """The three ops the fused launch replaces, run natively (optionally in ``dtype``)."""
    cast = (lambda t: t.to(dtype) if t is not None else None) if dtype else (lambda t: t)
    x, weights = cast(x), [cast(w) for w in weights]
    biases = [cast(b) for b in options["biases"]] if options["biases"] else None
    norm, k = None, x.shape[-1]
    if options.get("norm_weight") is not None:
        residual = options["residual"]
        norm = DL.NormInput(cast(options["norm_weight"]), options["eps"], options["cast_before_weight"],
                            cast(residual.reshape(-1, k)) if residual is not None else None,
                            options.get("norm_weight_offset", 0.0))
    return FUSED.unfused(x.reshape(-1, k), norm, weights, biases, options["activation"] or "")


def check(case: str, dtype: torch.dtype, device="cpu", tol=TOL) -> None:
    x, weights, options = _inputs(case, dtype, device)
    result = FUSED.decode_fused_linear(x, weights, **options)
    out, h = result if options.get("residual") is not None else (result, None)
    expected, expected_h = _unfused(x, weights, options)
    rows, sizes = CASES[case][0], CASES[case][1]
    assert out.shape == (1, rows, sizes[0] if options["activation"] else sum(sizes)) and out.dtype == dtype
    assert rel(out, expected) < tol[dtype]
    if h is not None:
        assert rel(h, expected_h) < (0 if dtype == torch.float32 else tol[dtype]) + 1e-12


@interp
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interp_kernel_matches_the_unfused_ops(gemv_on_cpu, dtype, case):
    check(case, dtype)
    assert gemv_on_cpu == {"grouped_gemv": 1}


@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_* tests itself")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to interpret")
def test_triton_kernels_in_a_subprocess(interpreted_tests):
    run_interpreted_tests(__file__, interpreted_tests)


@pytest.mark.parametrize("case", CASES)
def test_native_path_matches_float64(case):
    x, weights, options = _inputs(case, torch.float32, "cpu")
    result = FUSED.decode_fused_linear(x, weights, **options)
    out = result[0] if options.get("residual") is not None else result
    assert rel(out, _unfused(x, weights, options, torch.float64)[0]) < 1e-5


def test_bad_arguments_get_a_clear_error():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="two weights of one shape"):
        FUSED.decode_fused_linear(x, [w, w, w], activation="silu")
    with pytest.raises(ValueError, match="one of"):
        FUSED.decode_fused_linear(x, [w, w], activation="relu")
    with pytest.raises(ValueError, match="needs norm_weight"):
        FUSED.decode_fused_linear(x, [w], residual=torch.randn(1, 8))
    with pytest.raises(ValueError, match="needs norm_weight"):
        FUSED.decode_fused_linear(x, [w], norm_weight_offset=1.0)
    with pytest.raises(ValueError, match="not a power of two"):
        FUSED.decode_fused_linear(x, [w], block_n=12)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_kernel_matches_the_unfused_ops(dtype, case):
    check(case, dtype, cuda_device(), TOL_GPU)


# ---------------------------------------------------------------------------------------------- the pass

_PASSES = ("normalize", "norms", "horizontal_gemm", "activations", "rope", "decode_attention", "attention",
           "decode_linear", "decode_fusion", "decode_rope_cache")


def _run_passes(gm, example, training=False):
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    ctx = PassContext(hardware=detect_hardware("cpu"), config=OptimizeConfig(), training=training,
                      example_inputs=dict(zip(names, example)))
    results = PassManager([get_pass(name) for name in _PASSES]).run(gm, ctx)
    return dict((p.name, r) for p, r in results)["decode_fusion"]


def _fused_launches(gm) -> list[tuple[int, bool, bool, str | None]]:
    """(weights, normed, with a residual, activation) of each fused launch, in graph order."""
    return [(len(n.args[1]), n.kwargs["norm_weight"] is not None, n.kwargs.get("residual") is not None,
             n.kwargs["activation"]) for n in gm.graph.nodes if n.target is FUSED.decode_fused_linear]


# Per layer: the input norm into q/k/v (the first layer's reads the embeddings, no residual); the post-attention
# norm with its residual add into gate/up and their gated activation. Phi-3's packed gate_up is one weight.
@pytest.mark.parametrize("family, activation", [("llama", "silu"), ("qwen2", "silu"), ("qwen3", "silu"),
                                                ("mistral", "silu"), ("gemma2", "gelu_tanh")])
def test_transformers_decode_steps_fuse_norms_and_activations(family, activation):
    model = causal_lm(family)
    gm, example = _step_graph(model)
    original = clone_graph_module(gm)
    with torch.no_grad():
        result = _run_passes(gm, example)
        layers = model.config.num_hidden_layers
        expected = [(3, True, layer > 0, None) for layer in range(layers)]
        launches = _fused_launches(gm)
        assert [launch for launch in launches if launch[0] == 3] == expected
        assert [launch for launch in launches if launch[0] == 2] == [(2, True, True, activation)] * layers
        assert len(result.rewrites) == len(launches)
        offsets = {n.kwargs.get("norm_weight_offset", 0.0) for n in gm.graph.nodes
                   if n.target is FUSED.decode_fused_linear}
        assert offsets == ({1.0} if family == "gemma2" else {0.0})  # Gemma's 1 + w made in the kernel, no op of its own
        # each run on its own copy: a step writes its token into the cache and advances the cache's counter
        torch.testing.assert_close(gm(*_copied(example))[0], original(*_copied(example))[0], rtol=1e-5, atol=1e-5)


def _copied(example: list) -> list:
    return [value.clone() if isinstance(value, torch.Tensor) else value for value in example]


def test_a_packed_gate_up_weight_is_fused_as_its_two_halves():
    """Phi-3 packs q/k/v and gate/up into one weight each: the norm goes into both launches, and the packed gated
    activation into gate/up's, whose weight's row halves become the gate and up weights."""
    from .test_decode_linear import _phi3

    model = _phi3()
    gm, example = _step_graph(model)
    original = clone_graph_module(gm)
    with torch.no_grad():
        result = _run_passes(gm, example)
        layers = model.config.num_hidden_layers
        assert _fused_launches(gm) == [(1, True, layer > 0, None) if kind == "qkv" else (2, True, True, "silu")
                                       for layer in range(layers) for kind in ("qkv", "gate_up")]
        assert len(result.rewrites) == 2 * layers
        torch.testing.assert_close(gm(*_copied(example))[0], original(*_copied(example))[0], rtol=1e-5, atol=1e-5)


class _ResidualThenHead(nn.Module):
    """A final residual add and norm before an LM head: the norm's sum h is read by nothing after it."""

    def __init__(self, dim=32, vocab=40):
        super().__init__()
        self.norm, self.head = nn.RMSNorm(dim, eps=1e-6), nn.Linear(dim, vocab, False)

    def forward(self, x, r):
        return self.head(self.norm(x + r))


def test_a_norm_whose_residual_sum_nobody_reads_is_fused():
    torch.manual_seed(0)
    module = _ResidualThenHead().eval()
    x, r = torch.randn(1, 1, 32), torch.randn(1, 1, 32)
    with torch.no_grad():
        gm, example = capture_graph(module, (x, r))
        result = _run_passes(gm, example)
        assert _fused_launches(gm) == [(1, True, True, None)] and len(result.rewrites) == 1
        torch.testing.assert_close(gm(*example)[0], module(x, r), rtol=1e-6, atol=1e-6)


class _SharedNorm(nn.Module):
    """A norm whose output a projection and something else read (the fused launch would not write it)."""

    def __init__(self, dim=32):
        super().__init__()
        self.norm, self.q = nn.RMSNorm(dim, eps=1e-6), nn.Linear(dim, dim, False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.q(h) * F.silu(h.sum(-1, keepdim=True))


def test_a_norm_read_by_more_than_the_launch_and_training_graphs_are_left_alone():
    torch.manual_seed(0)
    module = _SharedNorm().eval()
    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        gm, example = capture_graph(module, (x,))
        original = clone_graph_module(gm)
        result = _run_passes(gm, example)
        assert not result.rewrites and not _fused_launches(gm)
        torch.testing.assert_close(gm(*example)[0], original(*example)[0], rtol=1e-6, atol=1e-6)
    gm, example = capture_graph(module.train(), (x,))
    assert not _run_passes(gm, example, training=True).rewrites


# ---------------------------------------------------------------------------------------------- resources

def test_the_committed_decode_tiles_do_not_spill_on_an_h100():
    """Compiled for sm_90a here (Triton and its ptxas, no GPU): a tile that spills registers reads local memory in
    its inner loop. (Occupancy is not asserted: read from memory, the one-row gated tile of 194 registers, 2 programs
    an SM, read faster than the others tried, results/tune_decode_linear_cold.json.)"""
    from benchmarks import kernel_resources

    committed = [v for v in kernel_resources.VARIANTS if "committed" in v.notes]
    assert len(committed) == 2
    for variant in committed:
        found = kernel_resources.resources(variant)
        assert found["spill_bytes"] == 0 and found["stack_bytes"] == 0, (variant.name, found)
