"""The driver that runs an ordered list of graph passes, lints and recompiles after each one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch.fx

from kernel_pytorch.errors import PassError
from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult
from kernel_pytorch.passes.graph_utils import checkpointed_subgraphs, is_checkpointed_region
from kernel_pytorch.passes.shape_constants import ConstantEvaluator

__all__ = ["PassManager", "constant_operands"]


class PassManager:
    """Runs ``passes`` in order on one graph. Any exception a pass raises, or a graph it leaves
    malformed (``Graph.lint`` fails), becomes a :class:`PassError` that names the pass and the graph.

    Example::

        results = PassManager([get_pass("normalize")]).run(gm, ctx)
        for graph_pass, result in results:
            print(graph_pass.name, result.changed)
    """

    def __init__(self, passes: Sequence[GraphPass]):
        self.passes = tuple(passes)

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> list[tuple[GraphPass, PassResult]]:
        return [(graph_pass, self.run_one(graph_pass, gm, ctx)) for graph_pass in self.passes]

    @staticmethod
    def run_one(graph_pass: GraphPass, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        """``graph_pass`` on ``gm`` and on the bodies of its activation-checkpointed regions (their
        results merged into one). Bodies get no example inputs: their placeholders are not the
        graph's, so nothing there is decided from example values."""
        result = PassManager._run_on(graph_pass, gm, ctx)
        evaluator = ConstantEvaluator()  # one for every body: the layers share one mask, evaluated once
        for name, body in checkpointed_subgraphs(gm):
            inner_ctx = replace(ctx, graph_name=f"{ctx.graph_name}/{name}", example_inputs={},
                                constant_inputs=_LazyConstants(gm, name, body, evaluator))
            inner = PassManager._run_on(graph_pass, body, inner_ctx)
            result.rewrites += inner.rewrites
            result.skipped += inner.skipped
            result.changed += inner.changed
        return result

    @staticmethod
    def _run_on(graph_pass: GraphPass, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        try:
            result = graph_pass.run(gm, ctx)
            if not isinstance(result, PassResult):
                raise TypeError(f"run() returned {type(result).__name__}, expected PassResult")
            gm.graph.lint()
            gm.recompile()
        except Exception as error:
            raise PassError(graph_pass.name, ctx.graph_name, error) from error
        return result


class _LazyConstants(Mapping):
    """:func:`constant_operands`, computed on first use: only the attention pass reads them, and a
    causal mask at L = 16384 costs about a second to evaluate, so the other passes should not pay it."""

    def __init__(self, gm: torch.fx.GraphModule, name: str, body: torch.fx.GraphModule,
                 evaluator: ConstantEvaluator):
        self._arguments, self._values = (gm, name, body, evaluator), None

    def _resolved(self) -> dict:
        if self._values is None:
            self._values = constant_operands(*self._arguments)
        return self._values

    def __getitem__(self, key):
        return self._resolved()[key]

    def __iter__(self):
        return iter(self._resolved())

    def __len__(self) -> int:
        return len(self._resolved())


def constant_operands(gm: torch.fx.GraphModule, name: str, body: torch.fx.GraphModule,
                      evaluator: ConstantEvaluator) -> dict:
    """The body placeholders of checkpointed region ``name`` whose operands ``gm`` computes from
    shape-only ops with static sizes (a causal mask built before the blocks), with their values."""
    calls = [n for n in gm.graph.nodes if is_checkpointed_region(n) and n.args and
             getattr(n.args[0], "target", None) == name]
    if len(calls) != 1:  # a body used twice could get different operands
        return {}
    placeholders = [n.name for n in body.graph.nodes if n.op == "placeholder"]
    known = {}
    for placeholder, operand in zip(placeholders, calls[0].args[1:]):
        if isinstance(operand, torch.fx.Node):
            evaluation = evaluator.evaluate(operand)
            if evaluation.value is not None and not evaluation.bound:
                known[placeholder] = evaluation.value
    return known
