"""The one registry of passes, by name. Backends and the config refer to passes by these names."""

from __future__ import annotations

from typing import TypeVar

from kernel_pytorch.errors import UnknownPassError
from kernel_pytorch.pass_names import record_pass_name, registered_pass_names
from kernel_pytorch.passes.base import GraphPass, ModulePass

__all__ = ["register_pass", "get_pass", "registered_pass_names"]

_PASSES: dict[str, GraphPass | ModulePass] = {}

P = TypeVar("P", bound=type)


def register_pass(cls: P) -> P:
    """Class decorator: instantiate the pass and register it under ``cls.name``.

    Example::

        @register_pass
        class DropIdentity(GraphPass):
            name = "drop_identity"
            description = "remove aten.alias nodes"
            def run(self, gm, ctx): ...
    """
    if not issubclass(cls, (GraphPass, ModulePass)):
        raise TypeError(f"{cls.__name__} is neither a GraphPass nor a ModulePass")
    name = cls.name
    existing = _PASSES.get(name)
    if existing is not None and type(existing).__qualname__ != cls.__qualname__:
        raise ValueError(f"a pass named '{name}' is already registered ({type(existing).__qualname__})")
    _PASSES[name] = cls()
    record_pass_name(name)  # what the config checks its pass names against
    return cls


def get_pass(name: str) -> GraphPass | ModulePass:
    """The registered pass named ``name``. The built-in ones are all here: importing this module runs
    ``kernel_pytorch/passes/__init__.py`` first, which registers them."""
    try:
        return _PASSES[name]
    except KeyError:
        raise UnknownPassError(f"no pass named '{name}'; registered: {sorted(_PASSES)}") from None
