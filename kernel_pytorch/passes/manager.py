"""The driver that runs an ordered list of graph passes, lints and recompiles after each one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch.fx

from kernel_pytorch.errors import PassError
from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult
from kernel_pytorch.passes.graph_utils import checkpointed_subgraphs

__all__ = ["PassManager"]


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
        for name, body in checkpointed_subgraphs(gm):
            inner = PassManager._run_on(graph_pass, body, replace(ctx, graph_name=f"{ctx.graph_name}/{name}",
                                                                   example_inputs={}))
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
