"""Ring attention benchmark: forward+backward throughput of ``kernel_pytorch.distributed.ring_attention`` on N
GPUs against N x the single-GPU attention throughput of the same per-GPU problem, and the longest sequence
that fits per world size.

    python benchmarks/ring_attention.py [--quick] [--out DIR] [--world-sizes 1 2 4] [--tokens-per-gpu 8192 ...]
                                        [--kernel flash|cudnn|efficient] [--memory-check-tokens 262144]

bf16, head dim 128, 32 query heads / 8 K/V heads (GQA), batch 1, causal, inputs in the (B, L, H, D) memory
layout models produce. Spawns one process per GPU itself (NCCL, no torchrun); world size 1 also measures
the single-GPU baseline: the same kernel on the same per-GPU problem (L tokens, causal) through
``kernel_pytorch.ops.attention.attention``, and PyTorch's SDPA for context.

FLOPs: causal forward 4·B·Hq·L²·D / 2, backward 2.5x forward (as benchmarks/attention.py). Ring throughput
is the FLOPs of attention over the full N·L-token sequence divided by the step time; efficiency is that over
N x the single-GPU throughput at L tokens (target: >= 0.85 at >= 16k tokens per GPU).

Longest sequence: ring attention's memory per GPU is linear in the tokens per GPU (no L² term, K/V never
all-gathered), so the peak memory measured at the two largest sizes gives bytes per token; the prediction
is (free memory x 0.95 - fixed) / bytes per token, for each N (equal bytes per token for every N is
what makes the longest sequence grow N-fold). Running attention at that length would take from minutes to
hours of compute (it is quadratic in the sequence); ``--memory-check-tokens`` instead runs one step at a
larger size than the timed ones and compares its measured peak with the model's.

Writes ring_attention.json (through benchmarks/harness.py) and ring_attention.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import RESULTS_DIR, measure, write_result
from kernel_pytorch.distributed import ring_attention, shard_sequence
from kernel_pytorch.ops.attention import attention

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM = 1, 32, 8, 128
EFFICIENCY_TARGET = 0.85
# Free memory kept back in the fit prediction: the allocator's fragmentation and NCCL's own buffers.
_FIT_MARGIN = 0.95
_TOKEN_GRANULE = 1024  # predicted lengths are rounded down to this (and so stay zigzag-divisible)


def causal_flops(tokens: int) -> float:
    """Forward + backward FLOPs of causal attention over ``tokens`` positions."""
    return 3.5 * 4 * BATCH * HEADS_Q * tokens**2 * HEAD_DIM / 2


# ---------------------------------------------------------------------------------------------------------
# Per-rank work.
# ---------------------------------------------------------------------------------------------------------


def _inputs(tokens: int, dtype=torch.bfloat16):
    """q, k, v (B, H, L, D) views of (B, L, H, D) memory, and a gradient for the output in the same layout."""
    def make(heads):
        return torch.randn(BATCH, tokens, heads, HEAD_DIM, device="cuda", dtype=dtype).transpose(1, 2)

    return make(HEADS_Q).requires_grad_(), make(HEADS_KV).requires_grad_(), make(HEADS_KV).requires_grad_(), \
        make(HEADS_Q)


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _rel(actual, expected) -> float:
    actual, expected = actual.detach().float(), expected.detach().float()
    return float((actual - expected).norm() / expected.norm())


def _ring_step(q, k, v, grad, kernel):
    def step():
        out = ring_attention(q, k, v, causal=True, kernel=kernel, check_inputs=False)
        torch.autograd.grad(out, (q, k, v), grad)
    return step


def _timed(step, tokens_total: int, world_size: int, runs: int) -> dict:
    """Median step time (the slowest rank's), TFLOP/s over all GPUs and per GPU, peak memory."""
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = _max_over_ranks(torch.cuda.max_memory_allocated())
    dist.barrier()
    median_ms = _max_over_ranks(measure(step, warmup=2, runs=runs).median_ms)
    tflops = causal_flops(tokens_total) / median_ms / 1e9
    return {"ms": round(median_ms, 3), "tflops": round(tflops, 1), "tflops_per_gpu": round(tflops / world_size, 1),
            "peak_memory_bytes": int(peak)}


def _ring_point(tokens: int, world_size: int, options: dict) -> dict:
    q, k, v, grad = _inputs(tokens)
    ring_attention(q, k, v, causal=True, kernel=options["kernel"])  # once with the cross-rank shape check
    row = {"tokens_per_gpu": tokens, "total_tokens": tokens * world_size}
    row.update(_timed(_ring_step(q, k, v, grad, options["kernel"]), tokens * world_size, world_size, options["runs"]))
    return row


def _single_point(tokens: int, options: dict) -> dict:
    """The per-GPU problem on one GPU: our kernel call (the baseline) and SDPA's own choice (context)."""
    q, k, v, grad = _inputs(tokens)

    def ours():
        out = attention(q, k, v, is_causal=True, enable_gqa=True, kernel=options["kernel"])
        torch.autograd.grad(out, (q, k, v), grad)

    def sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.grad(out, (q, k, v), grad)

    row = {"tokens": tokens, options["kernel"]: _timed(ours, tokens, 1, options["runs"])}
    try:
        row["sdpa"] = _timed(sdpa, tokens, 1, options["runs"])
    except RuntimeError as error:  # context only: a missing SDPA path must not lose the baseline
        row["sdpa"] = f"error: {str(error).splitlines()[0][:120]}"
    return row


def _numerics(world_size: int, options: dict) -> dict:
    """Relative errors of the bf16 ring (output, dq, dk, dv; worst rank) and of the bf16 single-GPU kernel,
    both against fp32 attention on the full sequence: the ring should be no worse than the kernel."""
    tokens = options["numerics_tokens_per_gpu"] * world_size
    torch.manual_seed(0)  # the same full tensors on every rank
    q, k, v, grad = (t.float().detach().requires_grad_() for t in _inputs(tokens))
    repeat = HEADS_Q // HEADS_KV  # expanded K/V, so fp32 SDPA takes its fused (efficient) kernel
    reference = F.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                               is_causal=True)
    expected = (reference, *torch.autograd.grad(reference, (q, k, v), grad))
    full_bf16 = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    local = [shard_sequence(t.detach(), 2).requires_grad_() for t in full_bf16]
    out = ring_attention(*local, causal=True, kernel=options["kernel"])
    ring = (out, *torch.autograd.grad(out, local, shard_sequence(grad.bfloat16(), 2)))
    single_out = attention(*full_bf16, is_causal=True, enable_gqa=True, kernel=options["kernel"])
    single = (single_out, *torch.autograd.grad(single_out, full_bf16, grad.bfloat16()))
    names = ("out", "dq", "dk", "dv")
    return {
        "tokens_per_gpu": options["numerics_tokens_per_gpu"],
        "ring": {n: _max_over_ranks(_rel(r, shard_sequence(e, 2))) for n, r, e in zip(names, ring, expected)},
        "single_gpu": {n: _rel(s, e) for n, s, e in zip(names, single, expected)},
    }


