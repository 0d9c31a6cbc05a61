"""``Backend``: one per hardware family, a short declarative choice of passes, kernels and compiler.

The pipeline itself (module passes, capture, graph passes, verification, compilation) is written once,
here; a subclass only declares what fits its hardware.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.nn as nn

from kernel_pytorch.capture import CompilerChoice, GraphOptimizer
from kernel_pytorch.config import OptimizeConfig, Vendor
from kernel_pytorch.errors import PassError
from kernel_pytorch.features import Feature, OptimizeRun, enabled_features
from kernel_pytorch.hardware import HardwareInfo
from kernel_pytorch.optimization_state import OptimizationState
from kernel_pytorch.passes.base import GraphPass, ModulePass, PassContext
from kernel_pytorch.passes.registry import get_pass
from kernel_pytorch.report import OptimizationReport, RewriteRecord, SkipRecord

__all__ = ["Backend", "Kernel", "PlanItem", "OptimizationState"]


@dataclass(frozen=True)
class Kernel:
    """A kernel family a backend dispatches to, and what the hardware must have for it."""

    name: str
    description: str
    requires: Callable[[HardwareInfo], str | None] = lambda hardware: None  # None: usable, else why not


@dataclass(frozen=True)
class PlanItem:
    """One line of a backend's plan: a pass, kernel or compiler, whether it applies, and why."""

    kind: str  # "pass" | "kernel" | "compiler"
    name: str
    applies: bool
    reason: str


