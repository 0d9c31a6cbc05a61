"""Content-aware (top-k) block-sparse attention (issue 7): the block choice against a brute-force float64
reference, what is always kept (sink, local) and never (future blocks under causal), exactness when every
block is kept, GQA, the BlockMask and FlexAttention (eager and compiled by Inductor on this CPU), the
measured error, the config's validation, and the attention pass: applied only with the option, only from
min_length (decided per call), refused in training and for masked calls, with a report line.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernel_pytorch.passes.attention as attention_pass  # noqa: F401  (registers "attention")
from kernel_pytorch import optimize, report_of
from kernel_pytorch.attention.kernels.topk_sparse import (
    select_blocks,
    topk_attention,
    topk_block_mask,
    topk_mask,
    topk_pattern,
    topk_relative_error,
)
from kernel_pytorch.config import OptimizeConfig, SparseAttentionConfig
from kernel_pytorch.errors import ConfigError
from kernel_pytorch.hardware import detect_hardware
from kernel_pytorch.ops.attention import attention, sparse_or_dense_attention
from kernel_pytorch.passes.attention import AttentionPass
from kernel_pytorch.passes.base import PassContext
from kernel_pytorch.passes.normalize import Normalize

from .conftest import capture_graph, rel_err

BLOCK = 128

# Eager FlexAttention warns that it is the unfused reference: expected here (correctness on the CPU).
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _qkv(length: int, heads: int = 4, kv_heads: int = 4, e: int = 16, batch: int = 2,
         dtype: torch.dtype = torch.float64, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(batch, h, length, e, generator=generator, dtype=dtype)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def _brute_force(q, k, *, is_causal, scale, topk=None, keep_ratio=None, local=1, sink=1, block=BLOCK):
    """The selection written out with loops: pooled means, scores, and per row the forced blocks plus
    ``budget`` of the best-scoring others (ties to the lower index), in float64."""
    batch, heads, lq, e = q.shape
    group = heads // k.shape[1]
    n_q, n_k = math.ceil(lq / block), math.ceil(k.shape[2] / block)
    scale = 1 / math.sqrt(e) if scale is None else scale
    chosen = torch.zeros(batch, heads, n_q, n_k, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            pq = [q[b, h, i * block:(i + 1) * block].double().mean(0) for i in range(n_q)]
            pk = [k[b, h // group, j * block:(j + 1) * block].double().mean(0) for j in range(n_k)]
            for i in range(n_q):
                candidates = [j for j in range(n_k) if not is_causal or j <= i]
                forced = {j for j in candidates if j < sink or (0 <= (i - j if is_causal else abs(i - j)) < local)}
                budget = topk if topk is not None else math.ceil(keep_ratio * len(candidates))
                others = sorted((j for j in candidates if j not in forced), key=lambda j: (-float(pq[i] @ pk[j]) * scale, j))
                for j in set(others[:budget]) | forced:
                    chosen[b, h, i, j] = True
    return chosen


# --------------------------------------------------------------------------------------------------
# the block choice
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("budget", [{"topk": 3}, {"keep_ratio": 0.3}, {"topk": 2, "local": 2, "sink": 0}],
                         ids=["topk3", "ratio0.3", "local2-nosink"])
def test_selection_matches_brute_force(is_causal, budget):
    q, k, _ = _qkv(7 * BLOCK + 37, heads=4, kv_heads=2, batch=1)  # GQA, a shorter last block
    local, sink = budget.pop("local", 1), budget.pop("sink", 1)
    got = select_blocks(q, k, is_causal=is_causal, scale=None, local_blocks=local, sink_blocks=sink, **budget)
    want = _brute_force(q, k, is_causal=is_causal, scale=None, local=local, sink=sink, **budget)
    assert got.shape == (1, 4, 8, 8)
    assert torch.equal(got, want), (got.int(), want.int())


def test_sink_and_local_kept_even_when_they_score_worst_and_causal_never_looks_ahead():
    q, k, _ = _qkv(8 * BLOCK, batch=1, heads=2, kv_heads=2)
    q = q.abs() + 1.0  # every pooled query points the same way
    k = k.clone()
    k[..., :BLOCK, :] = -10.0  # the sink block scores worst for every query block
    for i in range(8):  # and so does each query block's own (diagonal) block: lowest scores on the diagonal
        k[..., i * BLOCK:(i + 1) * BLOCK, :] -= 5.0 * (i + 1)
    selected = select_blocks(q, k, is_causal=True, scale=None, topk=3, local_blocks=2, sink_blocks=1)
    rows, cols = torch.arange(8)[:, None], torch.arange(8)[None, :]
    assert not selected[..., cols > rows].any()  # no future block
    assert selected[..., :, 0].all()  # sink
    assert selected[..., (rows - cols >= 0) & (rows - cols < 2)].all()  # the diagonal and the one before
    # sink + local are 3 blocks from row 2 on, and 3 more by score where the row has them
    assert selected.sum(-1)[0, 0].tolist() == [1, 2, 3, 4, 5, 6, 6, 6]


def test_keep_ratio_counts_the_causal_blocks_of_each_row():
    q, k, _ = _qkv(10 * BLOCK, batch=1, heads=1, kv_heads=1)
    selected = select_blocks(q, k, is_causal=True, scale=None, keep_ratio=0.5, local_blocks=0, sink_blocks=0)
    assert selected.sum(-1).flatten().tolist() == [math.ceil(0.5 * (i + 1)) for i in range(10)]


# --------------------------------------------------------------------------------------------------
# the attention: exact when everything is kept, the selection's mask otherwise
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("grad", [False, True], ids=["flex-eager", "sdpa-math-grad"])
def test_every_block_kept_is_dense_attention_exactly(is_causal, grad):
    q, k, v = _qkv(3 * BLOCK + 50, heads=4, kv_heads=2)
    q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
    with torch.set_grad_enabled(grad):
        out = topk_attention(q, k, v, is_causal=is_causal, topk=4)
        ratio = topk_attention(q, k, v, is_causal=is_causal, keep_ratio=1.0)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    assert rel_err(out, dense) < 1e-10 and rel_err(ratio, dense) < 1e-10
    assert topk_relative_error(q.detach(), k.detach(), v.detach(), is_causal=is_causal, topk=4) < 1e-10


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
def test_sparse_output_is_attention_under_the_selection_mask_forward_and_gradients(is_causal):
    q, k, v = _qkv(5 * BLOCK + 3, heads=4, kv_heads=1)
    selected = select_blocks(q, k, is_causal=is_causal, scale=0.3, topk=2)
    mask = topk_mask(selected, q.shape[2], k.shape[2], is_causal=is_causal, block=BLOCK)
    reference = F.scaled_dot_product_attention(q, k, v, mask, scale=0.3, enable_gqa=True)
    with torch.no_grad():  # FlexAttention's own CPU forward, with the selection's BlockMask
        assert rel_err(topk_attention(q, k, v, is_causal=is_causal, scale=0.3, topk=2), reference) < 1e-10
    assert rel_err(topk_attention(q, k, v, is_causal=is_causal, scale=0.3, topk=2), reference) > 0  # not dense...
    assert rel_err(reference, F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.3,
                                                             enable_gqa=True)) > 1e-3  # ...a real approximation
    fresh = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = topk_attention(*fresh, is_causal=is_causal, scale=0.3, topk=2)
    expected = F.scaled_dot_product_attention(*ref, mask, scale=0.3, enable_gqa=True)
    seed = torch.randn_like(expected)
    for got, want in zip(torch.autograd.grad(out, fresh, seed), torch.autograd.grad(expected, ref, seed)):
        assert rel_err(got, want) < 1e-10


def test_block_mask_lists_the_selection_with_only_diagonal_and_ragged_blocks_partial():
    q, k, _ = _qkv(4 * BLOCK + 10, batch=1, heads=2, kv_heads=2, dtype=torch.float32)
    for is_causal in (True, False):
        selected = select_blocks(q, k, is_causal=is_causal, scale=None, topk=2)
        block_mask = topk_block_mask(selected, q.shape[2], k.shape[2], is_causal=is_causal, block=BLOCK)
        assert torch.equal(block_mask.to_dense().bool(), selected)
        partial, full = block_mask.kv_num_blocks, block_mask.full_kv_num_blocks
        assert torch.equal(partial + full, selected.sum(-1).int())
        if is_causal:  # the diagonal block (the ragged last one is the last row's diagonal)
            assert (partial == 1).all(), partial
        else:  # only the ragged last key block, where it is chosen
            assert torch.equal(partial, selected[..., -1].int()), (partial, selected)


def test_attention_takes_the_topk_pattern_through_the_flex_kernel():
    q, k, v = _qkv(3 * BLOCK, heads=4, kv_heads=2, dtype=torch.float32)
    pattern = topk_pattern(topk=2, local_blocks=1, sink_blocks=1)
    with torch.no_grad():
        out = attention(q, k, v, is_causal=True, enable_gqa=True, kernel="flex", pattern=pattern)
        assert rel_err(out, topk_attention(q, k, v, is_causal=True, topk=2)) < 1e-6
    with pytest.raises(ValueError, match="exactly one of topk and keep_ratio"):
        attention(q, k, v, is_causal=True, enable_gqa=True, kernel="flex", pattern=("topk", 2, 0.5, 1, 1, 128))


def test_compiled_fullgraph_by_inductor_on_cpu_equals_eager():
    q, k, v = _qkv(4 * BLOCK + 40, heads=2, kv_heads=1, e=16, batch=1, dtype=torch.float32)
    pattern = topk_pattern(topk=1)  # the last rows: sink, diagonal and 1 of their other 3 blocks

    def call(q, k, v):
        return sparse_or_dense_attention(q, k, v, None, 0.0, True, None, True, kernel="sdpa", pattern=pattern,
                                         min_length=256)

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, dynamic=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got, want = compiled(q, k, v), call(q, k, v)
    assert rel_err(got, want) < 1e-5
    assert rel_err(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) > 1e-3


# --------------------------------------------------------------------------------------------------
# the measured error
# --------------------------------------------------------------------------------------------------


def test_relative_error_sampled_rows_and_structured_inputs():
    q, k, v = _qkv(8 * BLOCK, heads=2, kv_heads=2, batch=1)
    full = topk_relative_error(q, k, v, is_causal=True, topk=2)
    assert full > 1e-3
    assert math.isclose(topk_relative_error(q, k, v, is_causal=True, topk=2, query_blocks=8), full, rel_tol=1e-9)
    assert topk_relative_error(q, k, v, is_causal=True, topk=2, query_blocks=3) > 0
    # keys that one block holds, with queries that want exactly it: the choice finds it, the error is small
    k, q = k * 0.1, q * 0.1
    k[..., 3 * BLOCK:4 * BLOCK, :] += 4.0
    q += 4.0
    structured = topk_relative_error(q, k, v, is_causal=True, topk=3, local_blocks=1, sink_blocks=1)
    assert structured < 0.1 * full


# --------------------------------------------------------------------------------------------------
# the config
# --------------------------------------------------------------------------------------------------


def test_config_spellings_and_defaults():
    assert OptimizeConfig().sparse_attention is None
    default = OptimizeConfig(sparse_attention="topk").sparse_attention
    assert default == SparseAttentionConfig() and default.pattern() == ("topk", 16, None, 1, 1, 128)
    ratio = OptimizeConfig(sparse_attention={"keep_ratio": 0.25, "min_length": 16384}).sparse_attention
    assert ratio.pattern() == ("topk", None, 0.25, 1, 1, 128) and ratio.min_length == 16384
    assert OptimizeConfig.model_validate(OptimizeConfig(sparse_attention=ratio).model_dump()).sparse_attention == ratio


def test_the_option_turns_auto_verification_off_and_refuses_verify_true():
    assert OptimizeConfig(sparse_attention="topk").verify is False  # it would roll the approximation back
    assert OptimizeConfig(sparse_attention="topk", verify=False).verify is False
    assert OptimizeConfig().verify == "auto"
    with pytest.raises(ConfigError, match="sparse_attention is an approximation, which verify=True would roll"):
        OptimizeConfig(sparse_attention="topk", verify=True)


@pytest.mark.parametrize("value, message", [
    ("top-k", "sparse_attention takes None, 'topk', a SparseAttentionConfig"),
    (True, "sparse_attention takes None, 'topk', a SparseAttentionConfig"),
    ({"topk": 4, "keep_ratio": 0.1}, "set topk or keep_ratio, not both"),
    ({"block": 100}, "block must be a multiple of 128"),
    ({"keep_ratio": 1.5}, "less than or equal to 1"),
    ({"topk": 0}, "greater than 0"),
    ({"local_blocks": -1}, "greater than or equal to 0"),
    ({"window": 3}, "sparse_attention: unknown SparseAttentionConfig option 'window'"),
])
def test_config_errors_name_the_problem(value, message):
    with pytest.raises(ConfigError, match=message):
        OptimizeConfig(sparse_attention=value)


# --------------------------------------------------------------------------------------------------
# the attention pass
# --------------------------------------------------------------------------------------------------


class CausalAttention(nn.Module):
    def forward(self, q, k, v):
        n = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class PaddedAttention(nn.Module):
    def forward(self, q, k, v, keep):
        scores = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep[:, None, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


def _rewrite(module: nn.Module, inputs: tuple, sparse=None, training: bool = False):
    module.train(training)
    gm, example = capture_graph(module, inputs)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    config = OptimizeConfig(sparse_attention=sparse)
    ctx = PassContext(hardware=detect_hardware("cpu"), config=config, training=training,
                      example_inputs=dict(zip(names, example)), compiled=False)
    Normalize().run(gm, ctx)
    result = AttentionPass().run(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    return gm, result, targets


SPARSE = {"topk": 1, "min_length": 384}  # at 512: the last query block sees 3 of its 4 blocks


def _inputs(length: int, seed: int = 0):
    return tuple(t.float() for t in _qkv(length, heads=2, kv_heads=2, e=16, batch=1, seed=seed))


def test_pass_leaves_attention_dense_without_the_option():
    _, result, targets = _rewrite(CausalAttention(), _inputs(512))
    assert attention in targets and sparse_or_dense_attention not in targets
    assert "top-k" not in result.rewrites[0].replacement


def test_pass_applies_topk_from_min_length_and_measures_the_error():
    gm, result, targets = _rewrite(CausalAttention(), _inputs(512), SPARSE)
    assert sparse_or_dense_attention in targets and attention not in targets
    [line] = [r.replacement for r in result.rewrites]
    assert "top-k sparse attention (approximate): top 1 blocks of 128 tokens per query block, + 1 sink + 1 local, " \
           "from 384 tokens" in line, line
    measured = float(line.split("relative error against dense ")[1].split()[0])
    long_inputs = _inputs(512)
    with torch.no_grad():
        out = gm(*long_inputs)[0]
        expected = topk_attention(*long_inputs, is_causal=True, topk=1)
        assert rel_err(out, expected) < 1e-6  # the sparse path at 512 >= 384
        assert math.isclose(rel_err(out, CausalAttention()(*long_inputs)), measured, rel_tol=0.05)
        short = _inputs(200, seed=1)  # the same graph below min_length: dense, exact
        assert rel_err(gm(*short)[0], CausalAttention()(*short)) < 1e-5


def test_pass_reports_dense_at_a_short_example():
    _, result, targets = _rewrite(CausalAttention(), _inputs(200), SPARSE)
    assert sparse_or_dense_attention in targets
    assert "dense at the example length 200 (< 384): exact there" in result.rewrites[0].replacement


def test_pass_refuses_in_training_with_a_report_line():
    _, result, targets = _rewrite(CausalAttention(), _inputs(512), SPARSE, training=True)
    assert attention in targets and sparse_or_dense_attention not in targets
    assert any("top-k sparse attention not applied: it is an inference option" in s.reason for s in result.skipped)


def test_pass_refuses_a_padding_mask_and_a_small_head_dim():
    q, k, v = _inputs(512)
    keep = torch.ones(1, 512, dtype=torch.bool)
    _, result, targets = _rewrite(PaddedAttention(), (q, k, v, keep), SPARSE)
    assert sparse_or_dense_attention not in targets
    assert any("not applied: the call has a mask other than causal" in s.reason for s in result.skipped)
    small = tuple(t[..., :8].contiguous() for t in (q, k, v))
    _, result, targets = _rewrite(CausalAttention(), small, SPARSE)
    assert sparse_or_dense_attention not in targets
    assert any("FlexAttention needs head dims in [16, 256]" in s.reason for s in result.skipped)


def test_optimize_with_the_option_end_to_end():
    module = CausalAttention().eval()
    model = optimize(module, example_inputs=_inputs(200), sparse_attention=SPARSE, compile=False)
    [line] = [r.replacement for r in report_of(model).rewrites if r.pass_name == "attention"]
    assert "top-k sparse attention (approximate)" in line and "not compiled" in line, line
    assert report_of(model).verification is None
    assert any("not verified: sparse_attention is an approximation" in n for n in report_of(model).notes)
    with torch.no_grad():
        long_inputs = _inputs(640, seed=2)
        assert rel_err(model(*long_inputs), topk_attention(*long_inputs, is_causal=True, topk=1)) < 1e-6
        assert rel_err(model(*long_inputs), CausalAttention()(*long_inputs)) > 1e-3
        short = _inputs(300, seed=3)
        assert rel_err(model(*short), CausalAttention()(*short)) < 1e-5
