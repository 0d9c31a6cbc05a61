"""``CompilerChoice.opaque_triton_ops``: Inductor calls our ``triton_op`` ops from its generated code instead of
compiling their traced bodies (the generation lanes' graphs that replay CUDA graphs), with the same results; and the
Inductor fallbacks of our ops registered up front (:mod:`kernel_pytorch.inductor_fallbacks`)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from kernel_pytorch.capture import CompilerChoice
from kernel_pytorch.inductor_fallbacks import register_fallbacks

TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _norm_then_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    normed = torch.ops.kernel_pytorch.rms_norm(x, weight, None, 1e-6, False, False, None)[0]
    return torch.ops.kernel_pytorch.activation(normed * 2.0, "silu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opaque", [True, False])
def test_compiled_graph_calls_the_ops_only_when_opaque_and_matches_eager(opaque, dtype):
    x, weight = torch.randn(4, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    gm = torch.fx.symbolic_trace(_norm_then_silu)
    compiler = CompilerChoice("inductor", opaque_triton_ops=opaque)
    result, (code, *_) = run_and_get_code(lambda: compiler.compile(gm, [x, weight])(x, weight))
    called = [op for op in ("kernel_pytorch.rms_norm", "kernel_pytorch.activation") if op in code]
    assert called == (["kernel_pytorch.rms_norm", "kernel_pytorch.activation"] if opaque else [])
    output = result[0] if isinstance(result, (list, tuple)) else result
    torch.testing.assert_close(output, _norm_then_silu(x, weight), **TOLERANCES[dtype])


def test_every_op_of_ours_has_an_inductor_lowering_once_registered():
    from torch._inductor.lowering import lowerings

    register_fallbacks()
    ours = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith("kernel_pytorch::")]
    missing = [name for name in ours if getattr(torch.ops.kernel_pytorch, name.split("::")[1]).default not in lowerings]
    assert len(ours) > 10 and missing == []
