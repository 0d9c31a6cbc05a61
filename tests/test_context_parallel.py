"""``optimize(model, context_parallel=group)`` on gloo, world sizes 2 and 4, against the single-process model.

One spawned process group per world size runs every case (as tests/test_ring_attention.py does); each rank
writes its results as JSON and the tests below assert on them, per rank. Numerics in float64, relative error
< 1e-8, on a LlamaStyleLM whose RMSNorm and softmax keep float64: the library's LlamaStyleLM computes both in
float32 even in a float64 model, so its float64 logits are only float32-accurate (~3e-8 apart from any exact
re-implementation, which is also why plain ``optimize`` rolls its attention back at the 1e-10 tolerance).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import kernel_pytorch
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.distributed import context_parallel
from kernel_pytorch.distributed.context_parallel import ContextParallelError
from kernel_pytorch.ops.attention import attention
from kernel_pytorch.passes.base import PassResult
from kernel_pytorch.passes.context_parallel import _unshardable_attention
from kernel_pytorch.testing.llama_style import (
    LlamaStyleAttention,
    LlamaStyleConfig,
    LlamaStyleLM,
    RMSNorm,
)

from .spawned_ranks import run_in_spawned_ranks

pytestmark = pytest.mark.distributed

WORLD_SIZES = (2, 4)
_JOIN_TIMEOUT_S = 150  # rank processes are killed after this; each group's own timeout (60 s) fires first
_TOLERANCE = 1e-8
_SEQ = 16  # divisible by 2 x 4


# ---------------------------------------------------------------------------------------------------------
# The model: LlamaStyleLM with float64 kept in its norms and softmax (module docstring).
# ---------------------------------------------------------------------------------------------------------


class _ExactNorm(RMSNorm):
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _ExactAttention(LlamaStyleAttention):
    """LlamaStyleAttention with the softmax in the inputs' dtype; ``extra_mask`` (a buffer) is added to the
    scores when set: an arbitrary mask, which context parallelism must refuse."""

    def forward(self, x, cos, sin, mask):
        c = self.config
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rotary(q, cos, sin), _rotary(k, cos, sin)
        k = k.repeat_interleave(c.n_heads // c.n_kv_heads, dim=1)
        v = v.repeat_interleave(c.n_heads // c.n_kv_heads, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(c.head_dim) + mask
        if hasattr(self, "extra_mask"):
            scores = scores + self.extra_mask[:seq, :seq]
        out = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def _rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _ComputedRopeLM(LlamaStyleLM):
    """RoPE tables computed in the forward from ``arange`` positions (as Hugging Face models do from
    ``position_ids``): their global rows cannot be proven, so context parallelism must refuse."""

    def forward(self, tokens):
        seq, c = tokens.shape[1], self.config
        x = self.embed(tokens)
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=x.dtype) / c.head_dim)
        angles = torch.arange(seq, dtype=x.dtype)[:, None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        mask = torch.full((seq, seq), float("-inf"), dtype=x.dtype).triu(1)
        for layer in self.layers:
            x = layer(x, angles.cos(), angles.sin(), mask)
        return self.lm_head(self.norm(x))


def _model(extra_mask: bool = False, model_class=LlamaStyleLM) -> LlamaStyleLM:
    torch.manual_seed(0)  # the same weights on every rank
    model = model_class(LlamaStyleConfig.tiny()).double()
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.__class__ = _ExactNorm
        if isinstance(module, LlamaStyleAttention):
            module.__class__ = _ExactAttention
            if extra_mask:
                module.register_buffer("extra_mask", torch.randn(64, 64, dtype=torch.float64), persistent=False)
    return model


# ---------------------------------------------------------------------------------------------------------
# What every rank runs.
# ---------------------------------------------------------------------------------------------------------


def _rel(actual, expected) -> float:
    return float((actual.detach() - expected.detach()).norm() / expected.detach().norm())


def _train_step(model, tokens, weight):
    logits = model(tokens)
    (logits * weight).sum().backward()
    return logits


def _model_and_reference():
    """(model, an unoptimized twin trained one step, tokens, the loss weight, the twin's logits)."""
    model = _model()
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    tokens = torch.randint(0, 97, (2, _SEQ))
    weight = torch.randn(2, _SEQ, 97, dtype=torch.float64)
    return model, reference, tokens, weight, _train_step(reference, tokens, weight)


def _equivalence_case(world_size: int) -> dict:
    """Logits and parameter gradients of the context-parallel model vs the same model on one process."""
    model, reference, tokens, weight, expected = _model_and_reference()
    model = kernel_pytorch.optimize(model, context_parallel=dist.group.WORLD, example_inputs=(tokens,))
    report = kernel_pytorch.report_of(model)
    logits = _train_step(model, tokens, weight)
    grads = {name: _rel(p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), reference.parameters())}
    second = model(tokens)  # a second call reuses the compiled graph and gives the same logits
    return {
        "logits": _rel(logits, expected),
        "grads": grads,
        "second_call": _rel(second, expected),
        "verification_passed": report.verification is not None and report.verification.passed,
        "rolled_back": any("rolled back" in note for note in report.notes),
        "rewrites": [r.replacement for r in report.rewrites if "context parallel" in r.replacement],
        "indivisible": _raised(lambda: model(tokens[:, :2 * world_size + 2])),
    }


