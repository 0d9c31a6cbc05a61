"""The LM head's cross-entropy loss -> the fused ops of :mod:`kernel_pytorch.ops.linear_cross_entropy`.

Matched: a ``F.cross_entropy(x, target, ...)`` (``nn.CrossEntropyLoss`` reaches the graph as this call) whose
``x`` is 2-D ``(N, V)``, reached from the logits through views, reshapes, ``contiguous`` and dtype casts only,
with no other use of those steps; the logits are ``F.linear(h, W, b)`` (the LM head), optionally soft-capped
as Gemma-2 does (``tanh(logits / c) * c``). transformers' ``ForCausalLMLoss`` spells it::

    # before                                              # after (the logits are also an output)
    logits = F.linear(h, W, None)                         labels = F.pad(ids, (0, 1), value=-100)  ...
    logits_1 = logits.to(torch.float32)                   fused = linear_logits_cross_entropy(h, W, None,
    labels = F.pad(ids, (0, 1), value=-100)                   shift_labels_2, ignore_index=-100, ...)
    shift_labels = labels[..., 1:].contiguous()           loss = fused[0]
    logits_2 = logits_1.view(-1, V)                       logits = fused[1]     # what the model returns
    loss = F.cross_entropy(logits_2, shift_labels_2, ignore_index=-100, reduction="mean")
    (loss / num_items_in_batch, with reduction="sum": the division stays, the op computes the sum)

Three rewrites, by what the graph holds (the op module's docstring says why each keeps what it keeps):

* the logits are also used elsewhere (an output: every transformers model returns them) ->
  ``linear_logits_cross_entropy(h, W, b, ...)``, which computes the head's logits (soft-capped) and the loss
  from them, and sends the gradient to h, W, b slice by slice of the vocabulary; the logits' other users
  read its second output (the head and the loss in one op: see the op module on the gradient of an output);
* the logits feed only the loss (a hand-written model that returns the loss) ->
  ``linear_cross_entropy(h, W, b, ...)``: the logits never exist in full;
* no LM head in this graph (the logits are a graph input: GPT-2's ``loss_function`` logs a warning, a graph
  break between the head and the loss) -> ``logits_cross_entropy(None, None, None, logits, ...)``: no float32
  copy saved, the gradient of the logits in their dtype.

Skipped, with the reason: class weights, ``reduction="none"``, a target of class probabilities, an input
that is not ``(N, V)`` logits, a float32 copy or view of the logits used elsewhere too, logits read before
the loss's labels are computed (the fused op runs where the loss did).

On a GPU the choice is measured: the fused op replaces the unfused subgraph only where its forward
(+ backward when training) on the example shapes, compiled as the graph will be, is no slower than the
unfused one by more than :data:`TIME_MARGIN` (its point is the memory; a slower step is not taken), or by
more than :data:`DROPPED_LOGITS_MARGIN` where ``training_logits="drop"`` dropped the logits from the outputs:
that option trades the logits for memory, which inside the step only the fused op saves (the unfused loss
still materializes them). Elsewhere (the CPU) it is taken: the same work, less memory.
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx import Node

from kernel_pytorch.errors import first_line
from kernel_pytorch.ops.linear_cross_entropy import (linear_cross_entropy, linear_logits_cross_entropy,
                                                     logits_cross_entropy)
from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult, candidates
from kernel_pytorch.passes.graph_utils import erase_unused, nodes_between, set_example_value
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.shape_constants import example_value
from kernel_pytorch.timing import fastest_cuda_ms, measurement_compiles

__all__ = ["LinearCrossEntropyPass", "TIME_MARGIN", "DROPPED_LOGITS_MARGIN", "MEASURED_TOKENS", "drop_loss_logits"]

# The fused op is taken where it measured at most this much slower than the unfused loss: what it is for is the
# memory it frees (the float32 logits), and the loss is a small part of a training step (docs/results.md, the
# vocabulary-128256 row: a 2.2% difference in one measurement kept the unfused loss under a 2% margin).
TIME_MARGIN = 0.05
# The margin where training_logits="drop" returns no logits (module docstring): the user chose memory over the
# logits, so a fused loss up to half again as slow as the unfused one is still taken for it (the H100's
# measurements at vocabulary 128256 vary between runs: docs/passes.md).
DROPPED_LOGITS_MARGIN = 0.5
# Tokens the measurement runs (fewer when the graph has fewer): the costs on both sides grow with the tokens, so
# their ratio is measured at a size that leaves the model's own memory alone (the unfused loss at 8 x 2048
# tokens and vocab 128256 needs over 20 GB of temporaries).
MEASURED_TOKENS = 4096
_CROSS_ENTROPY = inspect.signature(F.cross_entropy)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class _Loss:
    """A matched loss: the cross-entropy call and what it reads."""

    loss: Node
    labels: Node
    logits: Node  # the tensor the loss reads, before its casts and views (capped, when soft-capped)
    steps: list[Node]  # the casts and views between the logits and the loss
    options: dict[str, Any]  # ignore_index, label_smoothing, reduction
    softcap: Optional[float] = None
    cap_nodes: list[Node] = field(default_factory=list)  # truediv, tanh, mul
    head: Optional[Node] = None  # F.linear(h, W, b) giving the (uncapped) logits, if in this graph

    @property
    def logits_kept(self) -> bool:
        """Whether anything but the loss reads the logits or a step of the head on the way to them."""
        way = ([self.head] if self.head is not None else []) + self.cap_nodes + [self.logits]
        return any(len(node.users) > 1 for node in way)  # the casts and views: one user each (_match)


# ----------------------------------------------------------------------------------------------- matching

def _options(node: Node) -> dict[str, Any] | str:
    """The loss's ignore_index, label_smoothing and reduction, or why it is not fused."""
    try:
        bound = _CROSS_ENTROPY.bind(*node.args, **node.kwargs)
    except TypeError:
        return "cross_entropy called with arguments it does not bind"
    bound.apply_defaults()
    arguments = bound.arguments
    if arguments["weight"] is not None:
        return "class weights (weight=) are not fused"
    if arguments["size_average"] is not None or arguments["reduce"] is not None:
        return "the legacy size_average / reduce arguments are not fused"
    if arguments["reduction"] not in ("mean", "sum"):
        return f"reduction={arguments['reduction']!r}: per-token losses are not fused"
    if not isinstance(arguments["ignore_index"], int) or not isinstance(arguments["label_smoothing"], (int, float)):
        return "ignore_index or label_smoothing is not a constant"
    return {"ignore_index": arguments["ignore_index"], "label_smoothing": float(arguments["label_smoothing"]),
            "reduction": arguments["reduction"]}


