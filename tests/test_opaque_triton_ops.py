"""``CompilerChoice.opaque_triton_ops``: Inductor calls our ``triton_op`` ops from its generated code instead of
compiling their traced bodies (the generation lanes' graphs that replay CUDA graphs), with the same results; and the
Inductor fallbacks of our ops registered up front (:mod:`kernel_pytorch.inductor_fallbacks`)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from kernel_pytorch.capture import CompilerChoice



def _norm_then_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    normed = torch.ops.kernel_pytorch.rms_norm(x, weight, None, 1e-6, False, False, None)[0]
    return torch.ops.kernel_pytorch.activation(normed * 2.0, "silu")


@pytest.mark.parametrize("opaque", [True, False])
def test_compiled_graph_calls_the_ops_only_when_opaque_and_matches_eager(opaque, caplog):
    from torch._inductor.lowering import lowerings

    ops = [torch.ops.kernel_pytorch.rms_norm.default, torch.ops.kernel_pytorch.activation.default]
    for op in ops:  # as in a fresh process: Inductor would register these at their first call in a graph
        lowerings.pop(op, None)
    x, weight = torch.randn(4, 64), torch.randn(64)  # float32: one Inductor compile (C++) per case
    gm = torch.fx.symbolic_trace(_norm_then_silu)
    compiler = CompilerChoice("inductor", opaque_triton_ops=opaque)
    with caplog.at_level(logging.INFO, logger="torch._inductor.graph"):
        result, (code, *_) = run_and_get_code(lambda: compiler.compile(gm, [x, weight])(x, weight))
    called = [op for op in ("kernel_pytorch.rms_norm", "kernel_pytorch.activation") if op in code]
    assert called == (["kernel_pytorch.rms_norm", "kernel_pytorch.activation"] if opaque else [])
    assert all(op in lowerings for op in ops)  # registered up front, so Inductor's implicit fallback never ran:
    assert not [r for r in caplog.records if "implicit fallback" in r.getMessage()]
    output = result[0] if isinstance(result, (list, tuple)) else result
    torch.testing.assert_close(output, _norm_then_silu(x, weight), rtol=1e-5, atol=1e-5)
