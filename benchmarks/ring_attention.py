"""Ring attention benchmark: forward+backward throughput of ``kernel_pytorch.distributed.ring_attention`` on N
GPUs against N x the single-GPU attention throughput of the same per-GPU problem, and the longest sequence
that fits per world size, for the attention op alone and for a whole model trained through
``optimize(model, context_parallel=group)``.

    python benchmarks/ring_attention.py [--quick] [--out DIR] [--world-sizes 1 2 4] [--parts attention model]
                                        [--tokens-per-gpu 8192 ...] [--kernel flash|cudnn|efficient]
                                        [--memory-check-tokens 262144]
                                        [--model-layers 12] [--model-tokens-per-gpu 4096 8192 16384]

Part ``attention`` (the op): bf16, head dim 128, 32 query heads / 8 K/V heads (GQA), batch 1, causal, inputs
in the (B, L, H, D) memory layout models produce. Spawns one process per GPU itself (NCCL, no torchrun);
world size 1 also measures the single-GPU baseline: the same kernel on the same per-GPU problem (L tokens,
causal) through ``kernel_pytorch.ops.attention.attention``, and PyTorch's SDPA for context.

FLOPs: causal forward 4·B·Hq·L²·D / 2, backward 2.5x forward (as benchmarks/attention.py). Ring throughput
is the FLOPs of attention over the full N·L-token sequence divided by the step time; efficiency is that over
N x the single-GPU throughput at L tokens (target: >= 0.85 at >= 16k tokens per GPU).

Longest sequence: ring attention's memory per GPU is linear in the tokens per GPU (no L² term, K/V never
all-gathered), so the peak memory measured at the two largest sizes gives bytes per token; the prediction
is (free memory x 0.95 - fixed) / bytes per token, for each N (equal bytes per token for every N is
what makes the longest sequence grow N-fold). Running attention at that length would take from minutes to
hours of compute (it is quadratic in the sequence); ``--memory-check-tokens`` instead runs one step at a
larger size than the timed ones and compares its measured peak with the model's.

Part ``model`` (issue 7's target: the longest sequence that fits grows N-fold with N GPUs): the op alone
grows short of N-fold (1.68x on 2 GPUs, 3.23x on 4, H200) because the ring's transient buffers (K/V in
flight, fp32 dK/dV travelling with them, the fp32 output/LSE merge) are a large share of its memory; in a
model, every layer's activations are per token too. Per world size, every rank builds docs/design.md's
Llama-style model (``kernel_pytorch.testing.LlamaStyleLM``: 12 layers, d 2048, 16 heads / 4 K/V heads,
hd 128, ffn 5632, vocab 32000, 0.67B parameters; bf16 parameters, same seed on every rank), runs
``optimize(model, context_parallel=group, example_inputs=..., compile=False)`` once, and trains at each
``--model-tokens-per-gpu`` (batch 1, N x that many tokens in all): forward, mean next-token loss, backward
(parameter gradients averaged over the group by optimize's hooks), fused ``torch.optim.AdamW`` step,
``zero_grad``. Peak memory is the max over ranks of ``torch.cuda.max_memory_allocated`` over a step (after
one step at that length, which captures its graph: static shapes, one capture per length); the fit and the
prediction are the op's (``_fit_prediction``); the step time is the slowest rank's median. Target: the
predicted longest total sequence on N GPUs >= 0.9 x N x that on one GPU (``meets_target`` per world;
``growth_vs_1_gpu`` is the ratio). Choices, and why:

- The model returns its per-token loss, (batch, sequence) in fp32, not logits: optimize's boundary gathers
  the outputs on every rank, and gathered logits would be N x local tokens x vocab x 2 bytes per rank (plus
  an fp32 copy for the loss), a term that grows with N and caps the longest sequence whatever ring
  attention does. The loss per token is computed on the local shard; 4 bytes per token are gathered.
- No activation checkpointing: the network's activations per token are what the ring's transients are
  compared against; checkpointing is a separate memory option whose composition with the ring op
  (recomputing its forward, communication included) is not measured here.
- ``compile=False``: Inductor would compile each length again (static shapes), a 12-layer graph each time;
  memory is what is measured, and the fused ops (attention, norms, RoPE) run without Inductor.
- Fused AdamW: its state (bf16 moments, 4 bytes per parameter) is part of the fixed bytes of real training.
- The end-to-end check runs at ``--model-example-tokens`` per GPU (the model as written keeps L² fp32 scores):
  ``verified`` records it, and a model that optimize rolled back (running whole on every rank) is an error.
- At most 16384 tokens per GPU are measured, and the prediction beyond that is memory only: the model
  builds its causal mask as an (L, L) tensor from ``full(-inf).triu(1)``, L the local length in the
  captured graph, and the attention pass proves it causal by evaluating it on the host, up to
  ``MAX_EVALUATED_ELEMENTS`` (2**28, kernel_pytorch/passes/shape_constants.py: L = 16384). Past that
  the mask stays, and context parallelism refuses the graph (measured on the H200: 32768 tokens per GPU
  refused). So today this model trains through ``optimize(context_parallel=...)`` at up to 16384 tokens
  per GPU, and the predicted longest sequence needs that proof to scale first.

Measured (4 x H200, NCCL, ``--parts model --world-sizes 1 2 4``: 2 minutes wall in all): 1167.7 KB per token
per GPU at N = 1, 2 and 4 alike (to 32 bytes), fixed 4.76 GiB (bf16 parameters, their gradients and AdamW
moments, the harness's 256 MiB L2-flush buffer), so the predicted longest sequence is 117k tokens on one
GPU, 233k on two, 467k on four: 2.0x and 4.0x (target met). Equal bytes per token for every N say that the
ring's buffers for N > 1 (K/V in flight, dK/dV received) are not alive at the model's peak, which (inferred,
not profiled) comes around the start of the backward, with every layer's saved activations and the loss's
vocab-sized fp32 rows alive. Step times at
4096 / 8192 / 16384 tokens per GPU: 46 / 102 / 265 ms on one GPU, 71 / 155 / 435 on two, 99 / 242 / 750 on
four (attention is quadratic in the total sequence; the sequence is N x longer).

Writes ring_attention.json (through benchmarks/harness.py) and ring_attention.png. The parts merge into an
existing file at ``--out``: a world's keys of the parts not run are kept (``ring``, ``fit``, ... from
``attention``; ``model_fit`` from ``model``), and ``environments`` records each part's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import RESULTS_DIR, environment, measure, write_result
from kernel_pytorch import optimize, report_of
from kernel_pytorch.distributed import ContextParallelError, ring_attention, shard_sequence
from kernel_pytorch.ops.attention import attention
from kernel_pytorch.passes.shape_constants import MAX_EVALUATED_ELEMENTS
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM = 1, 32, 8, 128
EFFICIENCY_TARGET = 0.85
PARTS = ("attention", "model")
# The model part: docs/design.md's model (module docstring); its max_seq_len is set per run to the longest sequence.
MODEL_CONFIG = LlamaStyleConfig()
# Model target: the longest total sequence on N GPUs at least this fraction of N x the longest on one GPU.
N_FOLD_FRACTION = 0.9
# The most tokens per GPU the model part can run (module docstring): the attention pass proves the model's
# (L, L) mask causal by evaluating it, up to MAX_EVALUATED_ELEMENTS elements (L = 16384).
MAX_MODEL_TOKENS_PER_GPU = math.isqrt(MAX_EVALUATED_ELEMENTS)
# A world's keys per part (a run of some parts keeps the other parts' keys of an existing file).
_PART_KEYS = {"attention": ("numerics", "single_gpu", "ring", "fit"), "model": ("model_fit",)}
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
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # gloo: the CPU smoke test of the model part
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
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


def _peak_and_median_ms(step, runs: int, warmup: int = 2, device: str = "cuda") -> tuple[float | None, float]:
    """(peak memory over one ``step``, the median step time in ms), each the slowest rank's. The peak is
    None off CUDA (no allocator statistics)."""
    peak = None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = _max_over_ranks(torch.cuda.max_memory_allocated())
    dist.barrier()
    return peak, _max_over_ranks(measure(step, warmup=warmup, runs=runs, device=device).median_ms)


def _timed(step, tokens_total: int, world_size: int, runs: int) -> dict:
    """Median step time (the slowest rank's), TFLOP/s over all GPUs and per GPU, peak memory."""
    peak, median_ms = _peak_and_median_ms(step, runs)
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


# ---------------------------------------------------------------------------------------------------------
# The model part: optimize(model, context_parallel=group) on docs/design.md's Llama-style model.
# ---------------------------------------------------------------------------------------------------------


class TokenLosses(nn.Module):
    """A causal LM with its next-token loss per token, (batch, sequence) in fp32: what crosses optimize's
    context-parallel boundary instead of the logits (module docstring: gathered logits grow with N)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(tokens)
        losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        return losses.view(targets.shape)


def _model_inputs(config: LlamaStyleConfig, total_tokens: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, next-token targets), batch 1, the same on every rank (every rank passes the full inputs)."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (1, total_tokens), generator=generator).to(device)
    return tokens, torch.roll(tokens, -1, dims=1)


def _optimized_model(world_size: int, options: dict, device: str) -> nn.Module:
    """The model in bf16 (fp32 on the CPU) on ``device``, the same weights on every rank (same seed; made on
    the device: initialising 0.67B parameters on the host takes seconds), through optimize."""
    config = options["config"]
    torch.manual_seed(0)
    with torch.device(device):
        model = TokenLosses(LlamaStyleLM(config))
    model = model.to(dtype=torch.bfloat16 if device == "cuda" else torch.float32).train()
    example = _model_inputs(config, options["example_tokens_per_gpu"] * world_size, device)
    return optimize(model, context_parallel=dist.group.WORLD, example_inputs=example, compile=False)


def _model_point(model: nn.Module, optimizer: torch.optim.Optimizer, tokens_per_gpu: int, world_size: int,
                 options: dict, device: str) -> dict:
    """One training step's peak memory and median time at ``tokens_per_gpu`` x N tokens."""
    tokens, targets = _model_inputs(options["config"], tokens_per_gpu * world_size, device)

    def step():
        model(tokens, targets).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # this length's capture (static shapes), and the optimizer's state at the first length
    peak, median_ms = _peak_and_median_ms(step, options["runs"], warmup=1, device=device)
    total = tokens_per_gpu * world_size
    row = {"tokens_per_gpu": tokens_per_gpu, "total_tokens": total, "ms": round(median_ms, 2),
           "tokens_per_s_per_gpu": round(tokens_per_gpu / median_ms * 1e3)}
    if peak is not None:
        row["peak_memory_bytes"] = int(peak)
    return row


def model_part(world_size: int, options: dict, device: str = "cuda", free_bytes: int | None = None) -> dict:
    """This rank's model results (every rank returns the same): the points, optimize's verification and
    context-parallel rewrites, and with ``free_bytes`` (CUDA) the fit and predicted longest sequence.
    Runs in an initialized process group (NCCL on GPUs; gloo on the CPU for the smoke test)."""
    model = _optimized_model(world_size, options, device)
    report = report_of(model)
    if any("rolled back" in note for note in report.notes):
        # The model would run whole on every rank: its memory would say nothing about the ring.
        raise RuntimeError(f"optimize rolled the context-parallel model back: {report.notes}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    try:
        points = [_model_point(model, optimizer, tokens, world_size, options, device) for tokens in options["tokens"]]
    except ContextParallelError as error:  # a length whose graph was refused: say what the passes decided
        raise ContextParallelError(f"{error}\n{_attention_decisions(report)}") from error
    result = {"points": points,
              "verified": report.verification is not None and report.verification.passed,
              # one capture per length: each graph's rewrites, once
              "rewrites": list(dict.fromkeys(r.replacement for r in report.rewrites
                                             if "context parallel" in r.replacement)),
              "graphs": report.graphs}
    if free_bytes is not None and all("peak_memory_bytes" in p for p in points):
        result.update(_fit_prediction(points, free_bytes, world_size))
    return result


def _attention_decisions(report) -> str:
    """The attention and RoPE passes' lines of the last graph captured (rewrites and skips)."""
    graph = f"graph {report.graphs - 1}"
    lines = [f"{r.pass_name} {r.location}: {r.replacement}" for r in report.rewrites
             if r.graph == graph and r.pass_name in ("attention", "rope")]
    lines += [f"skipped {s.pass_name} {s.location}: {s.reason}" for s in report.skipped if s.graph == graph]
    return f"{graph}:\n  " + "\n  ".join(lines)


# ---------------------------------------------------------------------------------------------------------
# One world: both parts in one process per GPU.
# ---------------------------------------------------------------------------------------------------------


def _attention_part(rank: int, world_size: int, free_bytes: int, options: dict) -> dict:
    result = {"numerics": _numerics(world_size, options), "ring": []}
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
    return result


def _worker(rank: int, world_size: int, port: int, options: dict, result_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=10), device_id=torch.device("cuda", rank))
    free_bytes = int(-_max_over_ranks(-torch.cuda.mem_get_info()[0]))  # the least free memory of any rank
    result = {"world_size": world_size, "device": torch.cuda.get_device_name()}
    if "attention" in options["parts"]:
        result.update(_attention_part(rank, world_size, free_bytes, options))
    if "model" in options["parts"]:
        torch.cuda.empty_cache()  # the attention part's cached blocks: the model part's peak counts only its own
        result["model_fit"] = model_part(world_size, options["model"], "cuda", free_bytes)
        _log(rank, f"N={world_size} model {result['model_fit']}")
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
    """Efficiency of each ring point: its TFLOP/s over N x the single-GPU TFLOP/s at the same tokens per GPU;
    and the model part's growth of the longest sequence (``model_growth``)."""
    single = {row["tokens"]: row[kernel]["tflops"] for row in worlds[0].get("single_gpu", [])}
    for world in worlds:
        for row in world.get("ring", []):
            baseline = single.get(row["tokens_per_gpu"])
            if baseline:
                row["efficiency"] = round(row["tflops"] / (world["world_size"] * baseline), 3)
    model_growth(worlds)
    return {
        "config": {"batch": BATCH, "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
                   "dtype": "bfloat16", "causal": True, "kernel": kernel, "efficiency_target": EFFICIENCY_TARGET},
        "worlds": worlds,
    }


def model_growth(worlds: list[dict]) -> None:
    """Per world with a model fit: ``growth_vs_1_gpu`` (its predicted longest total sequence over one GPU's)
    and ``meets_target`` (growth >= N_FOLD_FRACTION x N). Nothing without a one-GPU fit to compare with."""
    fits = {w["world_size"]: w["model_fit"] for w in worlds if "predicted_total_tokens" in w.get("model_fit", {})}
    if 1 not in fits:
        return
    for world_size, fit in fits.items():
        growth = fit["predicted_total_tokens"] / fits[1]["predicted_total_tokens"]
        fit["growth_vs_1_gpu"] = round(growth, 3)
        fit["meets_target"] = growth >= N_FOLD_FRACTION * world_size


def merge_worlds(previous: list[dict], worlds: list[dict], parts: tuple[str, ...]) -> list[dict]:
    """``worlds`` (this run's ``parts``) over ``previous`` (an earlier file's), per world size: the keys of
    the parts not run are kept, those of the parts run are replaced (none left from the earlier run)."""
    merged = {w["world_size"]: dict(w) for w in previous}
    for world in worlds:
        kept = merged.setdefault(world["world_size"], {})
        for part in parts:
            for key in _PART_KEYS[part]:
                kept.pop(key, None)
        kept.update(world)
    return [merged[n] for n in sorted(merged)]


def _previous(path: Path) -> dict:
    """An earlier result file at ``path``, else {}."""
    return json.loads(path.read_text()) if path.exists() else {}


def model_config_record(config: LlamaStyleConfig, options: dict) -> dict:
    return {"model": "kernel_pytorch.testing.LlamaStyleLM, per-token loss output (TokenLosses)",
            "config": dataclasses.asdict(config), "dtype": "bfloat16", "batch": 1, "compile": False,
            "checkpointing": "off", "optimizer": "torch.optim.AdamW(fused=True)",
            "example_tokens_per_gpu": options["example_tokens_per_gpu"], "tokens_per_gpu": list(options["tokens"]),
            "target": f"predicted longest total sequence on N GPUs >= {N_FOLD_FRACTION} x N x that on 1 GPU"}


def _payload(previous: dict, worlds: list[dict], options: dict, kernel: str) -> dict:
    """The file's content: this run's worlds merged over ``previous`` (unless that one ran on another kind of
    device), each part with its environment."""
    parts = options["parts"]
    if {w.get("device") for w in previous.get("worlds", [])} - {worlds[0]["device"]}:
        previous = {}
    if "attention" not in parts and "config" in previous:
        kernel = previous["config"]["kernel"]  # the kept attention rows' own kernel
    payload = summarize(merge_worlds(previous.get("worlds", []), worlds, parts), kernel)
    environments = dict(previous.get("environments", {}))
    if "environment" in previous and "environments" not in previous:
        environments["attention"] = previous["environment"]  # a file written before the model part
    environments.update({part: environment() for part in parts})
    payload["environments"] = environments
    if "model" in parts:
        payload["model_config"] = model_config_record(options["model"]["config"], options["model"])
    elif "model_config" in previous:
        payload["model_config"] = previous["model_config"]
    return payload


def _plot_longest(axis, worlds: list[dict], key: str, title: str) -> None:
    """Bars: the predicted longest total sequence per N (``world[key]``'s fit); dashed: N-fold of one GPU's."""
    worlds = [w for w in worlds if "predicted_total_tokens" in w.get(key, {})]
    sizes = [str(w["world_size"]) for w in worlds]
    longest = [w[key]["predicted_total_tokens"] / 1e6 for w in worlds]
    axis.bar(sizes, longest, color="tab:blue", label="predicted (memory)")
    if worlds and worlds[0]["world_size"] == 1:
        axis.plot(sizes, [longest[0] * w["world_size"] for w in worlds], color="gray", linestyle="--",
                  label="N-fold")
    axis.set_xlabel("GPUs (N)")
    axis.set_ylabel("longest sequence (M tokens)")
    axis.set_title(title)
    axis.legend(fontsize=8)


def _plot_efficiency(axis, worlds: list[dict]) -> None:
    for world in worlds:
        points = [(r["tokens_per_gpu"], r["efficiency"]) for r in world.get("ring", []) if "efficiency" in r]
        if points:
            axis.plot(*zip(*points), marker="o", label=f"N={world['world_size']}")
    axis.axhline(EFFICIENCY_TARGET, color="gray", linestyle="--", label=f"target {EFFICIENCY_TARGET:.0%}")
    axis.set_ylim(0, 1.1)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("tokens per GPU")
    axis.set_ylabel("ring TFLOP/s / (N x single-GPU TFLOP/s)")
    axis.set_title("fwd+bwd efficiency, causal")
    axis.legend(fontsize=8)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = payload["worlds"]
    panels = []
    if any("ring" in w for w in worlds):
        panels += [_plot_efficiency, lambda axis, ws: _plot_longest(axis, ws, "fit", "longest sequence, attention op")]
    if any("model_fit" in w for w in worlds):
        layers = payload["model_config"]["config"]["n_layers"]
        panels.append(lambda axis, ws: _plot_longest(axis, ws, "model_fit", f"longest sequence, {layers}-layer model"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for draw, axis in zip(panels, axes[0]):
        draw(axis, worlds)
    config = payload["config"]
    fig.suptitle(f"ring attention, bf16, hd{config['head_dim']}, {config['heads_q']}/{config['heads_kv']} heads, "
                 f"{config['kernel']}, {worlds[0]['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="2 sizes, world sizes 1 and 2, few runs; a 2-layer model at 4k and 8k tokens per GPU")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--world-sizes", type=int, nargs="+", help="default: 1, 2, 4, 8 up to the GPUs present")
    parser.add_argument("--tokens-per-gpu", type=int, nargs="+")
    parser.add_argument("--kernel", choices=("flash", "cudnn", "efficient"), default="flash",
                        help="the attention part's block kernel (the model part's is optimize's choice: flash)")
    parser.add_argument("--runs", type=int)
    parser.add_argument("--memory-check-tokens", type=int, metavar="TOKENS_PER_GPU",
                        help="one more step at this size, its peak memory checked against the linear model "
                             "(262144: about 20 s x N of compute)")
    parser.add_argument("--model-layers", type=int, help=f"default {MODEL_CONFIG.n_layers} (2 with --quick)")
    parser.add_argument("--model-tokens-per-gpu", type=int, nargs="+",
                        help=f"default 4096 8192 16384 (4096 8192 with --quick); each a multiple of 2 x world size, "
                             f"at most {MAX_MODEL_TOKENS_PER_GPU}")
    parser.add_argument("--model-example-tokens", type=int, default=256, metavar="TOKENS_PER_GPU",
                        help="optimize's example inputs per GPU (its end-to-end check runs the model as written)")
    args = parser.parse_args(argv)
    if args.model_tokens_per_gpu and max(args.model_tokens_per_gpu) > MAX_MODEL_TOKENS_PER_GPU:
        parser.error(f"--model-tokens-per-gpu: at most {MAX_MODEL_TOKENS_PER_GPU} (longer local sequences: the "
                     "model's causal mask is not proven, so context parallelism refuses the graph)")
    return args


def run_options(args: argparse.Namespace, world_sizes: list[int]) -> dict:
    tokens = args.model_tokens_per_gpu or ((4096, 8192) if args.quick else (4096, 8192, 16384))
    layers = args.model_layers or (2 if args.quick else MODEL_CONFIG.n_layers)
    # The RoPE tables cover the longest sequence of any world: the same fixed bytes for every N.
    config = dataclasses.replace(MODEL_CONFIG, n_layers=layers, max_seq_len=max(tokens) * max(world_sizes))
    return {
        "parts": tuple(args.parts),
        "kernel": args.kernel,
        "tokens": args.tokens_per_gpu or ((8192, 16384) if args.quick else (8192, 16384, 32768, 65536)),
        "runs": args.runs or (3 if args.quick else 5),
        "numerics_tokens_per_gpu": 1024 if args.quick else 2048,
        "memory_check_tokens": args.memory_check_tokens,
        "model": {"config": config, "tokens": tuple(tokens), "runs": args.runs or 3,
                  "example_tokens_per_gpu": args.model_example_tokens},
    }


def _print_model_summary(worlds: list[dict]) -> None:
    for world in worlds:
        fit = world.get("model_fit")
        if fit and "predicted_total_tokens" in fit:
            print(f"model N={world['world_size']}: {fit['bytes_per_token_per_gpu'] / 1e3:.1f} KB per token per GPU, "
                  f"fixed {fit['fixed_bytes'] / 2**30:.2f} GiB, longest {fit['predicted_total_tokens']} tokens, "
                  f"growth {fit.get('growth_vs_1_gpu')} (target >= {N_FOLD_FRACTION} x N: {fit.get('meets_target')}); "
                  f"ms per step {[p['ms'] for p in fit['points']]}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    gpus = torch.cuda.device_count()  # NVML: no CUDA context in this process before the workers start
    if gpus == 0:
        sys.exit("benchmarks/ring_attention.py needs CUDA GPUs")
    world_sizes = args.world_sizes or ((1, 2) if args.quick else (1, 2, 4, 8))
    world_sizes = sorted({1, *(n for n in world_sizes if n <= gpus)})  # 1 holds the single-GPU baselines
    options = run_options(args, world_sizes)
    name = "ring_attention" + ("_quick" if args.quick else "")
    previous = _previous(args.out / f"{name}.json")
    worlds = []
    for world_size in world_sizes:
        worlds.append(run_world(world_size, options))
        payload = _payload(previous, worlds, options, args.kernel)
        path = write_result(name, payload, args.out)  # kept up to date if cut off
    plot(payload, args.out / f"{name}.png")
    keys = ("world_size", "ring", "fit")
    print(json.dumps([{k: w[k] for k in keys if k in w} for w in payload["worlds"]], indent=1))
    _print_model_summary(payload["worlds"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
