"""The grouped GEMV of decode steps (kernel_pytorch/ops/decode_linear.py) against cuBLAS, per weight shape of
the decode benchmark's models (benchmarks/decode.py: 1b and 7b), and a sweep of its tiles: GPU time of CUDA-graph
replays (kernel_pytorch.timing), so launch gaps count as in a captured decode step.

    python benchmarks/tune_decode_linear.py [--rows 1 8] [--out DIR]

Candidates per shape: ``cublas``: one ``F.linear`` per weight (what a transformers model runs);
``cublas_packed``: one ``F.linear`` on the weights concatenated beforehand (what packing the parameters into one
tensor would give); ``gemv <tile>``: the grouped kernel, every tile of the sweep. Writes tune_decode_linear.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import environment  # noqa: E402
from kernel_pytorch.ops import decode_linear as DL  # noqa: E402
from kernel_pytorch.timing import fastest_cuda_graph_ms  # noqa: E402

# name: (out features of each weight, in features)
SHAPES = {
    "1b qkv": ((2048, 512, 512), 2048), "1b o": ((2048,), 2048), "1b gate_up": ((5632, 5632), 2048),
    "1b down": ((2048,), 5632), "1b lm_head": ((32000,), 2048),
    "7b qkv": ((4096, 1024, 1024), 4096), "7b o": ((4096,), 4096), "7b gate_up": ((14336, 14336), 4096),
    "7b down": ((4096,), 14336),
}
TILES = [DL.GemvTile(n, k, w, s) for n, k, w, s in itertools.product((8, 16, 32), (128, 256, 512), (4, 8), (3, 5))]


def measure(sizes: tuple[int, ...], k: int, rows: int) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for n in sizes]
    packed = torch.cat(weights)
    candidates = {"cublas": lambda: [F.linear(x, w) for w in weights], "cublas_packed": lambda: F.linear(x, packed)}
    reference = F.linear(x.float(), packed.float())
    errors = {}
    for tile in TILES:
        if tile.block_k > k:
            continue
        name = f"gemv n{tile.block_n} k{tile.block_k} w{tile.num_warps} s{tile.num_stages}"
        out = DL.grouped_gemv(x, weights, None, tile)
        errors[name] = float((out.float() - reference).norm() / reference.norm())
        candidates[name] = lambda tile=tile: DL.grouped_gemv(x, weights, None, tile)
    ms = fastest_cuda_graph_ms(candidates, rounds=3).ms
    bytes_read = sum(w.numel() for w in weights) * 2
    best = min((name for name in ms if name.startswith("gemv")), key=ms.get)
    return {"ms": ms, "max_rel_error": max(errors.values()), "best_gemv": best,
            "tb_per_s": {name: bytes_read / (value * 1e-3) / 1e12 for name, value in ms.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    results = {}
    for rows in args.rows:
        for name, (sizes, k) in SHAPES.items():
            r = measure(sizes, k, rows)
            results[f"{name} rows{rows}"] = r
            tb = r["tb_per_s"]
            print(f"{name:12s} rows {rows}: cublas {r['ms']['cublas'] * 1e3:6.1f} us ({tb['cublas']:.2f} TB/s), packed "
                  f"{r['ms']['cublas_packed'] * 1e3:6.1f} us ({tb['cublas_packed']:.2f}), best gemv "
                  f"{r['ms'][r['best_gemv']] * 1e3:6.1f} us ({tb[r['best_gemv']]:.2f}) {r['best_gemv']}; "
                  f"max rel error {r['max_rel_error']:.1e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), "command": " ".join(sys.argv), "results": results}
    (args.out / "tune_decode_linear.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
