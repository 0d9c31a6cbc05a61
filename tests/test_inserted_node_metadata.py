"""Nodes the graph passes insert carry an example value (``meta["example_value"]``, Dynamo's key, which
every pass reads) equal in shape, dtype and device to what the node computes, when the graph comes
from ``optimize``'s own Dynamo backend.

Inside that backend ``torch._guards.detect_fake_mode`` returns the tracing context's FakeTensorMode,
which on torch 2.13 is not the mode of the graph's example values: a pass that evaluated its new nodes
under it got "Mixing fake modes" and left them without a value. Graphs captured by hand
(``conftest.capture_graph``) run outside that context, so only a test through ``optimize`` sees it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx
from torch import nn

from kernel_pytorch import optimize, report_of
from kernel_pytorch.attention import dispatch
from kernel_pytorch.capture import CompilerChoice
from kernel_pytorch.memory import apply_checkpointing
from kernel_pytorch.passes.graph_utils import checkpointed_subgraphs, is_checkpointed_region
from kernel_pytorch.passes.manager import PassManager
from kernel_pytorch.passes.shape_constants import example_value
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

# The attention pass inserts logical_not for MaskedFillInf's -inf fill (SDPA's bool mask: True = attend) and
# where(masked, fill, 0) for MaskedFillFinfo's finfo.min fill (an additive mask).
from .test_attention_pass import MaskedFillFinfo, MaskedFillInf

# The passes whose inserted nodes are checked (normalize respells nodes in place; activations copies
# the replaced node's metadata onto its one new call).
CHECKED_PASSES = ("norms", "horizontal_gemm", "rope", "attention")


def graphs_of(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.GraphModule]]:
    """``gm`` and the bodies of its checkpointed regions (which the passes rewrite too), each with the
    prefix its node names get here: names are unique only within one graph."""
    return [("", gm), *((f"{name}/", body) for name, body in checkpointed_subgraphs(gm))]


def node_names(gm: torch.fx.GraphModule) -> set[str]:
    return {prefix + node.name for prefix, graph in graphs_of(gm) for node in graph.graph.nodes}


class Recorder:
    """Names of the nodes each pass inserted, and the graph and example inputs handed to the compiler."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.inserted: dict[str, set[str]] = {}
        self.graphs: list[tuple[torch.fx.GraphModule, list[Any]]] = []
        run_one, compile_graph = PassManager.run_one, CompilerChoice.compile

        def recording_run_one(graph_pass, gm, ctx):
            before = node_names(gm)
            result = run_one(graph_pass, gm, ctx)
            # Names survive clone_graph_module (graph_copy keeps them), unlike the Node objects.
            self.inserted.setdefault(graph_pass.name, set()).update(node_names(gm) - before)
            return result

        def recording_compile(choice, gm, example_inputs):
            self.graphs.append((gm, list(example_inputs)))
            return compile_graph(choice, gm, example_inputs)

        monkeypatch.setattr(PassManager, "run_one", staticmethod(recording_run_one))
        monkeypatch.setattr(CompilerChoice, "compile", recording_compile)

    def inserted_by(self, pass_name: str, gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.Node]]:
        """Nodes of ``gm`` (the graph that was compiled) and of its bodies that ``pass_name`` inserted,
        by prefixed name."""
        names = self.inserted.get(pass_name, set())
        return [(prefix + node.name, node) for prefix, graph in graphs_of(gm) for node in graph.graph.nodes
                if prefix + node.name in names]


def real_values(gm: torch.fx.GraphModule, inputs: list[Any]) -> dict[str, Any]:
    """Every node's value when ``gm`` runs on its real example inputs, checkpointed bodies' nodes by
    prefixed name (a body runs on the operands of its ``tag_activation_checkpoint`` call)."""
    values: dict[str, Any] = {}

    class Recording(torch.fx.Interpreter):
        def run_node(self, node):
            values[node.name] = super().run_node(node)
            return values[node.name]

    with torch.no_grad():
        Recording(gm).run(*inputs)
    for node in gm.graph.nodes:
        if is_checkpointed_region(node):
            name = str(node.args[0].target)
            operands = [values[arg.name] if isinstance(arg, torch.fx.Node) else arg for arg in node.args[1:]]
            body_values = real_values(getattr(gm, name), operands)
            values.update({f"{name}/{key}": value for key, value in body_values.items()})
    return values


