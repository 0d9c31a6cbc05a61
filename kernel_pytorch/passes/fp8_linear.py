"""Linear layers -> FP8 matmuls (``kernel_pytorch::float8_linear``), in the captured graph.

``optimize(model, fp8=True | "auto")`` runs this pass last, after the horizontal GEMM fusion, so it sees the
linears the model will really run::

    # before                                          # after
    w = torch.cat([w_q, w_k, w_v], 0)                  w = torch.cat([w_q, w_k, w_v], 0)
    qkv = F.linear(x, w, None)                         qkv = float8_linear(x, w, None, recipe="tensorwise")

Why in the graph and not by swapping modules before capture (as :func:`~kernel_pytorch.float8_conversion.
convert_to_float8` does): a swapped ``Float8Linear`` is no longer an ``F.linear`` the horizontal fusion can
concatenate, so an FP8 model lost the q/k/v and gate/up fusions, and each FP8 decision was taken on the
small unfused shapes, where FP8 loses (``benchmarks/results/fp8.json``, ``sweep``; docs/passes.md).
Converted here, the decision is taken on the fused shape (gate/up of the Llama-style model of
docs/design.md: (8192, 2048, 11264)), and the fusion stays.

Which linears. A linear is a candidate when every ``nn.Linear`` it computes (one, or the members of a
horizontally fused group, recorded in ``node.meta["fused_linears"]``) is a candidate of
:func:`~kernel_pytorch.float8_conversion.linear_targets` (eligible, not the output head, accepted by
``fp8.filter``), its input and weight share a 16-bit or fp32 dtype, its (M, K, N) is known, and it does
not run under autocast (the FP8 op would compute in the weight's dtype, not autocast's). ``F.linear`` called
directly on a tensor that is no ``nn.Linear``'s is left alone, with that reason.

The decision: ``fp8=True`` converts every candidate; ``fp8="auto"`` converts one only where
:func:`~kernel_pytorch.float8_conversion.measured_decision` measured FP8 faster for its (M, K, N) on this
GPU (each shape once per process); ``fp8.emulate=True`` converts every candidate to the same numerics run
in fp32 (any device; for testing, no speedup). The report gives each decision with its measurement.

Quantization fused into the producer: where a converted linear's input comes straight from an RMSNorm or
gated-activation kernel (tensorwise recipe), that kernel computes the input's maximum and the FP8 linear
does not read its input for it (:mod:`kernel_pytorch.passes.fp8_input_amax`); ``fp8="auto"`` then times
the FP8 side without that reduction. In training, where a converted linear feeds only a packed gated activation
(gate/up) or an RMSNorm (o_proj, down_proj), that kernel's backward computes the maximum of the linear's
output gradient (:mod:`kernel_pytorch.passes.fp8_grad_amax`), and ``fp8="auto"`` times that too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx import Node

from kernel_pytorch.float8_conversion import PASS_NAME, measured_decision
from kernel_pytorch.ops.float8_linear import FP8_ALIGNMENT, float8_dtypes_for, float8_linear
from kernel_pytorch.passes.base import Candidate, GraphPass, PassContext, PassResult, candidates
from kernel_pytorch.passes.fp8_grad_amax import consumer_name, grad_amax_consumer, wire_grad_amax
from kernel_pytorch.passes.fp8_input_amax import amax_producer, producer_amax
from kernel_pytorch.passes.graph_utils import FUSED_LINEARS, erase_unused, gemm_rows, set_example_value
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.shape_constants import example_value

__all__ = ["Float8LinearPass"]

_HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)
_AUTOCAST_ENTER, _AUTOCAST_EXIT = "_enter_autocast", "_exit_autocast"


@register_pass
class Float8LinearPass(GraphPass):
    """Each candidate linear -> ``float8_linear`` where FP8 is chosen (module docstring)."""

    name = PASS_NAME
    description = "linear layers (after q/k/v and gate/up fusion) -> FP8 matmuls where measured faster"

    def reason_not_to_run(self, hardware, config) -> str | None:
        if config.fp8.mode is False:
            return "fp8=False (the default: FP8 changes results beyond the bf16 tolerances)"
        if config.fp8.emulate or hardware.fp8:
            return None
        what = f"{hardware.vendor} ({hardware.device_name})" if hardware.device_name else hardware.vendor
        return (f"FP8 matmuls need an NVIDIA GPU of compute capability >= 8.9 or an AMD MI300; this is {what} "
                f"(fp8={{'mode': True, 'emulate': True}} runs FP8's numerics in fp32 anywhere)")

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        for found in candidates(gm.graph.nodes, _AutocastDepth().linear, result):
            self._convert_or_skip(gm, found, ctx, result)
        return result

    def _convert_or_skip(self, gm: torch.fx.GraphModule, found: Candidate[bool], ctx: PassContext,
                         result: PassResult) -> None:
        node, under_autocast = found.node, found.match
        members = node.meta.get(FUSED_LINEARS) or [found.location]
        location = found.location if len(members) > 1 else members[0]
        names = " + ".join(m.rpartition(".")[2] for m in members) if len(members) > 1 else ""
        shape, reason = _candidate(node, members, ctx, under_autocast)
        producer = amax_producer(node.args[0]) if ctx.config.fp8.recipe == "tensorwise" else None
        consumer = grad_amax_consumer(node, ctx)
        convert = False
        if reason is None:
            convert, reason = _decision(node, shape, ctx, producer is not None, consumer is not None)
        if not convert:
            result.skip(location, f"{names}: {reason}" if names else reason)
            return
        _replace(gm, node, ctx, fuse_input_amax=producer is not None, consumer=consumer)
        fused = f"; its input's maximum from the {producer} kernel" if producer else ""
        if consumer is not None:
            fused += f"; its gradient's maximum from the {consumer_name(consumer)} backward kernel"
        result.rewrite(location, f"{names + ' ' if names else ''}-> float8_linear ({ctx.config.fp8.recipe}): "
                                 f"{reason}{fused}")


class _AutocastDepth:
    """Follows the autocast regions of a graph read in order: the FP8 op would compute in the weight's
    dtype, not autocast's, so a linear inside one is no candidate."""

    def __init__(self) -> None:
        self.depth = 0

    def linear(self, node: Node) -> bool | None:
        """For a linear, whether it runs under autocast; None for any other node."""
        name = getattr(node.target, "__name__", "")
        self.depth += (name == _AUTOCAST_ENTER) - (name == _AUTOCAST_EXIT)
        return self.depth > 0 if is_call(node, F.linear) else None