def _compiled_case() -> dict:
    """``optimize(..., compile=True)``: the rewritten graphs go to a compiler, here aot_eager (AOTAutograd
    traces forward and backward, where point-to-point communication could not be traced; Inductor on the CPU
    adds C++ builds, ~10 s per rank, without tracing anything more). Compared with the unsharded model."""
    from kernel_pytorch.backends.cpu import CpuBackend

    model, reference, tokens, weight, expected = _model_and_reference()
    CpuBackend.compiler = "aot_eager"  # this spawned process only
    model = kernel_pytorch.optimize(model, context_parallel=dist.group.WORLD, example_inputs=(tokens,), compile=True)
    notes = kernel_pytorch.report_of(model).notes
    logits = _train_step(model, tokens, weight)
    grads = [_rel(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())]
    return {"logits": _rel(logits, expected), "max_grad": max(grads),
            "compiled": any(note.startswith("compiler: aot_eager") for note in notes),
            "eager_notes": [note for note in notes if "eagerly" in note]}


def _masked_case() -> dict:
    """A model with an arbitrary additive mask: refused on every rank, with the place named."""
    model = _model(extra_mask=True)
    tokens = torch.randint(0, 97, (2, _SEQ))
    return {"error": _raised(lambda: kernel_pytorch.optimize(model, context_parallel=dist.group.WORLD,
                                                             example_inputs=(tokens,)))}


def _computed_rope_case() -> dict:
    model = _model(model_class=_ComputedRopeLM)
    tokens = torch.randint(0, 97, (2, _SEQ))
    return {"error": _raised(lambda: kernel_pytorch.optimize(model, context_parallel=dist.group.WORLD,
                                                             example_inputs=(tokens,)))}


def _raised(call) -> str | None:
    try:
        call()
    except Exception as error:  # the message is what the tests check
        return f"{type(error).__name__}: {error}"
    return None


def _run_cases(world_size: int) -> dict:
    # The refusals first: the group must still be usable after them (nothing left half-exchanged).
    results = {"masked": _masked_case(), "computed_rope": _computed_rope_case(),
               "equivalence": _equivalence_case(world_size)}
    if world_size == 2:  # compiling costs seconds per process: one world size with a real ring is enough
        results["compiled"] = _compiled_case()
    return results


