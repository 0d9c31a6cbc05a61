"""What ``optimize`` hands the compiler mutates none of its graph inputs, as Inductor sees it.

Inductor skips CUDA graphs (``compile="reduce-overhead"``) for a graph that mutates an input it does not
own ("skipping cudagraphs due to mutated inputs"). Whether a graph does is decided by AOTAutograd's
functionalization: its metadata (``fw_metadata.input_info[i].mutates_data``) is where Inductor's
``mutated_input_idxs`` come from. The custom ops of ``kernel_pytorch/ops`` declare ``mutates_args=()``,
but a ``triton_op`` body is traced into its Triton kernels, and for each kernel functionalization asks
Inductor's TTIR analysis which pointer arguments it stores to; every argument named there is cloned
before the kernel and, when it is (a view of) a graph input, copied back into that input afterwards.

On a GPU the ops take their Triton path; here the same path is traced on CPU tensors (every size sent to
Triton, ``TRITON_DEVICE_TYPES`` widened as the interpreter tests do) with Triton's driver answering an
sm_90 target, which is all the TTIR generation needs. Measured before the fix: the norm kernels' row
indices came out of a helper that also took the input pointers, so X and the residual counted as written
and the Llama-style block stack's hidden-state input was mutated (the H100's reduce-overhead skip).
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

from benchmarks.block_fusion import BlockStack
from kernel_pytorch import optimize, report_of
from kernel_pytorch.capture import CompilerChoice
from kernel_pytorch.testing import LlamaStyleConfig

from .triton_interpreter import INTERPRETED

tu = importlib.import_module("kernel_pytorch.ops.triton_utils")
_OP_MODULES = tuple(importlib.import_module(f"kernel_pytorch.ops.{name}")
                    for name in ("rms_norm", "layer_norm", "rope", "activations"))

pytestmark = pytest.mark.skipif(
    not tu.HAS_TRITON or INTERPRETED,
    reason="needs Triton, and kernels Inductor can analyze (the interpreter's cannot be wrapped)")


@contextlib.contextmanager
def triton_path_as_on_a_gpu():
    """The ops' Triton path for CPU tensors of every size, traceable by Inductor's TTIR analysis."""
    import triton
    from triton.backends.compiler import GPUTarget

    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
        for module in _OP_MODULES:
            for name in dir(module):
                if name.startswith("TRITON_") and name.endswith(("MIN_ELEMENTS", "MIN_HIDDEN")):
                    patch.setattr(module, name, 0)
        patch.setattr(triton.runtime.driver, "_active", _Sm90())
        yield


def functionalized(gm: torch.nn.Module, example_inputs, grad: bool) -> dict:
    """Run AOTAutograd on ``gm`` as Inductor's compile_fx does (fake tensors, functionalization) and
    return what it found: ``mutated``, the input positions mutated (data or metadata); ``clones``, per
    Triton kernel the arguments functionalization took as written; ``backward_mutated``, placeholders of
    the backward graph that an op writes (training)."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode

    found: dict = {"clones": [], "backward_mutated": []}

    def clones(graph: torch.fx.GraphModule) -> list:
        return [node.kwargs["tensors_to_clone"] for node in graph.graph.nodes
                if "triton_kernel_wrapper_functional" in str(node.target)]

    def forward(graph, _inputs):
        found["mutated"] = [i for i, info in enumerate(TracingContext.get().fw_metadata.input_info)
                            if info.mutates_data or info.mutates_metadata]
        found["clones"] += clones(graph)
        return make_boxed_func(graph.forward)

    def backward(graph, _inputs):
        found["clones"] += clones(graph)
        found["backward_mutated"] = _written_placeholders(graph)
        return make_boxed_func(graph.forward)

    fake_mode = FakeTensorMode()
    inputs = [fake_mode.from_tensor(v, static_shapes=True) if isinstance(v, torch.Tensor) else v
              for v in example_inputs]
    with tracing(TracingContext(fake_mode)), fake_mode, torch.set_grad_enabled(grad):
        compiled = aot_module_simplified(gm, inputs, fw_compiler=forward, bw_compiler=backward)
        out = compiled(*inputs)
        if grad:
            out = out[0] if isinstance(out, (tuple, list)) else out
            out.float().sum().backward()
    return found


def _written_placeholders(graph: torch.fx.GraphModule) -> list[str]:
    placeholders = {node for node in graph.graph.nodes if node.op == "placeholder"}
    written = []
    for node in graph.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and value in placeholders:
                written.append(value.name)
    return written


# ------------------------------------------------------------------------------------ each custom op

