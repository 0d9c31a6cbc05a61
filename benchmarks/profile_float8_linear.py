"""Where a ``Float8Linear`` forward + backward spends its time: the torch profiler's kernel table for one
(M, K, N) per recipe, next to bf16 ``nn.Linear``, and the host time per call. A diagnosis tool for
benchmarks/fp8.py, whose per-call figures include the host time the GPU waits for.

    python benchmarks/profile_float8_linear.py [--mkn 8192 8192 8192] [--host-size 256] [--out DIR]

Host time: microseconds per forward and per forward + backward at M = K = N = ``--host-size``, where the
kernels are shorter than their launches, so the wall time of many back-to-back calls is the host's. The
FP8 layer is timed as ``Float8Linear`` calls it eagerly (its body through an ``autograd.Function``) and
through its ``torch.library`` op (what torch.compile and dispatch modes see).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import host_us_per_call  # noqa: E402
from kernel_pytorch.ops.float8_linear import Float8Linear  # noqa: E402

F8 = importlib.import_module("kernel_pytorch.ops.float8_linear")


def kernel_table(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, steps: int = 5) -> str:
    params = (x, layer.weight)
    for _ in range(3):
        torch.autograd.grad(layer(x), params, dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            torch.autograd.grad(layer(x), params, dy)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70)


def host_table(size: int) -> str:
    linear = nn.Linear(size, size, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    layers = {"bf16 nn.Linear": linear}
    for recipe in ("tensorwise", "rowwise"):
        layers[f"Float8Linear {recipe} (autograd.Function)"] = Float8Linear.from_linear(linear, recipe=recipe)
        layers[f"Float8Linear {recipe} (torch.library op)"] = lambda t, recipe=recipe: F8._float8_linear_op(
            t, linear.weight, None, None, recipe, False, torch.float8_e4m3fn, torch.float8_e5m2, True, True, False)[0]
    lines = [f"== host time per call, M = K = N = {size} (us)", f"{'':<48}{'forward':>10}{'fwd + bwd':>12}"]
    for name, layer in layers.items():
        forward = host_us_per_call(lambda: layer(x))
        step = host_us_per_call(lambda: torch.autograd.grad(layer(x), (x, linear.weight), dy))
        lines.append(f"{name:<48}{forward:>10.1f}{step:>12.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mkn", type=int, nargs=3, default=(8192, 8192, 8192))
    parser.add_argument("--host-size", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    m, k, n = args.mkn
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    tables = [host_table(args.host_size), f"== bf16 nn.Linear {m}x{k}x{n}\n{kernel_table(linear, x, dy)}"]
    for recipe in ("tensorwise", "rowwise"):
        fp8 = Float8Linear.from_linear(linear, recipe=recipe)
        tables.append(f"== Float8Linear {recipe} {m}x{k}x{n}\n{kernel_table(fp8, x, dy)}")
    text = "\n".join(tables)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"profile_float8_linear_{m}_{k}_{n}.txt").write_text(text)


if __name__ == "__main__":
    main()
