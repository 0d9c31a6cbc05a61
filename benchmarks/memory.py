"""Memory benchmark: optimizer-state offloading, activation checkpointing and activation offloading.

    python benchmarks/memory.py [--quick] [--out DIR] [--parts offload checkpointing activation_offload]

On a Llama-style model (kernel_pytorch.testing.LlamaStyleLM, bf16 parameters, fp32 optimizer state):

- ``offload``: a ~1B-parameter model at 8192 tokens per step (2 x 4096), AdamW fused on the GPU against
  ``kernel_pytorch.memory.OffloadedOptimizer`` (gpu_fraction 0 and "auto"): median step time and peak GPU
  memory. Issue targets: step time <= 1.15x fused GPU AdamW, peak lower by at least the optimizer
  state's size (8 bytes per parameter for the two fp32 moments, plus 4 for fp32 masters of bf16 weights).
- ``checkpointing``: policies off / full / selective on the same model family: peak activation memory
  (peak during forward+backward minus the memory held before the step) and step time. Targets: full
  -60% or more activation memory at <= 1.25x step time; selective in between.
- ``activation_offload``: ``OffloadActivations`` around the model, 8k-32k tokens: peak memory and time.

Per-step times are medians over steps after warm-up (harness.measure, CUDA events). Writes memory.json
and memory.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import RESULTS_DIR, measure, write_result  # noqa: E402
from kernel_pytorch.memory import OffloadActivations, OffloadedOptimizer, apply_checkpointing  # noqa: E402
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM  # noqa: E402

GIB = 2**30


def model_config(quick: bool) -> LlamaStyleConfig:
    # 20 layers of d 2048 / ffn 5632 with 32000-token embeddings: 1.03B parameters.
    return LlamaStyleConfig(n_layers=4 if quick else 20)


def build(config: LlamaStyleConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaStyleLM(config).to(device="cuda", dtype=torch.bfloat16).train()


def _training_step(model, optimizer, tokens) -> Callable[[], None]:
    targets = torch.roll(tokens, -1, dims=1)

    def step():
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return step


def _peak(step: Callable[[], None]) -> tuple[float, float]:
    """(peak GiB during one step, GiB held before it), after a warm-up step."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / GIB, before / GIB


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _case(name: str, make: Callable[[], Callable[[], None]], runs: int) -> dict:
    try:
        step = make()
        peak, held = _peak(step)
        ms = measure(step, warmup=1, runs=runs).median_ms
        return {"case": name, "step_ms": round(ms, 2), "peak_gib": round(peak, 3), "held_gib": round(held, 3)}
    except torch.cuda.OutOfMemoryError as error:
        return {"case": name, "error": f"OutOfMemoryError: {str(error).splitlines()[0][:160]}"}
    finally:
        _release()


def offload_part(quick: bool, runs: int) -> list[dict]:
    config = model_config(quick)
    tokens = torch.randint(0, config.vocab_size, (2, 4096 if not quick else 1024), device="cuda")
    rows = []

    def fused():
        model = build(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return _training_step(model, optimizer, tokens)

    def offloaded(fraction):
        def make():
            model = build(config)
            return _training_step(model, OffloadedOptimizer(model.parameters(), lr=1e-4, gpu_fraction=fraction),
                                  tokens)
        return make

    n_params = sum(p.numel() for p in build(config).parameters())
    _release()
    rows.append({"parameters": n_params, "tokens_per_step": tokens.numel()} | _case("AdamW fused (GPU)", fused, runs))
    for fraction in (0.0, "auto"):
        rows.append({"parameters": n_params, "tokens_per_step": tokens.numel()} |
                    _case(f"OffloadedOptimizer (gpu_fraction={fraction})", offloaded(fraction), runs))
    base = rows[0].get("step_ms")
    for row in rows:
        if base and "step_ms" in row:
            row["time_vs_fused"] = round(row["step_ms"] / base, 3)
            row["peak_saved_gib"] = round(rows[0]["peak_gib"] - row["peak_gib"], 3)
    return rows


def checkpointing_part(quick: bool, runs: int) -> list[dict]:
    config = model_config(quick)
    tokens = torch.randint(0, config.vocab_size, (2, 4096 if not quick else 1024), device="cuda")
    rows = []
    for policy in ("off", "full", "selective"):
        def make(policy=policy):
            model = build(config)
            if policy != "off":
                apply_checkpointing(model, policy=policy)
            return _training_step(model, None, tokens)
        row = _case(f"checkpointing {policy}", make, runs)
        if "peak_gib" in row:
            row["activation_gib"] = round(row["peak_gib"] - row["held_gib"], 3)
        rows.append(row)
    base = rows[0]
    for row in rows:
        if "activation_gib" in row and "activation_gib" in base:
            row["activation_vs_off"] = round(row["activation_gib"] / base["activation_gib"], 3)
            row["time_vs_off"] = round(row["step_ms"] / base["step_ms"], 3)
    return rows


def activation_offload_part(quick: bool, runs: int) -> list[dict]:
    config = LlamaStyleConfig(n_layers=2 if quick else 8)
    rows = []
    for seq in ((1024,) if quick else (8192, 16384, 32768)):
        tokens = torch.randint(0, config.vocab_size, (1, seq), device="cuda")
        for offload in (False, True):
            def make(offload=offload):
                model = build(dataclasses.replace(config, max_seq_len=seq))
                return _training_step(OffloadActivations(model) if offload else model, None, tokens)
            rows.append({"tokens": seq} | _case(f"activation offload {'on' if offload else 'off'}", make, runs))
    return rows


PARTS = {"offload": offload_part, "checkpointing": checkpointing_part, "activation_offload": activation_offload_part}


def plot(payload: dict, path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in PARTS if payload.get(p)]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4), squeeze=False)
    for ax, part in zip(axes[0], parts):
        rows = [r for r in payload[part] if "peak_gib" in r]
        labels = [r["case"] + (f" {r['tokens']}" if "tokens" in r else "") for r in rows]
        ax.scatter([r["step_ms"] for r in rows], [r["peak_gib"] for r in rows])
        for label, r in zip(labels, rows):
            ax.annotate(label, (r["step_ms"], r["peak_gib"]), fontsize=7)
        ax.set_xlabel("step time (ms)")
        ax.set_ylabel("peak GPU memory (GiB)")
        ax.set_title(part)
    fig.suptitle(f"memory wrappers, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model and sequences")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/memory.py needs a CUDA GPU")
    runs = 3 if args.quick else 10
    payload, name = {}, "memory" + ("_quick" if args.quick else "")
    for part in args.parts:
        payload[part] = PARTS[part](args.quick, runs)
        for row in payload[part]:
            print(part, row, flush=True)
        path = write_result(name, payload, args.out)  # kept up to date if cut off
    plot(payload, args.out / f"{name}.png", torch.cuda.get_device_name())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