def _is_cast_or_view(node: Node) -> bool:
    if is_call(node, "view", "reshape") and isinstance(example_value(node), torch.Tensor):
        source = example_value(node.args[0])
        return isinstance(source, torch.Tensor) and source.shape[-1:] == example_value(node).shape[-1:]
    if is_call(node, "contiguous"):
        return len(node.args) == 1 and not node.kwargs
    if is_call(node, "float", "bfloat16", "half"):  # as captured, before normalization spells them .to(dtype)
        return len(node.args) == 1 and not node.kwargs
    return is_call(node, "to") and len(node.args) == 2 and not node.kwargs and node.args[1] in _FLOATS


def _soft_cap(node: Node) -> Optional[tuple[float, Node, list[Node]]]:
    """``(c, x, [mul, tanh, truediv])`` when ``node`` is ``tanh(x / c) * c`` (either operand order)."""
    if not is_call(node, operator.mul):
        return None
    for tanh, cap in (node.args[:2], node.args[1::-1]):
        if is_call(tanh, torch.tanh) and isinstance(cap, (int, float)) and cap > 0:
            inner = tanh.args[0]
            if is_call(inner, operator.truediv) and inner.args[1] == cap and isinstance(inner.args[0], Node):
                return float(cap), inner.args[0], [node, tanh, inner]
    return None


def _head(node: Node, vocab: int) -> Optional[Node]:
    """``node`` if it is an LM head ``F.linear(h, W, b)`` with ``W`` of ``vocab`` rows, all in one dtype."""
    if not is_call(node, F.linear, torch._C._nn.linear) or len(node.args) < 2:  # the latter as captured
        return None
    values = [example_value(a) for a in node.args[:3] if a is not None] + [example_value(node)]
    if not all(isinstance(v, torch.Tensor) for v in values) or values[1].dim() != 2 or values[1].shape[0] != vocab:
        return None
    return node if len({v.dtype for v in values}) == 1 else None  # under autocast the dtypes differ


