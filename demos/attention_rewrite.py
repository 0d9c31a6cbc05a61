"""Demo: hand-written attention (GQA, causal mask built in the graph, fp32 softmax) becomes one fused
attention call; the same numbers, measured faster."""

from __future__ import annotations

import copy

import torch
from _common import DemoResult, demo_main
from rich.console import Console

from benchmarks.harness import measure
from kernel_pytorch import optimize, report_of
from kernel_pytorch.testing import LlamaStyleAttention, LlamaStyleConfig, rotary_tables


class CausalSelfAttention(torch.nn.Module):
    """A Llama attention layer as the decoder calls it: rotary tables sliced and the causal mask built
    in forward, so the pass can prove the mask causal."""

    def __init__(self, config: LlamaStyleConfig, max_seq: int):
        super().__init__()
        self.attn = LlamaStyleAttention(config)
        cos, sin = rotary_tables(config.head_dim, max_seq, config.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):
        seq = x.shape[1]
        mask = torch.full((seq, seq), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        return self.attn(x, self.cos[:seq].to(x.dtype), self.sin[:seq].to(x.dtype), mask)


def run(args) -> DemoResult:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    config = LlamaStyleConfig() if cuda else LlamaStyleConfig(dim=256, n_heads=8, n_kv_heads=2)
    seq = (1024 if args.quick else 4096) if cuda else 256
    batch = 2 if cuda else 1
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    eager = CausalSelfAttention(config, seq).to(device=device, dtype=dtype).eval()
    x = torch.randn(batch, seq, config.dim, device=device, dtype=dtype)
    model = optimize(copy.deepcopy(eager), example_inputs=(x,))
    console = Console()
    report = report_of(model)
    report.print(console)
    rewrites = [r for r in report.rewrites if r.pass_name == "attention"]
    if len(rewrites) != 1:
        return DemoResult("failed", notes=[f"expected 1 attention rewrite, got {len(rewrites)}"])
    x = torch.randn_like(x)
    with torch.no_grad():
        out, expected = model(x), eager(x)
    error = float((out.double() - expected.double()).norm() / expected.double().norm())
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    if not error < tolerance:
        return DemoResult("failed", notes=[f"outputs differ: relative error {error:.1e}"])
    with torch.no_grad():
        eager_ms = measure(lambda: eager(x), runs=5 if args.quick else 20).median_ms
        fused_ms = measure(lambda: model(x), runs=5 if args.quick else 20).median_ms
    console.print(f"attention layer, batch {batch} x {seq}, {str(dtype)[6:]} on {device}: eager {eager_ms:.2f} ms, "
                  f"optimized {fused_ms:.2f} ms ({eager_ms / fused_ms:.2f}x); relative error {error:.1e}")
    return DemoResult("ok", speedup=round(eager_ms / fused_ms, 3), notes=[rewrites[0].replacement])


if __name__ == "__main__":
    demo_main(__doc__, run)
