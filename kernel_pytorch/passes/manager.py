"""The driver that runs an ordered list of graph passes, lints and recompiles after each one."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx

from kernel_pytorch.errors import PassError
from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult

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
        try:
            result = graph_pass.run(gm, ctx)
            if not isinstance(result, PassResult):
                raise TypeError(f"run() returned {type(result).__name__}, expected PassResult")
            gm.graph.lint()
            gm.recompile()
        except Exception as error:
            raise PassError(graph_pass.name, ctx.graph_name, error) from error
        return result