def _read_before(match: _Loss) -> bool:
    """Whether something besides the loss reads the logits before the loss node (where the fused op goes)."""
    before_loss = set(nodes_between(match.logits, match.loss))
    way = set(match.steps) | set(match.cap_nodes) | {match.loss}
    return any(user in before_loss for user in match.logits.users if user not in way)


def _match(node: Node) -> _Loss | str | None:
    if not is_call(node, F.cross_entropy) or len(node.args) < 2:
        return None
    options = _options(node)
    if isinstance(options, str):
        return options
    source, labels = node.args[:2]
    value, label_value = example_value(source), example_value(labels)
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.dtype not in _FLOATS:
        return "the loss's input is not (tokens, classes) logits"
    if not isinstance(label_value, torch.Tensor) or label_value.is_floating_point():
        return "the target is class probabilities, not class indices"
    steps = []
    while isinstance(source, Node) and _is_cast_or_view(source):
        steps.append(source)
        source = source.args[0]
    if any(len(step.users) > 1 for step in steps):
        return "a float32 copy or view of the logits is also used elsewhere (it would stay materialized)"
    match = _Loss(node, labels, source, steps, options)
    capped = _soft_cap(source)
    if capped is not None:
        match.softcap, raw, match.cap_nodes = capped
        match.head = _head(raw, value.shape[1])
    else:
        match.head = _head(source, value.shape[1])
    if match.head is None:  # the loss from the logits alone: soft-capping, if any, stays in the graph
        match.softcap, match.cap_nodes = None, []
    elif match.logits_kept and _read_before(match):
        return "the logits are read before the loss's labels are computed (the fused op computes them there)"
    return match


# ------------------------------------------------------------------------------------------------ rewriting

def _fused_call(match: _Loss, training: bool) -> tuple[Callable[..., Any], tuple, dict[str, Any], str]:
    """The fused op, its arguments, and what the report says of it."""
    kwargs = dict(match.options, softcap=match.softcap)
    if match.head is None:
        return (logits_cross_entropy, (None, None, None, match.logits, match.labels), kwargs,
                "cross-entropy -> logits_cross_entropy (no LM head right before the loss in this graph: "
                "no float32 copy kept)")
    hidden, weight, *bias = match.head.args
    bias = bias[0] if bias else None
    capped = f", soft-capped at {match.softcap:g}" if match.softcap else ""
    if match.logits_kept:
        return (linear_logits_cross_entropy, (hidden, weight, bias, match.labels), kwargs,
                f"LM head + cross-entropy{capped} -> linear_logits_cross_entropy (the logits an output: "
                "no float32 copy kept, gradient by vocabulary slices)")
    grads = training and bool(getattr(example_value(match.loss), "requires_grad", False))
    kwargs.update(need_hidden=grads and example_value(hidden).requires_grad,
                  need_weight=grads and any(example_value(p).requires_grad for p in (weight, bias) if p is not None))
    return (linear_cross_entropy, (hidden, weight, bias, match.labels), kwargs,
            f"LM head + cross-entropy{capped} -> linear_cross_entropy (the logits never materialized)")


def _replace(gm: torch.fx.GraphModule, match: _Loss, target: Callable[..., Any], args: tuple,
             kwargs: dict[str, Any]) -> None:
    with gm.graph.inserting_before(match.loss):
        fused = gm.graph.call_function(target, args, kwargs)
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in match.loss.meta:
            fused.meta[key] = match.loss.meta[key]
    set_example_value(gm, fused)
    if target is linear_logits_cross_entropy:  # (loss, logits): the logits' other users read the second
        with gm.graph.inserting_after(fused):
            logits = gm.graph.call_function(operator.getitem, (fused, 1))
            fused = gm.graph.call_function(operator.getitem, (fused, 0))
        for node in (logits, fused):
            node.meta.update({k: v for k, v in match.logits.meta.items() if k in ("nn_module_stack", "stack_trace")})
            set_example_value(gm, node)
        match.logits.replace_all_uses_with(logits)
    match.loss.replace_all_uses_with(fused)
    head = [match.head] if match.head is not None else []
    erase_unused(gm.graph, [match.loss, *match.steps, *match.cap_nodes, *head])


