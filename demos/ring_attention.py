"""Demo: ring attention, exact causal attention over a sequence split across two processes.

Each process holds half of the sequence (the zigzag layout of ``shard_sequence``) and
``kernel_pytorch.distributed.ring_attention`` passes K/V blocks around the ring; outputs and q/k/v
gradients equal full attention computed in one process, and ``gather_sequence(shard_sequence(x))`` gives
``x`` back.

On a CPU: gloo, float64, grouped-query heads, against attention written out on the full sequence. With two
or more GPUs: NCCL, bf16, one GPU per rank, against fp32 SDPA on the full sequence, and the ring step timed
against one GPU doing the whole sequence.
"""

from __future__ import annotations

import datetime
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _common import DemoResult, default_device, demo_main, rel_err
from rich.console import Console
from rich.table import Table

from benchmarks.harness import measure
from kernel_pytorch.distributed import gather_sequence, ring_attention, shard_sequence

# Rank processes are killed after this; each process group's own timeout (60 s) fires first on a hang.
_JOIN_TIMEOUT_S = 180


@dataclass(frozen=True)
class Problem:
    """One attention problem: the full sequence, before sharding."""

    device: str  # "cpu" (gloo) or "cuda" (NCCL, rank r on cuda:r)
    world_size: int
    dtype: str
    heads_q: int
    heads_kv: int
    seq: int
    head_dim: int
    runs: int
    # Relative errors allowed for the output and for the gradients: float64 against float64 differs by
    # summation order only (the tests use 1e-8); bf16 flash blocks against an fp32 reference by bf16's rounding.
    tolerance: tuple[float, float]


def problem(device: str, quick: bool) -> Problem:
    if device == "cuda":
        world = 2 if quick else torch.cuda.device_count()
        return Problem("cuda", world, "bfloat16", 32, 8, (8192 if quick else 32768), 128, 5 if quick else 20, (2e-2, 5e-2))
    return Problem("cpu", 2, "float64", 4, 2, 256, 32, 3, (1e-8, 1e-8))


# ------------------------------------------------------------------------------------- every rank runs

def _reference_attention(q, k, v):
    """Causal attention on the full sequence, written out: K/V heads repeated for GQA, float64."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _full_attention(q, k, v, p: Problem):
    """The reference: written out in float64 on CPU. On GPU fp32 SDPA with the K/V heads repeated: the
    written-out form would need L^2 x heads x 4 bytes (8.6 GB at 8192 tokens and 32 heads), and SDPA's
    fp32 kernel (memory-efficient) takes no grouped heads."""
    if p.device == "cpu":
        return _reference_attention(q, k, v)
    groups = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(groups, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.float(), k, v, is_causal=True)


def _inputs(p: Problem, device: torch.device):
    """The full q, k, v and output gradient, and a tensor for the sharding round trip: every rank draws the
    same ones (a generator with one seed)."""
    generator = torch.Generator(device=device).manual_seed(1234)
    dtype = getattr(torch, p.dtype)

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    q, k, v = make(1, p.heads_q, p.seq, p.head_dim), make(1, p.heads_kv, p.seq, p.head_dim), make(1, p.heads_kv, p.seq, p.head_dim)
    return q, k, v, make(*q.shape), make(2, 3, 4 * p.world_size, 5)


def _rank_results(p: Problem, device: torch.device) -> dict:
    q, k, v, grad_out, x = _inputs(p, device)
    full = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    expected = _full_attention(*full, p)
    expected_grads = torch.autograd.grad(expected, full, grad_out.to(expected.dtype))

    local = [shard_sequence(t, 2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, causal=True)
    grads = torch.autograd.grad(out, local, shard_sequence(grad_out, 2))
    errors = {"output": rel_err(out, shard_sequence(expected, 2)),
              "gathered output": rel_err(gather_sequence(out.detach(), 2), expected)}
    errors.update({name: rel_err(g, shard_sequence(e, 2)) for name, g, e in zip(("dq", "dk", "dv"), grads, expected_grads)})

    round_trip = torch.equal(gather_sequence(shard_sequence(x, 2), 2), x)

    def ring_step():
        torch.autograd.grad(ring_attention(*local, causal=True, check_inputs=False), local, shard_sequence(grad_out, 2))

    results = {"errors": errors, "round_trip": round_trip, "local_tokens": local[0].shape[2],
               "ring_ms": measure(ring_step, warmup=1, runs=p.runs, device=p.device).median_ms}
    if p.device == "cuda" and dist.get_rank() == 0:
        results["one_gpu_ms"] = _one_gpu_ms(q, k, v, grad_out, p)
    return results


def _one_gpu_ms(q, k, v, grad_out, p: Problem) -> float:
    """Forward + backward of the whole sequence's causal attention on one GPU (bf16 SDPA), for comparison."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), grad_out)

    return measure(step, warmup=1, runs=p.runs, device="cuda").median_ms