def _decision(node: Node, shape: tuple[int, int, int], ctx: PassContext, input_amax_fused: bool,
              grad_amax_fused: bool) -> tuple[bool, str]:
    """Whether the candidate converts, and why."""
    config = ctx.config
    if config.fp8.emulate:
        return True, f"fp8 emulate=True (FP8 numerics in fp32) at (M, K, N) = {shape}"
    if config.fp8.mode is True:
        return True, f"fp8=True at (M, K, N) = {shape}"
    x = example_value(node.args[0])
    convert, reason, _, _ = measured_decision(shape, x.dtype, config.fp8.recipe, ctx.training, x.device, ctx.compiled,
                                              input_amax_fused, grad_amax_fused)
    return convert, reason


def _candidate(node: Node, members: list[str], ctx: PassContext,
               under_autocast: bool) -> tuple[tuple[int, int, int] | None, str | None]:
    """The linear's (M, K, N), and None; or why it is no candidate."""
    for member in members:
        reason = ctx.fp8_targets.get(member, f"not an nn.Linear's call (F.linear in {member})")
        if reason is not None:
            return None, reason
    if under_autocast:
        return None, "runs under autocast (the FP8 matmul would compute in the weight's dtype)"
    if len(node.args) < 2 or node.kwargs:
        return None, "a linear with keyword arguments (not in normalize's canonical form)"
    x, weight = example_value(node.args[0]), example_value(node.args[1])
    bias = node.args[2] if len(node.args) > 2 else None
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None, "no example value for its input or weight (shapes unknown)"
    if x.dtype != weight.dtype or x.dtype not in _HIGH_PRECISION:
        return None, f"input {x.dtype} and weight {weight.dtype}: FP8 takes one 16-bit or fp32 dtype"
    if bias is not None and getattr(example_value(bias), "dtype", None) not in _HIGH_PRECISION:
        return None, "its bias is not a bf16/fp16/fp32 tensor"
    rows, (n, k) = gemm_rows(node.args[0]), (int(s) for s in weight.shape)
    if rows is None:
        return None, "the input's leading sizes are unknown"
    if k % FP8_ALIGNMENT or n % FP8_ALIGNMENT:
        return None, f"(K, N) = ({k}, {n}) not multiples of {FP8_ALIGNMENT} (torch._scaled_mm requires it)"
    return (rows, k, n), None


def _replace(gm: torch.fx.GraphModule, node: Node, ctx: PassContext, fuse_input_amax: bool,
             consumer: Node | None) -> None:
    x = example_value(node.args[0])
    forward_dtype, backward_dtype = float8_dtypes_for(x.device)
    kwargs: dict[str, Any] = {"recipe": ctx.config.fp8.recipe, "emulate": ctx.config.fp8.emulate,
                              "forward_dtype": forward_dtype, "backward_dtype": backward_dtype}
    if fuse_input_amax:
        kwargs["x_amax"] = producer_amax(gm, node.args[0])
    args = tuple(node.args) + (None,) * (3 - len(node.args))
    with gm.graph.inserting_before(node):
        fp8 = gm.graph.call_function(float8_linear, args, kwargs)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in node.meta:
            fp8.meta[key] = node.meta[key]
    set_example_value(gm, fp8)
    node.replace_all_uses_with(fp8)
    erase_unused(gm.graph, [node])
    if consumer is not None:
        wire_grad_amax(gm, fp8, consumer)
