"""Memory benchmark: optimizer-state offloading, activation checkpointing and activation offloading, on the
model ``kernel_pytorch.optimize`` returns.

    python benchmarks/memory.py [--quick] [--out DIR] [--parts offload checkpointing activation_offload largest]
                                [--compile auto|off] [--largest-optimizers adamw fp32-masters offloaded]
                                [--offload-seqs 8192 16384 32768]

Every case builds a Llama-style model (kernel_pytorch.testing.LlamaStyleLM, bf16 parameters) on the GPU and
runs it through ``kernel_pytorch.optimize(model, example_inputs=(tokens,), verify=False, checkpointing=...,
offload_activations=..., offload_optimizer=...)``: attention becomes fused SDPA (the model as written keeps
L^2 fp32 scores: at 2 x 4096 tokens the 1B model's eager step does not fit in 80 GB, measured), norms,
activations and RoPE are fused, and capture sees the checkpointed regions. ``verify=False`` because
verification runs the model as written on the example inputs, which is what does not fit. The optimizer
comes from the config through ``kernel_pytorch.memory.make_optimizer(model, lr=...)``, except the
"fp32 masters on the GPU" reference, ``OffloadedOptimizer(gpu_fraction=1.0)`` built directly: no config
value means "offload nothing but keep the offloaded optimizer's math".

Parts (``--quick``: a small model and short sequences, compile off, well under a minute):

- ``offload``: the 1.03B model (20 layers, d 2048, ffn 5632, vocab 32000) at 2 x 4096 tokens, no
  checkpointing. AdamW fused on the GPU (moments in bf16 like the parameters: 4 bytes per parameter),
  fp32-master AdamW on the GPU (the offloaded optimizer's math: 16 bytes per parameter), and
  ``OffloadedOptimizer`` all on the host (``offload_optimizer=True``) and ``"auto"``. Median step time,
  peak and held GPU memory, optimizer-state bytes on GPU and host. Targets (issue 8): step time <= 1.15x
  fused AdamW; peak lower by at least the optimizer state's size.
- ``checkpointing``: the same model and tokens, forward + backward, ``checkpointing`` off / full /
  selective. Activation memory = peak during the step minus what is held before it. Targets: full -60%
  or more at <= 1.25x step time; selective in between.
- ``activation_offload``: the same model, 1 x {8192, 16384, 32768} tokens, ``offload_activations`` off /
  on: peak memory and step time.
- ``largest``: the largest model that trains (two optimizer steps) with each optimizer, at 2 x 4096 tokens
  with ``checkpointing="full"`` (so activations do not set the bound), a few ``n_layers`` of a
  Llama-7B-wide model (d 4096, ffn 11008, 32 heads / 8 kv: 177M parameters per layer, so that the search
  spans 1B-12B with at most 66 layers of capture), stopping at the first that runs out of GPU or host
  memory. ``compile=False`` here: Inductor's compile time grows with depth (minutes per try), while the
  bound is set by parameters and optimizer states, which compiling does not change. Expected on an
  80 GB GPU: fused AdamW ~8 bytes per parameter on the GPU, fp32-master AdamW ~20, the offloaded one ~4
  on the GPU and ~14 in pinned host memory, so host RAM bounds it.

Each case runs in its own try: an out-of-memory error (GPU, or host memory for the pinned states) is
recorded in its row, then everything is released (gc, ``torch._dynamo.reset()``, ``empty_cache``, peak
statistics reset) so the next case starts clean. Step times are medians of CUDA-event timings after
warm-up (harness.measure). Results go to ``--out``/memory.json, merged with what is already there (a part
replaces its earlier rows; the search per optimizer and activation offload per sequence length replace
only the pieces they ran), so the parts can run as separate commands, and memory.png.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import RESULTS_DIR, earlier_parts, environment, measure
from kernel_pytorch import optimize, report_of
from kernel_pytorch.memory import OffloadedOptimizer, make_optimizer
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

GIB = 2**30
LR = 1e-4

# The offload model: docs/design.md's Llama-style model at 20 layers, 1.03B parameters.
MODEL_1B = LlamaStyleConfig(n_layers=20, max_seq_len=32768)
# The search's model: Llama-7B's width, 177M parameters per layer (see the module docstring).
SEARCH_BASE = LlamaStyleConfig(dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=11008, max_seq_len=4096)
SEARCH_BILLIONS = (1, 2, 4, 6, 8, 10, 12)
OPTIMIZERS = ("adamw", "fp32-masters", "offloaded")


@dataclasses.dataclass(frozen=True)
class Setup:
    """Sizes of one run (full or ``--quick``)."""

    model: LlamaStyleConfig
    batch: int
    seq: int
    offload_seqs: tuple[int, ...]
    search_base: LlamaStyleConfig
    search_layers: tuple[int, ...]
    runs: int
    compile: bool | str


def make_setup(quick: bool, compile_choice: str | None) -> Setup:
    compile_setting = {"auto": "auto", "off": False, None: False if quick else "auto"}[compile_choice]
    if quick:
        # Activations of 1 MiB and more (2 x 1024 x 512 bf16), so activation offload moves something.
        small = LlamaStyleConfig(vocab_size=8192, dim=512, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=1408,
                                 max_seq_len=2048)
        return Setup(model=small, batch=2, seq=1024, offload_seqs=(1024, 2048), search_base=small,
                     search_layers=(2, 4), runs=3, compile=compile_setting)
    return Setup(model=MODEL_1B, batch=2, seq=4096, offload_seqs=(8192, 16384, 32768), search_base=SEARCH_BASE,
                 search_layers=tuple(layers_for(SEARCH_BASE, b * 1e9) for b in SEARCH_BILLIONS), runs=10,
                 compile=compile_setting)


def parameter_count(config: LlamaStyleConfig) -> int:
    d, hd = config.dim, config.head_dim
    attention = d * config.n_heads * hd * 2 + d * config.n_kv_heads * hd * 2
    per_layer = attention + 3 * d * config.ffn_dim + 2 * d
    return 2 * config.vocab_size * d + config.n_layers * per_layer + d


def layers_for(base: LlamaStyleConfig, parameters: float) -> int:
    """The number of layers whose model comes closest to ``parameters`` (at least 2: checkpointing needs a
    repeated block)."""
    per_layer = parameter_count(dataclasses.replace(base, n_layers=1)) - parameter_count(
        dataclasses.replace(base, n_layers=0))
    return max(2, round((parameters - parameter_count(dataclasses.replace(base, n_layers=0))) / per_layer))


# --------------------------------------------------------------------------------------------------
# Building and stepping
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build(config: LlamaStyleConfig) -> torch.nn.Module:
    """The model in bf16 on the GPU, initialised there (an fp32 copy on the host first would take 4 bytes
    per parameter of host memory, 48 GB at 12B, and minutes of CPU initialisation)."""
    torch.manual_seed(0)
    with torch.device("cuda"), _default_dtype(torch.bfloat16):
        model = LlamaStyleLM(config)
    return model.to(dtype=torch.bfloat16).train()  # the rotary tables are built in fp32 on purpose


def random_tokens(config: LlamaStyleConfig, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, seq), device="cuda",
                         generator=torch.Generator("cuda").manual_seed(1))


def optimized(config: LlamaStyleConfig, tokens: torch.Tensor, compile_setting: bool | str,
              **memory_options: Any) -> torch.nn.Module:
    model = build(config)
    return optimize(model, example_inputs=(tokens,), verify=False, compile=compile_setting, memory=memory_options)


@dataclasses.dataclass
class Trainer:
    """One training step of ``model`` on ``tokens`` (next-token cross-entropy), with ``optimizer`` if any
    (without one, gradients accumulate: the same memory from the second step on)."""

    model: torch.nn.Module
    tokens: torch.Tensor
    optimizer: torch.optim.Optimizer | None = None

    def step(self) -> None:
        logits = self.model(self.tokens)
        targets = torch.roll(self.tokens, -1, dims=1)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        if isinstance(self.optimizer, OffloadedOptimizer):
            self.optimizer.close()  # unpins now rather than whenever the collector gets to it


def release() -> None:
    """Free what the last case left: compiled graphs, cycles (model <-> its compiled call), cached blocks."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