def _fit_prediction(points: list[dict], free_bytes: int, world_size: int) -> dict:
    """Longest sequence predicted from peak memory, linear in tokens per GPU (two largest sizes)."""
    points = sorted(points, key=lambda p: p["tokens_per_gpu"])
    if len(points) >= 2:
        (t1, m1), (t2, m2) = ((p["tokens_per_gpu"], p["peak_memory_bytes"]) for p in points[-2:])
        per_token = (m2 - m1) / (t2 - t1)
        fixed = m2 - per_token * t2
    else:
        per_token, fixed = points[-1]["peak_memory_bytes"] / points[-1]["tokens_per_gpu"], 0.0
    tokens = int((free_bytes * _FIT_MARGIN - fixed) / per_token) // _TOKEN_GRANULE * _TOKEN_GRANULE
    return {"bytes_per_token_per_gpu": round(per_token), "fixed_bytes": round(fixed), "free_bytes": free_bytes,
            "predicted_tokens_per_gpu": tokens, "predicted_total_tokens": tokens * world_size}


def _memory_check(tokens: int, fit: dict, world_size: int, options: dict) -> dict:
    """One step at ``tokens`` per GPU (beyond the timed sizes): measured peak memory against the linear
    model's prediction. Every rank first shows it can allocate the predicted peak, because a rank running
    out of memory inside the ring would leave its peers waiting on its messages."""
    predicted = int(fit["bytes_per_token_per_gpu"] * tokens + fit["fixed_bytes"])
    try:
        probe = torch.empty(predicted, dtype=torch.uint8, device="cuda")
        del probe
        allocated = 1.0
    except torch.OutOfMemoryError:
        allocated = 0.0
    row = {"tokens_per_gpu": tokens, "total_tokens": tokens * world_size, "predicted_peak_bytes": predicted}
    if -_max_over_ranks(-allocated) < 1.0:  # the minimum over ranks
        return {**row, "ran": False, "why": "the predicted peak could not be allocated on every rank"}
    q, k, v, grad = _inputs(tokens)
    torch.cuda.reset_peak_memory_stats()
    start = datetime.datetime.now()
    _ring_step(q, k, v, grad, options["kernel"])()
    torch.cuda.synchronize()
    seconds = (datetime.datetime.now() - start).total_seconds()
    return {**row, "ran": True, "seconds": round(seconds, 1),
            "measured_peak_bytes": int(_max_over_ranks(torch.cuda.max_memory_allocated()))}


def _worker(rank: int, world_size: int, port: int, options: dict, result_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=10), device_id=torch.device("cuda", rank))
    free_bytes = int(-_max_over_ranks(-torch.cuda.mem_get_info()[0]))  # the least free memory of any rank
    result = {"world_size": world_size, "device": torch.cuda.get_device_name(), "numerics": _numerics(world_size, options),
              "ring": []}
    _log(rank, f"N={world_size} numerics {result['numerics']}")
    if world_size == 1:
        result["single_gpu"] = [_single_point(tokens, options) for tokens in options["tokens"]]
        _log(rank, f"single GPU {result['single_gpu']}")
    for tokens in options["tokens"]:
        result["ring"].append(_ring_point(tokens, world_size, options))
        _log(rank, f"N={world_size} {result['ring'][-1]}")
    result["fit"] = _fit_prediction(result["ring"], free_bytes, world_size)
    if options["memory_check_tokens"]:
        torch.cuda.empty_cache()
        result["fit"]["memory_check"] = _memory_check(options["memory_check_tokens"], result["fit"], world_size,
                                                      options)
    if rank == 0:
        Path(result_file).write_text(json.dumps(result))
    dist.destroy_process_group()