class Backend:
    """Base of the per-hardware backends; subclasses set the class attributes only.

    Example::

        backend = get_backend(detect_hardware())
        model, report = backend.prepare_model(model, OptimizeConfig())
    """

    vendor: ClassVar[Vendor]
    compiler: ClassVar[str]  # "inductor" | "openxla" | "eager"
    compile_by_default: ClassVar[bool]
    # Every backend runs these; the attention pass's kernel choice is per backend (attention/dispatch.py).
    # "rope" before "attention": the attention matcher takes Q and K from the RoPE call's outputs as it
    # does from any other node (either order matches; this one keeps attention's Q, K operands final).
    # "horizontal_gemm" before "activations": a gate/up pair it fuses is split with chunk(gate_up, 2, -1),
    # which the activations pass then turns into one packed gated activation.
    # "context_parallel" after both (with the context_parallel option only): it makes the fused RoPE tables and
    # attention calls global.
    # "decode_attention" before "attention": it takes the one-token SDPA calls of decode steps, which the attention
    # pass would otherwise dispatch as general attention.
    # "linear_cross_entropy" reads only the LM head and the loss, which no other pass rewrites.
    # "fp8" after them: it converts the linears as the horizontal fusion left them (passes/fp8_linear.py: why).
    # "decode_linear" after them: it takes the F.linear calls of a few token rows that no other pass converted;
    # "decode_fusion" after it: it folds the norm before and the gated activation after a decode_linear launch into
    # it; "decode_rope_cache" takes the rope pass's call and the KV-cache writes after it.
    graph_passes: ClassVar[tuple[str, ...]] = ("normalize", "norms", "horizontal_gemm", "activations", "rope",
                                               "decode_attention", "attention", "context_parallel",
                                               "linear_cross_entropy", "fp8", "decode_linear",
                                               "decode_fusion", "decode_rope_cache")
    module_passes: ClassVar[tuple[str, ...]] = ()
    kernels: ClassVar[tuple[Kernel, ...]] = ()

    def __init__(self, hardware: HardwareInfo):
        if hardware.vendor != self.vendor:
            raise ValueError(f"{type(self).__name__} serves {self.vendor}, not {hardware.vendor}")
        self.hardware = hardware

    @property
    def name(self) -> str:
        return self.vendor

    # -- choices ---------------------------------------------------------------------------------

    def compiler_unavailable_reason(self) -> str | None:
        """Why this backend's compiler cannot run here (``None``: it can)."""
        if self.compiler == "inductor" and self.vendor in ("nvidia", "amd") and not self.hardware.triton_usable:
            return "Inductor generates Triton kernels on GPUs, and Triton is not usable here"
        if self.compiler == "inductor" and self.vendor == "cpu" and not _cxx_compiler():
            return "Inductor's CPU backend needs a C++ compiler (g++ or clang++), none found on PATH"
        if self.compiler == "openxla" and importlib.util.find_spec("torch_xla") is None:
            return "the openxla compiler needs torch_xla, which is not installed"
        return None

    def compiler_choice(self, config: OptimizeConfig) -> tuple[CompilerChoice, str]:
        """The compiler graphs go to, and a report line saying why."""
        wanted = config.compile
        if wanted is False or (wanted == "auto" and not self.compile_by_default):
            why = "compile=False" if wanted is False else f"compile='auto' on {self.vendor}: compile time rarely pays back"
            return CompilerChoice("eager"), why
        unavailable = self.compiler_unavailable_reason()
        if unavailable:
            return CompilerChoice("eager"), f"{self.compiler} not used: {unavailable}"
        mode = wanted if isinstance(wanted, str) and wanted != "auto" else "default"
        return CompilerChoice(self.compiler, mode), f"{self.compiler} is {self.vendor}'s compiler"

    def selected_passes(self, config: OptimizeConfig) -> tuple[list[GraphPass | ModulePass], list[PlanItem]]:
        """The passes that will run, in order, and a plan line for every pass considered."""
        names = [n for n in (*self.module_passes, *self.graph_passes) if n not in config.extra_passes]
        names += list(config.extra_passes)
        chosen, plan = [], []
        for name in names:
            graph_pass = get_pass(name)
            unavailable = graph_pass.reason_not_to_run(self.hardware, config)
            if name in config.disable_passes:
                plan.append(PlanItem("pass", name, False, "disabled by config.disable_passes"))
            elif unavailable:
                plan.append(PlanItem("pass", name, False, unavailable))
            else:
                chosen.append(graph_pass)
                plan.append(PlanItem("pass", name, True, graph_pass.description))
        return chosen, plan

    def plan(self, config: OptimizeConfig | None = None) -> list[PlanItem]:
        """Which passes, kernels and compiler apply on this hardware, and why the others do not."""
        config = config or OptimizeConfig()
        _, items = self.selected_passes(config)
        for kernel in self.kernels:
            unavailable = kernel.requires(self.hardware)
            items.append(PlanItem("kernel", kernel.name, unavailable is None, unavailable or kernel.description))
        compiler, why = self.compiler_choice(config)
        items.append(PlanItem("compiler", compiler.describe(), True, why))
        return items

    # -- the pipeline --------------------------------------------------------------------------------

    def prepare_model(
        self, model: nn.Module, config: OptimizeConfig, example_inputs: Any = None, *, run: OptimizeRun | None = None,
        features: Sequence[Feature] | None = None,
    ) -> tuple[nn.Module, OptimizationReport]:
        """Apply the module passes in place and install the graph passes and compiler through dynamo.

        Graphs are captured at the first call (``optimize`` makes that call at once when it has example
        inputs). The model keeps its identity, parameters and ``state_dict`` keys. ``run`` and ``features``
        are what ``optimize`` decided (by default, decided here from ``config``).
        """
        run = run or OptimizeRun.decide(model, config, example_inputs, config)
        features = enabled_features(config) if features is None else features
        compiler, why = self.compiler_choice(config)
        report = OptimizationReport(hardware=self.hardware, backend=self.name,
                                    mode="training" if run.training else "inference", compiler=compiler.describe())
        report.notes.append(f"compiler: {why}")
        passes, plan = self.selected_passes(config)
        report.skipped += [SkipRecord(pass_name=p.name, location="(model)", reason=p.reason)
                           for p in plan if not p.applies]
        ctx = PassContext(hardware=self.hardware, config=config, training=run.training, graph_name="modules")
        undo = self._run_module_passes([p for p in passes if isinstance(p, ModulePass)], model, ctx, report)
        pass_inputs: dict[str, Any] = {}
        for feature in features:
            pass_inputs.update(feature.pass_inputs(model, run, [p.name for p in passes]))
        optimizer = GraphOptimizer(passes=[p for p in passes if isinstance(p, GraphPass)], hardware=self.hardware,
                                   config=config, training=run.training, compiler=compiler, verify=run.verify_graphs,
                                   report=report, features=features, pass_inputs=pass_inputs)
        state = OptimizationState(report=report, graph_optimizer=optimizer, module_undo=undo, model=model,
                                  dynamic=config.dynamic)
        model._kernel_pytorch = state
        state.install()
        return model, report

    def _run_module_passes(self, passes, model, ctx, report) -> list[Callable[[], None]]:
        undo: list[Callable[[], None]] = []
        for module_pass in passes:
            try:
                result = module_pass.run(model, ctx)
            except Exception as error:
                failure = PassError(module_pass.name, "the model's modules", error)
                if ctx.config.strict:
                    raise failure from error
                report.skipped.append(SkipRecord(pass_name=module_pass.name, location="(model)",
                                                 reason=f"the pass raised; skipped: {failure}"))
                continue
            undo += result.undo
            report.rewrites += [RewriteRecord(pass_name=module_pass.name, location=r.location,
                                              replacement=r.replacement, graph="modules") for r in result.rewrites]
            report.skipped += [SkipRecord(pass_name=module_pass.name, location=s.location, reason=s.reason,
                                          graph="modules") for s in result.skipped]
        return undo


def _cxx_compiler() -> str | None:
    return next((shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++", "c++") if c and shutil.which(c)),
                None)