# How running out of memory reads when it does not come as torch.OutOfMemoryError / MemoryError: cuBLAS
# and cuDNN workspaces, and pinning (cudaHostRegister) or allocating the host blocks of the offloaded states.
_GPU_OOM_TEXT = ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")
_HOST_OOM_TEXT = ("cudaHostRegister", "DefaultCPUAllocator: can't allocate memory")


def failure_of(error: BaseException) -> str | None:
    """'GPU out of memory' / 'host out of memory' when ``error`` (or what it wraps: dynamo wraps what a
    backend raises) is running out of memory, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, torch.OutOfMemoryError) or any(t in text for t in _GPU_OOM_TEXT):
            return "GPU out of memory"
        if isinstance(error, MemoryError) or any(t in text for t in _HOST_OOM_TEXT):
            return "host out of memory"
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


def run_case(make: Callable[[], Trainer], measure_fn: Callable[[Trainer], dict]) -> dict:
    """``measure_fn(make())``; running out of GPU or host memory is recorded in the row instead of raised
    (any other error is a bug and propagates). Memory is released after either way, outside the
    ``except``, once the traceback no longer holds the case's tensors."""
    row: dict[str, Any]
    trainer = None
    try:
        trainer = make()
        row = measure_fn(trainer)
    except Exception as error:
        kind = failure_of(error)
        if kind is None:
            raise
        first_line = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        row = {"error": f"{kind}: {first_line}"}
    if trainer is not None:
        trainer.close()
    del trainer
    release()
    return row