def _log(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


# ---------------------------------------------------------------------------------------------------------
# The driver: one spawned world per size, then the summary, JSON and plot.
# ---------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(world_size: int, options: dict) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        result_file = str(Path(directory) / "result.json")
        mp.start_processes(_worker, args=(world_size, _free_port(), options, result_file), nprocs=world_size,
                           join=True, start_method="spawn")
        return json.loads(Path(result_file).read_text())


def summarize(worlds: list[dict], kernel: str) -> dict:
    """Efficiency of each ring point: its TFLOP/s over N x the single-GPU TFLOP/s at the same tokens per GPU."""
    single = {row["tokens"]: row[kernel]["tflops"] for row in worlds[0].get("single_gpu", [])}
    for world in worlds:
        for row in world["ring"]:
            baseline = single.get(row["tokens_per_gpu"])
            if baseline:
                row["efficiency"] = round(row["tflops"] / (world["world_size"] * baseline), 3)
    return {
        "config": {"batch": BATCH, "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
                   "dtype": "bfloat16", "causal": True, "kernel": kernel, "efficiency_target": EFFICIENCY_TARGET},
        "worlds": worlds,
    }


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = payload["worlds"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for world in worlds:
        points = [(r["tokens_per_gpu"], r["efficiency"]) for r in world["ring"] if "efficiency" in r]
        if points:
            left.plot(*zip(*points), marker="o", label=f"N={world['world_size']}")
    left.axhline(EFFICIENCY_TARGET, color="gray", linestyle="--", label=f"target {EFFICIENCY_TARGET:.0%}")
    left.set_ylim(0, 1.1)
    left.set_xscale("log", base=2)
    left.set_xlabel("tokens per GPU")
    left.set_ylabel("ring TFLOP/s / (N x single-GPU TFLOP/s)")
    left.set_title("fwd+bwd efficiency, causal")
    left.legend(fontsize=8)
    sizes = [w["world_size"] for w in worlds]
    longest = [w["fit"]["predicted_total_tokens"] / 1e6 for w in worlds]
    right.bar([str(n) for n in sizes], longest, color="tab:blue", label="predicted (memory)")
    right.plot([str(n) for n in sizes], [longest[0] * n / sizes[0] for n in sizes], color="gray", linestyle="--",
               label="N-fold")
    right.set_xlabel("GPUs (N)")
    right.set_ylabel("longest sequence (M tokens)")
    right.set_title("longest sequence that fits")
    right.legend(fontsize=8)
    config = payload["config"]
    fig.suptitle(f"ring attention, bf16, hd{config['head_dim']}, {config['heads_q']}/{config['heads_kv']} heads, "
                 f"{config['kernel']}, {worlds[0]['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 sizes, world sizes 1 and 2, few runs")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--world-sizes", type=int, nargs="+", help="default: 1, 2, 4, 8 up to the GPUs present")
    parser.add_argument("--tokens-per-gpu", type=int, nargs="+")
    parser.add_argument("--kernel", choices=("flash", "cudnn", "efficient"), default="flash")
    parser.add_argument("--runs", type=int)
    parser.add_argument("--memory-check-tokens", type=int, metavar="TOKENS_PER_GPU",
                        help="one more step at this size, its peak memory checked against the linear model "
                             "(262144: about 20 s x N of compute)")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()  # NVML: no CUDA context in this process before the workers start
    if gpus == 0:
        sys.exit("benchmarks/ring_attention.py needs CUDA GPUs")
    world_sizes = args.world_sizes or ((1, 2) if args.quick else (1, 2, 4, 8))
    world_sizes = sorted({1, *(n for n in world_sizes if n <= gpus)})  # 1 holds the single-GPU baseline
    options = {
        "kernel": args.kernel,
        "tokens": args.tokens_per_gpu or ((8192, 16384) if args.quick else (8192, 16384, 32768, 65536)),
        "runs": args.runs or (3 if args.quick else 5),
        "numerics_tokens_per_gpu": 1024 if args.quick else 2048,
        "memory_check_tokens": args.memory_check_tokens,
    }
    name = "ring_attention" + ("_quick" if args.quick else "")
    worlds = []
    for world_size in world_sizes:
        worlds.append(run_world(world_size, options))
        path = write_result(name, summarize(worlds, args.kernel), args.out)  # kept up to date if cut off
    payload = summarize(worlds, args.kernel)
    plot(payload, args.out / f"{name}.png")
    print(json.dumps([{k: w[k] for k in ("world_size", "ring", "fit")} for w in payload["worlds"]], indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
