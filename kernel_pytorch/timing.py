"""The one GPU timer the library itself uses when it decides by measurement (the attention dispatch, the
FP8 pass): median milliseconds per call between CUDA events, after a warm-up. The benchmarks have their
own fuller harness (benchmarks/harness.py: L2 flushing, CUDA-graph GPU time); a decision made inside
``optimize`` needs only a quick, robust comparison of candidates on the same inputs.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

__all__ = ["median_cuda_ms"]


def median_cuda_ms(fn: Callable[[], object], warmup: int = 2, runs: int = 7) -> float:
    """Median over ``runs`` calls of ``fn`` of the time between CUDA events around it, in ms; the median,
    not the mean, so one call delayed by another process does not decide."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
