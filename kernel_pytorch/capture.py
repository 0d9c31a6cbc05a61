"""How graphs are obtained and optimized: a TorchDynamo backend of ours.

``optimize`` routes the model's ``__call__`` through TorchDynamo in place (``compiled_call.install``, which
keeps ``state_dict`` keys) with a :class:`GraphOptimizer` as the dynamo backend. Dynamo hands it each
captured torch-level graph (one per graph break, and again for new shapes or modes) with real example
inputs; it runs the passes, checks each rewritten graph against the captured one on those inputs, rolls
back the passes that break tolerance, and hands the result to the hardware's compiler (or runs it eagerly).

docs/design.md gives the measurement behind this choice: ``torch.fx.symbolic_trace`` fails on Llama, GPT-2
and BERT; dynamo captures them.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint

from kernel_pytorch.block_compile import compile_per_block
from kernel_pytorch.compile_skip import attention_only
from kernel_pytorch.compiled_call import GraphRun
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.errors import PassError
from kernel_pytorch.features import Feature
from kernel_pytorch.hardware import HardwareInfo
from kernel_pytorch.inductor_fallbacks import register_fallbacks
from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult
from kernel_pytorch.passes.graph_utils import (block_of, calls_per_block, checkpointed_subgraphs, clone_graph_module,
                                                is_checkpointed_region)
from kernel_pytorch.passes.linear_cross_entropy import drop_loss_logits
from kernel_pytorch.passes.manager import PassManager
from kernel_pytorch.report import (BlockRecord, OptimizationReport, RewriteRecord, RollbackRecord, SkipRecord,
                                   natural_order)
from kernel_pytorch.verify.graphs import GraphInputs, draws_random_numbers, without_dropout
from kernel_pytorch.verify.numerics import NoiseAwareCheck, unless_out_of_memory

__all__ = ["GraphOptimizer", "GuardedGraph", "CompilerChoice"]


class _PassRaised(Exception):
    """A skippable pass raised while every pass ran on one copy of the graph (``GraphOptimizer._apply``)."""


@dataclass(frozen=True)
class CompilerChoice:
    """The compiler graphs go to after the passes: ``"inductor"``, ``"openxla"`` or ``"eager"``. ``per_block``:
    Inductor compiles an inference graph one repeated block at a time, each distinct block once
    (:mod:`kernel_pytorch.block_compile`). ``opaque_triton_ops``: AOTAutograd keeps our ``triton_op`` calls as
    custom ops instead of tracing their bodies, which skips Triton's mutation analysis per call site (a TTIR build
    each, uncached); for graphs replayed from CUDA graphs, where the op's Python runs at capture only."""

    name: str
    mode: str = "default"
    per_block: bool = False
    opaque_triton_ops: bool = False

    @property
    def uses_cuda_graphs(self) -> bool:
        """Inductor's modes that replay CUDA graphs, which remove the host time :func:`attention_only` saves."""
        from torch._inductor import list_mode_options

        return self.name == "inductor" and bool(list_mode_options(self.mode).get("triton.cudagraphs"))

    def describe(self) -> str:
        return "eager (rewritten graphs run by PyTorch)" if self.name == "eager" else f"{self.name} ({self.mode})"

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self.name == "eager":
            return _with_eager_checkpointing(gm).forward
        if self.name == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx

            patches = list_mode_options(self.mode)
            register_fallbacks()
            with torch._functorch.config.patch(decompose_custom_triton_ops=False) if self.opaque_triton_ops \
                    else contextlib.nullcontext():
                if self.per_block and not torch.is_grad_enabled():
                    return compile_per_block(gm, example_inputs,
                                             lambda graph, inputs: compile_fx(graph, inputs, config_patches=patches))
                return compile_fx(gm, list(example_inputs), config_patches=patches)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.name)(gm, list(example_inputs))


