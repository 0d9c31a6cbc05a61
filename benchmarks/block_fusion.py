"""Block-fusion benchmark: the Llama-style block of docs/design.md (d 2048, 16 heads / 4 kv, ffn 5632), bf16.

    python benchmarks/block_fusion.py [--quick] [--out DIR] [--parts launches train latency epilogue] [--device cpu]

Parts (issue 6 targets in brackets):

- ``launches``: kernels per block forward (inference), counted with torch.profiler at batch 1 x 128 and
  4 x 2048, for eager, torch.compile, ``optimize``, ``optimize`` without the horizontal GEMM pass and
  ``optimize(compile="reduce-overhead")``: GPU kernels (memcpy/memset apart) and launch API calls (a
  CUDA graph replay is one call).
  [optimize >= 40% fewer kernels than eager]
- ``train``: block forward+backward at batch 4 x 2048: eager, torch.compile, ``optimize``, ``optimize``
  without ``horizontal_gemm`` (the pair isolates the in-graph weight concatenation; it is what
  ``passes/horizontal_gemm.py``'s ``MAX_COPY_SHARE`` is to be tuned with). ms and TFLOP/s.
  [optimize faster than torch.compile]
- ``latency``: a 12-layer block stack, batch 1 x 128, inference: eager, torch.compile (default and
  ``reduce-overhead``), ``optimize`` (default compile and ``compile="reduce-overhead"``: CUDA graphs).
  [optimize >= 3x faster than eager]
- ``epilogue``: the output projection followed by the fused residual add + RMSNorm kernel, against the
  residual added in the GEMM's epilogue (``addmm``) followed by RMSNorm, compiled, at the latency and
  train shapes, forward and forward+backward. [the epilogue form is used where it measures faster]

Every row records what the passes did (``horizontal_gemm`` fusions and skips with their reasons, rewrite
counts per pass, verification). Times: harness.measure (CUDA events, L2 flushed before each call, median).
``--device cpu`` is a smoke run (tiny fp32 model, no CUDA graphs) to check the script, not a measurement.
Writes block_fusion.json and block_fusion.png (``_quick`` / ``_cpu`` suffixed for those runs).
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import RESULTS_DIR, measure, synchronize, write_result
from kernel_pytorch import optimize, report_of
from kernel_pytorch.ops.rms_norm import rms_norm
from kernel_pytorch.passes.horizontal_gemm import MACHINE_BALANCE, weight_copy_share
from kernel_pytorch.testing import LlamaStyleBlock, LlamaStyleConfig, rotary_tables

EAGER, COMPILE, COMPILE_RO = "eager", "torch.compile", "torch.compile (reduce-overhead)"
OURS, OURS_NO_HGEMM, OURS_RO = "optimize", "optimize (no horizontal_gemm)", "optimize (compile='reduce-overhead')"
# The runtime calls that start work on the GPU: one per kernel, memcpy or memset, one per graph replay.
_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync", "hipLaunchKernel", "hipGraphLaunch")

# Leaf ATen ops that launch nothing on the CPU (views, allocations, no-op casts): left out of smoke counts.
_METADATA_OPS = frozenset(f"aten::{name}" for name in (
    "as_strided", "view", "_unsafe_view", "_reshape_alias", "reshape", "resolve_conj", "resolve_neg", "empty",
    "empty_strided", "empty_like", "detach", "alias", "t", "transpose", "expand", "slice", "select", "unsqueeze",
    "squeeze", "permute", "split", "split_with_sizes", "chunk", "unbind", "lift_fresh", "to"))


@dataclass(frozen=True)
class Setup:
    """Sizes and dtype of one run: the H100 figures, or ``--quick`` / ``--device cpu`` reductions."""

    device: str
    dtype: torch.dtype
    config: LlamaStyleConfig
    train_shape: tuple[int, int]  # (batch, seq) of the forward+backward
    launch_shapes: tuple[tuple[int, int], ...]
    latency_shape: tuple[int, int]
    latency_layers: int
    runs: int


def setup(quick: bool, device: str) -> Setup:
    if device == "cpu":  # above the CPU fusion threshold in training (267 fp32 tokens), seconds per part
        config = LlamaStyleConfig(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=352, max_seq_len=512)
        return Setup("cpu", torch.float32, config, (2, 160), ((1, 16), (2, 160)), (1, 16), 2, 3)
    config = LlamaStyleConfig(max_seq_len=4096)
    if quick:  # 2048 tokens still clear the bf16 training threshold (1727), so the pass still fuses
        return Setup("cuda", torch.bfloat16, config, (1, 2048), ((1, 128),), (1, 128), 4, 5)
    return Setup("cuda", torch.bfloat16, config, (4, 2048), ((1, 128), (4, 2048)), (1, 128), 12, 20)


class BlockStack(nn.Module):
    """Llama-style blocks on hidden states, with RoPE tables as non-persistent buffers and the causal
    mask built from sizes in forward, as ``LlamaStyleLM`` does (so the attention pass proves it causal)."""

    def __init__(self, config: LlamaStyleConfig, n_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(LlamaStyleBlock(config) for _ in range(n_layers))
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        cos, sin = self.rope_cos[:seq].to(x.dtype), self.rope_sin[:seq].to(x.dtype)
        mask = torch.full((seq, seq), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return x


def build(s: Setup, n_layers: int, training: bool) -> nn.Module:
    torch.manual_seed(0)
    return BlockStack(s.config, n_layers).to(device=s.device, dtype=s.dtype).train(training)


def hidden(s: Setup, shape: tuple[int, int], grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, s.config.dim, device=s.device, dtype=s.dtype, requires_grad=grad)


# ------------------------------------------------------------------------------------------ providers

def providers(s: Setup, base: nn.Module, x: torch.Tensor, training: bool, names: tuple[str, ...]):
    """Each named variant of ``base`` (a copy each: optimize rewrites in place), with the optimize reports."""
    made: dict[str, Callable[[torch.Tensor], Any]] = {}
    reports: dict[str, dict] = {}
    for name in names:
        if s.device == "cpu" and name in (COMPILE_RO, OURS_RO):
            continue  # CUDA graphs need CUDA
        model = copy.deepcopy(base)
        if name == EAGER:
            made[name] = model
        elif name in (COMPILE, COMPILE_RO):
            made[name] = torch.compile(model, mode="reduce-overhead" if name == COMPILE_RO else None)
        else:
            made[name], reports[name] = _optimized(model, x, training, name)
    return made, reports


def _optimized(model: nn.Module, x: torch.Tensor, training: bool, name: str):
    options: dict[str, Any] = {"mode": "training" if training else "inference"}
    if name == OURS_NO_HGEMM:
        options["disable_passes"] = ("horizontal_gemm",)
    if name == OURS_RO:
        options["compile"] = "reduce-overhead"
    with torch.set_grad_enabled(training):
        optimize(model, example_inputs=(x,), **options)
    return model, summarize(report_of(model))


def summarize(report) -> dict:
    """What the passes did: rewrites per pass, the horizontal GEMM lines, verification, compiler."""
    per_pass = collections.Counter(r.pass_name for r in report.rewrites)
    fused = sorted({f"{r.location}: {r.replacement}" for r in report.rewrites if r.pass_name == "horizontal_gemm"})
    skipped = sorted({f"{r.location}: {r.reason}" for r in report.skipped if r.pass_name == "horizontal_gemm"})
    verification = report.verification
    return {"rewrites_per_pass": dict(per_pass), "horizontal_gemm_fused": fused, "horizontal_gemm_skipped": skipped,
            "graphs": report.graphs, "compiler": report.compiler,
            "verified": None if verification is None else verification.passed,
            "rollbacks": [f"{r.pass_name}: {r.reason}" for r in report.rollbacks]}


# ------------------------------------------------------------------------------------------- counting

def count_kernels(fn: Callable[[], Any], device: str) -> dict:
    """Kernels one ``fn()`` runs, from torch.profiler, after two warm-up calls (compile, autotune, graph
    capture). On the CPU (smoke runs): leaf ``aten::`` ops, the closest thing to a kernel there."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = list(prof.events())
    if device != "cuda":
        leaves = [e.name for e in events if e.name.startswith("aten::") and not e.cpu_children and
                  e.name not in _METADATA_OPS]
        return {"kernels": len(leaves), "top": collections.Counter(leaves).most_common(8)}
    on_gpu = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [n for n in on_gpu if not n.startswith(("Memcpy", "Memset"))]
    return {"kernels": len(kernels), "memcpy_memset": len(on_gpu) - len(kernels),
            "launch_calls": sum(e.name in _LAUNCH_CALLS for e in events),
            "top": collections.Counter(kernels).most_common(8)}


