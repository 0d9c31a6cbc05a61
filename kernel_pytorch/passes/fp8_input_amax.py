"""An FP8 linear's input scale from the kernel that produced the input: quantization fused into the producer.

A tensorwise FP8 linear scales its input by ``fp8_max / max |x|``, and finding that maximum is a pass over
x of its own (``float8_cast.abs_max``). Where x comes straight out of one of our kernels that writes it
anyway, an RMSNorm (residual-fused or not) or a gated activation (SwiGLU / GeGLU, packed or not), that
kernel can take the maximum of what it writes: each program reduces its tile, one small reduction takes
theirs. The FP8 pass (:mod:`kernel_pytorch.passes.fp8_linear`) switches such a producer to
``fp8_amax=True`` and hands its maximum to ``float8_linear(..., x_amax=)``::

    # before                                        # after
    y = rms_norm(x, w, eps=1e-6)                     out = rms_norm(x, w, eps=1e-6, fp8_amax=True)
    q = float8_linear(y, w_qkv, None, ...)           y, y_amax = out[0], out[1]
                                                     q = float8_linear(y, w_qkv, None, ..., x_amax=y_amax)

The maximum is that of the rounded output, so the scale, and the result, are the unfused path's, bit for
bit (tests/test_fp8_producer_amax.py). One producer feeding several FP8 linears (q, k and v unfused) is
switched once and its maximum shared. Only the tensorwise recipe: rowwise scales need the maxima of x's
rows and of its columns, and the column maxima of a row-tiled kernel would take one atomic per program and
column, as many as x has elements over the tile's rows.
"""

from __future__ import annotations

import operator

import torch.fx
from torch.fx import Node

from kernel_pytorch.ops.activations import gated_activation, gated_activation_packed
from kernel_pytorch.ops.rms_norm import rms_norm
from kernel_pytorch.passes.graph_utils import set_example_value

__all__ = ["amax_producer", "producer_amax"]

_PRODUCERS = {rms_norm: "rms_norm", gated_activation: "gated_activation",
              gated_activation_packed: "gated_activation_packed"}
_AMAX_NODE = "fp8_amax_node"  # meta key on a switched producer: the getitem node of its maximum


def _producer(x: Node) -> tuple[Node, int | None] | None:
    """``(call, index)`` when ``x`` is a producer's output: ``call`` returns x itself (``index`` None), or
    x is item ``index`` of the tuple ``call`` returns (the residual-fused RMSNorm's ``(normed, summed)``, or
    a producer already switched to return its maximum)."""
    if not isinstance(x, Node) or x.op != "call_function":
        return None
    if x.target in _PRODUCERS and x.kwargs.get("residual") is None and not x.kwargs.get("fp8_amax"):
        return x, None
    if x.target is operator.getitem and x.args[1] == 0:
        call = x.args[0]
        if isinstance(call, Node) and call.op == "call_function" and call.target in _PRODUCERS \
                and (call.kwargs.get("residual") is not None or call.kwargs.get("fp8_amax")):
            return call, 0
    return None


def amax_producer(x: Node) -> str | None:
    """The name of the kernel that produces ``x`` and can compute its maximum, or None."""
    found = _producer(x)
    return _PRODUCERS[found[0].target] if found else None


def producer_amax(gm: torch.fx.GraphModule, x: Node) -> Node | None:
    """A node holding ``max |x|`` computed by x's producer (switched to ``fp8_amax=True`` on first use), or
    None when x has no such producer."""
    found = _producer(x)
    if found is None:
        return None
    call, index = found
    if _AMAX_NODE in call.meta:
        return call.meta[_AMAX_NODE]
    graph = gm.graph
    call.kwargs = {**call.kwargs, "fp8_amax": True}
    last = call
    if index is None:  # the call returned x; it now returns (x, amax): its users take item 0
        with graph.inserting_after(call):
            last = graph.call_function(operator.getitem, (call, 0))
        last.meta = dict(call.meta)
        call.replace_all_uses_with(last, delete_user_cb=lambda user: user is not last)
        amax_index = 1
    else:  # (normed, summed) -> (normed, summed, amax)
        amax_index = 2
    set_example_value(gm, call)
    with graph.inserting_after(last):
        amax = graph.call_function(operator.getitem, (call, amax_index))
    set_example_value(gm, amax)
    call.meta[_AMAX_NODE] = amax
    return amax
