"""Attention kernels and their dispatch, in two layers around :mod:`kernel_pytorch.ops.attention`:

* :mod:`kernel_pytorch.attention.kernels` (below the op): one record per kernel
  (:mod:`~kernel_pytorch.attention.kernels.registry`) and the kernels beyond PyTorch's own: FlexAttention,
  top-k sparse, cuDNN's sliding window, flash-attn.
* :mod:`kernel_pytorch.attention.dispatch` (above the op): which kernel runs a given attention problem on the
  hardware found; it calls the op to measure.

This package imports neither layer: the op imports the kernels through it, so importing the dispatcher
here would make an import cycle.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__: list[str] = []

_MOVED = ("AttentionProblem", "choose_kernel", "eligible_kernels", "PREFERENCE", "MEASURED_ONLY")


def __getattr__(name: str) -> Any:
    """The dispatcher's names, still reachable from here for one release, with a DeprecationWarning."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"kernel_pytorch.attention.{name} moved: import it from kernel_pytorch.attention.dispatch",
                  DeprecationWarning, stacklevel=2)
    from kernel_pytorch.attention import dispatch  # the deprecated spelling only (see the module docstring)

    return getattr(dispatch, name)
