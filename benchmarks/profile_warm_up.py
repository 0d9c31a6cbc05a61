"""Where ``optimize``'s generation warm-up spends its time: each captured graph's passes and compile (seconds, node
count), TorchDynamo's own phase times, and the host profile's heaviest functions, for the 1B-class Llama of
benchmarks/decode.py on a fresh process. ``--first-generate 1 8`` then times the first two ``generate`` calls at
each batch size (prompt 512, 64 new tokens, as decode.py's quick run), so the warm-up that issue 27 counts (setup
plus the first generate) and what later first calls at a new size still cost are both seen, with what TorchDynamo
compiled meanwhile (its counters and recompile reasons) and a host profile of the first calls. A diagnosis tool for
issue 27's warm-up target.

    python benchmarks/profile_warm_up.py [--layers 16] [--top 45] [--out DIR] [--generation JSON] [--optimize JSON]
                                         [--no-host-profile] [--guards]
                                         [--no-warm-up-profile] [--first-generate BATCH ...]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import logging
import pstats
import re
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernel_pytorch  # noqa: E402
from benchmarks.harness import dynamo_changes, dynamo_snapshot, synchronize  # noqa: E402
from benchmarks.profile_decode_step import llama  # noqa: E402
from kernel_pytorch.capture import GraphOptimizer  # noqa: E402


@contextlib.contextmanager
def timed_compiles(records: list[str]) -> Iterator[list[str]]:
    """Within the block, each graph's compile seconds and size are appended to ``records``."""
    original = GraphOptimizer._compile

    def compile_and_time(self, gm, example_inputs, name, training):
        started = time.perf_counter()
        try:
            return original(self, gm, example_inputs, name, training)
        finally:
            calls = sum(n.op == "call_function" for n in gm.graph.nodes)
            symbolic = sum(isinstance(v, torch.SymInt) for v in example_inputs)
            records.append(f"{name}: compile {time.perf_counter() - started:6.1f} s, {calls} calls, "
                           f"{symbolic} symbolic size inputs")
            print(records[-1], flush=True)  # as it happens: a run cut at its time limit still shows them

    GraphOptimizer._compile = compile_and_time
    try:
        yield records
    finally:
        GraphOptimizer._compile = original


class SizePinningGuards(logging.Handler):
    """While installed, each guard that pins a symbolic size to a number (``Eq(s77, 16)``: the next size compiles
    again) is printed as it is added, with the stack that added it (our code, transformers' and Inductor's frames),
    from TorchDynamo's shape-environment log. Why ``compile_layers_once`` recompiled each prompt bucket on GPUs
    (docs/kernels.md, "Generation warm-up") is the question it answers."""

    _LOGGER = "torch.fx.experimental.symbolic_shapes"
    _FRAMES = ("kernel_pytorch", "transformers", "_inductor", "_functorch", "fake_tensor")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "[guard added]" not in message or "[guard suppressed]" in message \
                or not re.search(r"Eq\(s\w+, \d+\)", message):
            return
        frames = [f"    {frame.filename.split('site-packages/')[-1]}:{frame.lineno} {frame.name}"
                  for frame in traceback.extract_stack()[:-1] if any(part in frame.filename for part in self._FRAMES)]
        print("== guard: " + message[:400] + _node_in_flight() + "\n" + "\n".join(frames[-25:]), flush=True)

    def __enter__(self) -> SizePinningGuards:
        logger = logging.getLogger(self._LOGGER)
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, *_: object) -> None:
        logger = logging.getLogger(self._LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._level)


def _node_in_flight() -> str:
    """`` while running node: <its code>`` for the innermost FX node an interpreter (FakeTensorProp, Dynamo's
    get_fake_value) is running in this thread, else ``""``: which op of a rewritten graph added the guard."""
    frame = sys._getframe(2)
    while frame is not None:
        node = frame.f_locals.get("n", frame.f_locals.get("node"))
        if isinstance(node, torch.fx.Node):
            return f" while running node: {node.format_node()[:300]}"
        frame = frame.f_back
    return ""


