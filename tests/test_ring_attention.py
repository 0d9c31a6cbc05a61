"""Ring attention and sequence sharding (kernel_pytorch.distributed) on gloo, world sizes 1, 2 and 4.

One spawned process group per world size runs every case (a spawn costs seconds, a case milliseconds);
each rank writes its results as JSON and the parametrized tests below assert on them, per case and rank.
Numerics: float64, against attention written out on the full sequence, relative error < 1e-8.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from kernel_pytorch.distributed import gather_sequence, ring_attention, shard_sequence
from kernel_pytorch.distributed.ring_attention import (
    _block_for_step,
    ring_attention_bwd,
    ring_attention_fwd,
)

from .spawned_ranks import run_in_spawned_ranks

pytestmark = pytest.mark.distributed

WORLD_SIZES = (1, 2, 4)
# Rank processes are killed after this; each group's own timeout (60 s) fires first on a hang.
_JOIN_TIMEOUT_S = 150
_TOLERANCE = 1e-8


# ---------------------------------------------------------------------------------------------------------
# What every rank runs.
# ---------------------------------------------------------------------------------------------------------


def _reference_attention(q, k, v, causal, scale):
    """Attention on the full sequence, written out: K/V heads repeated for GQA, top-left causal mask."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _rel(actual, expected) -> float:
    return float((actual.detach() - expected.detach()).norm() / expected.detach().norm())


def _attention_case(world_size, *, heads_q, heads_kv, chunk_q, chunk_k, causal, zigzag=True, value_dim=8,
                    kernel=None, scale=None) -> dict:
    """Relative errors of this rank's output and q/k/v gradients against the full-sequence reference."""
    torch.manual_seed(1234)  # the same full tensors on every rank
    chunks = 2 * world_size if zigzag else world_size
    seq_q, seq_k, batch, head_dim = chunk_q * chunks, chunk_k * chunks, 2, 8
    q = torch.randn(batch, heads_q, seq_q, head_dim, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, heads_kv, seq_k, head_dim, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, heads_kv, seq_k, value_dim, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(batch, heads_q, seq_q, value_dim, dtype=torch.float64)
    expected = _reference_attention(q, k, v, causal, scale)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)

    def shard(t):
        return shard_sequence(t.detach(), 2, zigzag=zigzag)

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, causal=causal, scale=scale, kernel=kernel)
    grads = torch.autograd.grad(out, local, shard(grad_out))
    errors = {"out": _rel(out, shard(expected)),
              "gathered_out": _rel(gather_sequence(out.detach(), 2, zigzag=zigzag), expected)}
    errors.update({name: _rel(g, shard(e)) for name, g, e in zip(("dq", "dk", "dv"), grads, expected_grads)})
    return errors


ATTENTION_CASES = {
    "causal_mha": {"heads_q": 2, "heads_kv": 2, "chunk_q": 3, "chunk_k": 3, "causal": True},
    "causal_gqa": {"heads_q": 4, "heads_kv": 2, "chunk_q": 2, "chunk_k": 2, "causal": True},
    "causal_gqa_scale": {"heads_q": 6, "heads_kv": 2, "chunk_q": 1, "chunk_k": 1, "causal": True,
                         "scale": 0.3},
    # the fused-kernel path of block_attention (the CUDA kernels' code path) through PyTorch's CPU kernel
    "causal_gqa_cpu_flash": {"heads_q": 4, "heads_kv": 2, "chunk_q": 3, "chunk_k": 3, "causal": True,
                             "kernel": "cpu_flash"},
    "full_zigzag": {"heads_q": 3, "heads_kv": 3, "chunk_q": 2, "chunk_k": 2, "causal": False},
    # cross-attention lengths and a value head dim unlike q/k's, in contiguous shards
    "full_gqa_contiguous": {"heads_q": 6, "heads_kv": 2, "chunk_q": 5, "chunk_k": 3, "causal": False,
                            "zigzag": False, "value_dim": 6},
}


