"""Verification of one captured graph: fresh copies of its example inputs per run, a float32 copy of the graph
for a referee, and dropout set to 0 (a fused kernel draws its own dropout mask, which eager cannot match).

``capture.GraphOptimizer`` checks each rewritten graph against the captured one with these and
:class:`~kernel_pytorch.verify.numerics.NoiseAwareCheck`; ``verify.model`` checks the model end to end.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Sequence

import torch
import torch.fx

from kernel_pytorch.attention.kernels.aten_sdpa import sdpa_dispatch_without_cudnn
from kernel_pytorch.passes.graph_utils import checkpointed_subgraphs, clone_graph_module
from kernel_pytorch.verify.numerics import LOW_PRECISION, Run, run_reference, unless_out_of_memory
from kernel_pytorch.verify.referee import referee_copy, referee_device

__all__ = ["GraphInputs", "draws_random_numbers", "float32_graph", "without_dropout"]

# Ops whose results depend on the RNG stream: an end-to-end comparison cannot match them when the
# compiler draws random numbers differently from eager PyTorch (Inductor does).
_RANDOM_OPS = frozenset({
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm",
    "bernoulli", "multinomial", "normal", "poisson", "uniform_", "normal_", "bernoulli_",
})


def draws_random_numbers(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph samples from the RNG (dropout in training, rand*, bernoulli...)."""
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", node.target) if node.op != "placeholder" else ""
        if name not in _RANDOM_OPS:
            continue
        if "dropout" in str(name) and not _dropout_active(node):
            continue
        return True
    return False


def without_dropout(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` with every dropout probability set to 0, for verification.

    A fused kernel draws its dropout mask from its own random stream (philox in the attention
    kernels), so a rewrite that moves dropout into a kernel can never match eager dropout bit for bit;
    with p = 0 on both sides, everything else about the rewrite is compared exactly.
    """
    copy = clone_graph_module(gm)
    for node in copy.graph.nodes:
        if node.op != "call_function":
            continue
        if getattr(node.target, "__name__", "") == "dropout" and len(node.args) > 1:
            node.args = (node.args[0], 0.0, *node.args[2:])
        elif getattr(node.target, "__name__", "") == "dropout" and "p" in node.kwargs:
            node.kwargs = {**node.kwargs, "p": 0.0}
        if "dropout_p" in node.kwargs:
            node.kwargs = {**node.kwargs, "dropout_p": 0.0}
    copy.recompile()
    return copy


def _dropout_active(node: torch.fx.Node) -> bool:
    # F.dropout(x, p=0.5, training=True, inplace=False); torch.dropout(x, p, train)
    p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
    training = node.kwargs.get("training", node.kwargs.get("train", node.args[2] if len(node.args) > 2 else True))
    return not (training is False or p == 0)


class GraphInputs:
    """Fresh copies of a graph's example inputs for each verification run.

    Tensors other than parameters are cloned per run, because a graph may update its inputs in place
    (BatchNorm statistics, KV caches) and each run must start from the same values. Symbolic sizes are
    replaced by the sizes of this call.
    """

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], training: bool):
        self.names = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
        self.values: list[Any] = []
        self.unusable_reason = ""
        for value in example_inputs:
            if isinstance(value, torch.SymInt):
                hint = value.node.hint
                if hint is None:
                    self.unusable_reason = "an input size is symbolic with no concrete value"
                value = hint
            self.values.append(value)
        self.grad = training and torch.is_grad_enabled() and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in self.values)

    def run_float32(self, gm: torch.fx.GraphModule, reference: Run | None = None) -> Run | str:
        """The captured graph ``gm`` as the float32 referee (:func:`float32_graph`), on float32 copies of the
        bfloat16/float16 inputs, or why not (``reference``: the low-precision run, whose outputs size the memory);
        on the host when the GPU lacks the memory (:func:`~kernel_pytorch.verify.referee.referee_device`), as the
        end-to-end referee."""
        device, why = referee_device([v for v in self.values if isinstance(v, torch.Tensor)], self.grad, reference)
        if why and device is None:
            return why
        started = time.perf_counter()
        try:
            run = unless_out_of_memory(lambda: self.run(float32_graph(gm, device), float32=True, device=device))
        except Exception as error:  # the referee is optional: its failure leaves the plain verdict
            return f"it failed: {type(error).__name__}: {error}"
        if run is None:
            return "out of memory"
        if device is not None:
            run.where = f"on the CPU in {time.perf_counter() - started:.0f} s ({why})"
        return run

    def run(self, gm: torch.fx.GraphModule, float32: bool = False, device: torch.device | None = None) -> Run:
        """``gm`` on fresh copies of the inputs (``float32``: low-precision ones upcast; ``device``: moved there)."""
        args = [_referee_input(v, device) if float32 else _fresh(v) for v in self.values]
        wrt = None
        if self.grad:
            wrt = {name: a for name, a in zip(self.names, args)
                   if isinstance(a, torch.Tensor) and a.requires_grad}
        with _eager_graph_run():
            return run_reference(gm, args, None, wrt)


@contextlib.contextmanager
def _eager_graph_run() -> Iterator[None]:
    """How a graph runs eagerly inside the capture: outside the capture's TracingContext (FlexAttention's
    eager autograd traces its score_mod with make_fx, which would take the capture's fake-tensor mode from it:
    on a GPU, Gemma-2's soft-capped training failed to compile), and without PyTorch's cuDNN SDPA kernel
    (:func:`~kernel_pytorch.attention.kernels.aten_sdpa.sdpa_dispatch_without_cudnn` says why)."""
    with torch._guards.tracing(None), sdpa_dispatch_without_cudnn():
        yield


def float32_graph(gm: torch.fx.GraphModule, device: torch.device | None = None) -> torch.fx.GraphModule:
    """A copy of ``gm`` computing in float32 where it computed in bfloat16/float16, for a float32 referee
    run: dtype arguments (``x.to(torch.bfloat16)``, ``softmax(..., dtype=)``) become float32 and
    low-precision attributes are upcast where read. Autocast regions are left as they are. ``device`` (the
    referee on the host): attributes moved there, and the devices calls name (``torch.arange(n, device=...)``,
    ``x.to(device)``) replaced by it."""
    copy = clone_graph_module(gm) if device is None else clone_graph_module(gm).to(device)

    def referee_argument(arg: Any) -> Any:
        if isinstance(arg, torch.dtype) and arg in LOW_PRECISION:
            return torch.float32
        return device if device is not None and isinstance(arg, torch.device) else arg

    for node in list(copy.graph.nodes):
        if "autocast" in str(getattr(node.target, "__name__", node.target)):
            continue
        node.args = torch.fx.node.map_aggregate(node.args, referee_argument)
        node.kwargs = dict(torch.fx.node.map_aggregate(node.kwargs, referee_argument))
        if device is not None and isinstance(node.kwargs.get("device"), str):
            node.kwargs = {**node.kwargs, "device": device}
        if node.op == "get_attr":
            value = copy
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
                with copy.graph.inserting_after(node):
                    cast = copy.graph.call_method("to", (node, torch.float32))
                node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    for name, body in checkpointed_subgraphs(copy):
        setattr(copy, name, float32_graph(body, device))
    copy.recompile()
    return copy


def _referee_input(value: Any, device: torch.device | None) -> Any:
    """An input of the float32 referee run: upcast and moved (:func:`~kernel_pytorch.verify.referee.referee_copy`),
    or, where that leaves it as it is, a fresh copy as for any run."""
    copied = referee_copy(value, device)
    return _fresh(value) if copied is value else copied


def _fresh(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value
