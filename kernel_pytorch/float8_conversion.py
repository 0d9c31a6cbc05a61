"""FP8 conversion of a model's linear layers: which are candidates, and the measured decision.

Two users share these rules. :func:`convert_to_float8` swaps a model's eligible ``nn.Linear`` modules for
:class:`~kernel_pytorch.ops.Float8Linear` in place, each only where FP8 is measured faster for that
layer's real shape::

    plan = convert_to_float8(model, recipe="tensorwise", decide="auto", example_inputs=(tokens,))
    print(plan.describe())

``optimize(model, fp8=...)`` instead converts in the captured graph (:mod:`kernel_pytorch.passes.fp8_linear`),
after the horizontal GEMM fusion, so that it decides on the fused q/k/v and gate/up shapes and keeps that
fusion; it takes the candidates from :func:`linear_targets` and each decision from :func:`measured_decision`.

Which layers. An ``nn.Linear`` is a candidate when :func:`~kernel_pytorch.ops.float8_linear.float8_eligible`
accepts it (16-bit or fp32 weights, both dimensions multiples of 16), ``filter_fn(module, fqn)`` (if
given) returns True, and it is not the output head: the last Linear the forward calls on the example
inputs (without them, the last one registered). The head is excluded by default because its logits feed a
softmax over a large vocabulary, where FP8's rounding (its SQNR: benchmarks/results/fp8.json, "numerics")
costs the most, and because tied embedding weights would be quantized too.

The decision. ``decide=True`` converts every candidate. ``decide="auto"`` runs each candidate's own
(M, K, N), recorded by forward hooks on the example inputs, through a forward (+ backward when
training) in its dtype and in FP8 on this GPU, and converts it only where FP8 is at least
:data:`MIN_SPEEDUP` faster: no layer ends slower. FP8 loses at small shapes, where the quantization passes
and launch costs outweigh the matmul saving, and wins at large ones (benchmarks/results/fp8.json, "sweep";
docs/kernels.md, "FP8 conversion"). Identical shapes are measured once per process.

How it times. A model that will run compiled (``compiled=True``; ``optimize`` passes whether its compiler
is one) is compared by GPU time, the steps replayed from a CUDA graph
(:func:`~kernel_pytorch.timing.fastest_cuda_graph_ms`): compiled code calls the FP8 kernels without the ops'
Python, host time per layer step that, timed per call, decided against FP8 for every layer of the
end-to-end benchmark (docs/kernels.md, "FP8 conversion"). An eager model pays that Python, so it is timed
per call. Each decision's reason says which timing it used.

Where FP8 cannot run (no GPU, NVIDIA below compute capability 8.9, AMD before MI300) nothing changes
and :attr:`Float8Plan.skipped_reason` says why; ``optimize`` writes it to the report.

Undo. :meth:`Float8Plan.undo` puts the original ``nn.Linear`` modules back. The swap never copies a
parameter: ``Float8Linear`` holds the same ``weight`` and ``bias`` objects, so ``state_dict`` keys, values
and the optimizer's view of the parameters are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import torch
import torch.fx
from torch import nn

from kernel_pytorch.ops.float8_cast import tensor_abs_max
from kernel_pytorch.ops.float8_linear import (
    RECIPES,
    Float8Linear,
    float8_dtypes_for,
    float8_eligible,
    float8_hardware_reason,
    float8_linear,
)
from kernel_pytorch.timing import PER_CALL, Timings, fastest_cuda_graph_ms, fastest_cuda_ms
from kernel_pytorch.verify import call_arguments

__all__ = ["Float8Plan", "LayerDecision", "convert_to_float8", "linear_targets", "measured_decision",
           "judging_config", "cuda_graphs_note", "CUDA_GRAPHS_NOTE", "PASS_NAME", "MIN_SPEEDUP", "FilterFn"]

FilterFn = Callable[[nn.Module, str], bool]
# FP8 must beat the layer's own dtype by this factor to be chosen: well above the timing noise of a warm
# GPU on these ms-scale steps (docs/kernels.md, "FP8 conversion"), so that no real tie or loss is picked.
MIN_SPEEDUP = 1.05
_MEASURE_WARMUP, _MEASURE_RUNS = 3, 5  # runs per round: kernel_pytorch.timing times 3 interleaved rounds
_measured: dict[tuple, _Measurement] = {}  # (m, k, n, dtype, recipe, training, device, compiled) -> times


@dataclass
class LayerDecision:
    """One candidate layer: its shape on the example inputs, the times measured, and what was done."""

    fqn: str
    shape: tuple[int, int, int] | None  # (M, K, N)
    converted: bool
    reason: str
    base_ms: float | None = None
    fp8_ms: float | None = None


@dataclass
class Float8Plan:
    """What :func:`convert_to_float8` did, and how to undo it."""

    recipe: str
    decisions: list[LayerDecision] = field(default_factory=list)
    skipped_reason: str | None = None
    _originals: dict[str, nn.Linear] = field(default_factory=dict, repr=False)
    _model: nn.Module | None = field(default=None, repr=False)

    @property
    def converted(self) -> list[str]:
        return [d.fqn for d in self.decisions if d.converted]

    def describe(self) -> str:
        if self.skipped_reason is not None:
            return f"fp8: not applied: {self.skipped_reason}"
        return (f"fp8 ({self.recipe}): {len(self.converted)} of {len(self.decisions)} candidate linear layers "
                f"converted")

    def undo(self) -> None:
        """Put the original ``nn.Linear`` modules back (their parameters were never copied)."""
        if self._model is not None:
            for fqn, linear in self._originals.items():
                _set_submodule(self._model, fqn, linear)
        self._originals.clear()


def convert_to_float8(
    model: nn.Module,
    recipe: str = "tensorwise",
    decide: Union[bool, Literal["auto"]] = "auto",
    example_inputs: Any = None,
    filter_fn: FilterFn | None = None,
    include_output_head: bool = False,
    training: bool | None = None,
    emulate: bool = False,
    compiled: bool = False,
) -> Float8Plan:
    """Swap ``model``'s eligible linear layers for :class:`Float8Linear` in place (see the module docstring).

    ``decide="auto"`` needs ``example_inputs`` (the shapes to measure) and a GPU; ``training`` (default:
    ``model.training``) says whether the backward is part of what is measured, ``compiled`` whether the
    model will run under torch.compile (GPU time compared, not time per call). ``emulate=True`` makes
    layers that run FP8's numerics in fp32 on any device (``decide=True`` only: there is nothing to time).
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; expected one of {RECIPES}")
    if decide not in (True, "auto"):
        raise ValueError(f"decide must be True or 'auto', got {decide!r}")
    if decide == "auto" and example_inputs is None:
        raise ValueError("fp8='auto' measures each layer's real shape: pass example_inputs (or fp8=True to convert "
                         "every eligible layer unmeasured)")
    if emulate and decide != True:  # noqa: E712  (decide is True or "auto")
        raise ValueError("emulate=True runs FP8 numerics without FP8 speed: use decide=True, nothing to measure")
    plan = Float8Plan(recipe=recipe, _model=model)
    plan.skipped_reason = None if emulate else float8_hardware_reason(_parameter_device(model))
    if plan.skipped_reason is not None:
        return plan
    training = model.training if training is None else training
    linears, reasons, shapes = _survey(model, example_inputs, filter_fn, include_output_head)
    for fqn, linear in linears.items():
        decision = _decide(fqn, linear, shapes.get(fqn), reasons[fqn], decide, recipe, training, compiled)
        plan.decisions.append(decision)
        if decision.converted:
            plan._originals[fqn] = linear
            forward_dtype, backward_dtype = float8_dtypes_for(linear.weight.device)
            _set_submodule(model, fqn, Float8Linear.from_linear(linear, recipe=recipe, emulate=emulate,
                                                                forward_dtype=forward_dtype,
                                                                backward_dtype=backward_dtype))
    return plan


