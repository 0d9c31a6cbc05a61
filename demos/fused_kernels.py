"""Demo: the fused-kernel passes on a hand-written Llama-style LM, trained: RMSNorm (with the residual
add), the SwiGLU MLP, RoPE on q and k, and attention each become one fused op; loss and gradients
match the original, and a training step is timed against eager.
"""

from __future__ import annotations

import collections
import copy

import torch
from _common import DemoResult, demo_main, slowdown_on_cpu
from rich.console import Console

from benchmarks.harness import measure
from kernel_pytorch import optimize, report_of
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

EXPECTED_PASSES = ("norms", "activations", "rope", "attention")


def _sizes(quick: bool, cuda: bool):
    if cuda:
        config = LlamaStyleConfig(dim=1024, n_layers=2 if quick else 4, n_heads=8, n_kv_heads=2, ffn_dim=2816)
        return config, 2, 512 if quick else 1024, torch.bfloat16
    return LlamaStyleConfig(vocab_size=500, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=352,
                            max_seq_len=128), 2, 32, torch.float32


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _step(model, tokens, targets):
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    return loss


def run(args) -> DemoResult:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config, batch, seq, dtype = _sizes(args.quick, device == "cuda")
    torch.manual_seed(0)
    eager = LlamaStyleLM(config).to(device=device, dtype=dtype).train()
    tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    model = optimize(copy.deepcopy(eager), example_inputs=(tokens,))
    console = Console()
    report = report_of(model)
    report.print(console)
    counts = collections.Counter(r.pass_name for r in report.rewrites)
    missing = [name for name in EXPECTED_PASSES if not counts[name]]
    if missing or report.rollbacks:
        return DemoResult("failed", notes=[f"no rewrites from {missing}" if missing else "",
                                           *[r.reason for r in report.rollbacks]])

    tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    targets = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    loss, expected = _step(model, tokens, targets), _step(eager, tokens, targets)
    grad_error = max(_rel_err(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters()))
    loss_error = abs(loss.item() - expected.item()) / abs(expected.item())
    tolerance = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 1e-1)
    if not (loss_error < tolerance[0] and grad_error < tolerance[1]):
        return DemoResult("failed", notes=[f"loss error {loss_error:.1e}, worst gradient error {grad_error:.1e}"])

    runs = 3 if args.quick else 10
    eager_ms = measure(lambda: _step(eager, tokens, targets), runs=runs).median_ms
    fused_ms = measure(lambda: _step(model, tokens, targets), runs=runs).median_ms
    speedup = eager_ms / fused_ms
    rewrites = ", ".join(f"{name} x{counts[name]}" for name in EXPECTED_PASSES)
    console.print(f"training step, batch {batch} x {seq} {str(dtype).removeprefix('torch.')} on {device}: eager "
                  f"{eager_ms:.2f} ms, optimized {fused_ms:.2f} ms ({speedup:.2f}x); rewrites: {rewrites}; loss "
                  f"error {loss_error:.1e}, worst gradient error {grad_error:.1e}")
    return DemoResult("ok", speedup=round(speedup, 3), notes=[rewrites, f"worst gradient error {grad_error:.1e}"],
                      slowdown_expected=slowdown_on_cpu(device, report.compiler))


if __name__ == "__main__":
    demo_main(__doc__, run)
