"""The names of the registered passes, which the config's ``disable_passes`` and ``extra_passes`` are
checked against.

:func:`kernel_pytorch.passes.register_pass` records each name here; the config reads them. This module
sits below both, so that the config imports no pass (the passes read the config and the hardware).
Importing ``kernel_pytorch`` registers the built-in passes, so they are all here before any config
can be built.
"""

from __future__ import annotations

__all__ = ["record_pass_name", "registered_pass_names", "check_pass_names"]

_NAMES: set[str] = set()


def record_pass_name(name: str) -> None:
    _NAMES.add(name)


def registered_pass_names() -> frozenset[str]:
    return frozenset(_NAMES)


def check_pass_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names``, if each is a registered pass's; else a ``ValueError`` that lists the unknown ones."""
    unknown = [name for name in names if name not in _NAMES]
    if unknown:
        raise ValueError(f"unknown pass name(s) {unknown}; registered passes: {sorted(_NAMES)}")
    return names
