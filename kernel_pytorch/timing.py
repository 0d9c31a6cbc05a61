"""The one GPU timer the library itself uses when it decides by measurement (the attention dispatch, the
FP8 pass): milliseconds per call between CUDA events, after a warm-up. The benchmarks have their own
fuller harness (benchmarks/harness.py: L2 flushing, CUDA-graph GPU time); a decision made inside
``optimize`` needs only a quick, robust comparison of candidates on the same inputs.

Candidates are timed interleaved, in rounds (A, B, C, A, B, C, ...), each round giving a median per
candidate, and each candidate keeps its best round. Timed one after the other, a candidate measured while
the GPU's clocks were still rising, or while another process used the GPU, lost by chance: on the H100 the
attention dispatch once timed cuDNN at 1.42 ms in one call and 1.165 ms in the next, and chose a kernel
9% slower for the whole run (issue 3's hd64 L1024 causal fwd+bwd row).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping

import torch

__all__ = ["fastest_cuda_ms", "median_cuda_ms"]


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


def fastest_cuda_ms(candidates: Mapping[str, Callable[[], object]], rounds: int = 3, warmup: int = 2,
                    runs: int = 5) -> dict[str, float]:
    """Per candidate, the best over ``rounds`` interleaved rounds of its median time over ``runs`` calls,
    in ms (module docstring). All candidates are warmed up before the first round."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in candidates.items():
            time = median_cuda_ms(fn, warmup=0, runs=runs)
            best[name] = min(best.get(name, time), time)
    return best