# ---------------------------------------------------------------------------------------------------------
# The tests.
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> dict[int, list[dict]]:
    """{world size: [rank 0's results, rank 1's, ...]}: every group runs at once, each rank its own process."""
    return run_in_spawned_ranks(_run_cases, WORLD_SIZES, tmp_path_factory.mktemp("context_parallel"),
                                _JOIN_TIMEOUT_S)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_logits_and_gradients_match_the_single_process_model(rank_results, world_size):
    for rank, results in enumerate(rank_results[world_size]):
        case = results["equivalence"]
        assert case["logits"] < _TOLERANCE and case["second_call"] < _TOLERANCE, (rank, case)
        assert len(case["grads"]) == 2 + 2 * 9 + 1  # embed, lm_head, per layer 7 linears + 2 norms, final norm
        assert max(case["grads"].values()) < _TOLERANCE, (rank, case["grads"])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rewrites_are_in_place_and_verified(rank_results, world_size):
    """Equal numbers could also come from a model rolled back to running whole on every rank: the report
    must show ring attention and global RoPE tables in use, and the end-to-end check passed."""
    for results in rank_results[world_size]:
        case = results["equivalence"]
        assert case["verification_passed"] and not case["rolled_back"]
        assert case["rewrites"] == ["context parallel: 2 RoPE table(s) indexed at the global positions",
                                    "context parallel: 2 attention call(s) -> ring_attention over the group"]


def test_compiled_graphs_run_compiled_and_match(rank_results):
    """Ring attention is a custom op in the graph, so the compiler takes the whole graph: no "running it
    eagerly" note, and the same logits and gradients as the unsharded model."""
    for rank, results in enumerate(rank_results[2]):
        case = results["compiled"]
        assert case["compiled"] and case["eager_notes"] == [], (rank, case)
        assert case["logits"] < _TOLERANCE and case["max_grad"] < _TOLERANCE, (rank, case)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_indivisible_sequence_raises_on_every_rank(rank_results, world_size):
    length = 2 * world_size + 2
    for results in rank_results[world_size]:
        error = results["equivalence"]["indivisible"]
        assert error is not None and error.startswith("ContextParallelError")
        assert f"sequence length {length} is not divisible by 2 x world size = {2 * world_size}" in error


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_arbitrary_mask_is_refused_on_every_rank(rank_results, world_size):
    for results in rank_results[world_size]:
        error = results["masked"]["error"]
        assert error is not None and error.startswith("ContextParallelError"), error
        assert "cannot run on a shard of the sequence" in error
        assert "layers.0.attn: attention with a mask" in error and "layers.1.attn: attention with a mask" in error


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rope_computed_from_positions_is_refused_on_every_rank(rank_results, world_size):
    for results in rank_results[world_size]:
        error = results["computed_rope"]["error"]
        assert error is not None and error.startswith("ContextParallelError"), error
        assert "layers.0.attn: the RoPE cos/sin tables are not the first rows of a table input" in error
        assert "arange computes positions" in error


# ---------------------------------------------------------------------------------------------------------
# In-process: the config.
# ---------------------------------------------------------------------------------------------------------


def test_context_parallel_takes_only_a_process_group():
    with pytest.raises(ValueError, match="context_parallel takes a torch.distributed ProcessGroup or None, got str"):
        OptimizeConfig(context_parallel="world")
    assert OptimizeConfig().context_parallel is None


def test_a_backend_without_the_sharding_passes_is_refused():
    from kernel_pytorch.backends.base import Backend
    from kernel_pytorch.backends.tpu import TpuBackend

    context_parallel.require_passes(Backend.graph_passes)  # the default pipeline runs them all
    with pytest.raises(ContextParallelError, match=r"this backend does not run \['rope', 'context_parallel'\]"):
        context_parallel.require_passes(TpuBackend.graph_passes)


def test_soft_capped_attention_is_refused_with_the_reason():
    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    for node in (q, k, v):
        node.meta["example_value"] = torch.randn(1, 2, 8, 4)
    call = graph.call_function(attention, (q, k, v, None), {"is_causal": True, "softcap": 30.0})
    assert _unshardable_attention(call, PassResult()) == "soft-capped attention (cap 30.0): ring attention has no cap"
