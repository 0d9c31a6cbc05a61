"""The kernel-pytorch command.

    kernel-pytorch info [--device VENDOR] [--json]   the hardware found, the backend chosen, what applies and why
    kernel-pytorch demo [NAME] [--quick] [--list]    one demo of demos/, or all of them (demos/run_all_demos.py)
    kernel-pytorch bench SUITE [ARGS...] [--list]    benchmarks/SUITE.py with ARGS (e.g. --quick)

demo and bench run the scripts of a source checkout (pip install -e .), each in its own process with its
exit code: the package never imports them, and a wheel does not ship them.
"""
# The docstring above is the text of --help, which argparse prints verbatim: plain text, no reST markup.

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kernel_pytorch.backends import get_backend
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.errors import HardwareUnavailableError
from kernel_pytorch.hardware import HardwareInfo, detect_hardware

__all__ = ["main"]


# The checkout's root: demos/ and benchmarks/ sit next to the package directory.
_ROOT = Path(__file__).resolve().parent.parent
_RUN_ALL = "run_all_demos"
# Exit code after a pipe closed early (kernel-pytorch info | head -1): rich's Console exits with it too.
_BROKEN_PIPE_EXIT = 1

# Where each benchmark suite runs, for bench --list. The suites are scripts the package never imports, so
# what each one needs is declared here; a suite missing from _SUITE_HARDWARE is listed as undeclared.
_CPU_OK = "CPU ok"
_CPU_SMOKE_RUN = "CPU: smoke run only (--device cpu); measures on a CUDA GPU"
_NEEDS_CUDA_GPU = "needs a CUDA GPU"
_NEEDS_FP8_GPU = "needs an FP8 GPU (NVIDIA compute capability >= 8.9)"
_NEEDS_CUDNN = "needs an NVIDIA GPU and the cudnn extra"
_SUITE_HARDWARE = {
    "attention": _NEEDS_CUDA_GPU,
    "block_fusion": _CPU_SMOKE_RUN,
    "decode": _CPU_SMOKE_RUN,
    "diagnose_cudagraph_skip": _NEEDS_CUDA_GPU,
    "diagnose_sdpa_gradients": _NEEDS_CUDA_GPU,
    "diagnose_variable_shapes": _NEEDS_CUDA_GPU,
    "e2e": _CPU_SMOKE_RUN,
    "fp8": _NEEDS_FP8_GPU,
    "inspect_compiled_norm": _NEEDS_CUDA_GPU,
    "kernel_resources": _CPU_OK,  # compiles for sm_90a and reads ptxas's report; runs no kernel
    "kernels": _NEEDS_CUDA_GPU,
    "memory": _NEEDS_CUDA_GPU,
    "profile_cudnn_band": _NEEDS_CUDNN,
    "profile_decode_step": _NEEDS_CUDA_GPU,
    "profile_warm_up": _NEEDS_CUDA_GPU,
    "profile_float8_linear": _NEEDS_FP8_GPU,
    "render_readme_table": _CPU_OK,  # reads benchmarks/results/ and prints Markdown
    "ring_attention": _NEEDS_CUDA_GPU,
    "saved_activations": _CPU_OK,  # traces the compiled graphs on the CPU, runs no GPU kernel
    "sparse_attention": _NEEDS_CUDA_GPU,
    "tune_flex_attention": _NEEDS_CUDA_GPU,
    "tune_float8_amax": _NEEDS_CUDA_GPU,
    "tune_decode_linear": _NEEDS_CUDA_GPU,
    "tune_row_kernels": _NEEDS_CUDA_GPU,
    "variable_shapes": _CPU_SMOKE_RUN,
}
_UNDECLARED = "not declared (see _SUITE_HARDWARE in kernel_pytorch/cli.py)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        code = _command(args)
        sys.stdout.flush()  # a reader gone early shows here, not as a traceback when the interpreter exits
    except BrokenPipeError:
        return _after_broken_pipe()
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kernel-pytorch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    info_help = "detected hardware, chosen backend, applicable passes and kernels"
    info = commands.add_parser("info", help=info_help, description=info_help)
    info.add_argument("--device", default="auto", help="force a vendor: nvidia, amd, tpu, intel, cpu")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    demo_help = "run a demo of demos/ (all of them without NAME)"
    demo = commands.add_parser("demo", help=demo_help, description=demo_help)
    demo.add_argument("name", nargs="?", help="the demo's script name, e.g. fp8_training (see --list)")
    demo.add_argument("--quick", action="store_true", help="small sizes: all demos in under 3 minutes on a CPU")
    demo.add_argument("--list", action="store_true", help="list the demos and exit")
    bench_help = "run benchmarks/SUITE.py with the arguments that follow it"
    bench = commands.add_parser("bench", help=bench_help, description=bench_help)
    bench.add_argument("--list", action="store_true", help="list the suites, with what each runs on, and exit")
    bench.add_argument("suite", nargs="?", help="the suite's script name, e.g. fp8 (see --list)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the suite (e.g. --quick; --help shows its own)")
    return parser


