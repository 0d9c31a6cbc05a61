"""The GPU timers the library itself uses when it decides by measurement (the attention dispatch, the
FP8 pass): milliseconds per call between CUDA events, after a warm-up. The benchmarks have their own
fuller harness (benchmarks/harness.py: L2 flushing, CUDA-graph GPU time); a decision made inside
``optimize`` needs only a quick, robust comparison of candidates on the same inputs.

Candidates are timed interleaved, in rounds (A, B, C, A, B, C, ...), each round giving a median per
candidate, and each candidate keeps its best round. Timed one after the other, a candidate measured while
the GPU's clocks were still rising, or while another process used the GPU, lost by chance: the attention
dispatch once chose a slower kernel for the whole run that way (docs/kernels.md, "Timing").

Two measures. :func:`fastest_cuda_ms` times each call as the caller makes it, host time included: what an
eager model pays. :func:`fastest_cuda_graph_ms` times the GPU's work alone, by replaying the calls captured
in a CUDA graph: what a step costs once compiled code no longer runs the candidates' Python per call (an
FP8 linear's host time per call is many times its GPU time at small shapes, docs/kernels.md "FP8 linear":
timed per call, it lost everywhere, even where compiled it wins).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from kernel_pytorch.errors import first_line

__all__ = ["fastest_cuda_ms", "fastest_cuda_graph_ms", "captured_calls", "median_cuda_ms", "median_ms",
           "measurement_compiles", "weight_copies", "rotating", "Timings", "GRAPH_TIME", "PER_CALL"]

_Copy = TypeVar("_Copy")

GRAPH_TIME = "GPU time (CUDA graph)"
PER_CALL = "per call"


@dataclass(frozen=True)
class Timings:
    """Milliseconds per call of each candidate, how they were measured (:data:`GRAPH_TIME` or
    :data:`PER_CALL`), and why not by CUDA graph when that was asked for and could not be done."""

    ms: dict[str, float]
    method: str
    fallback: str | None = None

    def describe(self) -> str:
        return self.method if self.fallback is None else f"{self.method}, {self.fallback}"

    def faster(self, candidate: str, incumbent: str) -> bool:
        """Whether ``candidate`` measured faster than ``incumbent`` (one that was not timed never wins)."""
        return self.ms.get(candidate, float("inf")) < self.ms.get(incumbent, float("inf"))

    def in_microseconds(self) -> str:
        """``"name 4.2 us, name 15.6 us"``, as the decode passes' report lines give them."""
        return ", ".join(f"{name} {value * 1e3:.1f} us" for name, value in self.ms.items())


