"""FP8 training benchmark: ``Float8Linear`` (tensorwise and rowwise) against bf16 ``nn.Linear``, on the GPU.

    python benchmarks/fp8.py [--quick] [--out DIR] [--parts ceilings linear numerics sweep model]

Five tables, bf16 activations and weights throughout:

1. ``ceilings``: the raw matmuls at M = K = N = 8192 on pre-quantized operands, no scaling work timed:
   bf16 ``torch.mm`` and ``torch._scaled_mm`` on float8_e4m3fn, tensorwise (0-dim fp32 scales) and rowwise
   ((M, 1) and (1, N) fp32 scales), each with ``use_fast_accum`` False (what ``Float8Linear`` runs) and
   True. TFLOP/s = 2 M N K / GPU time (``harness.measure_gpu_time``: CUDA-graph replays).
2. ``linear``: one linear layer forward + backward (output, input gradient and weight gradient: three
   matmuls, 6 M N K FLOPs) at M = K = N = 8192, quantization included: bf16 ``nn.Linear`` against
   ``Float8Linear.from_linear(..., recipe=...)``. Per-call time (``harness.measure``: CUDA events, L2
   flushed; what a training step sees) and GPU time. Issue targets: >= 1.5x tensorwise, >= 1.35x rowwise.
3. ``sweep``: the same forward + backward over (M, K, N), each in 1024 ... 16384 (quick: a few points): the
   data an automatic per-layer bf16/fp8 decision uses. ``speedup`` = bf16 time / fp8 time per call,
   ``gpu_speedup`` the same on GPU time; ``fp8_wins`` (per call) and ``gpu_fp8_wins`` per recipe.
4. ``numerics``: SQNR = 20 log10(||ref|| / ||ref - x||) of the output, the weight gradient and the input
   gradient of ``Float8Linear`` (and of bf16 ``nn.Linear``, for scale) against a float64 reference computed
   from the same bf16 inputs. Issue floors: >= 20 dB output, >= 17 dB weight gradient.
5. ``model``: a training step of docs/design.md's Llama-style model (12 layers, batch 4 x 2048) through
   ``kernel_pytorch.optimize`` in bf16, with ``fp8=True`` (each recipe) and ``fp8="auto"``. Target: 1.15x.
6. ``producers``: quantization fused into the producing kernel, at the model's shapes: RMSNorm -> the fused
   gate/up linear (8192 x 2048 -> 11264) and packed SwiGLU -> down (8192 x 5632 -> 2048), forward +
   backward, GPU time: the producer in bf16 + ``F.linear``; + ``float8_linear`` finding x's maximum itself;
   + ``float8_linear`` given the maximum the producer computed (``fp8_amax=True`` / ``x_amax``). And the
   backward's direction: the fused gate/up linear -> packed SwiGLU, whose backward computes the maximum of
   the linear's output gradient (``grad_amax_slot``; the "amax from the producer" column).

A run with some ``--parts`` keeps the other parts of the JSON it writes over, each with its environment.

Each sweep point also records ``auto``: what ``optimize(fp8="auto")`` decides there (its own timing) and
the speedup that choice gets on the point's measurements (never below 1 when the decision is right).

The layers have no bias (as in Llama-style blocks); the forward + backward step is
``torch.autograd.grad(layer(x), (x, layer.weight), dy)``, a fresh graph each call. A provider that fails
at a point (OOM, a shape ``_scaled_mm`` refuses, a CUDA graph that cannot be captured) is recorded as an
error string for that point; the run goes on. Writes fp8.json (fp8_quick.json with --quick) and fp8.png.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import RESULTS_DIR, earlier_parts, measure, measure_gpu_time, write_result  # noqa: E402
from kernel_pytorch import float8_conversion  # noqa: E402
from kernel_pytorch.ops.float8_linear import Float8Linear  # noqa: E402

DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
RECIPES = ("tensorwise", "rowwise")
BF16 = "bf16 nn.Linear"
TARGETS = {"tensorwise": 1.5, "rowwise": 1.35}  # forward + backward speedup at 8192^3
SQNR_FLOORS = {"output": 20.0, "grad_weight": 17.0}  # dB
SIZES = (1024, 2048, 4096, 8192, 16384)
PARTS = ("ceilings", "linear", "numerics", "sweep", "model", "producers")
# "gate/up -> swiglu": the other direction, the SwiGLU backward finds the gate/up gradient's maximum.
PRODUCER_SHAPES = {"rms_norm -> gate/up": (8192, 2048, 11264), "swiglu -> down": (8192, 5632, 2048),
                   "gate/up -> swiglu": (8192, 2048, 11264)}
QUICK_POINTS = ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 4096),
                (4096, 8192, 2048))
NUMERICS_SHAPE = (4096, 4096, 4096)  # M, K, N

# Inputs come from a private generator: a failed CUDA-graph capture can leave the default CUDA generator
# refusing later draws ("Offset increment outside graph capture"; see benchmarks/kernels.py).
_generator: torch.Generator | None = None


def _randn(*shape: int, scale: float = 1.0, grad: bool = False) -> torch.Tensor:
    global _generator
    if _generator is None:
        _generator = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(*shape, device="cuda", dtype=torch.float32, generator=_generator)
    return (t * scale).to(DTYPE).requires_grad_(grad)


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def _free() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _gpu_time(fn: Callable[[], object], flops: float) -> tuple[float | None, str | None]:
    """GPU time of one call in ms by CUDA-graph replays, fewer calls per graph for the large shapes (a
    16384^3 forward + backward is ~40 ms); the first capture of a backward can fail on lazy
    initialisation: retried once. ``(ms, None)`` or ``(None, error)``."""
    calls = max(3, min(20, int(2e13 / max(flops, 1.0))))
    error = None
    for _ in range(2):
        try:
            return measure_gpu_time(fn, calls=calls, replays=5), None
        except Exception as exc:  # not capturable: the caller keeps the per-call time
            error = _error(exc)
    return None, error


# ------------------------------------------------------------------------------------------ 1. ceilings

def _scaled_mm_step(m: int, k: int, n: int, rowwise: bool, fast_accum: bool) -> Callable[[], torch.Tensor]:
    """``torch._scaled_mm`` on e4m3 operands quantized beforehand: a (M, K) row-major, b (K, N)
    column-major (the transpose of a row-major (N, K)), fp32 scales, bf16 output."""
    a = _randn(m, k).to(FP8)
    b = _randn(n, k).to(FP8).t()
    if rowwise:
        scale_a = torch.ones(m, 1, device="cuda", dtype=torch.float32)
        scale_b = torch.ones(1, n, device="cuda", dtype=torch.float32)
    else:
        scale_a = torch.tensor(1.0, device="cuda")
        scale_b = torch.tensor(1.0, device="cuda")
    return lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=DTYPE,
                                    use_fast_accum=fast_accum)


def _mm_step(m: int, k: int, n: int) -> Callable[[], torch.Tensor]:
    a, b = _randn(m, k), _randn(k, n)
    return lambda: torch.mm(a, b)


def ceilings(size: int = 8192, runs: int = 20) -> dict:
    flops = 2 * size ** 3
    steps = {"bf16 torch.mm": lambda: _mm_step(size, size, size)}
    for rowwise, fast in itertools.product((False, True), (False, True)):
        name = f"fp8 e4m3 {'rowwise' if rowwise else 'tensorwise'}" + (" (fast accum)" if fast else "")
        steps[name] = lambda rowwise=rowwise, fast=fast: _scaled_mm_step(size, size, size, rowwise, fast)
    out = {"m": size, "k": size, "n": size, "flops": flops, "results": {}}
    for name, make in steps.items():
        result = {}
        try:
            step = make()
            with torch.no_grad():
                result["ms"] = round(measure(step, warmup=3, runs=runs).median_ms, 4)
                gpu_ms, gpu_error = _gpu_time(step, flops)
            if gpu_ms is not None:
                result["gpu_ms"] = round(gpu_ms, 4)
            else:
                result["gpu_error"] = gpu_error
            best = result.get("gpu_ms", result["ms"])
            result["tflops"] = round(flops / best / 1e9, 1)
        except Exception as error:  # one provider's failure must not end the run
            result["error"] = _error(error)
        out["results"][name] = result
        step = None
        _free()
    bf16 = out["results"]["bf16 torch.mm"].get("tflops")
    for result in out["results"].values():
        if bf16 and "tflops" in result:
            result["vs_bf16"] = round(result["tflops"] / bf16, 3)
    return out


# ------------------------------------------------------------------------------- 2/3. forward + backward

def _layer(k: int, n: int) -> nn.Linear:
    linear = torch.nn.utils.skip_init(nn.Linear, k, n, bias=False, device="cuda", dtype=DTYPE)
    with torch.no_grad():
        linear.weight.copy_(_randn(n, k, scale=k ** -0.5))
    return linear


def _providers(linear: nn.Linear) -> dict[str, Callable[[], nn.Module]]:
    providers: dict[str, Callable[[], nn.Module]] = {BF16: lambda: linear}
    for recipe in RECIPES:
        providers[f"fp8 {recipe}"] = lambda recipe=recipe: Float8Linear.from_linear(linear, recipe=recipe)
    return providers


def _train_step(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], object]:
    params = (x, layer.weight)
    return lambda: torch.autograd.grad(layer(x), params, dy)


def forward_backward(m: int, k: int, n: int, runs: int) -> dict:
    """One (M, K, N) point: every provider's forward + backward time per call and on the GPU."""
    flops = 6 * m * k * n
    row = {"m": m, "k": k, "n": n, "flops": flops, "results": {}}
    try:
        linear = _layer(k, n)
        x, dy = _randn(m, k, grad=True), _randn(m, n)
    except Exception as error:  # OOM on the inputs themselves: the whole point is an error
        row["error"] = _error(error)
        _free()
        return row
    for name, make in _providers(linear).items():
        result: dict = {}
        try:
            step = _train_step(make(), x, dy)
            timing = measure(step, warmup=2, runs=runs)
            result.update(ms=round(timing.median_ms, 4), tflops=round(flops / timing.median_ms / 1e9, 1))
            gpu_ms, gpu_error = _gpu_time(step, flops)
            if gpu_ms is not None:
                result.update(gpu_ms=round(gpu_ms, 4), gpu_tflops=round(flops / gpu_ms / 1e9, 1))
            else:
                result["gpu_error"] = gpu_error
        except Exception as error:  # one provider's failure must not end the run
            result["error"] = _error(error)
        row["results"][name] = result
        step = None
        _free()
    add_speedups(row)
    del linear, x, dy
    _free()
    return row