def linear_targets(model: nn.Module, config, example_inputs: Any = None) -> dict[str, str | None]:
    """What the graph pass (:mod:`kernel_pytorch.passes.fp8_linear`) may convert, per ``config.fp8*``:
    every ``nn.Linear``'s path, with None for a candidate or the reason it is not one (not eligible, the
    output head, ``fp8.filter``)."""
    _, reasons, _ = _survey(model, example_inputs, config.fp8.filter, config.fp8.include_output_head)
    return reasons


def _survey(model: nn.Module, example_inputs: Any, filter_fn: FilterFn | None, include_output_head: bool):
    """The model's linears by path; for each, None (a candidate) or why not; their (M, K, N) on the
    example inputs (empty without them)."""
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    shapes, call_order = _record_shapes(model, linears, example_inputs) if example_inputs is not None else ({}, [])
    head = (call_order or list(linears))[-1:] if not include_output_head else []
    reasons = {fqn: _candidate_reason(fqn, linear, head, filter_fn) for fqn, linear in linears.items()}
    return linears, reasons, shapes


def _candidate_reason(fqn: str, linear: nn.Linear, head: list[str], filter_fn: FilterFn | None) -> str | None:
    reason = float8_eligible(linear)
    if reason is not None:
        return reason
    if fqn in head:
        return "the output head (include_output_head=True to convert it)"
    if filter_fn is not None and not filter_fn(linear, fqn):
        return "excluded by filter_fn"
    return None


