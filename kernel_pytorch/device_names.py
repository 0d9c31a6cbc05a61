"""The names of the hardware vendors and the spellings users reach for, below the config and the hardware
detection that both read them (neither imports the other for them)."""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["Vendor", "VENDORS", "DEVICE_ALIASES", "DeviceName"]

Vendor = Literal["nvidia", "amd", "tpu", "intel", "cpu"]
VENDORS: tuple[str, ...] = get_args(Vendor)

# Spellings users reach for, mapped to the vendor names used everywhere else.
DEVICE_ALIASES: dict[str, str] = {
    "cuda": "nvidia",
    "rocm": "amd",
    "hip": "amd",
    "xla": "tpu",
    "xpu": "intel",
}


class DeviceName(str):
    """What ``OptimizeConfig.device`` holds: the vendor name (``"nvidia"`` for ``"cuda"``), which every
    comparison and lookup sees, plus ``written``, the value as the user gave it, for messages to echo."""

    written: str

    def __new__(cls, vendor: str, written: str | None = None) -> DeviceName:
        name = super().__new__(cls, vendor)
        name.written = vendor if written is None else written
        return name

    def __getnewargs__(self) -> tuple[str, str]:  # pickle and copy rebuild it with both names
        return str(self), self.written
