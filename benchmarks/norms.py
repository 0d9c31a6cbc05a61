"""Norm benchmark: RMSNorm, LayerNorm and residual add + RMSNorm, forward and backward, bf16.

    python benchmarks/norms.py [--quick] [--out DIR]

Providers: the hand-written norm (fp32 upcast, ``x * rsqrt(mean(x²) + eps) * w``) eager and under
torch.compile, ``F.rms_norm`` / ``F.layer_norm``, kernel_pytorch's op (``rms_norm`` / ``layer_norm``, with
its dispatch) and its Triton launchers called directly. The ceiling is a device-to-device copy moving the
same bytes. 16384 rows, hidden 2048 to 16384 (issue targets: forward >= 90% of copy at 2048-8192,
backward >= 80%, never slower than torch.compile).

GB/s = bytes the operation must move / median time: each input read once, each output written once.
Forward: x (and residual), weight (and bias) read; y (and the sum h) written. Backward: dy (and dh), x,
the per-row statistics, weight read; dx, dweight (and dbias) written. The backward is timed alone
(``torch.autograd.grad`` over a retained graph).

A second table, ``thresholds``, times the Triton launchers against the native path (ATen's fused
kernels) on small problems: the smallest rows x hidden from which Triton wins is what
``TRITON_FWD_MIN_ELEMENTS`` / ``TRITON_BWD_MIN_ELEMENTS`` in ``kernel_pytorch/ops/rms_norm.py`` and
``layer_norm.py`` should be. Writes norms.json and norms.png.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import RESULTS_DIR, measure, write_result  # noqa: E402

# The modules (kernel_pytorch.ops exports the functions under the same names).
L = importlib.import_module("kernel_pytorch.ops.layer_norm")
R = importlib.import_module("kernel_pytorch.ops.rms_norm")

DTYPE = torch.bfloat16
EPS = 1e-6
OPS = ("rms_norm", "layer_norm", "residual_rms_norm")
COPY = "copy (ceiling)"
OURS = "kernel_pytorch"


# ------------------------------------------------------------------------------ what model code writes

def eager_rms_norm(x, w):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def eager_layer_norm(x, w, b):
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    var = (x32 - mean).pow(2).mean(-1, keepdim=True)
    return ((x32 - mean) * torch.rsqrt(var + EPS) * w.float() + b.float()).to(x.dtype)


def eager_residual_rms_norm(x, r, w):
    h = x + r
    return eager_rms_norm(h, w), h


def _providers(op: str, compiled: dict[str, Callable]) -> dict[str, Callable]:
    """name -> fn(inputs) returning the outputs (a tensor or a tuple)."""
    if op == "rms_norm":
        return {"eager (hand-written)": lambda x, w: eager_rms_norm(x, w),
                "torch.compile (hand-written)": compiled[op],
                "F.rms_norm": lambda x, w: F.rms_norm(x, x.shape[-1:], w, EPS),
                OURS: lambda x, w: R.rms_norm(x, w, EPS)}
    if op == "layer_norm":
        return {"eager (hand-written)": eager_layer_norm,
                "torch.compile (hand-written)": compiled[op],
                "F.layer_norm": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS),
                OURS: lambda x, w, b: L.layer_norm(x, w, b, EPS)}
    return {"eager (hand-written)": eager_residual_rms_norm,
            "torch.compile (hand-written)": compiled[op],
            "F.rms_norm (after x + r)": lambda x, r, w: (F.rms_norm(x + r, x.shape[-1:], w, EPS), x + r),
            OURS: lambda x, r, w: R.rms_norm(x, w, EPS, r)}


def _inputs(op: str, rows: int, hidden: int, requires_grad: bool) -> list[torch.Tensor]:
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=DTYPE, requires_grad=requires_grad)  # noqa: E731
    if op == "rms_norm":
        return [make(rows, hidden), make(hidden)]
    if op == "layer_norm":
        return [make(rows, hidden), make(hidden), make(hidden)]
    return [make(rows, hidden), make(rows, hidden), make(hidden)]


def bytes_moved(op: str, rows: int, hidden: int, backward: bool) -> int:
    """The minimum traffic of the operation (see the module docstring), in bytes."""
    s, rh, stat = DTYPE.itemsize, rows * hidden, rows * 4  # statistics are fp32, one per row
    if op == "rms_norm":
        return (3 * rh * s + stat + 2 * hidden * s) if backward else (2 * rh * s + hidden * s)
    if op == "layer_norm":
        return (3 * rh * s + 2 * stat + 3 * hidden * s) if backward else (2 * rh * s + 2 * hidden * s)
    # residual: forward reads x, r and writes y, h; backward also reads dh (and writes one dx for both).
    return (4 * rh * s + stat + 2 * hidden * s) if backward else (4 * rh * s + hidden * s)


# --------------------------------------------------------------------------------------------- timing

def _forward_step(fn, inputs):
    return lambda: fn(*inputs)


def _backward_step(fn, inputs):
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    cotangents = [torch.randn_like(o) for o in outputs]
    leaves = [t for t in inputs if t.requires_grad]
    return lambda: torch.autograd.grad(outputs, leaves, cotangents, retain_graph=True)


def _triton_direct(op: str, inputs, backward: bool):
    """The launchers alone: kernel time without the custom op's dispatch."""
    inputs = [t.detach() for t in inputs]
    with torch.no_grad():
        if op == "layer_norm":
            x, w, b = inputs
            y, _, mean, rstd = L.layer_norm_fwd(x, w, b, None, EPS)
            dy = torch.randn_like(y)
            return (lambda: L.layer_norm_bwd(dy, x, w, b, mean, rstd)) if backward else \
                (lambda: L.layer_norm_fwd(x, w, b, None, EPS))
        x, r, w = (inputs[0], None, inputs[1]) if op == "rms_norm" else inputs
        y, h, rstd = R.rms_norm_fwd(x, w, r, EPS)
        dy = torch.randn_like(y)
        dh = torch.randn_like(y) if r is not None else None
        return (lambda: R.rms_norm_bwd(dy, h if r is not None else x, w, rstd, dh)) if backward else \
            (lambda: R.rms_norm_fwd(x, w, r, EPS))


