"""Per-hardware backends and the registry that picks one: ``get_backend(detect_hardware())``."""

from __future__ import annotations

from kernel_pytorch.backends.amd import AmdBackend
from kernel_pytorch.backends.base import Backend, Kernel, OptimizationState, PlanItem
from kernel_pytorch.backends.cpu import CpuBackend
from kernel_pytorch.backends.intel import IntelBackend
from kernel_pytorch.backends.nvidia import NvidiaBackend
from kernel_pytorch.backends.tpu import TpuBackend
from kernel_pytorch.hardware import HardwareInfo

__all__ = ["Backend", "Kernel", "PlanItem", "OptimizationState", "get_backend", "BACKENDS",
           "NvidiaBackend", "AmdBackend", "TpuBackend", "IntelBackend", "CpuBackend"]

BACKENDS: dict[str, type[Backend]] = {
    cls.vendor: cls for cls in (NvidiaBackend, AmdBackend, TpuBackend, IntelBackend, CpuBackend)
}


def get_backend(hardware: HardwareInfo) -> Backend:
    """The backend for ``hardware.vendor``.

    Example::

        backend = get_backend(detect_hardware())
        for item in backend.plan():
            print(item.kind, item.name, item.applies, item.reason)
    """
    return BACKENDS[hardware.vendor](hardware)