def _time(fn: Callable[[], Any], s: Setup) -> float:
    return round(measure(fn, warmup=3, runs=s.runs, device=s.device).median_ms, 4)


# ------------------------------------------------------------------------------------------------ parts

def launches_part(s: Setup) -> list[dict]:
    rows = []
    for shape in s.launch_shapes:
        base = build(s, 1, training=False)
        x = hidden(s, shape)
        made, reports = providers(s, base, x, False, (EAGER, COMPILE, OURS, OURS_NO_HGEMM, OURS_RO))
        row = {"batch": shape[0], "seq": shape[1], "counts": {}, "passes": reports}
        with torch.no_grad():
            for name, model in made.items():
                row["counts"][name] = _guarded(lambda model=model, x=x: count_kernels(lambda: model(x), s.device))
        eager, ours = (row["counts"].get(n, {}).get("kernels") for n in (EAGER, OURS))
        if eager and ours is not None:
            row["kernel_reduction_vs_eager"] = round(1 - ours / eager, 3)
            row["meets_40_percent"] = row["kernel_reduction_vs_eager"] >= 0.40
        rows.append(row)
    return rows


def block_flops(config: LlamaStyleConfig, batch: int, seq: int, backward: bool) -> float:
    """Matmul FLOPs of one block: the seven projections (x3 with the backward) and causal attention
    (x3.5 with the backward, as benchmarks/attention.py counts it)."""
    d, kv = config.dim, config.n_kv_heads * config.head_dim
    tokens = batch * seq
    linear = 2 * tokens * (d * (d + 2 * kv) + d * d + 3 * d * config.ffn_dim)
    attention = 4 * batch * config.n_heads * seq * seq * config.head_dim / 2
    return linear * (3 if backward else 1) + attention * (3.5 if backward else 1)