def add_speedups(row: dict) -> None:
    """Per recipe: bf16 time / fp8 time per call (``speedup``) and on GPU time (``gpu_speedup``), and
    whether fp8 wins on each; None where a figure is missing. ``best`` is the fastest provider per call."""
    results = row["results"]
    bf16 = results.get(BF16, {})
    for recipe in RECIPES:
        fp8 = results.get(f"fp8 {recipe}", {})
        for key, prefix in (("ms", ""), ("gpu_ms", "gpu_")):
            ratio = round(bf16[key] / fp8[key], 3) if key in bf16 and key in fp8 else None
            row.setdefault(prefix + "speedup", {})[recipe] = ratio
            row.setdefault(prefix + "fp8_wins", {})[recipe] = None if ratio is None else ratio > 1.0
    timed = {name: r["ms"] for name, r in results.items() if "ms" in r}
    row["best"] = min(timed, key=timed.get) if timed else None


def linear_8192(runs: int, size: int = 8192) -> dict:
    row = forward_backward(size, size, size, runs)
    row["targets"] = {}
    for recipe, need in TARGETS.items():
        got = row.get("speedup", {}).get(recipe)
        gpu = row.get("gpu_speedup", {}).get(recipe)
        row["targets"][recipe] = {"need": need, "speedup": got, "meets": None if got is None else got >= need,
                                  "gpu_speedup": gpu, "gpu_meets": None if gpu is None else gpu >= need}
    return row


