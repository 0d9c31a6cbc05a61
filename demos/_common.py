"""What every demo shares: --quick, the device, the closing verdict a person reads, and the result file
run_all_demos reads.

A demo run by hand prints only what a person reads. run_all_demos passes a file path in the environment
variable named by RESULT_FILE_ENV; the demo writes its DemoResult there as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # demos run from a checkout; benchmarks/ holds the timing harness
    sys.path.insert(0, str(ROOT))

# The environment variable run_all_demos sets to the path where the demo writes its result (JSON).
RESULT_FILE_ENV = "KERNEL_PYTORCH_DEMO_RESULT_FILE"

# Why optimize's model can time slower than eager on a CPU (fused_kernels, optimize_transformer): measured
# with torch.profiler, the optimized model runs the same ATen ops plus a custom-op call per fused op.
SLOWER_ON_CPU = ("expected on a CPU: compile='auto' leaves Inductor off there, so the rewritten graphs run op by "
                 "op, and the fused norm, RoPE and activation ops run ATen's CPU code (their Triton kernels need "
                 "a GPU) plus a custom-op call each; the speedups are measured on GPUs")

__all__ = ["RESULT_FILE_ENV", "SLOWER_ON_CPU", "DemoResult", "default_device", "demo_main", "plain", "rel_err",
           "slowdown_on_cpu", "speedup_note", "sqnr", "verdict"]


@dataclass
class DemoResult:
    status: str  # "ok" | "skipped" | "failed": the numerics' verdict, not the speed's
    speedup: float | None = None
    memory_saved_mb: float | None = None
    notes: list[str] = field(default_factory=list)
    # Why a speedup below 1.0 is expected in this run (device, sizes, settings); None: it is not expected.
    slowdown_expected: str | None = None


def demo_main(description: str, run: Callable[[argparse.Namespace], DemoResult]) -> None:
    parser = argparse.ArgumentParser(description=plain(description),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: finishes in seconds on a CPU")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    args = parser.parse_args()
    try:
        result = run(args)
    except Exception as error:
        traceback.print_exc()
        result = DemoResult("failed", notes=[f"{type(error).__name__}: {error}"])
    print(verdict(result), flush=True)
    result_file = os.environ.get(RESULT_FILE_ENV)
    if result_file:
        Path(result_file).write_text(json.dumps(asdict(result)))
    sys.exit(1 if result.status == "failed" else 0)


def plain(text: str) -> str:
    """A docstring as argparse prints it: without reST's double backticks."""
    return text.replace("``", "")


def speedup_note(speedup: float | None, slowdown_expected: str | None) -> str | None:
    """What a person needs to read a speedup below 1.0: that it is slower, and whether that is expected and
    why; None for no speedup or one of at least 1.0."""
    if speedup is None or speedup >= 1.0:
        return None
    if slowdown_expected:
        return f"slower ({speedup:.2f}x), {slowdown_expected}"
    return (f"slower ({speedup:.2f}x), not expected here: on this device and at these sizes it should not be "
            "slower; timings on a busy machine vary, so rerun the demo alone before calling it a regression")


def verdict(result: DemoResult) -> str:
    """The demo's closing lines: its status, speedup and memory saved, its notes, and the speedup note."""
    figures = [f"speedup {result.speedup:.2f}x" if result.speedup is not None else "",
               f"memory saved {result.memory_saved_mb:.3g} MB" if result.memory_saved_mb else ""]
    lines = [", ".join(["result: " + result.status, *filter(None, figures)])]
    lines += [f"  {note}" for note in result.notes if note]
    note = speedup_note(result.speedup, result.slowdown_expected)
    if note is not None:
        lines.append(f"  {note}")
    return "\n".join(lines)


def slowdown_on_cpu(device: str, compiler: str) -> str | None:
    """SLOWER_ON_CPU where it holds: CPU tensors, and optimize's graphs run eagerly (the report's compiler)."""
    return SLOWER_ON_CPU if device == "cpu" and compiler.startswith("eager") else None


def default_device(args: argparse.Namespace) -> str:
    """``--device``, else cuda when a GPU is visible, else cpu."""
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def rel_err(actual, expected) -> float:
    """||actual - expected|| / ||expected|| in float64."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm())


def sqnr(actual, expected) -> float:
    """Signal-to-quantization-noise ratio in dB, 20 log10(||expected|| / ||expected - actual||), as the FP8
    tests and benchmarks/fp8.py compute it; inf when the two are equal."""
    error = rel_err(actual, expected)
    return math.inf if error == 0 else -20 * math.log10(error)
