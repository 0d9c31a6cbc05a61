"""An FP8 linear's gradient scale from the kernel that computes the gradient: the backward's quantization
fused into its producer, the mirror of :mod:`kernel_pytorch.passes.fp8_input_amax`.

In training, a tensorwise FP8 linear casts its output's gradient to E5M2 with ``fp8_max / max |dy|``, and
finding that maximum reads dy once more. Where the linear's output goes only to one of our kernels whose
backward writes dy, that kernel can take the maximum as it writes: a packed gated activation (the fused
gate/up projection into SwiGLU / GeGLU: dy is d gate_up), or an RMSNorm, residual-fused or not (the output
projections o_proj / down_proj into the next norm: dy is the norm's dx, the residual stream's gradient).
The maximum travels back through autograd itself: the linear
returns a slot, a (1,) fp32 output nothing reads, the activation takes it as an input, and its backward
returns the maximum as the slot's gradient, which the linear's backward receives::

    # before                                        # after
    gate_up = float8_linear(x, w, None, ...)         out = float8_linear(x, w, None, ..., grad_amax_slot=True)
    h = gated_activation_packed(gate_up, "silu")     gate_up, slot = out[0], out[1]
                                                     h = gated_activation_packed(gate_up, "silu",
                                                                                 grad_amax_slot=slot)

The maximum is that of the rounded d gate_up, so the scale, and the gradients, are the unfused path's, bit
for bit (tests/test_fp8_producer_amax.py). Only where the consumer is the output's one user: with another
user, the output's gradient is a sum the consumer does not see.
"""

from __future__ import annotations

import operator

import torch.fx
from torch.fx import Node

from kernel_pytorch.ops.activations import gated_activation_packed
from kernel_pytorch.ops.rms_norm import rms_norm
from kernel_pytorch.passes.base import PassContext
from kernel_pytorch.passes.graph_utils import set_example_value

__all__ = ["grad_amax_consumer", "consumer_name", "wire_grad_amax"]

_CONSUMERS = {gated_activation_packed: "gated_activation_packed", rms_norm: "rms_norm"}


def grad_amax_consumer(linear: Node, ctx: PassContext) -> Node | None:
    """The kernel call that is the linear's output's only user and whose backward writes that output's whole
    gradient (a packed gated activation taking it as gate_up, an RMSNorm taking it as x or as the residual),
    in a training graph with the tensorwise recipe; else None."""
    if not ctx.training or ctx.config.fp8.recipe != "tensorwise" or len(linear.users) != 1:
        return None
    (user,) = linear.users
    if user.op != "call_function" or user.target not in _CONSUMERS or not user.args \
            or "grad_amax_slot" in user.kwargs:
        return None
    inputs = [user.args[0], user.kwargs.get("residual")] if user.target is rms_norm else [user.args[0]]
    return user if inputs.count(linear) == 1 and linear not in user.args[1:] else None


def consumer_name(consumer: Node) -> str:
    """The kernel whose backward computes the gradient's maximum, for the report."""
    return _CONSUMERS[consumer.target]


def wire_grad_amax(gm: torch.fx.GraphModule, fp8: Node, consumer: Node) -> None:
    """Switch ``fp8`` (a ``float8_linear`` call) to ``grad_amax_slot=True``: its output's users take item 0,
    and ``consumer`` takes the slot, item 1."""
    graph = gm.graph
    fp8.kwargs = {**fp8.kwargs, "grad_amax_slot": True}
    set_example_value(gm, fp8)
    with graph.inserting_after(fp8):
        out = graph.call_function(operator.getitem, (fp8, 0))
    with graph.inserting_after(out):
        slot = graph.call_function(operator.getitem, (fp8, 1))
    for node in (out, slot):
        set_example_value(gm, node)
    fp8.replace_all_uses_with(out, delete_user_cb=lambda user: user not in (out, slot))
    consumer.kwargs = {**consumer.kwargs, "grad_amax_slot": slot}
