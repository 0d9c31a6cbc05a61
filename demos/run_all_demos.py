"""Run every demo (each in its own process), show progress, then a summary table.

    python demos/run_all_demos.py --quick

Exits non-zero if any demo fails. A demo that needs hardware this machine lacks reports 'skipped'
with the reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from _common import RESULT_PREFIX

DEMOS = (
    ("hardware and backends", "hardware_and_backends.py"),
    ("attention rewriting", "attention_rewrite.py"),
    ("fused kernels, training", "fused_kernels.py"),
    ("optimize a transformer LM", "optimize_transformer.py"),
)
HERE = Path(__file__).resolve().parent


def run_demo(script: str, quick: bool, timeout_s: float) -> dict:
    command = [sys.executable, str(HERE / script), *(["--quick"] if quick else [])]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "notes": [f"timed out after {timeout_s:.0f} s"], "seconds": timeout_s}
    result = next((json.loads(line[len(RESULT_PREFIX):]) for line in reversed(done.stdout.splitlines())
                   if line.startswith(RESULT_PREFIX)), None)
    if result is None or done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        result = {"status": "failed", "notes": [f"exit code {done.returncode}", *tail]}
    result["seconds"] = time.perf_counter() - started
    result["log"] = done.stdout
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (under 3 minutes on a CPU)")
    parser.add_argument("--verbose", action="store_true", help="print each demo's own output")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per demo")
    args = parser.parse_args()
    console = Console()
    results = {}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as progress:
        for name, script in DEMOS:
            task = progress.add_task(name)
            results[name] = run_demo(script, args.quick, args.timeout)
            progress.update(task, description=f"{name}: {results[name]['status']}")
            progress.stop_task(task)
    if args.verbose:
        for name, result in results.items():
            console.rule(name)
            console.print(result.get("log", ""), markup=False, highlight=False)
    console.print(_summary(results))
    failed = [name for name, result in results.items() if result["status"] == "failed"]
    if failed:
        console.print(f"[red]{len(failed)} demo(s) failed:[/red] {', '.join(failed)}")
    return 1 if failed else 0


def _summary(results: dict) -> Table:
    table = Table(title="kernel_pytorch demos")
    for column in ("demo", "status", "speedup", "memory saved", "seconds", "notes"):
        table.add_column(column, overflow="fold")
    colours = {"ok": "green", "skipped": "yellow", "failed": "red"}
    for name, r in results.items():
        speedup = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        memory = f"{r['memory_saved_mb']:.0f} MB" if r.get("memory_saved_mb") else "-"
        status = f"[{colours.get(r['status'], 'white')}]{r['status']}[/]"
        table.add_row(name, status, speedup, memory, f"{r['seconds']:.1f}", "; ".join(r.get("notes", [])))
    return table


if __name__ == "__main__":
    sys.exit(main())