def _command(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return _demo(args.name, args.quick, args.list)
    if args.command == "bench":
        return _bench(args.suite, args.args, args.list)
    return _info(args.device, args.json)


def _after_broken_pipe() -> int:
    """The reader of stdout left (``| head``): send what is still buffered to devnull, so that the flush at
    exit raises nothing either, and exit quietly (Python's note on SIGPIPE, as rich does)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return _BROKEN_PIPE_EXIT


# ----------------------------------------------------------------------------------------- demo, bench

def _scripts(folder: str, exclude: tuple[str, ...] = ()) -> dict[str, Path] | str:
    """Runnable scripts of ``<checkout>/<folder>`` by name (those with a ``__main__`` block, not ``_*``,
    not ``exclude``), or the error message when the folder is missing."""
    directory = _ROOT / folder
    if not directory.is_dir():
        return (f"{folder}/ not found next to the kernel_pytorch package ({_ROOT}): the {folder} ship with the "
                "source checkout, not with the wheel; clone the repository and pip install -e . there")
    return {path.stem: path for path in sorted(directory.glob("*.py"))
            if not path.stem.startswith("_") and path.stem not in exclude and "__main__" in path.read_text()}


def _summary_line(path: Path) -> str:
    """The first sentence of the script's docstring, without a leading ``Demo:`` or reST's double backticks."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(docstring.replace("``", "").strip().split("\n\n")[0].split())
    return paragraph.split(". ")[0].removeprefix("Demo: ").rstrip(".")


def _listing(title: str, scripts: dict[str, Path], runs_on: dict[str, str] | None = None) -> Table:
    """Name and summary line of each script, and with ``runs_on`` (name: hardware) a column of it."""
    table = Table(title=title, title_justify="left")
    table.add_column("name")
    if runs_on is not None:
        table.add_column("runs on", overflow="fold")
    table.add_column("what", overflow="fold")
    for name, path in scripts.items():
        hardware = () if runs_on is None else (runs_on.get(name, _UNDECLARED),)
        table.add_row(name, *hardware, _summary_line(path))
    return table


def _find(kind: str, name: str, scripts: dict[str, Path], console: Console) -> Path | None:
    """The script called ``name`` (``.py`` and dashes allowed), or None after an error listing the names."""
    path = scripts.get(name.removesuffix(".py").replace("-", "_"))
    if path is None:
        console.print(f"[red]error:[/red] unknown {kind} {name!r}; choose one of: {', '.join(scripts)}", soft_wrap=True)
    return path


def _run(path: Path, args: Sequence[str]) -> int:
    """``python path args...`` in the checkout's root, output straight to this terminal; its exit code."""
    return subprocess.run([sys.executable, str(path), *args], cwd=_ROOT, check=False).returncode


def _demo(name: str | None, quick: bool, list_only: bool) -> int:
    console = Console()
    scripts = _scripts("demos")
    if isinstance(scripts, str):
        console.print(f"[red]error:[/red] {scripts}", soft_wrap=True)
        return 2
    demos = {stem: path for stem, path in scripts.items() if stem != _RUN_ALL}
    if list_only:
        console.print(_listing("demos (kernel-pytorch demo NAME [--quick]; without NAME: all of them)", demos))
        return 0
    path = scripts.get(_RUN_ALL) if name is None else _find("demo", name, demos, console)
    if path is None:
        return 2
    return _run(path, ["--quick"] if quick else [])


def _bench(suite: str | None, args: Sequence[str], list_only: bool) -> int:
    console = Console()
    scripts = _scripts("benchmarks")
    if isinstance(scripts, str):
        console.print(f"[red]error:[/red] {scripts}", soft_wrap=True)
        return 2
    if list_only or suite is None:
        console.print(_listing("benchmark suites (kernel-pytorch bench SUITE [--quick ...]; SUITE --help for its "
                               "options)", scripts, _SUITE_HARDWARE))
        if suite is None and not list_only:
            console.print("[red]error:[/red] name a suite", soft_wrap=True)
        return 0 if list_only else 2
    path = _find("benchmark suite", suite, scripts, console)
    return 2 if path is None else _run(path, args)


# ------------------------------------------------------------------------------------------------ info


def _info(device: str, as_json: bool) -> int:
    console = Console()
    try:
        config = OptimizeConfig(device=device)
        hardware = detect_hardware(config.device)
    except (HardwareUnavailableError, ValueError) as error:
        console.print(f"[red]error:[/red] {error}", soft_wrap=True)
        return 2
    backend = get_backend(hardware)
    plan = backend.plan(config)
    if as_json:
        print(json.dumps({"hardware": hardware.model_dump(mode="json"), "backend": backend.name,
                          "plan": [vars(item) for item in plan]}, indent=2))
        return 0
    console.print(_hardware_table(hardware))
    table = Table(title=f"backend: {backend.name}", title_justify="left")
    for column in ("kind", "name", "applies", "why"):
        table.add_column(column, overflow="fold")
    for item in plan:
        table.add_row(item.kind, item.name, "[green]yes[/green]" if item.applies else "[yellow]no[/yellow]", item.reason)
    console.print(table)
    return 0


def _hardware_table(hardware: HardwareInfo) -> Table:
    table = Table(title=f"hardware: {hardware.summary()}", show_header=False, title_justify="left")
    for name, value in hardware.model_dump().items():
        if name == "probes":
            continue
        table.add_row(name, _text(value))
    for probe, outcome in hardware.probes.items():
        table.add_row(f"probe {probe}", outcome)
    return table


def _text(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return ", ".join(map(str, value)) or "-"
    return "-" if value is None else str(value)


if __name__ == "__main__":
    sys.exit(main())
