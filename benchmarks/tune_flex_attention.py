"""Sweep FlexAttention's kernel options for the sparse patterns this library routes to it, on the GPU.

    python benchmarks/tune_flex_attention.py [--lengths 2048 16384] [--out DIR]

Inductor's FlexAttention template takes ``kernel_options`` (tile sizes, stages, warps, TMA loads, and
hints such as ``ROWS_GUARANTEED_SAFE``); its H100 default for bf16, head dim 128, is a (128, 64) forward
tile with 3 stages and 8 warps, and a (64, 128, 128, 64) backward with 3 stages and 8 warps. This times
each candidate on the causal sliding window of ``benchmarks/sparse_attention.py`` (window 1024, 16
heads, head dim 128, batch x L = 16384 tokens), forward and forward+backward, as GPU time (CUDA-graph
replays), next to cuDNN's dense causal attention, and checks each candidate's output against the default
one (a candidate that differs, or gives NaN, is never the best). Writes tune_flex_attention.json: TFLOP/s on
the attended positions per candidate, and the best.

H100 (2026-11-25, L=16384): the defaults are the best correct candidates, forward 0.431 ms (309 TFLOP/s on
the attended positions) and forward+backward 1.555 ms (300), 4.5x cuDNN's dense causal attention on GPU
time; ``ROWS_GUARANTEED_SAFE`` gave NaN, TMA and other tiles were slower. So ``attention/flex.py`` passes no
kernel options.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import RESULTS_DIR, measure_gpu_time, write_result  # noqa: E402
from benchmarks.sparse_attention import HEAD_DIM, HEADS, TOKENS, WINDOW, _dense, window_mask_mod  # noqa: E402

__all__ = ["FORWARD_OPTIONS", "BACKWARD_OPTIONS", "sweep", "main"]

DTYPE = torch.bfloat16
MATCH_TOLERANCE = 1e-2  # largest |candidate - default| accepted, bf16 outputs of unit-variance inputs

# Forward candidates around the H100 default (128, 64, 3 stages, 8 warps); shared memory bounds the rest.
FORWARD_OPTIONS: dict[str, dict] = {
    "default": {},
    "tma": {"USE_TMA": True},
    "rows safe": {"ROWS_GUARANTEED_SAFE": True},
    "128x128 s2 w8": {"BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 2, "num_warps": 8},
    "128x64 s4 w8": {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 4, "num_warps": 8},
    "128x64 s2 w8": {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2, "num_warps": 8},
    "64x128 s3 w4": {"BLOCK_M": 64, "BLOCK_N": 128, "num_stages": 3, "num_warps": 4},
    "tma 128x128 s2 w8": {"USE_TMA": True, "BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 2, "num_warps": 8},
}


def _bwd(m1: int, n1: int, m2: int, n2: int, stages: int, warps: int, **extra) -> dict:
    return {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2,
            "bwd_num_stages": stages, "bwd_num_warps": warps, **extra}


# Backward candidates (the forward left at its default); BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0
# are the template's static assertions.
BACKWARD_OPTIONS: dict[str, dict] = {
    "default": {},
    "tma": {"bwd_USE_TMA": True},
    "64/128 s2 w8": _bwd(64, 128, 128, 64, 2, 8),
    "64/128 s4 w8": _bwd(64, 128, 128, 64, 4, 8),
    "64/64 s3 w4": _bwd(64, 64, 64, 64, 3, 4),
    "64/64 s3 w8": _bwd(64, 64, 64, 64, 3, 8),
    "32/128 s3 w8": _bwd(32, 128, 128, 32, 3, 8),
    "128/128 s2 w8": _bwd(128, 128, 128, 128, 2, 8),
}


def attention_flops(length: int, batch: int, window: int, backward: bool) -> float:
    """Multiply-adds of the attended (query, key) pairs of a causal ``window`` (``length``: dense causal):
    4 E per pair forward, 3.5x that forward+backward."""
    pairs = sum(min(i + 1, window) for i in range(length))
    return 4 * HEAD_DIM * pairs * batch * HEADS * (3.5 if backward else 1.0)


def _inputs(length: int) -> tuple[torch.Tensor, ...]:
    shape = (TOKENS // length, HEADS, length, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(shape, device="cuda", dtype=DTYPE)


def _step(attention, inputs, backward: bool):
    """One call of ``attention(q, k, v)``: its output, or forward + backward and the gradients."""
    q, k, v, dout = inputs
    if backward:
        return lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), dout)
    return lambda: attention(q, k, v)


def _flex(block_mask, options: dict):
    return torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, kernel_options=options),
                         dynamic=False, fullgraph=True)


def _first(result):
    return result[0] if isinstance(result, tuple) else result


def _case(length: int, backward: bool) -> dict:
    inputs = _inputs(length)
    block_mask = create_block_mask(window_mask_mod, None, None, length, length, device="cuda")
    flops = attention_flops(length, TOKENS // length, WINDOW, backward)
    dense_flops = attention_flops(length, TOKENS // length, length, backward)
    cudnn_ms = measure_gpu_time(_step(_dense(SDPBackend.CUDNN_ATTENTION), inputs, backward))
    row = {"length": length, "direction": "fwd+bwd" if backward else "fwd",
           "cudnn_causal": {"ms": round(cudnn_ms, 4), "tflops": round(dense_flops / cudnn_ms / 1e9, 1)},
           "candidates": {}}
    reference = None
    for name, options in (BACKWARD_OPTIONS if backward else FORWARD_OPTIONS).items():
        result: dict = {"options": options}
        try:
            step = _step(_flex(block_mask, options), inputs, backward)
            out = _first(step()).float()
            reference = out if reference is None else reference
            diff = float((out - reference).abs().max())
            result["max_abs_diff_vs_default"] = diff if math.isfinite(diff) else None  # JSON has no NaN
            # Another tiling reorders bf16 sums (measured: <= 0.004 here); NaN or more is a wrong kernel.
            result["matches_default"] = math.isfinite(diff) and diff <= MATCH_TOLERANCE
            ms = measure_gpu_time(step)
            result.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                          vs_cudnn_causal=round(cudnn_ms / ms, 3))
        except Exception as error:  # a candidate the template rejects (shared memory, assertions) is a row
            result["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        row["candidates"][name] = result
        print(length, row["direction"], name, {k: v for k, v in result.items() if k != "options"}, flush=True)
    timed = {n: r["ms"] for n, r in row["candidates"].items() if "ms" in r and r["matches_default"]}
    row["best"] = min(timed, key=timed.get) if timed else None
    return row


def sweep(lengths: list[int]) -> list[dict]:
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    return [_case(length, backward) for length in lengths for backward in (False, True)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 2048])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tune_flex_attention.py times Inductor's FlexAttention kernels: it needs a CUDA GPU")
    rows = sweep(args.lengths)
    path = write_result("tune_flex_attention", {"window": WINDOW, "heads": HEADS, "head_dim": HEAD_DIM,
                                                "tokens": TOKENS, "dtype": "bfloat16", "rows": rows}, args.out)
    for row in rows:
        best = row["best"]
        print(row["length"], row["direction"], "cudnn causal", row["cudnn_causal"], "best", best,
              row["candidates"].get(best, {}).get("ms"))
    print("wrote", path)


if __name__ == "__main__":
    main()