def _gib(nbytes: float) -> float:
    return round(nbytes / GIB, 3)


def optimizer_bytes(optimizer: torch.optim.Optimizer | None) -> tuple[int, int]:
    """(GPU bytes, host bytes) of the optimizer's states, each storage once; pinned blocks for the
    offloaded optimizer (states, masters and gradient landing buffers)."""
    if optimizer is None:
        return 0, 0
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_cuda:
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    host = optimizer.pinned_bytes if isinstance(optimizer, OffloadedOptimizer) else 0
    return sum(storages.values()), host


def measure_step(trainer: Trainer, runs: int) -> dict:
    """Peak and held GPU memory of a step after a warm-up step, then the median step time."""
    trainer.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    trainer.step()
    torch.cuda.synchronize()
    peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    timing = measure(trainer.step, warmup=0, runs=runs)
    gpu_state, host_state = optimizer_bytes(trainer.optimizer)
    report = report_of(trainer.model)
    return {"step_ms": round(timing.median_ms, 2), "peak_gib": _gib(peak), "peak_reserved_gib": _gib(reserved),
            "held_gib": _gib(held), "activation_gib": _gib(peak - held),
            "optimizer_state_gpu_gib": _gib(gpu_state), "optimizer_state_host_gib": _gib(host_state),
            "capture_and_compile_s": report.timings_s.get("first call (capture, passes, compile)"),
            "report_memory": [r.model_dump() for r in report.memory]}


# --------------------------------------------------------------------------------------------------
# The parts
# --------------------------------------------------------------------------------------------------


def _optimizer_trainer(setup: Setup, config: LlamaStyleConfig, tokens: torch.Tensor, kind: str,
                       **options: Any) -> Trainer:
    """``kind``: 'adamw' (make_optimizer, no offload: fused AdamW), 'fp32-masters' (OffloadedOptimizer with
    every state on the GPU), 'offloaded' (offload_optimizer=True) or 'auto' (offload_optimizer='auto')."""
    offload = {"adamw": False, "fp32-masters": False, "offloaded": True, "auto": "auto"}[kind]
    model = optimized(config, tokens, options.pop("compile", setup.compile), offload_optimizer=offload, **options)
    if kind == "fp32-masters":
        optimizer = OffloadedOptimizer(model.parameters(), lr=LR, gpu_fraction=1.0)
    else:
        optimizer = make_optimizer(model, lr=LR)
    return Trainer(model, tokens, optimizer)


OFFLOAD_CASES = {
    "adamw": "AdamW fused (GPU, bf16 moments)",
    "fp32-masters": "AdamW fp32 masters on the GPU (OffloadedOptimizer gpu_fraction=1)",
    "offloaded": "OffloadedOptimizer (offload_optimizer=True)",
    "auto": "OffloadedOptimizer (offload_optimizer='auto')",
}


# Each part calls save(rows) after every case: a run cut off (timeout, the host's OOM killer during the
# search) keeps what it measured.
Save = Callable[[list[dict]], None]


def _no_save(rows: list[dict]) -> None:
    return None


def offload_part(setup: Setup, save: Save = _no_save) -> list[dict]:
    tokens = random_tokens(setup.model, setup.batch, setup.seq)
    common = {"parameters": parameter_count(setup.model), "tokens_per_step": tokens.numel()}
    rows = []
    for kind, name in OFFLOAD_CASES.items():
        row = run_case(lambda kind=kind: _optimizer_trainer(setup, setup.model, tokens, kind),
                       lambda trainer: measure_step(trainer, setup.runs))
        rows.append({"case": name, **common, **row})
        save(rows)
    base = rows[0]
    for row in rows[1:]:
        if "step_ms" in row and "step_ms" in base:
            row["time_vs_fused"] = round(row["step_ms"] / base["step_ms"], 3)
            row["peak_saved_vs_fused_gib"] = round(base["peak_gib"] - row["peak_gib"], 3)
    return rows