# ------------------------------------------------------------------------------------------------ measuring

def _example_tensors(match: _Loss) -> dict[str, torch.Tensor]:
    """Fresh random tensors as the loss reads them, flattened to (tokens, features), at most
    :data:`MEASURED_TOKENS` tokens."""
    vocab = int(example_value(match.steps[0] if match.steps else match.logits).shape[-1])

    def like(node: Any, width: Optional[int], requires_grad: bool = False) -> Optional[torch.Tensor]:
        value = example_value(node) if isinstance(node, Node) else None
        if value is None:
            return None
        shape = (min(MEASURED_TOKENS, value.numel() // (width or 1)),) + ((width,) if width else ())
        if not value.is_floating_point():
            return torch.randint(0, vocab, shape, device=value.device)
        return torch.randn(shape, dtype=value.dtype, device=value.device, requires_grad=requires_grad)

    labels = like(match.labels, None)
    if match.head is None:
        return {"logits": like(match.logits, vocab, True), "labels": labels}
    hidden, weight, *bias = match.head.args
    bias = bias[0] if bias else None
    width = int(example_value(weight).shape[1])
    return {"hidden": like(hidden, width, True),
            "weight": torch.randn(vocab, width, dtype=example_value(weight).dtype, device=labels.device,
                                  requires_grad=True),
            "bias": None if bias is None else torch.randn(vocab, dtype=example_value(bias).dtype,
                                                          device=labels.device, requires_grad=True),
            "labels": labels}


def _unfused_loss(match: _Loss) -> Callable[..., Any]:
    options, softcap = match.options, match.softcap

    def loss(hidden=None, weight=None, bias=None, logits=None, labels=None):
        if logits is None:
            logits = F.linear(hidden, weight, bias)
            logits = torch.tanh(logits / softcap) * softcap if softcap else logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1), **options), logits

    return loss


def _fused_loss(match: _Loss, training: bool) -> Callable[..., Any]:
    options, softcap, kept = match.options, match.softcap, match.logits_kept

    def loss(hidden=None, weight=None, bias=None, logits=None, labels=None):
        if logits is not None:
            return logits_cross_entropy(None, None, None, logits, labels, **options), logits
        if not kept:
            return linear_cross_entropy(hidden, weight, bias, labels, softcap=softcap, need_hidden=training,
                                        need_weight=training, **options), None
        return linear_logits_cross_entropy(hidden, weight, bias, labels, softcap=softcap, **options)

    return loss


def _step(loss: Callable[..., Any], tensors: dict[str, torch.Tensor], training: bool) -> Callable[[], None]:
    leaves = [t for t in tensors.values() if t is not None and t.requires_grad]

    def step() -> None:
        if training:
            torch.autograd.grad(loss(**tensors)[0], leaves)
        else:
            with torch.no_grad():
                loss(**tensors)

    return step


_MEASURED: dict[tuple, tuple[bool, str]] = {}


def _measured_choice(match: _Loss, ctx: PassContext) -> tuple[bool, str]:
    """Whether the fused op is taken on this GPU, and the measurement that says so (cached per shape)."""
    try:
        tensors = _example_tensors(match)
    except Exception as error:  # symbolic sizes, say: nothing to time with, and the memory is still saved
        return True, f"not measured ({first_line(error)}): taken for the memory"
    margin = _time_margin(match, ctx)
    key = (tuple((k, tuple(t.shape), t.dtype) for k, t in tensors.items() if t is not None), match.softcap,
           tuple(match.options.items()), match.logits_kept, ctx.training, ctx.compiled, margin)
    if key not in _MEASURED:
        _MEASURED[key] = _timed_choice(match, ctx, tensors, margin)
    return _MEASURED[key]


def _time_margin(match: _Loss, ctx: PassContext) -> float:
    """How much slower than the unfused loss the fused op may measure and still be taken."""
    dropped = ctx.training and ctx.config.training_logits == "drop" and not match.logits_kept
    return DROPPED_LOGITS_MARGIN if dropped else TIME_MARGIN