def _with_eager_checkpointing(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with each captured activation-checkpointed region (``tag_activation_checkpoint``) run by
    :func:`run_checkpointed_region` instead of the higher-order op's own eager implementation, which is
    written for tracing: it does not preserve the RNG state (Inductor does that by functionalizing the
    RNG), so dropout drew other masks when the backward recomputed the region, and in torch 2.11 its
    ``Interpreter`` kept every intermediate value of the region alive (the H100 memory benchmark at
    compile=False: 9 GiB more saved after the forward of a 2B model than compiled). A copy: ``gm`` keeps
    the op, by which the report and the tests find the regions' bodies."""
    if not checkpointed_subgraphs(gm):
        return gm
    gm = clone_graph_module(gm)
    for node in gm.graph.nodes:
        if is_checkpointed_region(node):
            node.target = run_checkpointed_region
    gm.recompile()
    return gm


def run_checkpointed_region(body: torch.fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """A checkpointed region of a captured graph, run eagerly as ``torch.utils.checkpoint`` runs the
    block it came from: non-reentrant, RNG state preserved, with the region's selective-checkpointing
    policy (Dynamo keeps it in ``body.meta``)."""
    options = {**kwargs, "use_reentrant": False, "preserve_rng_state": True}
    context_fn = body.meta.get("_checkpoint_context_fn")
    if context_fn is not None:
        options["context_fn"] = context_fn
    return torch.utils.checkpoint.checkpoint(body, *args, **options)


class GraphOptimizer:
    """The dynamo backend: ``GraphOptimizer(...)(gm, example_inputs) -> callable``.

    Passes that fail verification on a graph are rolled back for that graph (the report says which,
    with the measured error). With ``config.strict`` a pass that raises propagates as ``PassError``;
    otherwise it is skipped for that graph with a report line.
    """

    def __init__(
        self,
        *,
        passes: Sequence[GraphPass],
        hardware: HardwareInfo,
        config: OptimizeConfig,
        training: bool,
        compiler: CompilerChoice,
        verify: bool,
        report: OptimizationReport,
        features: Sequence[Feature] = (),
        pass_inputs: Mapping[str, Any] | None = None,
    ):
        self.passes = tuple(passes)
        self.features = tuple(features)
        self.pass_inputs = dict(pass_inputs or {})  # PassContext fields the features filled (FP8's targets)
        self.hardware = hardware
        self.config = config
        self.training = training
        self.compiler = compiler
        self.verify = verify
        self.report = report
        self.draws_random_numbers = False

    def __repr__(self) -> str:
        return f"kernel_pytorch.GraphOptimizer({self.hardware.vendor}, compiler={self.compiler.name})"

    def for_report(self, report: OptimizationReport) -> GraphOptimizer:
        """The same backend for a copy of the model: the copy's own report, nothing captured yet."""
        twin = copy.copy(self)
        twin.report, twin.draws_random_numbers = report, False
        return twin

    def with_compiler(self, compiler: CompilerChoice) -> GraphOptimizer:
        """The same passes and report, the graphs it captures compiled by ``compiler`` (a decoder's uncompiled
        prefill)."""
        twin = copy.copy(self)
        twin.compiler = compiler
        return twin

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        # The checks and kernel measurements below run forwards and backwards of their own, inside the model's
        # call that triggered the capture: saved-tensor hooks around that call are not theirs. Identity hooks
        # (the innermost pair is the one autograd uses) keep, e.g., saved_activation_bytes' meter from dropping
        # the tensors a check's backward needs (H100: memory_wrappers demo, a recapture inside the meter).
        with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
            return self._optimized(gm, example_inputs)

    def _optimized(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        name = f"graph {self.report.graphs}"
        self.report.graphs += 1
        self.draws_random_numbers |= draws_random_numbers(gm)
        placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        ctx = PassContext(hardware=self.hardware, config=self.config, training=self._training(example_inputs, name),
                          graph_name=name,
                          example_inputs=dict(zip(placeholders, example_inputs)),
                          compiled=self.compiler.name != "eager", cuda_graphs=self.compiler.uses_cuda_graphs,
                          **self.pass_inputs)
        if ctx.training and self.config.training_logits == "drop":
            self._drop_loss_logits(gm, name)
        started = time.perf_counter()
        candidate, results = self._apply(gm, self.passes, ctx)
        self.report.add_time("passes", time.perf_counter() - started)
        if self.verify and any(result.changed for _, result in results):
            started = time.perf_counter()
            candidate, results = self._verified(gm, candidate, results, example_inputs, ctx)
            self.report.add_time("verify", time.perf_counter() - started)
        self._record(results, name)
        self._record_blocks(gm, candidate, results, name)
        started = time.perf_counter()
        compiled = self._compile(candidate, example_inputs, name, ctx.training)
        self.report.add_time("compile", time.perf_counter() - started)
        guards = [guard for _, result in results for guard in result.guards]
        if guards:
            for guard in guards:
                guard.bind(candidate.graph)
            return GraphRun(GuardedGraph(compiled, gm, guards, self.report, name))
        return GraphRun(compiled)

    def _drop_loss_logits(self, gm: torch.fx.GraphModule, name: str) -> None:
        dropped = drop_loss_logits(gm)
        self.report.notes.append(
            f"{name}: training_logits='drop': " + (f"{dropped} LM head's logits read by the loss returned as None"
                                                   if dropped else "no logits returned only for a loss here; kept"))

    def _training(self, example_inputs: Sequence[Any], name: str) -> bool:
        """Whether this graph is rewritten for training: the model's mode at optimize time, or gradients
        flowing in this capture (a model optimized in eval mode, then trained: kernels need a backward)."""
        if self.training:
            return True
        flowing = torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad
                                                  for v in example_inputs)
        if flowing:
            self.report.notes.append(f"{name}: captured with gradients flowing, on a model optimized for inference: "
                                     "rewritten and verified as for training")
        return flowing

    def _apply(
        self, gm: torch.fx.GraphModule, passes: Sequence[GraphPass], ctx: PassContext
    ) -> tuple[torch.fx.GraphModule, list[tuple[GraphPass, PassResult]]]:
        """Run ``passes`` on a copy of ``gm``; a pass that raises leaves the copy as it was before it. They all run
        on one copy; only when one raises do they run again from ``gm``, each on a copy of its own (a copy per pass
        cost more than most passes: 34 ms for a 16-layer Llama's graph on the CPU, a dozen passes per graph)."""
        try:
            return self._apply_passes(gm, passes, ctx, copy_per_pass=False)
        except _PassRaised:
            return self._apply_passes(gm, passes, ctx, copy_per_pass=True)

    def _apply_passes(
        self, gm: torch.fx.GraphModule, passes: Sequence[GraphPass], ctx: PassContext, copy_per_pass: bool
    ) -> tuple[torch.fx.GraphModule, list[tuple[GraphPass, PassResult]]]:
        current = clone_graph_module(gm)
        results = []
        seconds: dict[str, float] = {}  # per pass: a measuring pass shows its share of the set-up in the report
        for graph_pass in passes:
            trial = clone_graph_module(current) if copy_per_pass else current
            earlier = {done.name: result for done, result in results}
            started = time.perf_counter()
            try:
                result = PassManager.run_one(graph_pass, trial, replace(ctx, earlier_results=earlier))
            except PassError as error:
                if self.config.strict or not graph_pass.skipped_on_error:
                    raise
                if not copy_per_pass:  # the copy may be half rewritten: start again with a copy per pass
                    raise _PassRaised from error
                self.report.skipped.append(SkipRecord(pass_name=graph_pass.name, location="(whole graph)",
                                                      reason=f"the pass raised; skipped: {error}", graph=ctx.graph_name))
                continue
            finally:
                seconds[graph_pass.name] = time.perf_counter() - started
            current = trial
            results.append((graph_pass, result))
        for name, spent in seconds.items():
            self.report.add_time(f"pass {name}", spent)
        return current, results

    def _verified(self, gm, candidate, results, example_inputs, ctx):
        """``candidate`` if it matches ``gm`` on the example inputs; else the passes re-applied one at a
        time, each kept only if the graph still matches."""
        inputs = GraphInputs(gm, example_inputs, ctx.training)
        if inputs.unusable_reason:
            self.report.notes.append(f"{ctx.graph_name}: not verified ({inputs.unusable_reason})")
            return candidate, results
        def first_check() -> tuple[NoiseAwareCheck, Any]:
            reference = inputs.run(without_dropout(gm))

            def float32_run():  # the graph's float32 copy is made only if the referee is needed
                return inputs.run_float32(without_dropout(gm), reference)

            check = NoiseAwareCheck(reference, float32_run, self.config)
            return check, check(inputs.run(without_dropout(candidate)), self._judged_by(results))

        # The original graph (hand-written attention's fp32 scores at long lengths) may not fit next to the
        # rewritten one; the rewrites then stay, unverified, as with unusable inputs.
        checked = unless_out_of_memory(first_check)
        if checked is None:
            self.report.notes.append(f"{ctx.graph_name}: not verified (out of memory running the graphs on the "
                                     "example inputs; smaller example inputs verify it, verify=False skips it)")
            return candidate, results
        check, comparison = checked
        if comparison.ok:
            self._note_referee(comparison, check, ctx.graph_name, "the rewritten graph")
            return candidate, results
        current, kept = clone_graph_module(gm), []
        for graph_pass, _ in results:
            trial, trial_results = self._apply(current, [graph_pass], ctx)
            if not trial_results:
                continue
            result = trial_results[0][1]
            judged_by = self._judged_by([*kept, (graph_pass, result)])
            comparison = check(inputs.run(without_dropout(trial)), judged_by) if result.changed else None
            if comparison is None or comparison.ok:
                if comparison is not None:
                    self._note_referee(comparison, check, ctx.graph_name, f"pass {graph_pass.name}")
                current = trial
                kept.append((graph_pass, result))
            else:
                self.report.rollbacks.append(RollbackRecord(
                    pass_name=graph_pass.name, graph=ctx.graph_name,
                    reason=f"rolled back: {comparison.describe()}"))
        if check.unavailable:
            self.report.notes.append(f"{ctx.graph_name}: judged by tolerance only, no float32 referee "
                                     f"({check.unavailable})")
        return current, kept

    def _judged_by(self, results: list[tuple[GraphPass, PassResult]]) -> OptimizeConfig:
        """The config whose tolerances judge a graph with these passes' rewrites."""
        return self.judging_config(graph_pass.name for graph_pass, result in results if result.changed)

    def judging_config(self, rewritten: Iterable[Any]) -> OptimizeConfig:
        """The config whose tolerances judge what ``rewritten`` (pass names, or rewrite records) changed: each
        feature's ``judging_config`` (with linears in FP8, ``fp8.tolerance``)."""
        names = [getattr(item, "pass_name", item) for item in rewritten]
        config = self.config
        for feature in self.features:
            config = feature.judging_config(config, names)
        return config

    def _note_referee(self, comparison: Any, check: NoiseAwareCheck, graph: str, what: str) -> None:
        if comparison.rule != "tolerance":
            where = f" (the referee ran {check.referee_where})" if check.referee_where else ""
            self.report.notes.append(f"{graph}: {what} accepted against a float32 run of the graph{where}: "
                                     f"{comparison.describe()}")

    def _record(self, results: list[tuple[GraphPass, PassResult]], graph: str) -> None:
        for graph_pass, result in results:
            self.report.rewrites += [RewriteRecord(pass_name=graph_pass.name, location=r.location,
                                                   replacement=r.replacement, graph=graph) for r in result.rewrites]
            self.report.skipped += [SkipRecord(pass_name=graph_pass.name, location=s.location,
                                               reason=s.reason, graph=graph) for s in result.skipped]

    def _record_blocks(self, gm: torch.fx.GraphModule, candidate: torch.fx.GraphModule,
                       results: list[tuple[GraphPass, PassResult]], graph: str) -> None:
        """Per repeated block: the rewrites kept and the graph operations before and after the passes."""
        before, after = calls_per_block(gm), calls_per_block(candidate)
        rewrites: dict[str, dict[str, int]] = {}
        for graph_pass, result in results:
            for record in result.rewrites:
                per_pass = rewrites.setdefault(block_of(record.location), {})
                per_pass[graph_pass.name] = per_pass.get(graph_pass.name, 0) + 1
        for block in sorted(before.keys() | after.keys(), key=natural_order):
            self.report.blocks.append(BlockRecord(block=block, graph=graph, rewrites=rewrites.get(block, {}),
                                                  ops_before=before.get(block, 0), ops_after=after.get(block, 0)))

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str,
                 training: bool) -> Callable[..., Any]:
        without_graphs = self.compiler.name == "inductor" and not self.compiler.uses_cuda_graphs
        for feature in self.features:
            note = feature.compile_note(gm, training, without_graphs)
            if note is not None:
                self.report.note(note)
        if without_graphs and attention_only(gm):
            self.report.notes.append(f"{name}: run eagerly, not by Inductor: its only compute is fused attention, "
                                     "which Inductor would call as it is (this saves its wrapper's host time)")
            return gm.forward
        try:
            compiled = self.compiler.compile(gm, example_inputs)
            if getattr(compiled, "block_compile_note", None):
                self.report.notes.append(f"{name}: {compiled.block_compile_note}")
            return compiled
        except Exception as error:
            if self.config.strict:
                raise
            self.report.notes.append(
                f"{name}: compiler {self.compiler.name} failed ({type(error).__name__}: {error}); running it eagerly")
            return gm.forward


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class GuardedGraph:
    """A compiled rewritten graph behind the runtime guards its rewrites rely on (``RuntimeGuard``).

    Each call checks the guards (cached lookups: a few attribute reads); if one fails, that call runs
    the original, unrewritten graph eagerly (correct, slower) and the report says so once. Dynamo
    calls it, and it calls the compiled function, with the graph's arguments unpacked.
    """

    def __init__(self, compiled: Callable[..., Any], original: torch.fx.GraphModule, guards: Sequence[Any],
                 report: OptimizationReport, name: str):
        self.compiled, self.original, self.guards = compiled, original, tuple(guards)
        self.report, self.name, self.fallbacks = report, name, 0

    def __call__(self, *args: Any) -> Any:
        failed = next((guard for guard in self.guards if not guard.holds(args)), None)
        if failed is None:
            return self.compiled(*args)
        if not self.fallbacks:
            self.report.notes.append(f"{self.name}: {failed.describe()} did not hold for a call; such calls run "
                                     "the graph unrewritten (eager)")
        self.fallbacks += 1
        return self.original(*args)
