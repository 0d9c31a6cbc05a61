"""Where a ``Float8Linear`` forward + backward spends its GPU time: the torch profiler's kernel table for
one (M, K, N) per recipe, next to bf16 ``nn.Linear``. A diagnosis tool for benchmarks/fp8.py.

    python benchmarks/profile_float8_linear.py [--mkn 8192 8192 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kernel_pytorch.ops.float8_linear import Float8Linear  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mkn", type=int, nargs=3, default=(8192, 8192, 8192))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    m, k, n = args.mkn
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    tables = [f"== bf16 nn.Linear {m}x{k}x{n}\n{kernel_table(linear, x, dy)}"]
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