def _decide(fqn: str, linear: nn.Linear, shape, reason: str | None, decide, recipe: str, training: bool,
            compiled: bool) -> LayerDecision:
    if reason is not None:
        return LayerDecision(fqn, shape, False, reason)
    if decide is True:
        return LayerDecision(fqn, shape, True, "fp8=True")
    if shape is None:
        return LayerDecision(fqn, shape, False, "not called on the example inputs: no shape to measure")
    converted, reason, base_ms, fp8_ms = measured_decision(shape, linear.weight.dtype, recipe, training,
                                                           linear.weight.device, compiled)
    return LayerDecision(fqn, shape, converted, reason, base_ms, fp8_ms)


def measured_decision(shape: tuple[int, int, int], dtype: torch.dtype, recipe: str, training: bool,
                      device: torch.device, compiled: bool, input_amax_fused: bool = False,
                      grad_amax_fused: bool = False) -> tuple[bool, str, float, float]:
    """``(convert, reason, base_ms, fp8_ms)`` for a linear of this (M, K, N): FP8 only where it measured at
    least :data:`MIN_SPEEDUP` faster on ``device`` (module docstring, "The decision").
    ``input_amax_fused``: the input's producer computes its maximum (``float8_linear``'s ``x_amax``), so
    the FP8 side is timed without that reduction, as it will run; ``grad_amax_fused``: likewise for the
    output gradient's maximum, from its consumer's backward (``grad_amax_slot``; training only)."""
    unable = float8_hardware_reason(device)
    if unable is not None:
        return False, f"fp8='auto' could not measure: {unable}", math.nan, math.nan
    timed = _measurement(shape, dtype, recipe, training, device, compiled, input_amax_fused,
                         grad_amax_fused and training)
    speedup = timed.base_ms / timed.fp8_ms
    measured = f"fp8 measured {speedup:.2f}x ({timed.timing}) at (M, K, N) = {tuple(shape)}"
    if speedup < MIN_SPEEDUP:
        return False, f"{measured}, below {MIN_SPEEDUP}x", timed.base_ms, timed.fp8_ms
    return True, measured, timed.base_ms, timed.fp8_ms


def _record_shapes(model: nn.Module, linears: dict[str, nn.Linear], example_inputs: Any):
    """(M, K, N) of each linear on the example inputs, and the order they were called in."""
    shapes: dict[str, tuple[int, int, int]] = {}
    order: list[str] = []

    def hook(fqn):
        def record(module, inputs, output):
            x = inputs[0]
            shapes[fqn] = (x.numel() // x.shape[-1], module.in_features, module.out_features)
            order.append(fqn)
        return record

    handles = [m.register_forward_hook(hook(fqn)) for fqn, m in linears.items()]
    args, kwargs = call_arguments(example_inputs)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return shapes, list(dict.fromkeys(reversed(order)))[::-1]


@dataclass(frozen=True)
class _Measurement:
    base_ms: float
    fp8_ms: float
    timing: str  # how: Timings.describe()


def _measurement(shape, dtype: torch.dtype, recipe: str, training: bool, device: torch.device,
                 compiled: bool, input_amax_fused: bool = False, grad_amax_fused: bool = False) -> _Measurement:
    """(ms in ``dtype``, ms in FP8) of one call, forward (+ backward when training), and how they were timed;
    measured once per process and arguments."""
    key = (*shape, dtype, recipe, training, str(device), compiled, input_amax_fused, grad_amax_fused)
    if key not in _measured:
        m, k, n = shape
        base = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
        forward_dtype, backward_dtype = float8_dtypes_for(device)
        x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=training)
        dy = torch.randn(m, n, device=device, dtype=dtype)
        x_amax = tensor_abs_max(x.detach()) if input_amax_fused else None  # as the producer would give it
        # With the gradient's maximum from the consumer: (out, slot), and the slot's gradient is that maximum.
        fp8_dy = (dy, tensor_abs_max(dy)) if grad_amax_fused else dy

        def fp8(x):
            return float8_linear(x, base.weight, None, recipe, False, forward_dtype, backward_dtype, x_amax,
                                 grad_amax_fused)

        timed = _timed({"base": _step(base, base.weight, x, dy, training),
                        "fp8": _step(fp8, base.weight, x, fp8_dy, training)}, compiled)
        _measured[key] = _Measurement(timed.ms["base"], timed.ms["fp8"], timed.describe())
    return _measured[key]


