"""Demo: what kernel_pytorch finds on this machine, the backend it picks, and what applies there."""

from __future__ import annotations

from _common import DemoResult, demo_main
from rich.console import Console

from kernel_pytorch import detect_hardware, get_backend
from kernel_pytorch.cli import main as cli_main


def run(args) -> DemoResult:
    hardware = detect_hardware()
    backend = get_backend(hardware)
    if backend.vendor != hardware.vendor:
        return DemoResult("failed", notes=[f"backend {backend.vendor} chosen for {hardware.vendor}"])
    if cli_main(["info"]) != 0:
        return DemoResult("failed", notes=["kernel-pytorch info failed"])
    plan = backend.plan()
    applies = [item.name for item in plan if item.applies and item.kind == "kernel"]
    missing = [item.name for item in plan if not item.applies]
    Console().print(f"backend {backend.name}: kernels {', '.join(applies) or '-'}")
    return DemoResult("ok", notes=[f"{hardware.vendor}: {hardware.device_name}",
                                   f"not available: {', '.join(missing) or '-'}"])


if __name__ == "__main__":
    demo_main(__doc__, run)