def train_part(s: Setup) -> list[dict]:
    batch, seq = s.train_shape
    base = build(s, 1, training=True)
    x = hidden(s, s.train_shape, grad=True)
    grad = torch.randn_like(x)
    made, reports = providers(s, base, x, True, (EAGER, COMPILE, OURS, OURS_NO_HGEMM))
    flops = block_flops(s.config, batch, seq, backward=True)
    row = {"batch": batch, "seq": seq, "ms": {}, "tflops": {}, "passes": reports,
           "predicted_copy_share": _predicted_share(s, batch * seq, training=True)}
    for name, model in made.items():
        def step(model=model):
            for p in model.parameters():
                p.grad = None
            model(x).backward(grad)
        ms = _guarded(lambda step=step: _time(step, s))
        row["ms"][name] = ms
        if isinstance(ms, float):
            row["tflops"][name] = round(flops / ms / 1e9, 1)
    ours, compiled = row["ms"].get(OURS), row["ms"].get(COMPILE)
    if isinstance(ours, float) and isinstance(compiled, float):
        row["speedup_vs_compile"] = round(compiled / ours, 3)
        row["faster_than_compile"] = ours < compiled
    no_hgemm = row["ms"].get(OURS_NO_HGEMM)
    if isinstance(ours, float) and isinstance(no_hgemm, float):
        row["horizontal_gemm_speedup"] = round(no_hgemm / ours, 3)  # > 1: the fusion pays at this shape
    return [row]


def latency_part(s: Setup) -> list[dict]:
    base = build(s, s.latency_layers, training=False)
    x = hidden(s, s.latency_shape)
    names = (EAGER, COMPILE, COMPILE_RO, OURS, OURS_RO)
    made, reports = providers(s, base, x, False, names)
    row = {"layers": s.latency_layers, "batch": s.latency_shape[0], "seq": s.latency_shape[1], "ms": {},
           "passes": reports,
           "predicted_copy_share": _predicted_share(s, s.latency_shape[0] * s.latency_shape[1], training=False)}
    with torch.no_grad():
        for name, model in made.items():
            row["ms"][name] = _guarded(lambda model=model: _time(lambda: model(x), s))
    eager = row["ms"].get(EAGER)
    for name in (OURS, OURS_RO):
        ms = row["ms"].get(name)
        if isinstance(eager, float) and isinstance(ms, float):
            row[f"speedup_vs_eager[{name}]"] = round(eager / ms, 2)
    best = max((v for k, v in row.items() if k.startswith("speedup_vs_eager")), default=None)
    row["meets_3x"] = None if best is None else best >= 3
    return [row]


def _residual_forms(o_proj: torch.Tensor, norm_weight: torch.Tensor) -> dict[str, Callable]:
    """The block boundary after the attention output projection, two ways: the projection, then the
    fused residual add + RMSNorm (what the passes build); or the residual added in the GEMM's epilogue
    (``addmm``, beta 1), then RMSNorm alone. Each returns (normed, h = residual + projection)."""
    def fused_norm(x, residual):
        return rms_norm(x @ o_proj.t(), norm_weight, 1e-6, residual=residual)

    def gemm_epilogue(x, residual):
        h = torch.addmm(residual.flatten(0, 1), x.flatten(0, 1), o_proj.t()).view_as(residual)
        return rms_norm(h, norm_weight, 1e-6), h
    return {"projection, then residual + RMSNorm kernel": fused_norm,
            "addmm residual epilogue, then RMSNorm": gemm_epilogue}


