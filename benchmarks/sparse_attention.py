"""Sparse attention benchmark: hand-written masked attention after ``optimize`` vs dense causal SDPA and
FlexAttention called directly.

    python benchmarks/sparse_attention.py [--quick] [--out DIR] [--lengths 4096 16384 ...]
                                          [--parts window blocks90 topk]

bf16, head dim 128, 16 heads, batch x L = 16384 tokens, forward and forward+backward:

* **window**: causal sliding window 1024 (Mistral's mask, built in the graph from index arithmetic) at
  L = 1k..16k. FLOPs counted for the attended positions only.
* **blocks90**: a block-sparse mask with 10% of its 128x128 tiles attended (the diagonal tile kept, so no
  row is empty), held in a bool buffer, at L = 16384 (the issue's 90% block sparsity).

Providers: ``kernel_pytorch.optimize`` of the hand-written module (default compile: Inductor), the best
dense causal SDPA kernel (min over cuDNN, flash, efficient with ``is_causal=True``: what a model pays
without the sparsity), dense SDPA with the mask tensor (efficient/cuDNN take it), FlexAttention directly
(``torch.compile(flex_attention)`` with the BlockMask of the same mask), and for the window, where the
cuDNN frontend is installed, cuDNN's banded kernel directly (``attention(..., kernel="cudnn_band")``).
Each row records the speedup of ``optimize`` over the best dense causal kernel and whether it is never
slower (issue 7 targets: window 1024 at L=16384 >= 6.5x, 90% block sparsity >= 7x, never slower than
dense at any length).
Writes sparse_attention.json and sparse_attention.png.

* **topk** (``--parts topk``; its own files, sparse_attention_topk.json / .png): content-aware top-k
  sparsity, ``optimize(..., sparse_attention=SparseAttentionConfig(...))`` of hand-written causal attention
  (an approximation), forward only (an inference option), bf16, hd128, 16 heads, batch x L = 32768 tokens,
  L = 4k/8k/16k/32k, budgets keep_ratio 0.10 and 0.25 and the default top 16 blocks; min_length 4096 so
  every row runs sparse and the speedups show where it starts to pay (what the default min_length 8192
  should be). Timed against the best dense causal SDPA kernel; the time of the block choice alone
  (pooling + scores + ranking) is recorded too. Relative error of optimize's output against dense causal
  SDPA (the whole output, norms in float64) on three inputs: random q/k (near-uniform attention: the
  worst case for the choice), "clustered" (each 128-token block has a q and a k topic in a rank-8
  subspace, tokens are their block's topic plus noise: peaked scores with the block coherence that
  pooled scores rely on), and "heavy blocks" (random q/k plus a shared direction that 1 key block in 16
  and the first block carry: attention concentrated on a few blocks and a sink). The bf16 floor of the comparison is recorded
  (dense math in fp32 vs the dense bf16 kernel).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.attention import _step, timed_ms  # noqa: E402  (one forward (+ backward) step, as attention.py times it)
from benchmarks.harness import RESULTS_DIR, write_result  # noqa: E402
from kernel_pytorch import optimize, report_of  # noqa: E402
from kernel_pytorch.config import SparseAttentionConfig  # noqa: E402

WINDOW = 1024
HEADS, HEAD_DIM, TOKENS = 16, 128, 16384
BLOCK = 128  # FlexAttention's tile, the unit of the block-sparse mask
DENSE_CAUSAL = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
TARGETS = {("window", 16384): 6.5, ("blocks90", 16384): 7.0}
PARTS = ("window", "blocks90", "topk")
TOPK_TOKENS = 32768
DEVICE = "cuda"  # the topk part's device (a CPU dry run of its logic sets "cpu" and small sizes)
TOPK_LENGTHS = (4096, 8192, 16384, 32768)
TOPK_BUDGETS = {"keep 10%": {"keep_ratio": 0.10}, "keep 25%": {"keep_ratio": 0.25}, "top 16 blocks": {"topk": 16}}


class SlidingWindowAttention(nn.Module):
    """Mistral-style: key j is blocked when it is ahead of query i or ``window`` or more behind it."""

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2], device=q.device)
        blocked = (i[None, :] > i[:, None]) | ((i[:, None] - i[None, :]) >= WINDOW)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(blocked, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class BufferMaskAttention(nn.Module):
    """A mask held in a bool buffer (True = attend), as models with fixed sparse layouts keep it."""

    def __init__(self, allowed: torch.Tensor):
        super().__init__()
        self.register_buffer("allowed", allowed)

    def forward(self, q, k, v):
        scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~self.allowed, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def window_mask_mod(b, h, q_idx, kv_idx):
    """The causal window as a FlexAttention ``mask_mod``: what a hand-tuned FlexAttention user writes."""
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def window_allowed(length: int, device) -> torch.Tensor:
    i = torch.arange(length, device=device)
    return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < WINDOW)


def block_sparse_allowed(length: int, density: float, device) -> torch.Tensor:
    """Tiles attended with probability ``density`` (seeded), the diagonal tiles always."""
    tiles = length // BLOCK
    generator = torch.Generator().manual_seed(0)
    chosen = (torch.rand(tiles, tiles, generator=generator) < density) | torch.eye(tiles, dtype=torch.bool)
    return chosen.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1).to(device)


def _flex_direct(allowed: torch.Tensor, length: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if allowed is None:
        mask_mod = window_mask_mod
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return allowed[q_idx, kv_idx]
    block_mask = create_block_mask(mask_mod, None, None, length, length, device="cuda")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask), block_mask.sparsity()


def _dense(backend, causal: bool = True):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def _cudnn_band():
    from kernel_pytorch.ops import attention

    return lambda q, k, v: attention(q, k, v, kernel="cudnn_band", pattern=("band", 0, WINDOW - 1))


def _dense_masked(allowed):
    def run(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    return run


def run_case(kind: str, length: int, backward: bool, runs: int) -> dict:
    batch = max(1, TOKENS // length)
    make = lambda: torch.randn(batch, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                               requires_grad=backward)
    q, k, v = make(), make(), make()
    if kind == "window":
        module, allowed, flex_mask = SlidingWindowAttention(), window_allowed(length, "cuda"), None
    else:
        allowed = block_sparse_allowed(length, 0.10, "cuda")
        module, flex_mask = BufferMaskAttention(allowed), allowed
    module.train(backward)
    # Verification runs the eager original once: at 16k its fp32 scores alone take 16 GB.
    optimized = optimize(module, example_inputs=(q, k, v), verify=length <= 8192)
    rewrite = next((r.replacement for r in report_of(optimized).rewrites if r.pass_name == "attention"),
                   "not rewritten")
    flex_fn, flex_sparsity = _flex_direct(flex_mask, length)
    providers = {"kernel_pytorch.optimize": optimized, "flex_attention (direct)": flex_fn,
                 "sdpa masked (dense, mask tensor)": _dense_masked(allowed)}
    if kind == "window" and importlib.util.find_spec("cudnn") is not None:
        providers["cudnn band (direct)"] = _cudnn_band()
    providers.update({f"sdpa-{name} causal (dense)": _dense(b, causal=True) for name, b in DENSE_CAUSAL.items()})
    if kind != "window":  # a mask that is not causal restricts full attention: that is its dense baseline
        providers.update({f"sdpa-{name} (dense)": _dense(b, causal=False) for name, b in DENSE_CAUSAL.items()})
    attended = float(allowed.float().mean())
    flops = 4 * batch * HEADS * length * length * HEAD_DIM * attended * (3.5 if backward else 1.0)
    row = {"kind": kind, "length": length, "batch": batch, "heads": HEADS, "head_dim": HEAD_DIM,
           "backward": backward, "attended_fraction": round(attended, 4),
           "flex_block_sparsity_percent": round(flex_sparsity, 2), "rewrite": rewrite, "ms": {},
           "tflops_attended": {}, "gpu_ms": {}}
    for name, fn in providers.items():
        row["ms"][name] = timed_ms(_step(fn, q, k, v, backward), runs)
        row["gpu_ms"][name] = timed_ms(_step(fn, q, k, v, backward), runs, gpu_time=True)
        if isinstance(row["ms"][name], float):
            row["tflops_attended"][name] = round(flops / row["ms"][name] / 1e9, 1)
    return _summarize(row)


def _summarize(row: dict) -> dict:
    """Speedups of optimize over dense attention and whether it is ever slower than dense, per call and
    (``gpu_speedup_vs_dense``) on GPU time, CUDA-graph replays without the host.

    The dense baseline is the attention the mask restricts: causal attention for the (causal) sliding
    window, full attention for the block-sparse mask; ``speedup_vs_dense`` is against its fastest SDPA
    kernel, ``speedup_vs_dense_flash`` against SDPA-flash (the kernel the issue's reference figure, 6.66x
    for FlexAttention, was measured against). ``never_slower_than_dense`` compares with the same mask run
    by the dense kernels (SDPA given the mask tensor) and with the dense baseline, 2% allowed for the
    run-to-run noise of the medians; the speedup targets are checked against the fastest dense kernel."""
    suffix = "causal (dense)" if row["kind"] == "window" else " (dense)"
    dense = {n: t for n, t in row["ms"].items() if n.endswith(suffix) and isinstance(t, float)
             and (row["kind"] == "window" or "causal" not in n)}
    mine = row["ms"].get("kernel_pytorch.optimize")
    same_mask = row["ms"].get("sdpa masked (dense, mask tensor)")
    if not dense or not isinstance(mine, float):
        return row
    row["dense_baseline"] = "causal attention" if row["kind"] == "window" else "full attention"
    row["best_dense_ms"] = min(dense.values())
    row["speedup_vs_dense"] = round(min(dense.values()) / mine, 3)
    gpu = {n: t for n, t in row.get("gpu_ms", {}).items() if isinstance(t, float)}
    gpu_dense = [t for n, t in gpu.items() if n in dense]
    if gpu_dense and "kernel_pytorch.optimize" in gpu:
        row["gpu_speedup_vs_dense"] = round(min(gpu_dense) / gpu["kernel_pytorch.optimize"], 3)
    flash = next((t for n, t in dense.items() if n.startswith("sdpa-flash")), None)
    if flash is not None:
        row["speedup_vs_dense_flash"] = round(flash / mine, 3)
    slowest_allowed = min(min(dense.values()), same_mask if isinstance(same_mask, float) else math.inf)
    row["never_slower_than_dense"] = mine <= slowest_allowed * 1.02
    target = TARGETS.get((row["kind"], row["length"]))
    if target is not None:
        row["target_speedup"] = target
        row["target_met"] = row["speedup_vs_dense"] >= target
    return row


class CausalAttention(nn.Module):
    """Hand-written causal attention, as model code writes it (an additive triu mask built in the graph)."""

    def forward(self, q, k, v):
        length = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        scores = scores + torch.full((length, length), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v


def topk_inputs(kind: str, batch: int, length: int, generator: torch.Generator):
    """q, k, v (B, H, L, D) bf16 on the GPU: "random", "clustered" or "heavy blocks" (module docstring)."""
    shape = (batch, HEADS, length, HEAD_DIM)

    def randn(*size):
        return torch.randn(*size, device=DEVICE, generator=generator)

    q, k, v = randn(*shape), randn(*shape), randn(*shape)
    if kind == "clustered":
        # Each 128-token block has a topic (q and k alike) in a rank-8 subspace per head, tokens are their
        # block's topic plus noise: what block-level choice relies on (neighbouring tokens are alike). Basis
        # rows have norm sqrt(D / rank) = 4, so topic scores have std ~16 x sqrt(rank) / sqrt(D) = 4 after the
        # 1/sqrt(D) scale: peaked, like trained heads; the 0.5 token noise adds ~0.25.
        rank, blocks = 8, -(-length // BLOCK)
        basis = randn(HEADS, rank, HEAD_DIM) / math.sqrt(rank)
        topics_q = (randn(batch, HEADS, blocks, rank) @ basis).repeat_interleave(BLOCK, dim=2)[:, :, :length]
        topics_k = (randn(batch, HEADS, blocks, rank) @ basis).repeat_interleave(BLOCK, dim=2)[:, :, :length]
        q, k = topics_q + 0.5 * q, topics_k + 0.5 * k
    elif kind == "heavy blocks":
        direction = randn(HEADS, 1, HEAD_DIM)
        direction = direction / direction.norm(dim=-1, keepdim=True) * math.sqrt(HEAD_DIM)
        heavy = torch.zeros(length, device=DEVICE)
        blocks = torch.arange(length, device=DEVICE) // BLOCK
        heavy[(blocks % 16 == 5) | (blocks == 0)] = 1.0  # 1 block in 16, and the first (a sink)
        # +0.36 x D = +46 in q·k, +4 after the 1/sqrt(D) scale: those keys weigh e^4 ~ 55x the others, ~70% of
        # a row's mass at 32k
        k = k + 0.6 * heavy[:, None] * direction
        q = q + 0.6 * direction
    elif kind != "random":
        raise ValueError(kind)
    return tuple(t.to(torch.bfloat16).contiguous() for t in (q, k, v))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def run_topk_case(length: int, budget_name: str, budget: dict, runs: int) -> dict:
    from kernel_pytorch.attention.kernels.topk_sparse import select_blocks

    batch = max(1, TOPK_TOKENS // length)
    config = SparseAttentionConfig(**budget, min_length=min(TOPK_LENGTHS))
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = topk_inputs("random", batch, length, generator)
    torch._dynamo.reset()
    with torch.no_grad():
        optimized = optimize(CausalAttention().eval(), example_inputs=(q, k, v), sparse_attention=config)
    rewrite = next((r.replacement for r in report_of(optimized).rewrites if r.pass_name == "attention"),
                   "not rewritten")
    row = {"kind": "topk", "budget": budget_name, "config": config.model_dump(), "length": length, "batch": batch,
           "heads": HEADS, "head_dim": HEAD_DIM, "backward": False, "rewrite": rewrite, "ms": {}}
    topk, keep_ratio = config.budget
    providers = {"kernel_pytorch.optimize (top-k)": optimized,
                 "block choice only": lambda q, k, v: select_blocks(
                     q, k, is_causal=True, scale=None, topk=topk, keep_ratio=keep_ratio,
                     local_blocks=config.local_blocks, sink_blocks=config.sink_blocks, block=config.block)}
    providers.update({f"sdpa-{name} causal (dense)": _dense(b, causal=True) for name, b in DENSE_CAUSAL.items()})
    with torch.no_grad():
        for name, fn in providers.items():
            row["ms"][name] = timed_ms(_step(fn, q, k, v, False), runs)
        selected = providers["block choice only"](q, k, v)
        row["kept_fraction_of_causal_blocks"] = round(float(selected.sum() / (
            selected.shape[0] * selected.shape[1] * selected.shape[2] * (selected.shape[2] + 1) / 2)), 4)
        row["relative_error_vs_dense"] = {}
        for kind in ("random", "clustered", "heavy blocks"):
            inputs = (q, k, v) if kind == "random" else topk_inputs(kind, batch, length, generator)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                dense = F.scaled_dot_product_attention(*inputs, is_causal=True)
            row["relative_error_vs_dense"][kind] = round(_relative(optimized(*inputs), dense), 5)
        # The comparison's own floor: the dense bf16 kernel against fp32 math, on the first 2048 queries
        # (whose causal keys are the first 2048: a 2048 x 2048 problem).
        head = [t[..., :2048, :] for t in (q, k, v)]
        with sdpa_kernel(SDPBackend.MATH):
            exact = F.scaled_dot_product_attention(*(t.float() for t in head), is_causal=True)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            row["bf16_floor_dense_vs_fp32"] = round(_relative(
                F.scaled_dot_product_attention(*head, is_causal=True), exact), 5)
    dense = [t for n, t in row["ms"].items() if n.endswith("causal (dense)") and isinstance(t, float)]
    mine = row["ms"].get("kernel_pytorch.optimize (top-k)")
    if dense and isinstance(mine, float):
        row["best_dense_causal_ms"] = min(dense)
        row["speedup_vs_dense_causal"] = round(min(dense) / mine, 3)
    return row


def plot_topk(rows, path, device: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for budget in TOPK_BUDGETS:
        subset = [r for r in rows if r["budget"] == budget and "speedup_vs_dense_causal" in r]
        if not subset:
            continue
        lengths = [r["length"] for r in subset]
        axes[0].plot(lengths, [r["speedup_vs_dense_causal"] for r in subset], marker="o", label=budget)
        for kind, style in (("random", ":"), ("clustered", "-"), ("heavy blocks", "--")):
            axes[1].plot(lengths, [r["relative_error_vs_dense"][kind] for r in subset], linestyle=style,
                         marker="o", label=f"{budget}, {kind}")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set_title("fwd: speedup vs best dense causal SDPA")
    axes[0].set_ylabel("x dense causal")
    axes[1].set_yscale("log")
    axes[1].set_title("relative error vs dense causal")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.legend(fontsize=6)
    fig.suptitle(f"top-k sparse attention, bf16, hd{HEAD_DIM}, causal, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_topk(args) -> None:
    lengths = args.lengths or ((8192,) if args.quick else TOPK_LENGTHS)
    budgets = {"keep 10%": TOPK_BUDGETS["keep 10%"]} if args.quick else TOPK_BUDGETS
    name = "sparse_attention_topk" + ("_partial" if args.quick or args.lengths else "")
    rows = []
    for length in lengths:
        for budget_name, budget in budgets.items():
            rows.append(run_topk_case(length, budget_name, budget, runs=5 if args.quick else 10))
            print(rows[-1], flush=True)
            path = write_result(name, {"rows": rows}, args.out)  # kept up to date if cut off
    plot_topk(rows, args.out / f"{name}.png", torch.cuda.get_device_name())
    print(f"wrote {path}")


def plot(rows, path, device: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, backward in zip(axes, (False, True)):
        for kind, marker in (("window", "o"), ("blocks90", "s")):
            subset = [r for r in rows if r["kind"] == kind and r["backward"] == backward and "speedup_vs_dense" in r]
            if subset:
                ax.plot([r["length"] for r in subset], [r["speedup_vs_dense"] for r in subset],
                        marker=marker, label=f"optimize, {kind}")
            flex = [(r["length"], r["best_dense_ms"] / r["ms"]["flex_attention (direct)"]) for r in subset
                    if isinstance(r["ms"].get("flex_attention (direct)"), float)]
            if flex:
                ax.plot(*zip(*flex), marker=marker, linestyle="--", label=f"flex direct, {kind}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{'fwd+bwd' if backward else 'fwd'}: speedup vs the fastest dense SDPA kernel")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("x dense (window: causal, blocks: full)")
        ax.legend(fontsize=7)
    fig.suptitle(f"sparse attention, bf16, hd{HEAD_DIM}, window {WINDOW}, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="L = 1k and 4k windows only, forward, 5 runs")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--lengths", type=int, nargs="+", help="only these window (and top-k) lengths")
    parser.add_argument("--directions", nargs="+", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"],
                        help="forward and/or forward+backward rows of the window and blocks90 parts")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="which parts to run (default: all); topk writes sparse_attention_topk.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sparse_attention.py measures GPU kernels; no CUDA device found")
    torch._dynamo.config.cache_size_limit = 64  # one optimize/flex compile per case
    if "window" in args.parts or "blocks90" in args.parts:
        run_masks(args)
    if "topk" in args.parts:
        run_topk(args)


def run_masks(args) -> None:
    """The window and blocks90 parts (sparse_attention.json)."""
    lengths = args.lengths or ((1024, 4096) if args.quick else (1024, 2048, 4096, 8192, 16384))
    cases = [("window", length) for length in lengths] if "window" in args.parts else []
    if "blocks90" in args.parts and not args.quick and (not args.lengths or 16384 in args.lengths):
        cases.append(("blocks90", 16384))
    partial = args.quick or args.lengths or not {"window", "blocks90"} <= set(args.parts) or len(args.directions) < 2
    name = "sparse_attention" + ("_partial" if partial else "")
    rows = []
    directions = [d == "fwd+bwd" for d in args.directions]
    for backward in ((False,) if args.quick else directions):
        for kind, length in cases:
            rows.append(run_case(kind, length, backward, runs=5 if args.quick else 10))
            print(rows[-1], flush=True)
            path = write_result(name, {"rows": rows, "never_slower_than_dense": all(
                r.get("never_slower_than_dense", False) for r in rows)}, args.out)  # kept up to date if cut off
    plot(rows, args.out / f"{name}.png", torch.cuda.get_device_name())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
