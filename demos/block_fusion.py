"""Demo: block fusion on a Llama-style decoder block, trained. The horizontal GEMM pass turns the q/k/v
projections into one linear and gate/up into another (the other passes then fuse RMSNorm, RoPE, the
SwiGLU activation and attention); output and gradients match the original block, and the GEMM calls and
ops per block forward + backward (torch.profiler), and the step time, are compared with eager and with
``optimize`` without the horizontal GEMM pass.
"""

from __future__ import annotations

import copy

import torch
from _common import DemoResult, default_device, demo_main, rel_err, speedup_note
from rich.console import Console
from rich.table import Table

from benchmarks.block_fusion import BlockStack, count_kernels, setup
from benchmarks.harness import measure
from kernel_pytorch import optimize, report_of

EAGER, UNFUSED, FUSED = "eager", "optimize, no horizontal_gemm", "optimize"
# GEMM calls as the dispatcher sees them: Inductor calls these too (extern kernels), so the count means the
# same eager or compiled, on CPU or GPU. Fused attention kernels are not among them.
_GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"})
# Which linears the pass must fuse in a Llama block: (module path, the replacement's first words).
EXPECTED_FUSIONS = {("layers.0.attn", "q_proj + k_proj + v_proj -> one linear"),
                    ("layers.0.mlp", "gate_proj + up_proj -> one linear")}


def _gemm_calls(fn, device: str) -> int:
    """GEMM ops dispatched by one ``fn()``, after two warm-up calls (compilation, autotuning)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    return sum(event.name in _GEMM_OPS for event in prof.events())


def _step(model: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def step():
        for p in model.parameters():
            p.grad = None
        model(x).backward(grad)
    return step


def _same_values_and_gradients(model, reference, x: torch.Tensor, tolerance: tuple[float, float]) -> str | None:
    """Output and input/parameter gradients of ``model`` against ``reference`` on ``x``; what differs, or None."""
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    x1, x2 = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    out, expected = model(x1), reference(x2)
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    errors = {"output": rel_err(out, expected), "input gradient": rel_err(x1.grad, x2.grad)}
    errors.update({name: rel_err(p.grad, q.grad) for (name, p), q in zip(model.named_parameters(), reference.parameters())})
    worst = max((e for name, e in errors.items() if name != "output"))
    if not (errors["output"] < tolerance[0] and worst < tolerance[1]):
        bad = max(errors, key=errors.get)
        return f"{bad} differs: relative error {errors[bad]:.1e} (output {errors['output']:.1e})"
    return None


def run(args) -> DemoResult:
    device = default_device(args)
    s = setup(args.quick, device)  # benchmarks/block_fusion.py's sizes: above the pass's token threshold
    torch.manual_seed(0)
    base = BlockStack(s.config, 1).to(device=device, dtype=s.dtype).train()
    x = torch.randn(*s.train_shape, s.config.dim, device=device, dtype=s.dtype, requires_grad=True)
    models = {EAGER: base,
              UNFUSED: optimize(copy.deepcopy(base), example_inputs=(x,), disable_passes=("horizontal_gemm",)),
              FUSED: optimize(copy.deepcopy(base), example_inputs=(x,))}
    console = Console()
    report = report_of(models[FUSED])
    fusions = [r for r in report.rewrites if r.pass_name == "horizontal_gemm"]
    for r in fusions[:len(EXPECTED_FUSIONS)]:  # each capture of the block has the same two lines
        console.print(f"horizontal_gemm at {r.location}: {r.replacement}")
    found = {(r.location, r.replacement.split(",")[0]) for r in fusions}
    if found != EXPECTED_FUSIONS or report.rollbacks:
        skipped = [f"{r.location}: {r.reason}" for r in report.skipped if r.pass_name == "horizontal_gemm"]
        return DemoResult("failed", notes=[f"fusions {sorted(found)}", *skipped, *[r.reason for r in report.rollbacks]])

    tolerance = (1e-5, 1e-4) if s.dtype == torch.float32 else (2e-2, 1e-1)
    for name in (UNFUSED, FUSED):
        problem = _same_values_and_gradients(models[name], base, torch.randn_like(x), tolerance)
        if problem is not None:
            return DemoResult("failed", notes=[f"{name}: {problem}"])

    grad = torch.randn_like(x)
    steps = {name: _step(model, x, grad) for name, model in models.items()}
    counts = {name: (_gemm_calls(step, device), count_kernels(step, device)["kernels"]) for name, step in steps.items()}
    runs = 20 if device == "cpu" else s.runs  # a CPU step takes milliseconds: more runs, a steadier median
    ms = {name: measure(step, runs=runs, device=device).median_ms for name, step in steps.items()}
    console.print(_table(counts, ms, s, device))
    if not counts[FUSED][0] < counts[UNFUSED][0]:
        return DemoResult("failed", notes=[f"GEMM calls not reduced: {counts[UNFUSED][0]} -> {counts[FUSED][0]}"])
    speedup, own = ms[EAGER] / ms[FUSED], ms[UNFUSED] / ms[FUSED]
    own_slower = speedup_note(own, None)  # fewer GEMM calls doing the same FLOPs: slower is not expected
    return DemoResult("ok", speedup=round(speedup, 3), notes=[
        f"GEMMs per block step {counts[EAGER][0]} eager, {counts[UNFUSED][0]} -> {counts[FUSED][0]} by the pass",
        f"ops {counts[EAGER][1]} -> {counts[FUSED][1]}",
        f"horizontal_gemm alone {own_slower or f'{own:.2f}x'}"])


def _table(counts: dict, ms: dict, s, device: str) -> Table:
    batch, seq = s.train_shape
    unit = "CUDA kernels" if device == "cuda" else "leaf aten ops"
    table = Table(title=f"one Llama-style block, forward + backward, batch {batch} x {seq}, d {s.config.dim}, "
                        f"{str(s.dtype).removeprefix('torch.')} on {device}", title_justify="left")
    for column in ("", "GEMM calls", unit, "ms", "vs eager"):
        table.add_column(column, justify="right" if column else "left")
    for name in counts:
        table.add_row(name, str(counts[name][0]), str(counts[name][1]), f"{ms[name]:.2f}", f"{ms[EAGER] / ms[name]:.2f}x")
    return table


if __name__ == "__main__":
    demo_main(__doc__, run)