def _layout_case(world_size) -> dict:
    """The zigzag order (rank r holds chunks r and 2N-1-r), and gather(shard(x)) == x in both layouts."""
    rank = dist.get_rank()
    torch.manual_seed(7)
    x = torch.randn(3, 4 * world_size, 5)
    return {
        "zigzag_positions": shard_sequence(torch.arange(2 * world_size), 0).tolist(),
        "expected_positions": [rank, 2 * world_size - 1 - rank],
        "contiguous_positions": shard_sequence(torch.arange(world_size), 0, zigzag=False).tolist(),
        "round_trip_zigzag": torch.equal(gather_sequence(shard_sequence(x, 1), 1), x),
        "round_trip_contiguous": torch.equal(gather_sequence(shard_sequence(x, -2, zigzag=False), -2, zigzag=False), x),
    }


def _gather_gradient_case(world_size) -> dict:
    """Every rank computes (gather(x) * w).sum(): each part's gradient is N x its part of w."""
    weight = torch.arange(4.0 * world_size).reshape(1, -1)
    local = shard_sequence(torch.zeros_like(weight), 1).requires_grad_()
    (gather_sequence(local, 1) * weight).sum().backward()
    return {"error": _rel(local.grad, world_size * shard_sequence(weight, 1))}


def _raised(fn) -> str | None:
    """The ValueError message ``fn`` raised, or None."""
    try:
        fn()
    except ValueError as error:
        return str(error)
    return None


def _tensors(heads_q, heads_kv, seq):
    return (torch.randn(1, heads_q, seq, 8), torch.randn(1, heads_kv, seq, 8), torch.randn(1, heads_kv, seq, 8))


def _error_cases(world_size) -> dict:
    rank = dist.get_rank()
    cases = {
        # every rank holds 3 tokens: 3N is not divisible by 2N (caught locally, the same on every rank)
        "odd_length": lambda: ring_attention(*_tensors(2, 2, 3), causal=True),
        "heads_not_multiple": lambda: ring_attention(*_tensors(3, 2, 4)),
        "shard_indivisible": lambda: shard_sequence(torch.zeros(2, 2 * world_size + 1), 1),
    }
    if world_size > 1:
        cases.update({
            # only rank 0 is wrong: the shape check must make every rank raise, not leave the others waiting
            "one_rank_odd_length": lambda: ring_attention(*_tensors(2, 2, 3 if rank == 0 else 4), causal=True),
            "heads_differ": lambda: ring_attention(*_tensors(2 + 2 * rank, 2, 4)),
            "kernels_differ": lambda: ring_attention(*_tensors(2, 2, 4), kernel="math" if rank else "cpu_flash"),
            "gather_lengths_differ": lambda: gather_sequence(torch.zeros(2, 2 + 2 * rank), 1),
        })
    results = {name: _raised(case) for name, case in cases.items()}
    # The group is still usable after the errors (no message left half-exchanged).
    results["afterwards"] = _attention_case(world_size, heads_q=2, heads_kv=1, chunk_q=1, chunk_k=1, causal=True)
    return results


