"""Sweep the row-kernel tuning constants of ``kernel_pytorch/ops/triton_utils.py`` on the GPU.

    python benchmarks/tune_row_kernels.py [--quick] [--out DIR]

For RMSNorm and LayerNorm, forward and backward, bf16, 16384 rows, hidden 2048 to 16384, each setting
of ``_ELEMENTS_PER_THREAD`` (warps per row), ``_MIN_TILE_ELEMENTS`` (rows per tile) and, for the
backward, ``_WARPS_PER_SM`` (programs of the persistent grid) is timed as GPU time only: 20 launcher
calls captured in one CUDA graph, replayed, so Python and launch overhead are out of the number (they
are what the triton_op path removes under torch.compile). The copy ceiling is timed the same way.
Writes tune_row_kernels.json: every setting's GB/s and fraction of copy, and the best per case.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import RESULTS_DIR, measure_gpu_time, write_result  # noqa: E402
from benchmarks.kernels import EPS, bytes_moved  # noqa: E402

L = importlib.import_module("kernel_pytorch.ops.layer_norm")
R = importlib.import_module("kernel_pytorch.ops.rms_norm")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")

DTYPE = torch.bfloat16


def _case(op: str, backward: bool, hidden: int, rows: int):
    x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
    w, b = torch.randn(hidden, device="cuda", dtype=DTYPE), torch.randn(hidden, device="cuda", dtype=DTYPE)
    dy = torch.randn_like(x)
    if op == "rms_norm":
        _, _, rstd, _ = R.rms_norm_fwd(x, w)
        return (lambda: R.rms_norm_bwd(dy, x, w, rstd)) if backward else (lambda: R.rms_norm_fwd(x, w, None, EPS))
    _, _, mean, rstd = L.layer_norm_fwd(x, w, b)
    return (lambda: L.layer_norm_bwd(dy, x, w, b, mean, rstd)) if backward else \
        (lambda: L.layer_norm_fwd(x, w, b, None, EPS))


def settings(backward: bool, quick: bool):
    per_thread = (4, 8, 16) if backward else (4, 8, 16, 32)
    tile = (2048, 4096) if quick else (2048, 4096, 8192)
    warps_per_sm = (16, 32, 64, 128) if backward else (None,)
    return list(itertools.product(per_thread, tile, warps_per_sm))


def sweep(quick: bool) -> list[dict]:
    rows, results = 16384, []
    saved = (dict(tu._ELEMENTS_PER_THREAD), tu._MIN_TILE_ELEMENTS, tu._WARPS_PER_SM)
    for hidden in ((2048, 8192) if quick else (2048, 4096, 8192, 16384)):
        src = torch.empty(bytes_moved("rms_norm", rows, hidden, False) // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_ms = measure_gpu_time(lambda: dst.copy_(src))
        copy_gbps = 2 * src.numel() / copy_ms / 1e6
        for op, backward in itertools.product(("rms_norm", "layer_norm"), (False, True)):
            n_bytes = bytes_moved(op, rows, hidden, backward)
            for per_thread, tile, warps_per_sm in settings(backward, quick):
                tu._ELEMENTS_PER_THREAD[backward] = per_thread
                tu._MIN_TILE_ELEMENTS = tile
                if warps_per_sm:
                    tu._WARPS_PER_SM = warps_per_sm
                shape = tu.row_tile(hidden, rows, backward=backward)
                entry = {"op": op, "backward": backward, "hidden": hidden, "elements_per_thread": per_thread,
                         "min_tile_elements": tile, "warps_per_sm": warps_per_sm, "rows_per_tile": shape.rows,
                         "num_warps": shape.num_warps}
                try:
                    ms = measure_gpu_time(_case(op, backward, hidden, rows))
                    entry.update(ms=round(ms, 4), gbps=round(n_bytes / ms / 1e6, 1),
                                 fraction_of_copy=round(n_bytes / ms / 1e6 / copy_gbps, 3))
                except Exception as error:  # a setting that does not compile (registers) is a result too
                    entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
                results.append(entry)
                torch.cuda.empty_cache()
            best = max((e for e in results if e["op"] == op and e["backward"] == backward and e["hidden"] == hidden
                        and "gbps" in e), key=lambda e: e["gbps"], default=None)
            print(f"{op:10s} {'bwd' if backward else 'fwd'} hidden {hidden:5d}: copy {copy_gbps:.0f} GB/s; best {best}",
                  flush=True)
    tu._ELEMENTS_PER_THREAD.update(saved[0])
    tu._MIN_TILE_ELEMENTS, tu._WARPS_PER_SM = saved[1], saved[2]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    results = sweep(args.quick)
    path = write_result("tune_row_kernels" + ("_quick" if args.quick else ""), {"settings": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