def time_generate_calls(model: torch.nn.Module, batch: int, profiler: cProfile.Profile | None,
                        prompt: int = 512, new_tokens: int = 64) -> str:
    """Seconds of two greedy ``generate`` calls in a row at ``batch``: the first pays what the warm-up left (and runs
    under ``profiler`` when one is given)."""
    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
    seconds = []
    for call in range(2):
        synchronize(device)
        started = time.perf_counter()
        with profiler if profiler is not None and call == 0 else contextlib.nullcontext():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    line = f"generate at batch {batch} (prompt {prompt}, {new_tokens} new tokens): first {seconds[0]:.2f} s, " \
           f"second {seconds[1]:.3f} s"
    print(line, flush=True)
    return line


def dynamo_line(before: dict[str, int], during: str) -> str:
    """What TorchDynamo compiled since ``before`` (:func:`~benchmarks.harness.dynamo_snapshot`), so that a slow call
    can be told apart from a silent recompile."""
    changes, reasons = dynamo_changes(before)
    moved = {key: value for key, value in changes.items() if value}
    return f"== TorchDynamo during {during}: counters moved {moved or 'none'}; recompile reasons: {reasons or 'none'}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--generation", type=json.loads, default={}, metavar="JSON",
                        help="optimize(model, generation=...), e.g. '{\"compile_layers_once\": true}'")
    parser.add_argument("--optimize", type=json.loads, default={}, metavar="JSON",
                        help="other optimize(model, ...) options, e.g. '{\"compile\": false}' (a \"generation\" key joins "
                             "--generation)")
    parser.add_argument("--no-host-profile", action="store_true", help="no cProfile (it slows the host's work)")
    parser.add_argument("--guards", action="store_true",
                        help="print each guard pinning a symbolic size to a number, with the stack that added it")
    parser.add_argument("--no-warm-up-profile", action="store_true",
                        help="profile only the first generate calls: the warm-up runs at full speed")
    parser.add_argument("--first-generate", type=int, nargs="*", default=[], metavar="BATCH",
                        help="after the warm-up, time the first two generate calls at each batch size")
    args = parser.parse_args(argv)
    records: list[str] = []
    profiler = cProfile.Profile()
    with timed_compiles(records), SizePinningGuards() if args.guards else contextlib.nullcontext():
        options = dict(args.optimize)  # its "generation", if any, joins --generation
        generation = {"enabled": True, **args.generation, **options.pop("generation", {})}
        model = kernel_pytorch.optimize(llama("1b", args.layers), **options, generation=generation)
        warm_up_before = dynamo_snapshot()
        started = time.perf_counter()
        with contextlib.nullcontext() if args.no_host_profile or args.no_warm_up_profile else profiler:
            model.generate.warm_up(progress=False)
    seconds = time.perf_counter() - started
    warm_up_dynamo = dynamo_line(warm_up_before, "the warm-up")
    print(f"== warm-up {seconds:.1f} s\n{warm_up_dynamo}", flush=True)
    first_profiler = None if args.no_host_profile else cProfile.Profile()
    before = dynamo_snapshot()
    first_calls = [time_generate_calls(model, batch, first_profiler) for batch in args.first_generate]
    first_calls += [dynamo_line(before, "the first generate calls")] if args.first_generate else []
    stream = io.StringIO()
    if not (args.no_host_profile or args.no_warm_up_profile):
        pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(args.top)
    if first_profiler is not None and args.first_generate:
        for order in ("cumulative", "tottime"):  # tottime: the functions that hold the host themselves
            stream.write(f"== host profile of the first generate calls ({order}):\n")
            pstats.Stats(first_profiler, stream=stream).sort_stats(order).print_stats(args.top)
    phases = kernel_pytorch.report_of(model).timings_s
    text = "\n".join([f"== warm-up {seconds:.1f} s; report phases: " + ", ".join(
        f"{k} {v:.1f}" for k, v in phases.items() if v >= 0.5), *records, warm_up_dynamo, *first_calls,
        "== TorchDynamo compile_times:", str(torch._dynamo.utils.compile_times(repr="str")),
        "== host profile (cumulative):", stream.getvalue()])
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_warm_up.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
