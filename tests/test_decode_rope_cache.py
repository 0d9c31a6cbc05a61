"""The fused RoPE + KV-cache write of decode steps (kernel_pytorch/ops/decode_rope_cache.py) and the
decode_rope_cache pass: the kernel under Triton's interpreter and on the GPU against apply_rope + index_copy_
(strided q/k/v views as a fused projection gives them, partial rotary, several tokens and batch rows); on
transformers decode steps of several families, the rewrite per layer and the step's logits and caches against the
original graph; prefills and training graphs left alone.

The ``test_interp_*`` tests run in a child pytest started with ``TRITON_INTERPRET=1``
(``test_triton_kernels_in_a_subprocess``).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.hardware import detect_hardware
from kernel_pytorch.ops.rope import apply_rope
from kernel_pytorch.passes import PassContext, PassManager, get_pass
from kernel_pytorch.passes.graph_utils import clone_graph_module

from .conftest import capture_graph
from .generation_models import causal_lm
from .test_decode_linear import _step_graph
from .triton_interpreter import INTERPRETED, cuda_device, interp, route_to_triton, run_interpreted_tests

RC = importlib.import_module("kernel_pytorch.ops.decode_rope_cache")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")

# (batch, new tokens, rotary dim); heads 4 / 2, head dim 16, a cache of 10 slots
CASES = {"decode-1x1-full-rotary": (1, 1, 16), "3x2-partial-rotary": (3, 2, 12)}


def _inputs(case: str, dtype: torch.dtype, device):
    batch, tokens, rotary = CASES[case]
    heads_q, heads_k, dim, length = 4, 2, 16, 10
    torch.manual_seed(len(case))
    qkv = torch.randn(batch, tokens, (heads_q + 2 * heads_k) * dim, device=device, dtype=dtype)
    q, k, v = (part.view(batch, tokens, -1, dim).transpose(1, 2)
               for part in qkv.split([heads_q * dim, heads_k * dim, heads_k * dim], -1))
    cos, sin = (torch.randn(batch, tokens, rotary, device=device, dtype=dtype).unsqueeze(1) for _ in range(2))
    caches = [torch.randn(batch, heads_k, length, dim, device=device, dtype=dtype) for _ in range(2)]
    positions = torch.tensor([3, 7][:tokens], device=device)
    return q, k, v, cos, sin, caches, positions


def check(case: str, dtype: torch.dtype, device="cpu") -> None:
    q, k, v, cos, sin, (k_cache, v_cache), positions = _inputs(case, dtype, device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    q_rot = RC.decode_rope_cache(q, k, v, cos, sin, k_cache, v_cache, positions)
    expected_q, k_rot = apply_rope(q, k, cos, sin)
    expected_k.index_copy_(2, positions, k_rot)
    expected_v.index_copy_(2, positions, v)
    # the same formula and one rounding on both paths
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
    torch.testing.assert_close(q_rot, expected_q, **tol)
    torch.testing.assert_close(k_cache, expected_k, **tol)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    return route_to_triton(monkeypatch, RC, ("rope_cache_fwd",), ())


@interp
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interp_kernel_matches_rope_and_index_copy(triton_on_cpu, dtype, case):
    check(case, dtype)
    assert triton_on_cpu == {"rope_cache_fwd": 1}


@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_* tests itself")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to interpret")
def test_triton_kernels_in_a_subprocess(interpreted_tests):
    run_interpreted_tests(__file__, interpreted_tests)


@pytest.mark.parametrize("case", CASES)
def test_native_path_matches_rope_and_index_copy(case):
    check(case, torch.float32)


def test_caches_that_disagree_with_k_get_a_clear_error():
    q, k, v, cos, sin, (k_cache, v_cache), positions = _inputs("decode-1x1-full-rotary", torch.float32, "cpu")
    with pytest.raises(ValueError, match="disagree"):
        RC.decode_rope_cache(q, k, v[..., :8], cos, sin, k_cache, v_cache, positions)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_kernel_matches_rope_and_index_copy(dtype, case):
    check(case, dtype, cuda_device())


# ---------------------------------------------------------------------------------------------- the pass

_PASSES = ("normalize", "norms", "rope", "decode_attention", "attention", "decode_rope_cache")


def _run(gm, example, training=False):
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    ctx = PassContext(hardware=detect_hardware("cpu"), config=OptimizeConfig(), training=training,
                      example_inputs=dict(zip(names, example)))
    results = PassManager([get_pass(name) for name in _PASSES]).run(gm, ctx)
    return dict((p.name, r) for p, r in results)["decode_rope_cache"]


def _copied(example: list) -> list:
    return [value.clone() if isinstance(value, torch.Tensor) else value for value in example]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma2"])
def test_transformers_decode_steps_write_the_cache_in_the_rope_launch(family):
    model = causal_lm(family)
    gm, example = _step_graph(model)
    original = clone_graph_module(gm)
    with torch.no_grad():
        result = _run(gm, example)
        layers = model.config.num_hidden_layers
        assert len(result.rewrites) == layers + 1  # and one line for the counters
        assert sum(n.target is RC.decode_rope_cache for n in gm.graph.nodes) == layers
        assert not any(n.target in ("index_copy_", "add_") for n in gm.graph.nodes)
        advances = [n for n in gm.graph.nodes if n.target is torch._foreach_add_]
        assert len(advances) == 1 and len(advances[0].args[0]) == layers
        ours, theirs = _copied(example), _copied(example)
        torch.testing.assert_close(gm(*ours)[0], original(*theirs)[0], rtol=1e-5, atol=1e-5)
        for mine, reference in zip(ours, theirs):  # the caches (and their counters) after the step
            if isinstance(mine, torch.Tensor):
                torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-6)


def test_prefills_and_training_graphs_are_left_alone():
    from .test_decode_linear import _prefill_graph

    gm, example = _prefill_graph(causal_lm("llama"), batch=1, tokens=40)
    with torch.no_grad():
        assert not _run(gm, example).rewrites  # 40 tokens, a symbolic length: the RoPE kernel's tiles stay
    gm, example = _step_graph(causal_lm("llama"))
    assert not _run(gm, example, training=True).rewrites


class _TwoLayersSharedPositions(nn.Module):
    """Two layers of RoPE (transformers' rotate_half) and cache writes at one positions tensor for both, as a
    model that passes ``cache_position`` down to every layer's cache update writes them."""

    def forward(self, q, k, v, cos, sin, positions, caches):
        outputs = []
        for layer in range(2):
            q_rot = q * cos + _rotate_half(q) * sin
            k_rot = k * cos + _rotate_half(k) * sin
            caches[2 * layer].index_copy_(2, positions, k_rot)
            caches[2 * layer + 1].index_copy_(2, positions, v)
            outputs.append(q_rot * (layer + 1))
        return outputs[0] + outputs[1]


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_a_positions_tensor_shared_by_the_layers_pairs_each_layers_own_writes():
    q, k, v, cos, sin, _, positions = _inputs("decode-1x1-full-rotary", torch.float32, "cpu")
    caches = [torch.randn(1, 2, 10, 16) for _ in range(4)]
    args = (q, k, v, cos, sin, positions, caches)
    gm, example = capture_graph(_TwoLayersSharedPositions(), args)
    original = clone_graph_module(gm)
    with torch.no_grad():
        result = _run(gm, example)
        assert len(result.rewrites) == 2
        fused = [n for n in gm.graph.nodes if n.target is RC.decode_rope_cache]
        # each call writes its own layer's caches: k into caches 0 / 2, v into 1 / 3
        assert [(n.args[5].name, n.args[6].name) for n in fused] == [("l_caches_0_", "l_caches_1_"),
                                                                      ("l_caches_2_", "l_caches_3_")]
        ours, theirs = _copied(example), _copied(example)
        torch.testing.assert_close(gm(*ours)[0], original(*theirs)[0], rtol=1e-6, atol=1e-6)
        for mine, reference in zip(ours, theirs):
            torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-6)