def _timed(steps: dict[str, Callable[[], None]], compiled: bool) -> Timings:
    """GPU time (CUDA-graph replay) for a model that will run compiled, time per call for an eager one
    (module docstring, "How it times")."""
    if compiled:
        return fastest_cuda_graph_ms(steps, warmup=_MEASURE_WARMUP, runs=_MEASURE_RUNS)
    return Timings(fastest_cuda_ms(steps, warmup=_MEASURE_WARMUP, runs=_MEASURE_RUNS), PER_CALL)


def _step(layer: Callable[[torch.Tensor], Any], weight: torch.Tensor, x: torch.Tensor, dy: Any,
          training: bool) -> Callable[[], None]:
    """One forward (+ backward) of ``layer``; ``dy``: the gradient of its output, or of each of its outputs."""
    def step():
        if training:
            torch.autograd.grad(layer(x), (x, weight), dy)
        else:
            with torch.no_grad():
                layer(x)

    return step


def _parameter_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_name, _, name = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, name, module)


# ------------------------------------------------------------------------------------ optimize() glue

# The graph pass (passes/fp8_linear.py) whose rewrites put FP8 matmuls in a graph.
PASS_NAME = "fp8"


def judging_config(config, rewriting_passes: Iterable[str]):
    """The config whose tolerances judge a graph (or model) rewritten by ``rewriting_passes`` (the names of
    the passes that changed it): ``config`` with ``fp8.tolerance`` for every dtype once the FP8 pass is
    among them, else ``config``. FP8's rounding amplifies the kernel passes' own small differences too:
    judged with the bf16 tolerances every kernel pass of an FP8 model was rolled back in the end-to-end
    benchmark (docs/kernels.md, "FP8 conversion")."""
    if PASS_NAME not in set(rewriting_passes):
        return config
    return config.model_copy(update={"tolerances": {name: config.fp8.tolerance for name in config.tolerances}})


# The Llama-style training step with fp8="auto" ran faster with compile="reduce-overhead" than through
# Inductor's default mode, which is host-bound (benchmarks/results/e2e.json; docs/kernels.md, "FP8
# conversion"). Not the default: CUDA graphs overwrite a step's outputs at the next step, which breaks code
# that keeps them.
CUDA_GRAPHS_NOTE = ("FP8 matmuls add short cast kernels whose launches leave the GPU idle in between; "
                    "compile='reduce-overhead' (CUDA graphs) removes that: the Llama-style training step with "
                    "fp8='auto' ran faster that way than in the default mode (benchmarks/results/e2e.json)")


def cuda_graphs_note(gm: torch.fx.GraphModule, training: bool, inductor_without_graphs: bool) -> str | None:
    """:data:`CUDA_GRAPHS_NOTE` for a training graph that runs FP8 matmuls (not emulated) through Inductor
    without CUDA graphs, else None."""
    if not (training and inductor_without_graphs):
        return None
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]  # checkpointed regions too
    runs_fp8 = any(n.op == "call_function" and n.target is float8_linear and not n.kwargs.get("emulate", False)
                   for graph in graphs for n in graph.nodes)
    return CUDA_GRAPHS_NOTE if runs_fp8 else None