def sweep_points(quick: bool) -> list[tuple[int, int, int]]:
    """Quick: a few points. Full: every (M, K, N) in SIZES^3, 125 points, smallest first (the per-point
    cost is dominated by the 16384-sized ones, about 2 s each on an H100)."""
    if quick:
        return list(QUICK_POINTS)
    return sorted(itertools.product(SIZES, SIZES, SIZES), key=lambda p: (p[0] * p[1] * p[2], p))


def add_auto_decision(row: dict, recipe: str = "tensorwise") -> None:
    """What ``optimize(fp8="auto")`` decides at this point for a compiled model (its own GPU-time measurement,
    kernel_pytorch.float8_conversion.measured_decision) and the speedup over bf16 that decision gets on this
    row's GPU times: never below 1 when right."""
    shape = (row["m"], row["k"], row["n"])
    try:
        use_fp8, _, base_ms, fp8_ms = float8_conversion.measured_decision(shape, DTYPE, recipe, True,
                                                                          torch.device("cuda"), compiled=True)
    except Exception as error:  # an OOM at the largest points: no decision recorded
        row["auto"] = {"error": _error(error)}
        return
    results = row["results"]
    chosen = results.get(f"fp8 {recipe}" if use_fp8 else BF16, {}).get("gpu_ms")
    bf16 = results.get(BF16, {}).get("gpu_ms")
    row["auto"] = {"recipe": recipe, "choice": "fp8" if use_fp8 else "bf16",
                   "measured_speedup": round(base_ms / fp8_ms, 3),
                   "speedup": round(bf16 / chosen, 3) if bf16 and chosen else None}


