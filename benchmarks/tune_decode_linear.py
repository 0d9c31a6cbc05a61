"""The grouped GEMV of decode steps (kernel_pytorch/ops/decode_linear.py) against cuBLAS, per weight shape of
the decode benchmark's models (benchmarks/decode.py: 1b and 7b), and a sweep of its tiles: GPU time of CUDA-graph
replays (kernel_pytorch.timing), so launch gaps count as in a captured decode step.

    python benchmarks/tune_decode_linear.py [--rows 1 8] [--cold] [--out DIR]

Candidates per shape: ``cublas``: one ``F.linear`` per weight (what a transformers model runs);
``cublas_packed``: one ``F.linear`` on the weights concatenated beforehand (what packing the parameters into one
tensor would give); ``gemv <tile>``: the grouped kernel, every tile of the sweep; for the q/k/v and gate/up
shapes also ``fused <tile>``: the decode_fusion launch (RMSNorm with a residual before, and for gate/up the
SwiGLU after; ops/decode_fused_linear.py) at the default tile, with half and twice its rows or K tile, and with the
other warp count. Writes tune_decode_linear.json (``--cold``: tune_decode_linear_cold.json).

``--cold``: the calls captured in one CUDA graph rotate over copies of the weights that together exceed twice the
L2 (``kernel_pytorch.timing.weight_copies``, as the decode passes time their candidates), so each call reads its
weights from HBM, as a decode step does (weights read once per token); without it, weights of up to ~32 MB stay in
the H100's 50 MB L2 between replays.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import environment  # noqa: E402
from kernel_pytorch.ops import decode_linear as DL  # noqa: E402
from kernel_pytorch.timing import fastest_cuda_graph_ms, rotating, weight_copies  # noqa: E402

# name: (out features of each weight, in features)
SHAPES = {
    "1b qkv": ((2048, 512, 512), 2048), "1b o": ((2048,), 2048), "1b gate_up": ((5632, 5632), 2048),
    "1b down": ((2048,), 5632), "1b lm_head": ((32000,), 2048),
    "7b qkv": ((4096, 1024, 1024), 4096), "7b o": ((4096,), 4096), "7b gate_up": ((14336, 14336), 4096),
    "7b down": ((4096,), 14336),
}
TILES = [DL.GemvTile(n, k, w, s) for n, k, w, s in itertools.product((8, 16, 32), (128, 256, 512), (4, 8), (3, 5))]


_CALLS_PER_GRAPH = 8


def _weight_sets(sizes: tuple[int, ...], k: int, cold: bool) -> list[list[torch.Tensor]]:
    """One set of weights, or (cold) enough copies that one graph's calls read over twice the L2 between them."""
    def make() -> list[torch.Tensor]:
        return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in sizes]
    return weight_copies(make, sum(sizes) * k * 2, torch.device("cuda")) if cold else [make()]


def measure(sizes: tuple[int, ...], k: int, rows: int, cold: bool) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    sets = _weight_sets(sizes, k, cold)
    weights = sets[0]
    packed_sets = [torch.cat(ws) for ws in sets]
    candidates = {"cublas": rotating(lambda ws: [F.linear(x, w) for w in ws], sets),
                  "cublas_packed": rotating(lambda w: F.linear(x, w), packed_sets)}
    reference = F.linear(x.float(), packed_sets[0].float())
    errors = {}
    for tile in TILES:
        if tile.block_k > k:
            continue
        name = f"gemv n{tile.block_n} k{tile.block_k} w{tile.num_warps} s{tile.num_stages}"
        out = DL.grouped_gemv(x, weights, None, tile)[0]
        errors[name] = float((out.float() - reference).norm() / reference.norm())
        candidates[name] = rotating(lambda ws, tile=tile: DL.grouped_gemv(x, ws, None, tile), sets)
    candidates.update(_fused_candidates(x, sizes, sets))
    ms = fastest_cuda_graph_ms(candidates, rounds=3, calls_per_graph=_CALLS_PER_GRAPH).ms
    bytes_read = sum(w.numel() for w in weights) * 2
    best = min((name for name in ms if name.startswith("gemv")), key=ms.get)
    return {"ms": ms, "max_rel_error": max(errors.values()), "best_gemv": best, "weight_copies": len(sets),
            "tb_per_s": {name: bytes_read / (value * 1e-3) / 1e12 for name, value in ms.items()}}


def _fused_candidates(x: torch.Tensor, sizes: tuple[int, ...], sets: list) -> dict:
    """The decode_fusion launch for q/k/v (3 weights: norm + residual) and gate/up (2 equal weights: norm + residual
    + SwiGLU), at the default tile, with half and twice its rows or K tile, and with the other warp count."""
    if len(sizes) == 1:
        return {}
    gated = len(sizes) == 2
    norm = DL.NormInput(torch.ones(x.shape[-1], device="cuda", dtype=x.dtype), 1e-6, False, torch.randn_like(x))
    default = DL.gemv_tile(x.shape[0], sizes[0] if gated else sum(sizes), gated=gated, normed=True)
    tiles = {"default": default, "half rows": replace(default, block_n=max(default.block_n // 2, 1)),
             "double rows": replace(default, block_n=default.block_n * 2),
             f"{12 - default.num_warps} warps": replace(default, num_warps=12 - default.num_warps),
             "half K tile": replace(default, block_k=default.block_k // 2),
             "double K tile": replace(default, block_k=default.block_k * 2)}
    return {f"fused {label}": rotating(lambda ws, tile=tile: DL.grouped_gemv(
        x, ws, None, tile, norm=norm, activation="silu" if gated else None), sets) for label, tile in tiles.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1])
    parser.add_argument("--cold", action="store_true", help="weights read from HBM at every call (see above)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    results = {}
    for rows in args.rows:
        for name, (sizes, k) in SHAPES.items():
            r = measure(sizes, k, rows, args.cold)
            results[f"{name} rows{rows}"] = r
            tb = r["tb_per_s"]
            print(f"{name:12s} rows {rows}: cublas {r['ms']['cublas'] * 1e3:6.1f} us ({tb['cublas']:.2f} TB/s), packed "
                  f"{r['ms']['cublas_packed'] * 1e3:6.1f} us ({tb['cublas_packed']:.2f}), best gemv "
                  f"{r['ms'][r['best_gemv']] * 1e3:6.1f} us ({tb[r['best_gemv']]:.2f}) {r['best_gemv']}; "
                  f"max rel error {r['max_rel_error']:.1e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), "command": " ".join(sys.argv), "results": results}
    name = "tune_decode_linear_cold.json" if args.cold else "tune_decode_linear.json"
    (args.out / name).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