@contextlib.contextmanager
def measurement_compiles():
    """How a measurement inside ``optimize`` compiles (FlexAttention in the attention dispatch, the unfused
    loss in the linear cross-entropy pass): wrap both the compile and the timed calls in it.

    Dynamo's recompile limits (8 per code object by default) are lifted: one entry per problem would
    otherwise push a model's later problems back to eager. And the backward is compiled with the forward:
    the measurement runs inside the model's own capture, which holds Dynamo's compile lock, and on CUDA
    autograd runs the backward on a device thread, whose lazy backward compile waits for that lock forever
    (GPU runs: optimize hung in ``compile_fx_backward``, for a sliding window in training, then for the
    LM head's loss).
    """
    with torch._dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16), \
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        yield


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


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 2, runs: int = 7) -> float:
    """:func:`median_cuda_ms` on a CUDA device; elsewhere the median of the host clock around each call (a CPU
    call is done when it returns)."""
    if device.type == "cuda":
        return median_cuda_ms(fn, warmup, runs)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def fastest_cuda_ms(candidates: Mapping[str, Callable[[], object]], rounds: int = 3, warmup: int = 2,
                    runs: int = 5) -> dict[str, float]:
    """Per candidate, the best over ``rounds`` interleaved rounds of its median time over ``runs`` calls,
    in ms (module docstring). All candidates are warmed up before the first round."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    return _best_round({name: (lambda fn=fn: median_cuda_ms(fn, warmup=0, runs=runs))
                        for name, fn in candidates.items()}, rounds)


def fastest_cuda_graph_ms(candidates: Mapping[str, Callable[[], object]], rounds: int = 3, warmup: int = 2,
                          runs: int = 5, calls_per_graph: int = 8) -> Timings:
    """Per candidate, the GPU time of one call in ms: ``calls_per_graph`` calls captured in one CUDA graph
    (after ``warmup`` calls on a side stream), the graph's replays timed between CUDA events, ``runs`` per
    round, in interleaved rounds keeping each candidate's best round (as :func:`fastest_cuda_ms`).

    A candidate made by :func:`rotating` raises ``calls_per_graph`` to its number of copies, so that a graph
    reads each copy (and every candidate's graph holds as many calls).

    If any candidate cannot be captured (it synchronizes with the host, or runs on the CPU), all of them are
    timed per call instead, and :attr:`Timings.fallback` says why: one candidate's GPU time against
    another's time per call would compare different things.
    """
    if not candidates:
        raise ValueError("fastest_cuda_graph_ms: no candidates to time")
    _require_positive(rounds=rounds, warmup=warmup, runs=runs, calls_per_graph=calls_per_graph)
    calls_per_graph = max([calls_per_graph] + [len(c) for c in candidates.values() if isinstance(c, _Rotating)])
    if not torch.cuda.is_available():
        raise RuntimeError("fastest_cuda_graph_ms times CUDA graphs: it needs a CUDA GPU, and none is available")
    try:
        graphs = captured_calls(candidates, warmup, calls_per_graph)
    except Exception as error:  # capture is how it times, not what: the per-call timer still answers
        reason = f"CUDA-graph capture failed ({first_line(error)})"
        return Timings(fastest_cuda_ms(candidates, rounds, warmup=0, runs=runs), PER_CALL, reason)
    per_call = {name: (lambda graph=graph: median_cuda_ms(graph.replay, warmup=0, runs=runs) / calls_per_graph)
                for name, graph in graphs.items()}
    return Timings(_best_round(per_call, rounds), GRAPH_TIME)


def _best_round(time_round: Mapping[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each candidate's smallest time over ``rounds`` rounds of ``time_round[name]()``, interleaved."""
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, timed in time_round.items():
            time = timed()
            best[name] = min(best.get(name, time), time)
    return best


def captured_calls(candidates: Mapping[str, Callable[[], object]], warmup: int,
                   calls: int) -> dict[str, torch.cuda.CUDAGraph]:
    """One CUDA graph of ``calls`` calls per candidate (benchmarks/harness.py times its replays too). The
    warm-up runs on a side stream first, as capture requires: lazy initialization (cuBLAS workspaces, Triton
    compilation, the allocator's first blocks) must not happen while the stream is captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in candidates.values():
            for _ in range(warmup):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graphs = {}
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    before = generator.clone_state()
    for name, fn in candidates.items():
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
        except BaseException:
            # A capture that fails leaves the device's RNG marked as capturing: every later random draw on it
            # raised "Offset increment outside graph capture" (torch 2.11). Its state from before returns.
            generator.graphsafe_set_state(before)
            raise
        graphs[name] = graph
    return graphs


def weight_copies(make: Callable[[], _Copy], bytes_per_copy: int, device: torch.device) -> list[_Copy]:
    """Copies of a candidate's weights (``make()`` each, ``bytes_per_copy`` bytes), enough that reading them in turn
    reads over twice the device's L2 cache. Timed on the next copy each call (:func:`rotating`), a call reads its
    weights from memory, as a decode step reads each weight once per token; weights reused call after call stay in
    the H100's 50 MB L2, and a decision timed that way picked the kernel that was slower in the step
    (docs/kernels.md, "Decode GEMV")."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    return [make() for _ in range(max(1, -(-2 * l2_bytes // max(bytes_per_copy, 1))))]  # one of twice the L2 or more


def rotating(fn: Callable[[_Copy], object], copies: Sequence[_Copy]) -> Callable[[], object]:
    """A call of ``fn`` on the next of ``copies`` each time (one CUDA graph captures a copy per call:
    :func:`fastest_cuda_graph_ms` captures at least as many calls as there are copies)."""
    return _Rotating(fn, copies)


class _Rotating:
    """:func:`rotating`'s calls; ``len``: its number of copies."""

    def __init__(self, fn: Callable[[_Copy], object], copies: Sequence[_Copy]):
        self._fn, self._turn, self._copies = fn, itertools.cycle(copies), len(copies)

    def __call__(self) -> object:
        return self._fn(next(self._turn))

    def __len__(self) -> int:
        return self._copies


def _require_positive(**counts: int) -> None:
    bad = [f"{name}={value!r}" for name, value in counts.items() if not isinstance(value, int) or value < 1]
    if bad:
        raise ValueError(f"timing counts must be integers >= 1: {', '.join(bad)}")