def _compiled_case(world_size) -> dict:
    """``torch.compile(fullgraph=True)`` (aot_eager: AOTAutograd traces forward and backward) of a function
    calling ring_attention, against the same call eagerly: output and q/k/v gradients, per kernel."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(5)
    q, k, v = (shard_sequence(t, 2) for t in _tensors(4, 2, 4 * world_size))
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    results = {}
    for kernel in ("math", "cpu_flash"):
        def attend(q, k, v, kernel=kernel):
            return ring_attention(q, k, v, causal=True, kernel=kernel).sin()  # something around the op too

        counter = CompileCounterWithBackend("aot_eager")
        torch._dynamo.reset()
        compiled = torch.compile(attend, fullgraph=True, backend=counter)(q, k, v)
        expected = attend(q, k, v)
        grads = torch.autograd.grad(compiled, (q, k, v), grad_out)
        expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
        results[kernel] = {
            "errors": [_rel(compiled, expected)] + [_rel(g, e) for g, e in zip(grads, expected_grads)],
            "graphs": counter.frame_count,
            "op_in_graph": any("ring_attention_fwd" in str(g.graph) for g in counter.graphs),
        }
    return results


def _opcheck_case() -> dict:
    """``torch.library.opcheck`` of both ops over this world-size-1 group (its real name, resolved by the
    ops), per block kernel: schema, fake tensors against real, autograd registration, AOT dispatch."""

    torch.manual_seed(6)
    name = dist.group.WORLD.group_name
    q, k, v = (t.double().requires_grad_() for t in _tensors(4, 2, 6))
    failures = {}
    for kernel in ("math", "cpu_flash"):
        fwd_args = (q, k, v, name, True, 0.3, kernel)
        out, lse = ring_attention_fwd(*fwd_args)
        bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, name, True, 0.3,
                    kernel)
        for op, args in ((ring_attention_fwd, fwd_args), (ring_attention_bwd, bwd_args)):
            try:
                torch.library.opcheck(op, args)
            except Exception as error:  # noqa: BLE001 (OpCheckError and what it wraps: the test shows the message)
                failures[f"{op._name} {kernel}"] = f"{type(error).__name__}: {error}"
    return {"group_name": name, "failures": failures}


def _run_cases(world_size) -> dict:
    results = {name: _attention_case(world_size, **options) for name, options in ATTENTION_CASES.items()}
    results["layout"] = _layout_case(world_size)
    results["gather_gradient"] = _gather_gradient_case(world_size)
    results["errors"] = _error_cases(world_size)
    if world_size == 2:  # compiling costs seconds per process: one world size with a real ring is enough
        results["compiled"] = _compiled_case(world_size)
    if world_size == 1:
        results["opcheck"] = _opcheck_case()
    return results


# ---------------------------------------------------------------------------------------------------------
# The tests.
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> dict[int, list[dict]]:
    """{world size: [rank 0's results, rank 1's, ...]}: every group runs at once, each rank its own process."""
    return run_in_spawned_ranks(_run_cases, WORLD_SIZES, tmp_path_factory.mktemp("ring_attention"), _JOIN_TIMEOUT_S)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_matches_full_attention(rank_results, world_size, case):
    for rank, results in enumerate(rank_results[world_size]):
        errors = results[case]
        assert set(errors) == {"out", "gathered_out", "dq", "dk", "dv"}
        assert max(errors.values()) < _TOLERANCE, f"rank {rank}: {errors}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sequence_layout_and_round_trip(rank_results, world_size):
    for results in rank_results[world_size]:
        layout = results["layout"]
        assert layout["zigzag_positions"] == layout["expected_positions"]
        assert layout["round_trip_zigzag"] and layout["round_trip_contiguous"]
    assert [r["layout"]["contiguous_positions"] for r in rank_results[world_size]] == [[r] for r in range(world_size)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather_sequence_gradient(rank_results, world_size):
    for results in rank_results[world_size]:
        assert results["gather_gradient"]["error"] == 0.0


_EXPECTED_ERRORS = {
    "odd_length": "divisible by 2 x world size",
    "heads_not_multiple": "must be a multiple of key/value heads",
    "shard_indivisible": "is not divisible by 2 x world size",
    "one_rank_odd_length": "every rank must pass the same shapes",
    "heads_differ": "every rank must pass the same shapes",
    "kernels_differ": "every rank must pass the same shapes, dtypes and options",
    "gather_lengths_differ": "every rank must pass the same shapes",
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bad_input_raises_on_every_rank(rank_results, world_size):
    expected = {name: text for name, text in _EXPECTED_ERRORS.items()
                if world_size > 1 or name in ("odd_length", "heads_not_multiple", "shard_indivisible")}
    for rank, results in enumerate(rank_results[world_size]):
        errors = results["errors"]
        for name, text in expected.items():
            assert errors[name] is not None and text in errors[name], f"rank {rank}, {name}: {errors[name]!r}"
        assert max(errors["afterwards"].values()) < _TOLERANCE
    if world_size > 1:  # the mismatch message lists every rank's shapes
        assert "rank 0: q (1, 2, 3, 8)" in rank_results[world_size][-1]["errors"]["one_rank_odd_length"]


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
def test_compiled_fullgraph_matches_eager(rank_results, kernel):
    """One graph (fullgraph=True would raise on a break) holding the custom op, and the same numbers as eager
    (the op runs the same code: only the tracing around it differs)."""
    for rank, results in enumerate(rank_results[2]):
        case = results["compiled"][kernel]
        assert case["graphs"] == 1 and case["op_in_graph"], (rank, case)
        assert max(case["errors"]) < 1e-12, (rank, case)


def test_opcheck_on_a_group_of_one(rank_results):
    results = rank_results[1][0]["opcheck"]
    assert results["group_name"]  # a real registered name, resolved inside the ops
    assert results["failures"] == {}


# ---------------------------------------------------------------------------------------------------------
# In-process: no process group.
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 8))
def test_zigzag_blocks_cover_exactly_the_causal_pairs(world_size):
    """For every rank and step, the block computed covers exactly the (query, key) pairs the causal mask
    allows between the two ranks' positions, unmasked except on the own block; every rank does equal work."""
    chunk = 3
    positions = [[*range(r * chunk, (r + 1) * chunk), *range((2 * world_size - 1 - r) * chunk,
                                                            (2 * world_size - r) * chunk)] for r in range(world_size)]
    work = []
    for rank in range(world_size):
        pairs = 0
        for step in range(world_size):
            source = (rank - step) % world_size
            block = _block_for_step(step, rank, world_size, True, 2 * chunk)
            queries, keys = positions[rank][block.q_rows], positions[source][block.kv_rows]
            covered = {(qp, kp) for qp in queries for kp in keys}
            allowed = {(qp, kp) for qp in positions[rank] for kp in positions[source] if kp <= qp}
            assert block.causal == (source == rank), (rank, step)
            if block.causal:  # top-left causal in local order: the zigzag positions are increasing
                local = positions[rank]
                covered = {(local[i], local[j]) for i in range(len(local)) for j in range(i + 1)}
            assert covered == allowed, (rank, step)
            pairs += len(covered)
        work.append(pairs)
    assert len(set(work)) == 1, work