def _leaves(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def mismatches(name: str, node: torch.fx.Node, real: Any) -> list[str]:
    """How ``node``'s example value differs from the value it computed (empty: it agrees)."""
    fake = example_value(node)
    if fake is None:
        return [f"{name} ({node.target}): no example value"]
    fakes, reals = _leaves(fake), _leaves(real)
    if len(fakes) != len(reals):
        return [f"{name}: {len(fakes)} example values for {len(reals)} outputs"]
    problems = []
    for index, (f, r) in enumerate(zip(fakes, reals)):
        if not isinstance(r, torch.Tensor):
            continue
        if not isinstance(f, torch.Tensor):
            problems.append(f"{name}[{index}]: example value is {type(f).__name__}, not a tensor")
        elif (tuple(f.shape), f.dtype, f.device) != (tuple(r.shape), r.dtype, r.device):
            problems.append(f"{name}[{index}]: example {tuple(f.shape)} {f.dtype} {f.device}, "
                            f"computed {tuple(r.shape)} {r.dtype} {r.device}")
    return problems


def check_inserted_nodes(recorder: Recorder, expected_passes: tuple[str, ...]) -> None:
    """Each of ``expected_passes`` inserted nodes into a compiled graph, and every node any checked pass
    inserted has an example value that agrees with the real run."""
    # One graph per model here: inserted nodes are known by name, and names are unique within one graph.
    assert len(recorder.graphs) == 1, f"{len(recorder.graphs)} graphs reached the compiler"
    problems, counts = [], dict.fromkeys(CHECKED_PASSES, 0)
    for gm, inputs in recorder.graphs:
        values = real_values(gm, inputs)
        for pass_name in CHECKED_PASSES:
            nodes = recorder.inserted_by(pass_name, gm)
            counts[pass_name] += len(nodes)
            problems += [f"{pass_name}: {p}" for name, node in nodes for p in mismatches(name, node, values[name])]
    assert all(counts[name] for name in expected_passes), counts
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------------------------------
# a Llama-style model through optimize
# --------------------------------------------------------------------------------------------------

# Inference at 2 x 16 tokens: norms (residual adds fused), RoPE and attention rewrite; horizontal_gemm
# skips (too few tokens). Training at 2 x 140 = 280 tokens passes its CPU threshold for fp32 (267), so
# the q/k/v and gate/up linears are fused too. Checkpointed: every block is a checkpointed body, which
# the passes rewrite inside (graphs of their own, with example values of their own).
CASES = {
    "inference": ({}, 16, False, False, ("norms", "rope", "attention")),
    "training": ({"max_seq_len": 160}, 140, True, False, ("norms", "horizontal_gemm", "rope", "attention")),
    "checkpointed": ({}, 16, True, True, ("norms", "rope", "attention")),
}


@pytest.mark.parametrize("case", CASES)
def test_llama_style_inserted_nodes_have_example_values(monkeypatch, case):
    changes, seq, training, checkpointed, expected_passes = CASES[case]
    torch.manual_seed(0)
    config = LlamaStyleConfig.tiny(**changes)
    model = LlamaStyleLM(config).train(training)
    if checkpointed:
        apply_checkpointing(model, policy="full")
    recorder = Recorder(monkeypatch)
    optimize(model, example_inputs=(torch.randint(0, config.vocab_size, (2, seq)),), compile=False)
    report = report_of(model)
    assert not report.rollbacks, report.rollbacks
    assert {r.pass_name for r in report.rewrites} >= set(expected_passes), report.rewrites
    if checkpointed:  # the RoPE and attention rewrites happened inside the bodies
        assert all(any("/" in name for name in recorder.inserted[p]) for p in ("rope", "attention")), recorder.inserted
    check_inserted_nodes(recorder, expected_passes)


# --------------------------------------------------------------------------------------------------
# attention masks the pass builds nodes for
# --------------------------------------------------------------------------------------------------

B, H, L, E = 2, 4, 6, 8


class EinsumSeqFirst(nn.Module):
    """(B, L, H, E) operands: the pass inserts permutes of q, k, v and of the fused call's output."""

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.2
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def _with_keep() -> tuple[torch.Tensor, ...]:
    keep = torch.ones(B, L)
    keep[1, 4:] = 0  # a padded second sequence; every query still sees a key
    return torch.randn(B, H, L, E), torch.randn(B, H, L, E), torch.randn(B, H, L, E), keep


MASKED = {
    "masked_fill_inf": (MaskedFillInf, _with_keep, torch.bool),
    "masked_fill_finfo": (MaskedFillFinfo, _with_keep, torch.float32),
    "einsum_seq_first": (EinsumSeqFirst, lambda: tuple(torch.randn(B, H, L, E) for _ in range(3)), None),
}


@pytest.mark.parametrize("name", MASKED)
def test_attention_inserted_nodes_have_example_values_and_reach_the_dispatcher(monkeypatch, name):
    cls, make_inputs, mask_dtype = MASKED[name]
    seen_masks: list[Any] = []
    choose_kernel = dispatch.choose_kernel

    def spy(q, k, v, attn_mask, **kwargs):
        seen_masks.append(attn_mask)
        return choose_kernel(q, k, v, attn_mask, **kwargs)

    # The kernel choice is made from the inserted nodes' example values: a mask without one was
    # chosen for as "no mask", so on CUDA a kernel that takes no mask (flash) could be picked.
    monkeypatch.setattr(dispatch, "choose_kernel", spy)
    torch.manual_seed(0)
    recorder = Recorder(monkeypatch)
    model = cls().eval()
    optimize(model, example_inputs=make_inputs(), compile=False)
    assert [r.pass_name for r in report_of(model).rewrites] == ["attention"]
    check_inserted_nodes(recorder, ("attention",))
    assert len(seen_masks) == 1
    if mask_dtype is None:
        assert seen_masks[0] is None
    else:
        mask = seen_masks[0]
        assert isinstance(mask, torch.Tensor) and mask.dtype == mask_dtype, mask
        assert tuple(mask.shape) == (B, 1, 1, L)


def test_our_ops_on_layouts_seen_before_reuse_the_earlier_fake_run(monkeypatch):
    """Every layer's RMSNorm and RoPE call has the same input layouts: one fake run per layout gives their example
    values, which still agree with the real run."""
    from kernel_pytorch.passes import graph_utils

    evaluated: list[Any] = []
    evaluate_fake = graph_utils.evaluate_fake

    def counting_evaluate_fake(gm, target, *args, **kwargs):
        evaluated.append(target)
        return evaluate_fake(gm, target, *args, **kwargs)

    monkeypatch.setattr(graph_utils, "evaluate_fake", counting_evaluate_fake)
    torch.manual_seed(0)
    config = LlamaStyleConfig.tiny(n_layers=3)
    model = LlamaStyleLM(config).eval()
    recorder = Recorder(monkeypatch)
    optimize(model, example_inputs=(torch.randint(0, config.vocab_size, (2, 16)),), compile=False)
    check_inserted_nodes(recorder, ("norms", "rope"))
    gm = recorder.graphs[0][0]
    ours = [node for pass_name in ("norms", "rope") for _, node in recorder.inserted_by(pass_name, gm)
            if graph_utils._is_our_op(node.target)]
    runs = [target for target in evaluated if graph_utils._is_our_op(target)]
    # each op's calls (both norms of a layer, every layer's RoPE) share their layouts here: one fake run per op
    assert len(ours) >= 3 * 3 and len(runs) == len(set(runs)), (len(ours), runs)


def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _flattened(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1)


@pytest.mark.parametrize("op, fake_runs", [(_doubled, 1), (_flattened, 2)])
def test_only_outputs_owning_their_storage_are_reused(monkeypatch, op, fake_runs):
    """Two calls on the same layout: an output of its own is reused for the second call; a view (whose storage a pass
    may read, as the attention pass reads V's) is evaluated again for each call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kernel_pytorch.passes import graph_utils

    monkeypatch.setattr(op, "__module__", "kernel_pytorch.ops.for_tests")  # counted as one of our ops
    evaluated: list[Any] = []
    evaluate_fake = graph_utils.evaluate_fake
    monkeypatch.setattr(graph_utils, "evaluate_fake",
                        lambda gm, target, *a, **k: evaluated.append(target) or evaluate_fake(gm, target, *a, **k))
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode() as mode:
        x.meta["example_value"] = torch.empty(3, 4)
    calls = [graph.call_function(op, (x,)) for _ in range(2)]
    graph.output(tuple(calls))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert [graph_utils.set_example_value(gm, call) for call in calls] == ["", ""]
    assert len(evaluated) == fake_runs
    values = [example_value(call) for call in calls]
    assert all(v.fake_mode is mode and tuple(v.shape) == tuple(op(torch.empty(3, 4)).shape) for v in values)
    assert values[0] is not values[1]
