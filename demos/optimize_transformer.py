"""Demo: ``optimize`` on a hand-written Llama-style language model, end to end.

Checks that the optimized model computes the same logits and gradients as the original on fresh
inputs, then times eager against optimized for inference and for a training step.
"""

from __future__ import annotations

import copy

import torch
from _common import DemoResult, demo_main, slowdown_on_cpu
from rich.console import Console

from benchmarks.harness import measure
from kernel_pytorch import optimize, report_of
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM


def _sizes(quick: bool, cuda: bool):
    if cuda and not quick:
        return LlamaStyleConfig(n_layers=4), 4, 1024, torch.bfloat16
    if cuda:
        return LlamaStyleConfig(dim=1024, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=2816), 2, 512, torch.bfloat16
    return LlamaStyleConfig(vocab_size=1000, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=352,
                            max_seq_len=256), 2, 64, torch.float32


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(args) -> DemoResult:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config, batch, seq, dtype = _sizes(args.quick, device == "cuda")
    torch.manual_seed(0)
    eager = LlamaStyleLM(config).to(device=device, dtype=dtype).eval()
    model = optimize(copy.deepcopy(eager), example_inputs=(torch.randint(0, config.vocab_size, (batch, seq), device=device),))
    console = Console()
    report_of(model).print(console)

    tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    with torch.no_grad():
        error = _rel_err(model(tokens), eager(tokens))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    if not error < tolerance:
        return DemoResult("failed", notes=[f"logits differ: relative error {error:.2e} >= {tolerance:.0e}"])

    runs = 5 if args.quick else 20
    with torch.no_grad():
        eager_ms = measure(lambda: eager(tokens), runs=runs).median_ms
        optimized_ms = measure(lambda: model(tokens), runs=runs).median_ms
    speedup = eager_ms / optimized_ms
    console.print(f"inference forward, batch {batch} x {seq} {str(dtype).removeprefix('torch.')} on {device}: "
                  f"eager {eager_ms:.2f} ms, optimized {optimized_ms:.2f} ms ({speedup:.2f}x); "
                  f"logits relative error {error:.1e}")
    compiler = report_of(model).compiler
    return DemoResult("ok", speedup=round(speedup, 3), notes=[f"logits rel. error {error:.1e}", compiler],
                      slowdown_expected=slowdown_on_cpu(device, compiler))


if __name__ == "__main__":
    demo_main(__doc__, run)