class _LayersCountingTokens(nn.Module):
    """transformers' StaticLayer.update for two layers at one new token: each layer's write position is its counter,
    advanced in place; ``shared``: both layers count in one tensor; ``read_after``: the first counter is read again
    after its advance; ``one_positions``: both layers write at the first layer's positions."""

    def __init__(self, shared: bool = False, read_after: bool = False, one_positions: bool = False):
        super().__init__()
        self.shared, self.read_after, self.one_positions = shared, read_after, one_positions

    def forward(self, q, k, v, cos, sin, counters, caches):
        outputs = []
        for layer in range(2):
            counter = counters[0 if self.shared else layer]
            if layer == 0 or not self.one_positions:
                positions = torch.arange(1) + counter
                counter.add_(1)
            q_rot = q * cos + _rotate_half(q) * sin
            k_rot = k * cos + _rotate_half(k) * sin
            caches[2 * layer].index_copy_(2, positions, k_rot)
            caches[2 * layer + 1].index_copy_(2, positions, v)
            outputs.append(q_rot * (layer + 1))
        if self.read_after:
            outputs.append(counters[0] * 1.0)
        return outputs[0] + outputs[1] + (outputs[2] if self.read_after else 0)


@pytest.mark.parametrize("shared, read_after, one_positions, moved", [
    (False, False, False, 2), (True, False, False, 1), (False, True, False, 1), (False, False, True, 1)])
def test_cache_counters_are_read_by_the_launches_and_advanced_together(shared, read_after, one_positions, moved):
    """A shared counter: the second layer's positions read it after the first layer's advance, which stays; the
    second advance, after which nothing reads it, moves. A counter read after its advance keeps it. One positions
    tensor for both layers: the first launch reads the counter, the second the positions."""
    q, k, v, cos, sin, _, _ = _inputs("decode-1x1-full-rotary", torch.float32, "cpu")
    counters = [torch.tensor(3), torch.tensor(3)]
    caches = [torch.randn(1, 2, 10, 16) for _ in range(4)]
    model = _LayersCountingTokens(shared, read_after, one_positions)
    gm, example = capture_graph(model, (q, k, v, cos, sin, counters, caches))
    original = clone_graph_module(gm)
    with torch.no_grad():
        result = _run(gm, example)
        advances = [n for n in gm.graph.nodes if n.target is torch._foreach_add_]
        assert sum(len(n.args[0]) for n in advances) == moved
        assert sum(n.target == "add_" for n in gm.graph.nodes) == (1 if one_positions else 2) - moved
        assert len(result.rewrites) == 2 + (moved > 0)
        ours, theirs = _copied(example), _copied(example)
        torch.testing.assert_close(gm(*ours), original(*theirs), rtol=1e-6, atol=1e-6)
        for mine, reference in zip(ours, theirs):  # the caches and the counters after the step
            torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-6)
