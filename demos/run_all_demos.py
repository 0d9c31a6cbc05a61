"""Run every demo (each in its own process), show progress, then a summary table.

    python demos/run_all_demos.py --quick          # every demo; under 3 minutes on a 2-core CPU
    python demos/run_all_demos.py --list           # the demos, by script name
    python demos/run_all_demos.py --only fp8_training block_fusion

Each demo checks its own numerics and writes its result (status, speedup, memory saved, notes) to a JSON
file this script names in the environment (demos/_common.py); run by hand, a demo prints only its own
lines. Exits non-zero if any demo fails. A demo, or a part of one, that needs hardware this machine lacks
says so in its notes ('skipped' when nothing of it could run). A speedup below 1.0 comes with the reason,
and whether it is expected on this machine; 'ok' is the verdict on the numerics.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from _common import RESULT_FILE_ENV, plain, speedup_note

# (title, script): one demo per capability.
DEMOS = (
    ("hardware and backends", "hardware_and_backends.py"),
    ("attention rewriting", "attention_rewrite.py"),
    ("sparse attention", "sparse_attention.py"),
    ("fused kernels, training", "fused_kernels.py"),
    ("FP8 training", "fp8_training.py"),
    ("block fusion", "block_fusion.py"),
    ("ring attention", "ring_attention.py"),
    ("memory wrappers", "memory_wrappers.py"),
    ("optimize a transformer LM", "optimize_transformer.py"),
    ("generate() after optimize", "generation.py"),
)
HERE = Path(__file__).resolve().parent


def run_demo(script: str | Path, quick: bool, timeout_s: float) -> dict:
    """Run one demo script (a name in this folder, or a path) and return the result it wrote, with
    ``seconds`` and ``log`` added; a crash, a missing result or a non-zero exit is 'failed'."""
    command = [sys.executable, str(HERE / script), *(["--quick"] if quick else [])]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="demo_result_") as directory:
        result_file = Path(directory, "result.json")
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False,
                                  env={**os.environ, RESULT_FILE_ENV: str(result_file)})
        except subprocess.TimeoutExpired:
            return {"status": "failed", "notes": [f"timed out after {timeout_s:.0f} s"], "seconds": timeout_s}
        result = json.loads(result_file.read_text()) if result_file.exists() else None
    if result is None:  # it crashed before demo_main could report, or never called it
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        result = {"status": "failed", "notes": [f"exit code {done.returncode}, no result written", *tail]}
    elif done.returncode != 0 and result["status"] != "failed":
        result = {**result, "status": "failed", "notes": [f"exit code {done.returncode}", *result.get("notes", [])]}
    result["seconds"] = time.perf_counter() - started
    result["log"] = done.stdout
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=plain(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (under 3 minutes on a CPU)")
    parser.add_argument("--verbose", action="store_true", help="print each demo's own output")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per demo")
    parser.add_argument("--list", action="store_true", help="list the demos and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these demos (script names, no .py)")
    args = parser.parse_args(argv)
    if args.list:
        for name, script in DEMOS:
            print(f"{Path(script).stem:24} {name}")
        return 0
    try:
        demos = _selected(args.only)
    except ValueError as error:
        parser.error(str(error))
    # A log or a pipe gets a wide table instead of rich's 80-column default; a terminal keeps its width.
    console = Console(width=None if sys.stdout.isatty() else 150)
    results = {}
    started = time.perf_counter()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as progress:
        tasks = {name: progress.add_task(f"{name}: waiting", start=False) for name, _ in demos}
        for name, script in demos:
            progress.start_task(tasks[name])
            progress.update(tasks[name], description=f"{name}: running")
            results[name] = run_demo(script, args.quick, args.timeout)
            progress.update(tasks[name], description=f"{name}: {results[name]['status']}")
            progress.stop_task(tasks[name])
    if args.verbose:
        for name, result in results.items():
            console.rule(name)
            console.print(result.get("log", ""), markup=False, highlight=False)
    console.print(_summary(results))
    console.print(f"{len(results)} demos in {time.perf_counter() - started:.0f} s")
    failed = [name for name, result in results.items() if result["status"] == "failed"]
    if failed:
        console.print(f"[red]{len(failed)} demo(s) failed:[/red] {', '.join(failed)}")
    return 1 if failed else 0


def _selected(names: list[str] | None) -> tuple[tuple[str, str], ...]:
    """The (title, script) pairs named by ``--only`` (all without it); unknown names raise ValueError."""
    if not names:
        return DEMOS
    by_stem = {Path(script).stem: (title, script) for title, script in DEMOS}
    unknown = [name for name in names if name.removesuffix(".py") not in by_stem]
    if unknown:
        raise ValueError(f"unknown demo(s) {', '.join(unknown)}; choose from {', '.join(by_stem)}")
    return tuple(by_stem[name.removesuffix(".py")] for name in names)


def _summary(results: dict) -> Table:
    """One row per demo: its status (the numerics), figures, and notes, led by why a speedup is below 1.0."""
    table = Table(title="kernel_pytorch demos")
    for column in ("demo", "status", "speedup", "memory saved", "seconds", "notes"):
        table.add_column(column, overflow="fold")
    colours = {"ok": "green", "skipped": "yellow", "failed": "red"}
    for name, r in results.items():
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        memory = f"{r['memory_saved_mb']:.3g} MB" if r.get("memory_saved_mb") else "-"
        status = f"[{colours.get(r['status'], 'white')}]{r['status']}[/]"
        notes = "; ".join(note for note in r.get("notes", []) if note)
        slower = speedup_note(r.get("speedup"), r.get("slowdown_expected"))
        if slower is not None:
            colour = "yellow" if r.get("slowdown_expected") else "red"
            speedup = f"[{colour}]{speedup}[/]"
            notes = f"[{colour}]{escape(slower)}[/]" + (f"; {escape(notes)}" if notes else "")
        else:
            notes = escape(notes)
        table.add_row(name, status, speedup, memory, f"{r['seconds']:.1f}", notes)
    return table


if __name__ == "__main__":
    sys.exit(main())
