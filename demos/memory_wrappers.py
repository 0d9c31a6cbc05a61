"""Demo: the memory wrappers of ``kernel_pytorch.memory`` on a Llama-style LM in training.

* Activation checkpointing of the repeated blocks, ``policy="full"`` and ``"selective"``: the bytes autograd
  keeps for backward, measured with saved-tensor hooks, and gradients equal to the original model's; then
  ``optimize(model, checkpointing="full")``, where the fused kernels and checkpointing add up.
* On a CUDA GPU: activation offload (``optimize(..., offload_activations=True)``: saved activations go to
  pinned host memory) and the offloaded optimizer (``optimize(..., offload_optimizer=True)`` then
  ``make_optimizer``: AdamW states in pinned host memory), each against the same model without it: peak
  or resident GPU memory, and gradients or updated parameters equal. Without a GPU there is no device
  memory to free, and both are skipped with that reason.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from _common import DemoResult, default_device, demo_main, rel_err
from rich.console import Console
from rich.table import Table

from kernel_pytorch import optimize, report_of
from kernel_pytorch.memory import (
    OffloadedOptimizer,
    apply_checkpointing,
    make_optimizer,
    saved_activation_bytes,
)
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

_MIB = 1 << 20
OPTIMIZER_STEPS = 3


@dataclass(frozen=True)
class Setup:
    device: str
    dtype: torch.dtype
    config: LlamaStyleConfig
    batch: int
    seq: int
    # Relative errors allowed against the original: (wrappers alone, with optimize's fused kernels too).
    # The wrappers recompute or copy the same values: fp32 on a CPU measured 0 (bitwise equal); on a GPU
    # the embedding's backward sums with atomics, in any order. The fused kernels round differently:
    # docs/design.md's fp32 tolerances (1e-5 outputs, 1e-4 gradients), bf16's (2e-2 / 1e-1 in fused_kernels.py).
    tolerance: tuple[float, float]


def setup(device: str, quick: bool) -> Setup:
    if device == "cuda":
        config = LlamaStyleConfig(dim=1024, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=2816, max_seq_len=2048)
        return Setup("cuda", torch.bfloat16, config, 2 if quick else 4, 1024 if quick else 2048, (1e-2, 1e-1))
    config = LlamaStyleConfig(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352, max_seq_len=128)
    return Setup("cpu", torch.float32, config, 2, 128, (1e-6, 1e-4))


@dataclass
class Row:
    """One line of the summary: what was measured, and how far its gradients are from the original's."""

    name: str
    measure: str
    before: int
    after: int
    error: float | None = None
    notes: list[str] = field(default_factory=list)
    fused: bool = False  # optimize's fused kernels are in it too (their rounding, their memory)

    @property
    def saved_mib(self) -> float:
        return (self.before - self.after) / _MIB


def _model(s: Setup) -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaStyleLM(s.config).to(device=s.device, dtype=s.dtype).train()