# ------------------------------------------------------------------------------------------ 5. model

def model_step(quick: bool, runs: int) -> dict:
    """A training step (forward, loss, backward, fused AdamW) of docs/design.md's Llama-style model at batch
    4 x 2048 (quick: 2 layers, batch 2 x 1024), through ``kernel_pytorch.optimize`` in bf16, with
    ``fp8=True`` and with ``fp8="auto"``. Issue target: fp8 >= 1.15x the bf16 step."""
    import kernel_pytorch
    import torch.nn.functional as F
    from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

    config = LlamaStyleConfig(n_layers=2 if quick else 12)
    batch, seq = (2, 1024) if quick else (4, 2048)
    out: dict = {"layers": config.n_layers, "batch": batch, "seq": seq, "results": {}}
    for name, options in (("bf16", {}), ("fp8 tensorwise", {"fp8": True}),
                          ("fp8 rowwise", {"fp8": {"mode": True, "recipe": "rowwise"}}), ("fp8 auto", {"fp8": "auto"})):
        result: dict = {}
        try:
            torch.manual_seed(0)
            model = LlamaStyleLM(config).to(device="cuda", dtype=DTYPE).train()
            tokens = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
            started = time.perf_counter()
            model = kernel_pytorch.optimize(model, example_inputs=(tokens,), **options)
            report = kernel_pytorch.report_of(model)
            result["optimize_s"] = round(time.perf_counter() - started, 1)
            result["optimize_phases_s"] = report.timings_s
            print("model", name, "optimized", result, flush=True)
            result["fp8_layers"] = sum(r.pass_name == "fp8" for r in report.rewrites)
            result["verified"] = report.verification.passed if report.verification else None
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def step():
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            timing = measure(step, warmup=3, runs=runs)
            result.update(ms=round(timing.median_ms, 2), peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        except Exception as error:  # one variant's failure must not end the run
            result["error"] = _error(error)
        out["results"][name] = result
        print("model", name, result, flush=True)
        model = optimizer = step = None
        _free()
        torch.cuda.reset_peak_memory_stats()
    bf16 = out["results"]["bf16"].get("ms")
    for result in out["results"].values():
        if bf16 and "ms" in result:
            result["speedup"] = round(bf16 / result["ms"], 3)
    return out


# ------------------------------------------------------------------------------------------ 6. producers

def _producer_step(case: str, m: int, k: int, n: int, fp8: str | None) -> Callable[[], object]:
    """Forward + backward of producer -> linear; ``fp8``: None (bf16 F.linear), "cast" (float8_linear reads
    x for its maximum) or "producer" (the producer's kernel computes it)."""
    if case == "gate/up -> swiglu":
        return _consumer_step(m, k, n, fp8)
    from kernel_pytorch.ops import gated_activation_packed, rms_norm
    from kernel_pytorch.ops.float8_linear import float8_linear

    source = _randn(m, 2 * k if case.startswith("swiglu") else k, grad=True)
    norm_weight = _randn(k, grad=True) if case.startswith("rms_norm") else None
    weight, dy = _randn(n, k, scale=k ** -0.5, grad=True), _randn(m, n)
    params = tuple(t for t in (source, norm_weight, weight) if t is not None)

    def step():
        fused = fp8 == "producer"
        if norm_weight is not None:
            out = rms_norm(source, norm_weight, 1e-6, fp8_amax=fused)
        else:
            out = gated_activation_packed(source, "silu", fp8_amax=fused)
        x, amax = out if fused else (out, None)
        y = torch.nn.functional.linear(x, weight) if fp8 is None else float8_linear(x, weight, x_amax=amax)
        return torch.autograd.grad(y, params, dy)

    return step


def _consumer_step(m: int, k: int, n: int, fp8: str | None) -> Callable[[], object]:
    """Forward + backward of the gate/up linear -> packed SwiGLU; ``fp8`` "producer": the SwiGLU backward
    computes the maximum of the linear's output gradient (``grad_amax_slot``)."""
    from kernel_pytorch.ops import gated_activation_packed
    from kernel_pytorch.ops.float8_linear import float8_linear

    x, weight, dy = _randn(m, k, grad=True), _randn(n, k, scale=k ** -0.5, grad=True), _randn(m, n // 2)

    def step():
        if fp8 is None:
            gate_up, slot = torch.nn.functional.linear(x, weight), None
        else:
            gate_up, slot = float8_linear(x, weight, grad_amax_slot=True) if fp8 == "producer" else (
                float8_linear(x, weight), None)
        return torch.autograd.grad(gated_activation_packed(gate_up, "silu", grad_amax_slot=slot), (x, weight), dy)

    return step


def producers(runs: int) -> dict:
    """GPU time of each producer -> linear pair, bf16 and FP8 without and with the fused maximum."""
    out: dict = {}
    for case, (m, k, n) in PRODUCER_SHAPES.items():
        row: dict = {"m": m, "k": k, "n": n, "gpu_ms": {}}
        for name, fp8 in (("bf16", None), ("fp8, amax by the cast", "cast"), ("fp8, amax from the producer", "producer")):
            try:
                ms, error = _gpu_time(_producer_step(case, m, k, n, fp8), 6 * m * k * n)
                row["gpu_ms"][name] = round(ms, 4) if ms is not None else error
            except Exception as error:  # one provider's failure must not end the run
                row["gpu_ms"][name] = _error(error)
            _free()
        times = row["gpu_ms"]
        if all(isinstance(t, float) for t in times.values()):
            row["fused_saves_ms"] = round(times["fp8, amax by the cast"] - times["fp8, amax from the producer"], 4)
            row["speedup_vs_bf16"] = {name: round(times["bf16"] / t, 3) for name, t in times.items() if name != "bf16"}
        out[case] = row
        print("producers", case, row, flush=True)
    return out


# ------------------------------------------------------------------------------------------ 4. numerics

def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """20 log10(||ref|| / ||ref - x||) in dB, in float64; inf when x equals ref."""
    ref, x = ref.double(), x.double()
    noise = torch.linalg.vector_norm(ref - x).item()
    signal = torch.linalg.vector_norm(ref).item()
    return round(20 * math.log10(signal / noise), 2) if noise > 0 else math.inf


def numerics(m: int, k: int, n: int) -> dict:
    linear = _layer(k, n)
    x, dy = _randn(m, k, grad=True), _randn(m, n)
    x64, w64, dy64 = x.detach().double(), linear.weight.detach().double(), dy.double()
    refs = {"output": x64 @ w64.t(), "grad_input": dy64 @ w64, "grad_weight": dy64.t() @ x64}
    out = {"m": m, "k": k, "n": n, "floors_db": SQNR_FLOORS, "results": {}}
    for name, make in _providers(linear).items():
        try:
            layer = make()
            y = layer(x)
            gx, gw = torch.autograd.grad(y, (x, layer.weight), dy)
            got = {"output": y.detach(), "grad_input": gx, "grad_weight": gw}
            result = {f"{key}_sqnr_db": sqnr(refs[key], got[key]) for key in refs}
            if name != BF16:
                result["meets"] = {key: result[f"{key}_sqnr_db"] >= floor for key, floor in SQNR_FLOORS.items()}
            out["results"][name] = result
        except Exception as error:  # one provider's failure must not end the run
            out["results"][name] = {"error": _error(error)}
        _free()
    del linear, x, dy, x64, w64, dy64, refs
    _free()
    return out


# ---------------------------------------------------------------------------------------------- plot

def plot(sweep: list[dict], path: Path, device: str, linear: dict | None = None) -> None:
    """Speedup over bf16 (forward + backward, per call) against M·K·N, one panel per recipe, one colour
    per M; hollow markers: the same on GPU time. The issue's target at 8192^3 as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted({r["m"] for r in sweep})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, len(RECIPES), figsize=(6.5 * len(RECIPES), 4.8), squeeze=False, sharey=True)
    for ax, recipe in zip(axes[0], RECIPES):
        for i, m in enumerate(ms):
            colour = colours[i % len(colours)]
            rows = sorted((r for r in sweep if r["m"] == m), key=lambda r: r["m"] * r["k"] * r["n"])
            for key, filled in (("speedup", True), ("gpu_speedup", False)):
                points = [(r["m"] * r["k"] * r["n"], r[key][recipe]) for r in rows
                          if r.get(key, {}).get(recipe) is not None]
                if points:
                    ax.scatter(*zip(*points), marker="o", s=22, label=f"M={m}" + ("" if filled else " (GPU time)"),
                               color=colour if filled else "none", edgecolors=colour)
        if linear is not None and linear.get("speedup", {}).get(recipe) is not None:
            ax.scatter([linear["m"] * linear["k"] * linear["n"]], [linear["speedup"][recipe]], marker="*", s=120,
                       color="black", label="8192^3 (linear table)", zorder=3)
        ax.axhline(1.0, color="grey", linewidth=1)
        ax.axhline(TARGETS[recipe], color="red", linestyle=":", linewidth=1,
                   label=f"target at 8192^3: {TARGETS[recipe]}x")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M·K·N")
        ax.set_ylabel("speedup over bf16 (fwd+bwd)")
        ax.set_title(f"Float8Linear {recipe}")
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"FP8 linear forward + backward vs bf16 nn.Linear, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few sweep points, fewer runs")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    return parser.parse_args(argv)


def fp8_unavailable() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if not torch.cuda.is_available():
        return "benchmarks/fp8.py needs a CUDA GPU with FP8 matmuls (compute capability >= 8.9); none found"
    if torch.version.hip is not None:
        return "benchmarks/fp8.py measures the OCP float8 formats on NVIDIA GPUs (compute capability >= 8.9)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return (f"benchmarks/fp8.py needs FP8 matmuls (compute capability >= 8.9: Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name()} is {major}.{minor}")
    return None


def _summary(row: dict) -> dict:
    return {"mkn": (row["m"], row["k"], row["n"]), "ms": {n: r.get("ms", r.get("error")) for n, r in
                                                          row["results"].items()},
            "speedup": row.get("speedup"), "gpu_speedup": row.get("gpu_speedup")}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    reason = fp8_unavailable()
    if reason:
        sys.exit(reason)
    started = time.perf_counter()
    runs = 5 if args.quick else 10
    name = "fp8" + ("_quick" if args.quick else "")
    payload: dict = earlier_parts(args.out / f"{name}.json", [p for p in PARTS if p not in args.parts])
    payload.update({"dtype": "bfloat16", "fp8_forward": "float8_e4m3fn", "fp8_backward": "float8_e5m2"})

    if "ceilings" in args.parts:
        payload["ceilings"] = ceilings(runs=runs)
        print("ceilings:", {n: r.get("tflops", r.get("error")) for n, r in payload["ceilings"]["results"].items()},
              flush=True)
        write_result(name, payload, args.out)  # kept up to date if cut off
    if "linear" in args.parts:
        payload["linear"] = linear_8192(runs=runs)
        print("linear 8192^3:", _summary(payload["linear"]), payload["linear"]["targets"], flush=True)
        write_result(name, payload, args.out)
    if "numerics" in args.parts:
        payload["numerics"] = numerics(*NUMERICS_SHAPE)
        print("numerics:", payload["numerics"]["results"], flush=True)
        write_result(name, payload, args.out)
    if "sweep" in args.parts:
        payload["sweep"] = []
        for m, k, n in sweep_points(args.quick):
            row = forward_backward(m, k, n, runs)
            add_auto_decision(row)
            payload["sweep"].append(row)
            print(_summary(row), row.get("auto"), flush=True)
            write_result(name, payload, args.out)
    if "model" in args.parts:
        payload["model"] = model_step(args.quick, runs)
        write_result(name, payload, args.out)
    if "producers" in args.parts:
        payload["producers"] = producers(runs)
        write_result(name, payload, args.out)
    payload["seconds"] = round(time.perf_counter() - started, 1)
    path = write_result(name, payload, args.out)
    if "sweep" in payload:
        try:
            plot(payload["sweep"], args.out / f"{name}.png", torch.cuda.get_device_name(), payload.get("linear"))
        except ImportError as error:  # matplotlib is a dev extra
            print(f"no plot: {error}")
    print(f"wrote {path} in {payload['seconds']} s")


if __name__ == "__main__":
    main()