def _cases():
    x, r, w, b = torch.randn(16, 128), torch.randn(16, 128), torch.randn(128), torch.randn(128)
    stat = torch.rand(16) + 0.5
    q, k, cos, sin = torch.randn(1, 4, 16, 32), torch.randn(1, 2, 16, 32), torch.randn(16, 32), torch.randn(16, 32)
    g, u, gu = torch.randn(16, 96), torch.randn(16, 96), torch.randn(16, 192)
    ops = torch.ops.kernel_pytorch
    # (op call, inputs, the kernel arguments it writes: its outputs; a list, per kernel, for ops that launch
    # several: the backward norms reduce their per-program partial sums in a second kernel)
    return {
        "rms_norm": (lambda x, w: ops.rms_norm(x, w, None, 1e-5, True, False, None), (x, w), {"Y", "RSTD"}),
        "rms_norm residual": (lambda x, w, r: ops.rms_norm(x, w, r, 1e-5, False, False, None), (x, w, r),
                              {"H", "Y", "RSTD"}),
        "rms_norm fp8_amax": (lambda x, w, r: ops.rms_norm(x, w, r, 1e-5, False, True, None), (x, w, r),
                              {"H", "Y", "RSTD", "AMAX"}),
        "rms_norm_backward": (lambda dy, x, w, s, dh: ops.rms_norm_backward(dy, x, w, s, dh, False, True, False),
                              (r, x, w, stat, r * 2), [{"DX", "DW_PARTIAL"}, {"OUT0"}]),
        "rms_norm_backward fp8_amax": (
            lambda dy, x, w, s, dh: ops.rms_norm_backward(dy, x, w, s, dh, False, True, True),
            (r, x, w, stat, r * 2), [{"DX", "DW_PARTIAL", "DX_AMAX"}, {"OUT0"}]),
        "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b, None, 1e-5), (x, w, b), {"Y", "MEAN", "RSTD"}),
        "layer_norm residual": (lambda x, w, b, r: ops.layer_norm(x, w, b, r, 1e-5), (x, w, b, r),
                                {"H", "Y", "MEAN", "RSTD"}),
        "layer_norm_backward": (
            lambda dy, x, w, b, m, s, dh: ops.layer_norm_backward(dy, x, w, b, m, s, dh, True, True),
            (r, x, w, b, stat, stat, r * 2), [{"DX", "PARTIAL"}, {"OUT0", "OUT1"}]),
        "rope": (lambda q, k, c, s: ops.rope(q, k, c, s, False), (q, k, cos, sin), {"QO", "KO"}),
        "rope_backward": (lambda q, k, c, s: ops.rope_backward(q, k, c, s, False), (q, k, cos, sin), {"QO", "KO"}),
        "activation": (lambda x: ops.activation(x, "gelu_tanh"), (x,), {"Y"}),
        "activation_backward": (lambda dy, x: ops.activation_backward(dy, x, "silu"), (r, x), {"DX"}),
        "gated_activation": (lambda g, u: ops.gated_activation(g, u, "silu", False), (g, u), {"Y"}),
        "gated_activation fp8_amax": (lambda g, u: ops.gated_activation(g, u, "silu", True), (g, u), {"Y", "AMAX"}),
        "gated_activation_backward": (lambda dy, g, u: ops.gated_activation_backward(dy, g, u, "silu"),
                                      (g * 2, g, u), {"DG", "DU"}),
        "gated_activation_packed": (lambda gu: ops.gated_activation_packed(gu, "silu", True, False, None), (gu,),
                                    {"Y"}),
        "gated_activation_packed fp8_amax": (lambda gu: ops.gated_activation_packed(gu, "silu", True, True, None),
                                             (gu,), {"Y", "AMAX"}),
        "gated_activation_packed_backward": (lambda dy, gu: ops.gated_activation_packed_backward(dy, gu, "silu", True,
                                                                                                 False),
                                             (g * 2, gu), {"DG"}),
        "gated_activation_packed_backward fp8_amax": (
            lambda dy, gu: ops.gated_activation_packed_backward(dy, gu, "silu", True, True), (g * 2, gu),
            {"DG", "DAMAX"}),
    }


class _Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        out = self.fn(*args)
        return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", sorted(_cases()))
def test_each_triton_op_writes_only_its_outputs(name):
    fn, inputs, outputs = _cases()[name]
    with triton_path_as_on_a_gpu():
        found = functionalized(_Call(fn), inputs, grad=False)
    assert found["clones"], "the op did not take its Triton path"
    per_kernel = outputs if isinstance(outputs, list) else [outputs] * len(found["clones"])
    assert len(found["clones"]) == len(per_kernel), found["clones"]
    for written, expected in zip(found["clones"], per_kernel):
        assert set(written) == expected, f"{name}: Inductor takes {written} as written (outputs: {sorted(expected)})"
    assert found["mutated"] == [], f"{name} mutates inputs {found['mutated']} as Inductor sees it"


# ------------------------------------------------------------------------------- the optimized model

def _graphs_handed_to_the_compiler(monkeypatch, training: bool):
    """optimize() on the block stack of benchmarks/block_fusion.py (hidden states in, so the first norm reads
    the graph's own input), recording each graph and its example inputs as the compiler receives them."""
    recorded = []
    compile_graph = CompilerChoice.compile

    def record(self, gm, example_inputs):
        recorded.append((gm, list(example_inputs)))
        return compile_graph(self, gm, example_inputs)

    monkeypatch.setattr(CompilerChoice, "compile", record)
    config = LlamaStyleConfig(dim=128, n_heads=4, n_kv_heads=2, ffn_dim=352, max_seq_len=64)
    torch.manual_seed(0)
    model = BlockStack(config, 2).train(training)
    state = {name: value.clone() for name, value in model.state_dict().items()}
    x = torch.randn(1, 16, config.dim, requires_grad=training)
    with torch.set_grad_enabled(training):
        optimize(model, example_inputs=(x,), compile=False, device="cpu")
    report = report_of(model)
    assert {"norms", "rope", "activations"} <= {r.pass_name for r in report.rewrites}
    assert report.verification is not None and report.verification.passed
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    assert recorded
    return recorded


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_optimized_block_stack_mutates_no_graph_input(monkeypatch, training):
    for gm, example_inputs in _graphs_handed_to_the_compiler(monkeypatch, training):
        names = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
        with triton_path_as_on_a_gpu():
            found = functionalized(gm, example_inputs, grad=training)
        assert found["clones"], "no Triton kernel was traced: the check saw nothing"
        mutated = [names[i] for i in found["mutated"]]
        assert mutated == [], f"graph inputs {mutated} mutated: Inductor would skip CUDA graphs"
        assert found["backward_mutated"] == [], f"backward graph inputs {found['backward_mutated']} written"
