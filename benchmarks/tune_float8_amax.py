"""Sweep the tiling of the FP8 amax kernel (``_abs_max_kernel`` in ``kernel_pytorch/ops/float8_cast.py``) on
the GPU.

    python benchmarks/tune_float8_amax.py [--quick] [--out DIR]

For each bf16 operand shape an FP8 layer of docs/design.md's Llama-style model (and the 8192^3 benchmark) reduces,
the tensor's maximum (tensorwise) and the row and column maxima (rowwise, both for a training operand) are
timed per setting of ``_AMAX_BLOCK_R`` x ``_AMAX_BLOCK_C`` (the tile), ``_AMAX_NUM_WARPS`` and
``_AMAX_MIN_PROGRAMS`` (how many tiles each program walks), as GPU time only (``harness.measure_gpu_time``:
CUDA-graph replays, the maxima buffer's memset included, the same for every setting). Every setting's
result is checked against ``torch.amax``. The read bandwidth is against a device-to-device copy of the
same bytes (which also writes them: an upper bound of what one read can reach). Writes
tune_float8_amax.json: every setting per case and, per mode and for both modes together, the setting
with the least total time over the shapes, with the current one's total beside it.
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

FC = importlib.import_module("kernel_pytorch.ops.float8_cast")

DTYPE = torch.bfloat16
# (rows, cols): the 8192^3 benchmark's operands; the model's activations/gradients (M = 8192) and weights (N, K)
SHAPES = ((8192, 8192), (8192, 2048), (8192, 3072), (11264, 2048), (2048, 5632))
MODES = {"tensorwise": dict(tensorwise=True), "rows+cols": dict(tensorwise=False, rows=True, cols=True)}
TILES = ((32, 256), (64, 256), (16, 512), (32, 512), (64, 128), (128, 128))
WARPS = (4, 8)
MIN_PROGRAMS = (264, 528, 1056)
_SETTING = ("_AMAX_BLOCK_R", "_AMAX_BLOCK_C", "_AMAX_NUM_WARPS", "_AMAX_MIN_PROGRAMS")
_FIELDS = ("block_r", "block_c", "num_warps", "min_programs")


def _reference(t: torch.Tensor, mode: dict) -> list[torch.Tensor]:
    a = t.abs().float()
    return [a.amax().reshape(1)] if mode["tensorwise"] else [a.amax(1), a.amax(0)]


def _maxima(amax) -> list[torch.Tensor]:
    return [amax.tensor] if amax.tensorwise else [amax.rows, amax.cols]


def _time_setting(t: torch.Tensor, mode: dict, expected: list[torch.Tensor]) -> dict:
    got = _maxima(FC.abs_max(t, **mode))
    if not all(torch.equal(g, e) for g, e in zip(got, expected)):
        return {"error": "wrong maxima"}
    return {"ms": round(measure_gpu_time(lambda: FC.abs_max(t, **mode), calls=20, replays=5), 5)}


def sweep(quick: bool) -> dict:
    saved = tuple(getattr(FC, name) for name in _SETTING)
    current = saved
    settings = [(r, c, w, p) for (r, c), w, p in itertools.product(TILES, WARPS, MIN_PROGRAMS)]
    if saved not in settings:
        settings.insert(0, saved)
    shapes = SHAPES[:2] if quick else SHAPES
    cases = []
    try:
        for shape in shapes:
            t = torch.randn(*shape, device="cuda", dtype=DTYPE)
            src = t.view(torch.uint8).flatten()
            dst = torch.empty_like(src)
            copy_ms = measure_gpu_time(lambda: dst.copy_(src))
            for mode_name, mode in MODES.items():
                expected = _reference(t, mode)
                case = {"shape": list(shape), "mode": mode_name, "copy_ms": round(copy_ms, 5), "settings": []}
                for setting in settings:
                    for name, value in zip(_SETTING, setting):
                        setattr(FC, name, value)
                    entry = dict(zip(_FIELDS, setting))
                    try:
                        entry.update(_time_setting(t, mode, expected))
                    except Exception as error:  # a setting that does not compile (registers) is a result too
                        entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                    if "ms" in entry:
                        entry["read_of_copy"] = round(copy_ms / entry["ms"], 3)  # the copy moves 2x the bytes
                    case["settings"].append(entry)
                cases.append(case)
                print(shape, mode_name, min((e for e in case["settings"] if "ms" in e), key=lambda e: e["ms"]),
                      flush=True)
            del t, src, dst
            torch.cuda.empty_cache()
    finally:
        for name, value in zip(_SETTING, saved):
            setattr(FC, name, value)
    return {"cases": cases, "best": _best(cases, current)}


def _best(cases: list[dict], current: tuple) -> dict:
    """Per mode, and for both together ("both": the kernel has one setting), the setting with the least total
    time over the shapes (settings that failed anywhere are out), and the current setting's total."""
    best = {}
    for mode in (*MODES, "both"):
        totals: dict[tuple, float] = {}
        failed = set()
        for case in (c for c in cases if mode in (c["mode"], "both")):
            for e in case["settings"]:
                key = tuple(e[field] for field in _FIELDS)
                if "ms" not in e:
                    failed.add(key)
                totals[key] = totals.get(key, 0.0) + e.get("ms", 0.0)
        ok = {k: v for k, v in totals.items() if k not in failed}
        winner = min(ok, key=ok.get)
        best[mode] = {"setting": dict(zip(_FIELDS, winner)), "total_ms": round(ok[winner], 5),
                      "current_setting": dict(zip(_FIELDS, current)),
                      "current_total_ms": round(ok.get(current, float("nan")), 5)}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="two shapes")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    result = sweep(args.quick)
    print(result["best"])
    path = write_result("tune_float8_amax_quick" if args.quick else "tune_float8_amax", result, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
