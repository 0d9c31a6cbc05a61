"""What every demo shares: ``--quick``, the device, and the one result line run_all_demos reads."""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # demos run from a checkout; benchmarks/ holds the timing harness
    sys.path.insert(0, str(ROOT))

RESULT_PREFIX = "DEMO_RESULT "

__all__ = ["RESULT_PREFIX", "DemoResult", "default_device", "demo_main", "rel_err", "sqnr"]


@dataclass
class DemoResult:
    status: str  # "ok" | "skipped" | "failed"
    speedup: float | None = None
    memory_saved_mb: float | None = None
    notes: list[str] = field(default_factory=list)


def demo_main(description: str, run: Callable[[argparse.Namespace], DemoResult]) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="small sizes: finishes in seconds on a CPU")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    args = parser.parse_args()
    try:
        result = run(args)
    except Exception as error:
        traceback.print_exc()
        result = DemoResult("failed", notes=[f"{type(error).__name__}: {error}"])
    print(RESULT_PREFIX + json.dumps(asdict(result)), flush=True)
    sys.exit(1 if result.status == "failed" else 0)


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
