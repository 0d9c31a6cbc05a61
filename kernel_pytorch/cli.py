"""``kernel-pytorch info``: the hardware found, the backend chosen, and what applies there and why."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from kernel_pytorch.backends import get_backend
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.errors import HardwareUnavailableError
from kernel_pytorch.hardware import HardwareInfo, detect_hardware

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernel-pytorch", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="detected hardware, chosen backend, applicable passes and kernels")
    info.add_argument("--device", default="auto", help="force a vendor: nvidia, amd, tpu, intel, cpu")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON instead of tables")
    args = parser.parse_args(argv)
    return _info(args.device, args.json)


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