def _timed_choice(match: _Loss, ctx: PassContext, tensors: dict[str, torch.Tensor],
                  margin: float) -> tuple[bool, str]:
    steps = {}
    for name, loss in (("unfused", _unfused_loss(match)), ("fused", _fused_loss(match, ctx.training))):
        loss = torch.compile(loss, dynamic=False) if ctx.compiled else loss
        steps[name] = _step(loss, tensors, ctx.training)
    tokens = next(t for t in tensors.values() if t is not None).shape[0]
    try:
        with measurement_compiles():  # compiled on the first (warm-up) call
            ms = fastest_cuda_ms(steps)
    except torch.cuda.OutOfMemoryError:  # the unfused loss is the one that needs the memory
        return True, f"measuring at {tokens} tokens ran out of GPU memory: taken for the memory"
    except Exception as error:  # a measurement that fails leaves the graph as it was, with the reason
        return False, f"not measured ({first_line(error)}): unfused loss kept"
    measured = (f"measured at {tokens} tokens: fused {ms['fused']:.3f} ms, unfused {ms['unfused']:.3f} ms, "
                f"margin {margin:.0%}" + (" (training_logits='drop')" if margin == DROPPED_LOGITS_MARGIN else ""))
    return ms["fused"] <= ms["unfused"] * (1 + margin), measured


def _decision(match: _Loss, ctx: PassContext) -> tuple[bool, str]:
    value = example_value(match.loss)
    if getattr(value, "device", torch.device("cpu")).type != "cuda" or not torch.cuda.is_available():
        return True, "no GPU to measure on: taken for the memory"
    return _measured_choice(match, ctx)


def drop_loss_logits(gm: torch.fx.GraphModule) -> int:
    """``OptimizeConfig(training_logits="drop")``: each LM head's logits (soft-capped or not) that a cross-entropy
    loss reads and that are otherwise only returned are returned as None instead, so that the fused loss never
    materializes them. Changes the captured graph ``gm`` in place, before the passes and the checks, which
    compare against it: the outputs the user asked not to have are not compared. Returns how many were dropped."""
    output = next(node for node in gm.graph.nodes if node.op == "output")
    dropped = 0
    for node in list(gm.graph.nodes):
        logits = _returned_head_logits(node, output) if is_call(node, F.cross_entropy) else None
        if logits is None:
            continue
        output.args = torch.fx.node.map_arg(output.args, lambda arg, kept=logits: None if arg is kept else arg)
        dropped += 1
    if dropped:
        gm.graph.lint()
        gm.recompile()
    return dropped


def _returned_head_logits(loss: Node, output: Node) -> Optional[Node]:
    """The logits ``loss`` reads through casts and views, when they are an LM head's (or its soft cap's) and
    are used by nothing but that chain and the graph's output; else None."""
    chain, source = [], loss.args[0] if loss.args else None
    while isinstance(source, Node) and _is_cast_or_view(source):
        if len(source.users) != 1:
            return None
        chain.append(source)
        source = source.args[0]
    value = example_value(loss.args[0]) if loss.args else None
    if not isinstance(source, Node) or not isinstance(value, torch.Tensor):
        return None
    capped = _soft_cap(source)
    if _head(capped[1] if capped else source, value.shape[-1]) is None:
        return None
    first = chain[-1] if chain else loss
    return source if [user for user in source.users if user is not first] == [output] else None


@register_pass
class LinearCrossEntropyPass(GraphPass):
    """The LM head's cross-entropy -> a fused op that keeps no float32 logits (module docstring)."""

    name = "linear_cross_entropy"
    description = "LM head + cross-entropy loss -> fused ops that keep no float32 logits (chunked, measured on GPUs)"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        for found in candidates(gm.graph.nodes, _match, result):
            target, args, kwargs, description = _fused_call(found.match, ctx.training)
            take, why = _decision(found.match, ctx)
            if not take:
                result.skip(found.location, f"{description.split(' -> ')[0]}: fused op slower ({why})")
                continue
            _replace(gm, found.match, target, args, kwargs)
            result.rewrite(found.location, f"{description}; {why}")
        return result