def test_without_process_group_is_plain_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    assert not dist.is_initialized()
    expected = _reference_attention(q, k, v, causal=True, scale=None)
    assert _rel(ring_attention(q, k, v, causal=True), expected) < _TOLERANCE
    assert torch.equal(gather_sequence(shard_sequence(q, 2), 2), q)


@pytest.mark.parametrize("kernel", ["math", "cpu_flash"])
def test_gradient_laid_out_unlike_the_output(kernel):
    """Inputs in (B, L, H, D) memory as models make them, and output gradients in both layouts (one of them
    unlike the output's, which the backward copies into the output's layout for the fused kernels)."""
    torch.manual_seed(0)

    def blhd(heads):
        return torch.randn(2, 6, heads, 8, dtype=torch.float64).transpose(1, 2).requires_grad_()

    q, k, v = blhd(4), blhd(2), blhd(2)
    expected = _reference_attention(q, k, v, causal=True, scale=None)
    out = ring_attention(q, k, v, causal=True, kernel=kernel)
    assert _rel(out, expected) < _TOLERANCE
    grads = [torch.randn(2, 4, 6, 8, dtype=torch.float64), blhd(4).detach()]
    assert any(grad.stride() != out.stride() for grad in grads)
    for grad in grads:
        actual = torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)
        wanted = torch.autograd.grad(expected, (q, k, v), grad, retain_graph=True)
        assert max(_rel(a, w) for a, w in zip(actual, wanted)) < _TOLERANCE


def test_group_without_initialized_distributed_raises():
    with pytest.raises(ValueError, match="not initialized"):
        ring_attention(*_tensors(2, 2, 4), group=object())


def test_unknown_kernel_raises():
    with pytest.raises(ValueError, match="unknown ring attention kernel 'triton'"):
        ring_attention(*_tensors(2, 2, 4), kernel="triton")
