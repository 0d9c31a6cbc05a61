"""An FP8 linear's gradient scale from the kernel that computes the gradient: the backward's quantization
fused into its producer, the mirror of :mod:`kernel_pytorch.passes.fp8_input_amax`.

In training, a tensorwise FP8 linear casts its output's gradient to E5M2 with ``fp8_max / max |dy|``, and
finding that maximum reads dy once more. Where the linear's output goes only to a packed gated activation
(the fused gate/up projection into SwiGLU / GeGLU), dy is d gate_up, which the activation's backward kernel
writes: it can take the maximum as it writes. The maximum travels back through autograd itself: the linear
returns a slot, a (1,) fp32 output nothing reads, the activation takes it as an input, and its backward
returns the maximum as the slot's gradient, which the linear's backward receives::

    # before                                        # after
    gate_up = float8_linear(x, w, None, ...)         out = float8_linear(x, w, None, ..., grad_amax_slot=True)
    h = gated_activation_packed(gate_up, "silu")     gate_up, slot = out[0], out[1]
                                                     h = gated_activation_packed(gate_up, "silu",
                                                                                 grad_amax_slot=slot)

The maximum is that of the rounded d gate_up, so the scale, and the gradients, are the unfused path's, bit
for bit (tests/test_fp8_producer_amax.py). Only where the activation is the output's one user: with another
user, the output's gradient is a sum the activation does not see.
"""

from __future__ import annotations

import operator

import torch.fx
from torch.fx import Node

from kernel_pytorch.ops.activations import gated_activation_packed
from kernel_pytorch.passes.base import PassContext
from kernel_pytorch.passes.graph_utils import set_example_value

__all__ = ["grad_amax_consumer", "wire_grad_amax"]


def grad_amax_consumer(linear: Node, ctx: PassContext) -> Node | None:
    """The packed gated activation that is the linear's output's only user (as its gate_up), in a training
    graph with the tensorwise recipe; else None."""
    if not ctx.training or ctx.config.fp8_recipe != "tensorwise" or len(linear.users) != 1:
        return None
    (user,) = linear.users
    if user.op != "call_function" or user.target is not gated_activation_packed or not user.args \
            or user.args[0] is not linear or "grad_amax_slot" in user.kwargs:
        return None
    return user


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