def checkpointing_part(setup: Setup, save: Save = _no_save) -> list[dict]:
    tokens = random_tokens(setup.model, setup.batch, setup.seq)
    rows = []
    for policy in ("off", "full", "selective"):
        row = run_case(lambda policy=policy: Trainer(optimized(setup.model, tokens, setup.compile,
                                                               checkpointing=policy), tokens),
                       lambda trainer: measure_step(trainer, setup.runs))
        rows.append({"case": f"checkpointing {policy}", "tokens_per_step": tokens.numel(), **row})
        save(rows)
    base = rows[0]
    for row in rows[1:]:
        if "activation_gib" in row and "activation_gib" in base:
            row["activation_vs_off"] = round(row["activation_gib"] / base["activation_gib"], 3)
            row["time_vs_off"] = round(row["step_ms"] / base["step_ms"], 3)
    return rows


def activation_offload_part(setup: Setup, save: Save = _no_save) -> list[dict]:
    rows = []
    for seq in setup.offload_seqs:
        config = dataclasses.replace(setup.model, max_seq_len=max(seq, setup.model.max_seq_len))
        tokens = random_tokens(config, 1, seq)
        pair = []
        for offload in (False, True):
            def make(config=config, tokens=tokens, offload=offload) -> Trainer:
                return Trainer(optimized(config, tokens, setup.compile, offload_activations=offload), tokens)

            # Half the runs: a step at 32k tokens takes seconds.
            row = run_case(make, lambda trainer: measure_step(trainer, max(3, setup.runs // 2)))
            pair.append({"case": f"activation offload {'on' if offload else 'off'}", "tokens": seq, **row})
        off, on = pair
        if "peak_gib" in off and "peak_gib" in on:
            on["peak_saved_gib"] = round(off["peak_gib"] - on["peak_gib"], 3)
            on["time_vs_off"] = round(on["step_ms"] / off["step_ms"], 3)
        rows += pair
        save(rows)
    return rows


def _two_steps(trainer: Trainer) -> dict:
    """Trains = two optimizer steps (the second with every state allocated); peak and time of the second."""
    trainer.step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.step()
    torch.cuda.synchronize()
    gpu_state, host_state = optimizer_bytes(trainer.optimizer)
    return {"trained": True, "step_s": round(time.perf_counter() - started, 2),
            "peak_gib": _gib(torch.cuda.max_memory_allocated()),
            "optimizer_state_gpu_gib": _gib(gpu_state), "optimizer_state_host_gib": _gib(host_state)}


def largest_part(setup: Setup, save: Save = _no_save, optimizers: tuple[str, ...] = OPTIMIZERS) -> list[dict]:
    rows = []
    for kind in optimizers:
        for layers in setup.search_layers:
            config = dataclasses.replace(setup.search_base, n_layers=layers)
            tokens = random_tokens(config, setup.batch, min(setup.seq, config.max_seq_len))
            row = run_case(lambda config=config, kind=kind, tokens=tokens: _optimizer_trainer(
                setup, config, tokens, kind, compile=False, checkpointing="full"), _two_steps)
            rows.append({"optimizer": kind, "n_layers": layers, "parameters": parameter_count(config),
                         "tokens_per_step": tokens.numel(), **row})
            save(rows)
            if not row.get("trained"):
                break  # the first size that does not train ends this optimizer's search
    return rows


PARTS: dict[str, Callable[..., list[dict]]] = {
    "offload": offload_part, "checkpointing": checkpointing_part,
    "activation_offload": activation_offload_part, "largest": largest_part,
}


# --------------------------------------------------------------------------------------------------
# Summary, plot, main
# --------------------------------------------------------------------------------------------------


def summary(payload: dict) -> list[str]:
    """The issue's targets, one line each, from whatever parts are in ``payload``."""
    lines = []
    rows = {r["case"]: r for r in payload.get("offload", [])}
    fused = rows.get(OFFLOAD_CASES["adamw"], {})
    for kind in ("offloaded", "auto"):
        row = rows.get(OFFLOAD_CASES[kind], {})
        if "time_vs_fused" in row:
            lines.append(f"offload {kind}: {row['time_vs_fused']}x fused AdamW step time (target <= 1.15); peak "
                         f"{row['peak_saved_vs_fused_gib']} GiB lower (target >= the fused optimizer's state, "
                         f"{fused.get('optimizer_state_gpu_gib')} GiB)")
    for row in payload.get("checkpointing", [])[1:]:
        if "activation_vs_off" in row:
            lines.append(f"{row['case']}: activations {row['activation_vs_off']}x off (full target <= 0.4), "
                         f"{row['time_vs_off']}x step time (full target <= 1.25)")
    for row in payload.get("activation_offload", []):
        if "peak_saved_gib" in row:
            lines.append(f"activation offload at {row['tokens']} tokens: peak {row['peak_saved_gib']} GiB lower, "
                         f"{row['time_vs_off']}x step time")
    largest = {}
    for row in payload.get("largest", []):
        if row.get("trained"):
            largest[row["optimizer"]] = max(largest.get(row["optimizer"], 0), row["parameters"])
    if largest:
        tokens = payload["largest"][0].get("tokens_per_step")
        text = ", ".join(f"{kind} {n / 1e9:.2f}B" for kind, n in largest.items())
        lines.append(f"largest model that trained ({tokens} tokens per step, full checkpointing): {text} "
                     "(target: offloaded >= 2x adamw)")
    return lines


def plot(payload: dict, path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [p for p in PARTS if payload.get(p)]
    if not parts:
        return
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts):
        if part == "largest":
            trained = [r for r in payload[part] if r.get("trained")]
            for kind in dict.fromkeys(r["optimizer"] for r in payload[part]):
                mine = [r for r in trained if r["optimizer"] == kind]
                ax.plot([r["parameters"] / 1e9 for r in mine], [r["peak_gib"] for r in mine], "o-", label=kind)
            ax.set_xlabel("parameters (billions), sizes that trained")
            ax.legend(fontsize=7)
        else:
            rows = [r for r in payload[part] if "peak_gib" in r]
            ax.scatter([r["step_ms"] for r in rows], [r["peak_gib"] for r in rows])
            for r in rows:
                label = r["case"] + (f" {r['tokens']}" if "tokens" in r else "")
                ax.annotate(label, (r["step_ms"], r["peak_gib"]), fontsize=6)
            ax.set_xlabel("step time (ms)")
        ax.set_ylabel("peak GPU memory (GiB)")
        ax.set_title(part)
    fig.suptitle(f"memory wrappers after kernel_pytorch.optimize, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# The row field that tells a part's pieces apart.
_SPLIT_BY = {"largest": "optimizer", "activation_offload": "tokens"}


def write_merged(name: str, parts: dict, directory: Path) -> Path:
    """``<name>.json`` with ``parts`` replacing those of an earlier run (each part with the environment it
    ran in), so that parts run as separate commands end up in one file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    merged = earlier_parts(path, PARTS)
    environments = merged.get("environments", {})
    for part, rows in parts.items():
        if part in _SPLIT_BY:
            # These parts can run a piece per command (--largest-optimizers, --offload-seqs): keep the rows
            # of the pieces this run did not redo.
            key = _SPLIT_BY[part]
            mine = {row[key] for row in rows}
            rows = [row for row in merged.get(part, []) if row[key] not in mine] + rows
        merged[part] = rows
        environments[part] = environment()
    merged["environments"] = environments
    merged["summary"] = summary(merged)
    path.write_text(json.dumps(merged, indent=2, default=str) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model and sequences, compile off (< 1 min)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--compile", choices=("auto", "off"), default=None,
                        help="optimize's compile setting (default: auto, off with --quick; 'largest' is always off)")
    parser.add_argument("--largest-optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS),
                        help="the optimizers the 'largest' search runs (to split it across commands)")
    parser.add_argument("--offload-seqs", nargs="+", type=int, default=None,
                        help="activation_offload's sequence lengths (default 8192 16384 32768; 1024 2048 quick)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/memory.py needs a CUDA GPU")
    setup = make_setup(args.quick, args.compile)
    if args.offload_seqs:
        setup = dataclasses.replace(setup, offload_seqs=tuple(args.offload_seqs))
    # The harness's L2-flush buffer (256 MiB) stays allocated once created: create it before the first
    # case, so that every case's held and peak memory include it alike.
    measure(lambda: None, warmup=0, runs=1)
    name = "memory" + ("_quick" if args.quick else "")
    done: dict[str, list[dict]] = {}
    for part in args.parts:
        def save(rows: list[dict], part: str = part) -> None:
            write_merged(name, {**done, part: rows}, args.out)

        started = time.perf_counter()
        if part == "largest":
            rows = largest_part(setup, save, tuple(args.largest_optimizers))
        else:
            rows = PARTS[part](setup, save)
        done[part] = rows
        for row in rows:
            print(part, {k: v for k, v in row.items() if k != "report_memory"}, flush=True)
        print(f"{part}: {time.perf_counter() - started:.0f} s", flush=True)
        path = write_merged(name, done, args.out)  # kept up to date if cut off
    merged = json.loads(path.read_text())
    plot(merged, args.out / f"{name}.png", torch.cuda.get_device_name())
    for line in merged["summary"]:
        print(line)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