def _rank_main(rank: int, p: Problem, directory: str) -> None:
    if p.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # the ranks share the machine's cores
        device = torch.device("cpu")
    dist.init_process_group("nccl" if p.device == "cuda" else "gloo", init_method=f"file://{directory}/store",
                            rank=rank, world_size=p.world_size, timeout=datetime.timedelta(seconds=60))
    try:
        results = _rank_results(p, device)
    finally:
        dist.destroy_process_group()
    Path(directory, f"rank{rank}.json").write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------- the driver

def _spawn(p: Problem) -> list[dict] | str:
    """Every rank's results, or why they are missing."""
    with tempfile.TemporaryDirectory() as directory:
        context = mp.get_context("spawn")
        processes = [context.Process(target=_rank_main, args=(rank, p, directory)) for rank in range(p.world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for rank in hung:
            processes[rank].kill()
        failed = {rank: process.exitcode for rank, process in enumerate(processes) if process.exitcode != 0}
        if hung or failed:
            return f"rank processes hung {hung} or failed {failed} (rank: exit code)"
        return [json.loads(Path(directory, f"rank{rank}.json").read_text()) for rank in range(p.world_size)]


def _table(p: Problem, ranks: list[dict]) -> Table:
    backend = "NCCL" if p.device == "cuda" else "gloo"
    table = Table(title=f"causal ring attention, {p.world_size} ranks over {backend}, {p.dtype}, {p.seq} tokens, "
                        f"{p.heads_q} query / {p.heads_kv} K/V heads, head dim {p.head_dim}; relative errors "
                        "against full attention", title_justify="left")
    names = ("output", "dq", "dk", "dv")
    for column in ("rank", "tokens", *names, "ms"):
        table.add_column(column, justify="left" if column == "rank" else "right")
    for rank, r in enumerate(ranks):
        table.add_row(str(rank), str(r["local_tokens"]), *(f"{r['errors'][n]:.1e}" for n in names), f"{r['ring_ms']:.1f}")
    return table


def run(args) -> DemoResult:
    device = default_device(args)
    notes = []
    if device == "cuda" and torch.cuda.device_count() < 2:
        notes.append(f"NCCL: skipped: needs 2 GPUs, found {torch.cuda.device_count()}; gloo on the CPU instead")
        device = "cpu"
    p = problem(device, args.quick)
    ranks = _spawn(p)
    if isinstance(ranks, str):
        return DemoResult("failed", notes=[ranks, *notes])
    console = Console()
    console.print(_table(p, ranks))
    gathered = max(r["errors"]["gathered output"] for r in ranks)
    console.print(f"gather_sequence(output) vs full attention: {gathered:.1e}; gather_sequence(shard_sequence(x)) == x: "
                  f"{all(r['round_trip'] for r in ranks)}; ms: one forward + backward of the ring")
    worst_out = max(r["errors"]["output"] for r in ranks)
    worst = max(max(r["errors"].values()) for r in ranks)
    if not (worst_out < p.tolerance[0] and worst < p.tolerance[1]):
        return DemoResult("failed", notes=[f"ring attention differs from full attention: worst relative error {worst:.1e}",
                                           *notes])
    if not all(r["round_trip"] for r in ranks):
        return DemoResult("failed", notes=["gather_sequence(shard_sequence(x)) differs from x", *notes])
    ring_ms = max(r["ring_ms"] for r in ranks)  # the step ends when the slowest rank does
    notes.insert(0, f"{p.world_size} ranks, {p.dtype}: worst error {worst:.1e}, ring step {ring_ms:.1f} ms")
    speedup = None
    if "one_gpu_ms" in ranks[0]:
        speedup = ranks[0]["one_gpu_ms"] / ring_ms
        console.print(f"whole sequence on one GPU: {ranks[0]['one_gpu_ms']:.2f} ms; on {p.world_size} GPUs as a ring: "
                      f"{ring_ms:.2f} ms ({speedup:.2f}x)")
    else:
        notes.append("speed: a CPU run shows correctness; the ring pays with one GPU per rank")
    return DemoResult("ok", speedup=None if speedup is None else round(speedup, 3), notes=notes)


if __name__ == "__main__":
    demo_main(__doc__, run)
