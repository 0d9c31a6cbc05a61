"""Inductor's fallback lowerings for our custom ops, registered before a compile.

A custom op that Inductor does not generate code for (one of ours kept opaque, see
:attr:`~kernel_pytorch.capture.CompilerChoice.opaque_triton_ops`, or a ``custom_op`` such as the attention ops) is
called from Inductor's generated code through a fallback lowering, which Inductor registers itself at the op's
first call in a graph. Torch before 2.13 formats that call's IR arguments for an info log there, whether or not the
log is on, and the text grows with the graph's depth: for an op first called after 16 decoder layers (the
generation prefill with opaque ops, on an H100) the compile did not finish in 255 s. Registered up front, as
Inductor would (the op's layout-constraint tag, or the default for custom ops), no graph takes that path.
"""

from __future__ import annotations

import torch

__all__ = ["register_fallbacks"]

_NAMESPACE = "kernel_pytorch::"


def register_fallbacks() -> None:
    """Registers a fallback lowering for each ``kernel_pytorch::`` op Inductor has no lowering for. Idempotent."""
    from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    for op in _our_ops():
        if op not in lowerings:
            constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            make_fallback(op, layout_constraint=constraint, warn=False)


def _our_ops() -> list[torch._ops.OpOverload]:
    """Every overload of the ops registered under our namespace so far (ops register at import)."""
    ops = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith(_NAMESPACE):
            name, _, overload = qualified[len(_NAMESPACE):].partition(".")
            ops.append(getattr(getattr(torch.ops.kernel_pytorch, name), overload or "default"))
    return ops