def epilogue_part(s: Setup) -> list[dict]:
    """Issue 6's "output projection with the residual add as its epilogue where measured faster": both
    forms compiled (static shapes, as optimize compiles), forward and forward+backward."""
    d, rows = s.config.dim, []
    weights = [(torch.randn(d, d, device=s.device, dtype=s.dtype) / d ** 0.5).requires_grad_(),
               torch.ones(d, device=s.device, dtype=s.dtype, requires_grad=True)]
    for (batch, seq), backward in ((s.latency_shape, False), (s.train_shape, False), (s.train_shape, True)):
        x, residual = (torch.randn(batch, seq, d, device=s.device, dtype=s.dtype, requires_grad=backward)
                       for _ in range(2))
        row = {"batch": batch, "seq": seq, "backward": backward, "ms": {}}
        for name, form in _residual_forms(*weights).items():
            compiled = torch.compile(form, dynamic=False)

            def step(compiled=compiled):
                y, h = compiled(x, residual)
                if backward:
                    torch.autograd.backward((y, h), (torch.ones_like(y), torch.ones_like(h)))
            row["ms"][name] = _guarded(lambda step=step: _time(step, s))
        times = [v for v in row["ms"].values() if isinstance(v, float)]
        if len(times) == 2:
            row["epilogue_speedup"] = round(times[0] / times[1], 3)  # > 1: the epilogue form is faster
        rows.append(row)
    return rows


def _predicted_share(s: Setup, tokens: int, training: bool) -> float:
    """The pass's own estimate of the weight copy's share of the fused GEMM time at this shape."""
    vendor = "nvidia" if s.device == "cuda" else "cpu"
    size = torch.finfo(s.dtype).bits // 8
    return round(weight_copy_share(tokens, size, MACHINE_BALANCE[vendor][size > 2], training), 4)


def _guarded(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the error's first line: one failing variant must not lose the others' numbers."""
    try:
        return fn()
    except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
        return f"error: {type(error).__name__}: {str(error).splitlines()[0][:160]}"


PARTS = {"launches": launches_part, "train": train_part, "latency": latency_part, "epilogue": epilogue_part}


# ------------------------------------------------------------------------------------------------- plot

def plot(payload: dict, path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(payload)
    rows = max(1, (len(panels) + 1) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, ylabel, values) in zip(axes.flat, panels):
        names = list(values)
        ax.bar(range(len(names)), [values[n] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
    fig.suptitle(f"Llama-style block fusion, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _panels(payload: dict) -> list[tuple[str, str, dict]]:
    panels = []
    for row in payload.get("launches", []):
        counts = {k: v["kernels"] for k, v in row["counts"].items() if isinstance(v, dict)}
        panels.append((f"kernels per block forward, {row['batch']}x{row['seq']}", "kernels", counts))
    for row in payload.get("train", []):
        ms = {k: v for k, v in row["ms"].items() if isinstance(v, float)}
        panels.append((f"block fwd+bwd, {row['batch']}x{row['seq']}", "ms", ms))
    for row in payload.get("latency", []):
        ms = {k: v for k, v in row["ms"].items() if isinstance(v, float)}
        panels.append((f"{row['layers']}-layer stack inference, {row['batch']}x{row['seq']}", "ms", ms))
    return panels


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller shapes and stack, fewer runs")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of the script on a tiny fp32 model (no measurement)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/block_fusion.py needs a CUDA GPU (or --device cpu for a smoke run)")
    for limit in ("recompile_limit", "cache_size_limit"):  # many compiled variants of one block class
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    s = setup(args.quick, args.device)
    name = "block_fusion" + ("_cpu" if args.device == "cpu" else "_quick" if args.quick else "")
    payload: dict[str, Any] = {"config": {**asdict(s.config), "dtype": str(s.dtype)}}
    for part in args.parts:
        payload[part] = PARTS[part](s)
        for row in payload[part]:
            print(part, {k: v for k, v in row.items() if k != "passes"}, flush=True)
        path = write_result(name, payload, args.out)  # kept up to date if cut off
        torch._dynamo.reset()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke run)"
    try:
        plot(payload, args.out / f"{name}.png", device)
    except ImportError as error:  # matplotlib is a dev extra
        print(f"no plot: {error}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