def _tokens(s: Setup, count: int = 1) -> list[torch.Tensor]:
    return [torch.randint(0, s.config.vocab_size, (s.batch, s.seq + 1), device=s.device) for _ in range(count)]


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def _gradient_error(model: torch.nn.Module, reference: torch.nn.Module, batch: torch.Tensor) -> float:
    """The worst relative error of ``model``'s parameter gradients against ``reference``'s on one batch."""
    for net in (model, reference):
        net.zero_grad(set_to_none=True)
        _loss(net, batch).backward()
    return max(rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


# ----------------------------------------------------------------------------------------- checkpointing

def checkpointing_rows(s: Setup, reference: torch.nn.Module, batch: torch.Tensor) -> list[Row]:
    inputs = (batch[:, :-1],)
    rows = []
    for policy in ("full", "selective"):
        model = copy.deepcopy(reference)
        plan = apply_checkpointing(model, policy=policy, example_inputs=inputs)
        rows.append(Row(f"checkpointing {policy}", "saved for backward", plan.saved_bytes_before,
                        plan.saved_bytes_after, _gradient_error(model, reference, batch),
                        [f"apply_checkpointing(model, policy='{policy}'): {plan.describe()}"]))
    before = rows[0].before
    for policy in ("off", "full"):
        # Selective under optimize is left out: after the fusion passes its pointwise ops are gone (fused),
        # so it keeps about what the unwrapped optimized model keeps, and it compiles for seconds more.
        model = optimize(copy.deepcopy(reference), example_inputs=inputs, memory={"checkpointing": policy})
        problem = _rolled_back(model)
        name = "optimize" + (f" + checkpointing {policy}" if policy != "off" else "")
        rows.append(Row(name, "saved for backward", before, saved_activation_bytes(model, inputs),
                        _gradient_error(model, reference, batch),
                        [problem or f"optimize(model, checkpointing='{policy}'): fused kernels"
                         + (" and checkpointed blocks" if policy != "off" else " alone")], fused=True))
    return rows


def _rolled_back(model: torch.nn.Module) -> str | None:
    report = report_of(model)
    if report.rollbacks or not (report.verification and report.verification.passed):
        return f"optimize rolled back: {[r.reason for r in report.rollbacks]}"
    return None


# --------------------------------------------------------------------------------------- GPU: offloads

def _peak_step_bytes(model: torch.nn.Module, batch: torch.Tensor) -> int:
    """Peak GPU memory of one forward + backward above what was allocated before it."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _loss(model, batch).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def activation_offload_row(s: Setup, reference: torch.nn.Module, batch: torch.Tensor) -> Row:
    inputs = (batch[:, :-1],)
    # compile=False: the rewritten graphs run eagerly (fused kernels, no Inductor), minutes of compiling
    # saved; the offload hooks sit around the call either way.
    plain = optimize(copy.deepcopy(reference), example_inputs=inputs, compile=False)
    offloaded = optimize(copy.deepcopy(reference), example_inputs=inputs, compile=False,
                         memory={"offload_activations": True})
    error = _gradient_error(offloaded, plain, batch)
    peaks = [_peak_step_bytes(model, batch) for model in (plain, offloaded)]
    record = next(r for r in report_of(offloaded).memory if r.wrapper == "activation_offload")
    return Row("activation offload", "peak of fwd+bwd", *peaks, error,
               [f"optimize(model, offload_activations=True) against optimize(model): {record.description}"])


def offloaded_optimizer_row(s: Setup, reference: torch.nn.Module, batches: list[torch.Tensor]) -> Row:
    # fp32 parameters: OffloadedOptimizer updates fp32 masters, torch.optim.AdamW the parameters themselves;
    # in fp32 both are the same AdamW, so the parameters after a few steps must agree.
    fp32 = copy.deepcopy(reference).float()
    inputs = (batches[0][:, :-1],)
    models = {"adamw": optimize(copy.deepcopy(fp32), example_inputs=inputs, compile=False),
              "offloaded": optimize(copy.deepcopy(fp32), example_inputs=inputs, compile=False,
                                    memory={"offload_optimizer": True})}
    resident = {}
    for name, model in models.items():
        optimizer = make_optimizer(model, lr=1e-3)
        if (name == "offloaded") != isinstance(optimizer, OffloadedOptimizer):
            raise RuntimeError(f"make_optimizer gave {type(optimizer).__name__} for the {name} model")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for batch in batches:
            _loss(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        resident[name] = torch.cuda.memory_allocated() - before  # the states the optimizer keeps on the GPU
    error = max(rel_err(p, q) for p, q in zip(models["offloaded"].parameters(), models["adamw"].parameters()))
    record = next(r for r in report_of(models["offloaded"]).memory if r.wrapper == "optimizer_offload")
    return Row("optimizer offload", "AdamW state on GPU", resident["adamw"], resident["offloaded"], error,
               [(f"optimize(model, offload_optimizer=True) + make_optimizer(model) against torch.optim.AdamW, "
                 f"fp32 parameters compared after {len(batches)} steps: {record.description}")])


# ------------------------------------------------------------------------------------------------ report

def _table(s: Setup, rows: list[Row]) -> Table:
    c = s.config
    table = Table(title=f"Llama-style LM, {c.n_layers} layers, d {c.dim}, batch {s.batch} x {s.seq}, "
                        f"{str(s.dtype).removeprefix('torch.')} on {s.device}; error: worst relative error of the gradients "
                        "(of the parameters, for optimizer offload) against the model without the wrapper",
                  title_justify="left")
    for column in ("wrapper", "what (MiB)", "without", "with", "saved", "error"):
        table.add_column(column, justify="left" if column in ("wrapper", "what (MiB)") else "right", overflow="fold")
    for r in rows:
        error = "-" if r.error is None else f"{r.error:.1e}"
        table.add_row(r.name, r.measure, f"{r.before / _MIB:.2f}", f"{r.after / _MIB:.2f}", f"{r.saved_mib:.2f}", error)
    return table


def _failures(s: Setup, rows: list[Row]) -> list[str]:
    failures = []
    for r in rows:
        tolerance = s.tolerance[1] if r.fused else s.tolerance[0]
        if r.error is None or not r.error < tolerance:
            failures.append(f"{r.name}: gradient/parameter error {r.error} >= {tolerance:.0e}")
        if any(note.startswith("optimize rolled back") for note in r.notes):
            failures.append(f"{r.name}: {r.notes[0]}")
        if not r.after < r.before:  # every row, optimize alone too: fused attention keeps no L x L scores
            failures.append(f"{r.name}: saved nothing ({r.before} -> {r.after} bytes)")
    return failures


def run(args) -> DemoResult:
    device = default_device(args)
    s = setup(device, args.quick)
    reference = _model(s)
    batches = _tokens(s, OPTIMIZER_STEPS)
    rows = checkpointing_rows(s, reference, batches[0])
    skipped = []
    if device == "cuda":
        rows.append(activation_offload_row(s, reference, batches[0]))
        rows.append(offloaded_optimizer_row(s, reference, batches))
    else:
        skipped = [("activation offload: skipped: needs a CUDA GPU (on a CPU the saved activations already are in "
                    "host memory)"),
                   "optimizer offload: skipped: needs a CUDA GPU (its states move from GPU to pinned host memory)"]
    console = Console()
    console.print(_table(s, rows))
    for r in rows:
        for note in r.notes:
            console.print(f"  {note}")
    for line in skipped:
        console.print(f"[yellow]{line}[/yellow]")
    failures = _failures(s, rows)
    if failures:
        return DemoResult("failed", notes=failures)
    wrappers = [r for r in rows if not r.fused]
    best = max(wrappers, key=lambda r: r.before - r.after)  # the wrappers' own savings, the fused kernels' apart
    summary = [f"{r.name}: {r.measure} {r.before / _MIB:.1f} -> {r.after / _MIB:.1f} MiB" for r in rows]
    if skipped:
        summary.append("activation and optimizer offload: skipped: need a CUDA GPU")
    return DemoResult("ok", memory_saved_mb=round((best.before - best.after) / 1e6, 3), notes=summary)


if __name__ == "__main__":
    demo_main(__doc__, run)