def _copy_step(n_bytes: int):
    src = torch.empty(n_bytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _time(step_factory, n_bytes, runs) -> dict:
    try:
        timing = measure(step_factory(), warmup=3, runs=runs)
    except Exception as error:  # one provider's failure (compile error, OOM) must not end the run
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"}
    return {"ms": round(timing.median_ms, 4), "gbps": round(n_bytes / timing.median_ms / 1e6, 1)}


def run_case(op: str, hidden: int, rows: int, backward: bool, compiled, runs: int) -> dict:
    n_bytes = bytes_moved(op, rows, hidden, backward)
    row = {"op": op, "hidden": hidden, "rows": rows, "backward": backward, "bytes": n_bytes, "results": {}}
    inputs = _inputs(op, rows, hidden, requires_grad=backward)
    step = _backward_step if backward else _forward_step
    for name, fn in _providers(op, compiled).items():
        row["results"][name] = _time(lambda fn=fn: step(fn, inputs), n_bytes, runs)
    row["results"][f"{OURS} (Triton launchers)"] = _time(lambda: _triton_direct(op, inputs, backward), n_bytes, runs)
    row["results"][COPY] = _time(lambda: _copy_step(n_bytes), n_bytes, runs)
    ceiling = row["results"][COPY].get("gbps")
    for result in row["results"].values():
        if ceiling and "gbps" in result:
            result["fraction_of_copy"] = round(result["gbps"] / ceiling, 3)
    del inputs
    torch.cuda.empty_cache()
    return row


def threshold_sweep(runs: int, quick: bool) -> list[dict]:
    """Triton vs native, forward and backward, on small problems: sets TRITON_{FWD,BWD}_MIN_ELEMENTS."""
    sweep = []
    for hidden in ((1024, 4096) if quick else (512, 1024, 2048, 4096, 8192)):
        for rows in ((256, 4096) if quick else (64, 256, 1024, 4096, 16384)):
            x = torch.randn(rows, hidden, device="cuda", dtype=DTYPE)
            w, b = torch.randn(hidden, device="cuda", dtype=DTYPE), torch.randn(hidden, device="cuda", dtype=DTYPE)
            dy = torch.randn_like(x)
            try:
                _, _, rstd = R.rms_norm_fwd(x, w)
                _, _, mean, lrstd = L.layer_norm_fwd(x, w, b)
            except Exception as error:  # report it, and go on with the other sizes
                sweep.append({"rows": rows, "hidden": hidden, "error": f"{type(error).__name__}: {error}"[:200]})
                continue
            cases = {
                ("rms_norm", False): (lambda: R.rms_norm_fwd(x, w, None, EPS),
                                      lambda: R._rms_norm_fwd_native(x, w, None, EPS, False)),
                ("rms_norm", True): (lambda: R.rms_norm_bwd(dy, x, w, rstd),
                                     lambda: R._rms_norm_bwd_native(dy, x, w, rstd, None, False, True)),
                ("layer_norm", False): (lambda: L.layer_norm_fwd(x, w, b, None, EPS),
                                        lambda: L._layer_norm_fwd_native(x, w, b, None, EPS)),
                ("layer_norm", True): (lambda: L.layer_norm_bwd(dy, x, w, b, mean, lrstd),
                                       lambda: L._layer_norm_bwd_native(dy, x, w, b, mean, lrstd, None, True, True)),
            }
            for (op, backward), (triton_fn, native_fn) in cases.items():
                n_bytes = bytes_moved(op, rows, hidden, backward)
                entry = {"op": op, "backward": backward, "rows": rows, "hidden": hidden, "elements": rows * hidden,
                         "triton": _time(lambda: triton_fn, n_bytes, runs),
                         "native": _time(lambda: native_fn, n_bytes, runs)}
                t, n = entry["triton"].get("ms"), entry["native"].get("ms")
                entry["triton_faster"] = bool(t and n and t < n)
                sweep.append(entry)
                print(entry, flush=True)
    return sweep


def suggested_thresholds(sweep: list[dict]) -> dict[str, int | None]:
    """Per op and direction: the smallest element count from which Triton wins at every measured
    larger size (None: it never does, within the sweep)."""
    out = {}
    for op in OPS[:2]:
        for backward in (False, True):
            entries = sorted((e for e in sweep if e.get("op") == op and e["backward"] == backward),
                             key=lambda e: e["elements"])
            threshold = None
            for i, entry in enumerate(entries):
                if all(e["triton_faster"] for e in entries[i:]):
                    threshold = entry["elements"]
                    break
            out[f"{op}.TRITON_{'BWD' if backward else 'FWD'}_MIN_ELEMENTS"] = threshold
    return out


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, row by row: True, False, or None where a figure is missing."""
    checks = []
    for row in rows:
        results = row["results"]
        ours = results.get(OURS, {})
        fraction = ours.get("fraction_of_copy")
        need = 0.8 if row["backward"] else 0.9
        in_range = fraction is not None and 2048 <= row["hidden"] <= 8192
        compiled = results.get("torch.compile (hand-written)", {}).get("ms")
        checks.append({
            "op": row["op"], "hidden": row["hidden"], "backward": row["backward"],
            "copy_fraction_target": need if 2048 <= row["hidden"] <= 8192 else None,
            "meets_copy_fraction": (fraction >= need) if in_range else None,
            "not_slower_than_compile": (ours["ms"] <= compiled) if "ms" in ours and compiled else None,
        })
    return checks


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(OPS), 2, figsize=(12, 4 * len(OPS)), squeeze=False)
    for i, op in enumerate(OPS):
        for j, backward in enumerate((False, True)):
            ax = axes[i][j]
            subset = sorted((r for r in rows if r["op"] == op and r["backward"] == backward), key=lambda r: r["hidden"])
            if not subset:
                ax.set_visible(False)
                continue
            for name in subset[0]["results"]:
                points = [(r["hidden"], r["results"][name]["gbps"]) for r in subset if "gbps" in r["results"][name]]
                if points:
                    ax.plot(*zip(*points), marker="o", label=name, linestyle="--" if name == COPY else "-")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op} {'backward' if backward else 'forward'}, {subset[0]['rows']} rows, bf16")
            ax.set_xlabel("hidden")
            ax.set_ylabel("GB/s")
            ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"norms, {torch.cuda.get_device_name()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two sizes, fewer runs")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/norms.py needs a CUDA (or ROCm) GPU")
    # One compiled function per op, recompiled per hidden size and direction: lift dynamo's limit.
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 64)
    # The backward is timed by replaying it over a retained graph, which a compiled backward that
    # donates its saved buffers refuses; donation saves memory, not time.
    if hasattr(torch._functorch.config, "donated_buffer"):
        torch._functorch.config.donated_buffer = False
    compiled = {"rms_norm": torch.compile(eager_rms_norm), "layer_norm": torch.compile(eager_layer_norm),
                "residual_rms_norm": torch.compile(eager_residual_rms_norm)}
    hiddens = (2048, 8192) if args.quick else (2048, 4096, 8192, 16384)
    runs = 5 if args.quick else 20
    rows = []
    for op in OPS:
        for backward in (False, True):
            for hidden in hiddens:
                rows.append(run_case(op, hidden, 16384, backward, compiled, runs))
                print({k: v for k, v in rows[-1].items() if k != "results"},
                      {name: r.get("gbps", r.get("error")) for name, r in rows[-1]["results"].items()}, flush=True)
    sweep = threshold_sweep(runs, args.quick)
    current = {f"{m.__name__.rsplit('.', 1)[1]}.{k}": getattr(m, k)
               for m in (R, L) for k in ("TRITON_FWD_MIN_ELEMENTS", "TRITON_BWD_MIN_ELEMENTS")}
    payload = {"rows": rows, "targets": check_targets(rows), "thresholds": sweep,
               "suggested_thresholds": suggested_thresholds(sweep), "current_thresholds": current}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "norms" + ("_quick" if args.quick else "")
    path = write_result(name, payload, args.out)
    try:
        plot(rows, args.out / f"{name}.png")
    except ImportError as error:  # matplotlib is a dev extra
        print(f"no plot: {error}")
    print(f"wrote {path}")
    print("targets:", *payload["targets"], sep="\n  ")
    print("suggested thresholds (elements):", payload["suggested_thresholds"])


if __name__ == "__main__":
    main()
