"""The one timing harness for benchmarks and demos: warm-up, median of many runs, environment record.

On CUDA, each run is timed with CUDA events and the L2 cache is flushed before it (a 256 MiB write,
larger than the H100's 50 MB and H200's 60 MB L2), so that inputs are read from HBM as in a real model.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kernel_pytorch.timing import captured_calls

__all__ = ["Timing", "measure", "measure_gpu_time", "host_us_per_call", "environment", "write_result", "timing_dict",
           "same_device_models", "save_figure", "write_final_result", "scaled_run_parser", "scaled_run_args",
           "dynamo_compile_counts", "dynamo_snapshot", "dynamo_changes", "synchronize", "start_stack_dumps",
           "format_stacks", "RESULTS_DIR"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_L2_FLUSH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    runs: int


def measure(fn: Callable[[], Any], *, warmup: int = 3, runs: int = 20, device: str | None = None) -> Timing:
    """Median wall time of ``fn()`` in milliseconds, synchronised on CUDA."""
    on_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    for _ in range(warmup):
        fn()
    if on_cuda:
        torch.cuda.synchronize()
    times = [_time_cuda(fn) if on_cuda else _time_host(fn) for _ in range(runs)]
    return Timing(statistics.median(times), min(times), max(times), runs)


def measure_gpu_time(fn: Callable[[], Any], *, calls: int = 20, replays: int = 7) -> float:
    """Median GPU time of one ``fn()`` in ms, host overhead excluded: ``calls`` calls captured in one
    CUDA graph, replayed ``replays`` times. For kernel tuning and kernel-vs-kernel choices; the
    per-call :func:`measure` is what a model's step sees."""
    graph = captured_calls({"fn": fn}, warmup=2, calls=calls)["fn"]  # warm-up compiles and allocates
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def host_us_per_call(fn: Callable[[], Any], calls: int = 200, rounds: int = 5) -> float:
    """Best of ``rounds`` of ``calls`` back-to-back calls, in us per call, synchronized at the end: the
    host's time per call where the kernels are shorter than their launches."""
    best = float("inf")
    for _ in range(rounds + 1):  # the first round warms up
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def _time_host(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


_flush_buffer: torch.Tensor | None = None


def _time_cuda(fn: Callable[[], Any]) -> float:
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    _flush_buffer.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def environment() -> dict[str, Any]:
    """Device, versions, date and command: recorded with every result."""
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    return env


def earlier_parts(path: Path, parts: Iterable[str]) -> dict[str, Any]:
    """The ``parts`` an earlier result file at ``path`` holds, for a run of other parts to write back with
    its own, and under ``environments`` the environment each was measured in (the one the file records for
    the part, else the file's); {} when there is no such file or part."""
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    kept = {part: earlier[part] for part in parts if part in earlier}
    recorded = earlier.get("environments", {})
    environments = {part: recorded.get(part, earlier.get("environment")) for part in kept}
    return {**kept, "environments": environments} if kept else {}


def scaled_run_parser(description: str, quick_help: str) -> argparse.ArgumentParser:
    """The options every whole-model benchmark shares: ``--quick`` (``quick_help`` says what it reduces),
    ``--device cpu`` (a smoke run of the flow on tiny fp32 models) and ``--out``; see :func:`scaled_run_args`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of the whole flow on tiny fp32 models (no measurement)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--stack-dumps", type=float, default=None, metavar="SECONDS",
                        help="print every thread's Python stack to stderr every SECONDS (where a set-up that does not "
                             "finish within the GPU machine's call spends its time)")
    return parser


def scaled_run_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parsed, refusing ``--quick`` with ``--device cpu`` (two different reductions); ``--stack-dumps`` started."""
    args = parser.parse_args(argv)
    if args.quick and args.device == "cpu":
        parser.error("--quick and --device cpu are two different reductions; choose one")
    if args.stack_dumps is not None:
        if args.stack_dumps <= 0:
            parser.error("--stack-dumps takes a positive number of seconds")
        start_stack_dumps(args.stack_dumps)
    return args


def start_stack_dumps(period_s: float) -> threading.Thread:
    """Every ``period_s``, every thread's Python stack to stderr, from a daemon thread. It reads the frames holding
    the GIL: faulthandler's watchdog reads them without it and crashed the process inside an Inductor compile."""
    def dump_forever() -> None:
        while True:
            time.sleep(period_s)
            print(format_stacks(), file=sys.stderr, flush=True)

    thread = threading.Thread(target=dump_forever, name="stack-dumps", daemon=True)
    thread.start()
    return thread


def format_stacks() -> str:
    """Every thread's Python stack, most recent call last, each headed by the thread's name."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    stacks = [f"Thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
              for ident, frame in sys._current_frames().items()]
    return "\n".join(["--- Python stacks ---", *stacks])


def same_device_models(path: Path, fresh: bool) -> dict[str, Any]:
    """The ``models`` of an earlier result file at ``path`` measured on this same device, to merge a run into;
    {} when ``fresh``, absent, unreadable or from another device (two machines' numbers in one table mislead)."""
    if fresh or not path.exists():
        return {}
    try:
        previous = json.loads(path.read_text())
    except ValueError:
        return {}
    if previous.get("environment", {}).get("device") != environment()["device"]:
        return {}
    return previous.get("models", {})


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write (100 dpi) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_final_result(name: str, payload: dict[str, Any], directory: Path,
                       plot: Callable[[dict[str, Any], Path], None]) -> Path:
    """A run's last write: ``<name>.json``, its plot ``<name>.png`` (matplotlib is a dev extra: without it, a
    line says so), then the summary lines and where the file went."""
    path = write_result(name, payload, directory)
    payload["environment"] = environment()
    try:
        plot(payload, directory / f"{name}.png")
    except ImportError as error:
        print(f"no plot: {error}")
    print("\n".join(payload.get("summary", [])))
    print(f"wrote {path} in {payload.get('seconds')} s")
    return path


def write_result(name: str, payload: dict[str, Any], directory: Path = RESULTS_DIR) -> Path:
    """``results/<name>.json`` holding ``payload`` and the environment."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), **payload}, indent=2, default=str) + "\n")
    return path


def synchronize(device: str | torch.device) -> None:
    """Wait for the GPU's queued work when ``device`` is a CUDA one (a host clock read after it covers the GPU's)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def dynamo_compile_counts() -> dict[str, int]:
    """TorchDynamo's counters of graphs and frames compiled, and the recompile counters some torch versions keep."""
    from torch._dynamo.utils import counters

    counts = {"unique_graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"]}
    for group, counter in counters.items():
        if "recompil" in group:
            counts.update({f"{group}.{k}": v for k, v in counter.items()})
        counts.update({f"{group}.{k}": v for k, v in counter.items() if "recompil" in str(k)})
    return counts


def dynamo_snapshot() -> dict[str, int]:
    """:func:`dynamo_compile_counts` now, with TorchDynamo's record of compiles (the recompile reasons; it keeps the
    last 64) emptied: what :func:`dynamo_changes` compares with."""
    from torch._dynamo import utils

    if hasattr(utils, "clear_compilation_metrics"):
        utils.clear_compilation_metrics()
    return dynamo_compile_counts()


def dynamo_changes(before: dict[str, int]) -> tuple[dict[str, int], list[str]]:
    """What TorchDynamo compiled since ``before`` (:func:`dynamo_snapshot`): each counter's increase (every counter,
    zeros included), and the recompile reasons it recorded (300 characters each)."""
    from torch._dynamo import utils

    after = dynamo_compile_counts()
    metrics = getattr(utils, "get_compilation_metrics", lambda: [])()
    reasons = [str(m.recompile_reason)[:300] for m in metrics if getattr(m, "recompile_reason", None)]
    return {key: value - before.get(key, 0) for key, value in after.items()}, reasons


def timing_dict(timing: Timing) -> dict[str, float]:
    return asdict(timing)
