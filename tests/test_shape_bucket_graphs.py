"""shape_buckets.cuda_graphs on the CPU: which calls a bucket's CUDA graph may serve, the option's config errors, and
calls that cannot replay (the CPU's) running as without it. The replays themselves: tests/test_shape_buckets_gpu.py."""

from __future__ import annotations

import typing

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kernel_pytorch
from kernel_pytorch import report_of
from kernel_pytorch.config import CUDA_GRAPH_COMPILE_MODES, CompileMode, OptimizeConfig
from kernel_pytorch.errors import ConfigError
from kernel_pytorch.report import OptimizationReport
from kernel_pytorch.features.shape_buckets import graphs as graphs_module
from kernel_pytorch.features.shape_buckets.graphs import GRAPHS_NOTE, replayable
from kernel_pytorch.features.shape_buckets.wrapper import bucket_call

from .conftest import rel_err, twin
from .test_shape_buckets import FLOAT32, bert, tokens


def test_a_graph_serves_inference_calls_on_cuda_with_hashable_arguments():
    with FakeTensorMode():  # CUDA tensors without a GPU: only their metadata is read
        ids = torch.empty(4, 32, dtype=torch.long, device="cuda")
        half = torch.empty(2, 32, dtype=torch.long, device="cuda")
        cpu_ids = torch.empty(4, 32, dtype=torch.long)
    with torch.no_grad():
        key = replayable((ids,), {"attention_mask": ids, "return_dict": True})
        assert key == ((0, (4, 32), torch.long, ids.device), ("attention_mask", (4, 32), torch.long, ids.device),
                       ("return_dict", True))
        assert replayable((ids,), {"attention_mask": ids}) != replayable((half,), {"attention_mask": half})
        assert replayable((cpu_ids,), {}) is None  # not on CUDA
        assert replayable((ids,), {"labels": [1, 2]}) is None  # a list cannot key a graph
    assert replayable((ids,), {}) is None  # autograd on: the graph would not record the backward


def test_cuda_graphs_do_not_combine_with_inductors_own():
    with pytest.raises(ConfigError) as caught:
        OptimizeConfig(shape_buckets={"cuda_graphs": True}, compile="reduce-overhead")
    assert str(caught.value) == ("shape_buckets does not combine with compile='reduce-overhead' when "
                                 "shape_buckets.cuda_graphs is on: Inductor's CUDA graphs and the buckets' own would "
                                 "capture the same calls (choose one)")
    assert OptimizeConfig(shape_buckets={"cuda_graphs": True}, compile="max-autotune-no-cudagraphs").shape_buckets


def test_the_compile_modes_refused_are_those_whose_inductor_options_replay_cuda_graphs():
    from torch._inductor import list_mode_options

    modes = typing.get_args(CompileMode)
    assert set(CUDA_GRAPH_COMPILE_MODES) == {m for m in modes if list_mode_options(m).get("triton.cudagraphs")}


def test_calls_that_cannot_replay_run_compiled_as_without_the_option():
    torch.manual_seed(0)
    model, key = bert()
    model.eval()
    reference = twin(model)
    model = kernel_pytorch.optimize(model, example_inputs=tokens(2, 11), shape_buckets={"cuda_graphs": True})
    for batch, length in ((3, 17), (4, 32)):
        inputs = tokens(batch, length, padded_rows=1)
        with torch.no_grad():
            out, expected = model(**inputs), reference(**inputs)
        assert rel_err(out[key], expected[key]) < FLOAT32, (batch, length)
    assert bucket_call(model).graphs.graphs == {}  # CPU tensors: nothing captured
    assert not any(note.startswith(GRAPHS_NOTE) for note in report_of(model).notes)


def test_a_failed_capture_turns_the_graphs_off_with_a_report_line(monkeypatch):
    attempts = []

    def refuse(entry, args, kwargs, sharing):
        attempts.append(args)
        raise RuntimeError("operation not permitted when stream is capturing\n(the CUDA error's details)")

    monkeypatch.setattr(graphs_module._BucketGraph, "capture", staticmethod(refuse))
    report = OptimizationReport()
    graphs = graphs_module.BucketGraphs(torch.nn.Linear(2, 2), report)
    for _ in range(2):
        assert graphs.run(("key",), lambda x: x * 2, (torch.ones(2),), {}).tolist() == [2.0, 2.0]
    assert len(attempts) == 1 and graphs.graphs == {}  # not tried again at the second call
    assert report.notes == [f"{GRAPHS_NOTE} off, a capture failed (RuntimeError: operation not permitted when "
                            "stream is capturing); calls run compiled without graphs"]


class _RecordedGraph:
    """A stand-in for a captured graph on the CPU: a replay calls the entry again, and is counted."""

    replays = 0

    def __init__(self, entry, args, kwargs):
        self.entry, self.args, self.kwargs, self.graph = entry, args, kwargs, None

    @classmethod
    def capture(cls, entry, args, kwargs, sharing):
        return cls(entry, args, kwargs)

    def replay(self, args, kwargs):
        type(self).replays += 1
        return self.entry(*args, **kwargs)


def _graphs_with_recorded_captures(monkeypatch, model):
    monkeypatch.setattr(graphs_module, "_BucketGraph", _RecordedGraph)
    monkeypatch.setattr(_RecordedGraph, "replays", 0)
    report = OptimizationReport()
    return graphs_module.BucketGraphs(model, report), report


def test_a_registered_hook_runs_instead_of_a_replay(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    graphs, report = _graphs_with_recorded_captures(monkeypatch, model)
    x = torch.randn(3, 2)
    graphs.run(("key",), model, (x,), {})
    seen = []
    handle = model[1].register_forward_hook(lambda module, args, out: seen.append(out))
    replays = _RecordedGraph.replays
    assert torch.equal(graphs.run(("key",), model, (x,), {}), model(x))
    assert len(seen) == 2 and _RecordedGraph.replays == replays  # the hook ran; nothing replayed
    assert report.notes[-1] == ("bucket CUDA graphs not replayed while a forward hook on 1 is registered (a replay "
                                "would skip its Python): those calls ran compiled, hooks and all")
    handle.remove()
    graphs.run(("key",), model, (x,), {})
    assert _RecordedGraph.replays == replays + 1  # replays again once the hook is gone


def test_a_changed_train_mode_drops_the_graphs(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).eval()
    graphs, report = _graphs_with_recorded_captures(monkeypatch, model)
    graphs.run(("key",), model, (torch.randn(3, 2),), {})
    model[1].train()  # one submodule: a replay of the eval capture would skip its dropout
    graphs.run(("key",), model, (torch.randn(3, 2),), {})
    assert report.notes[0] == ("bucket CUDA graphs dropped: a module's train/eval mode changed since 1 were captured "
                               "(.to(), .half(), a replaced parameter, .train() / .eval()); captured again as calls "
                               "come")
    assert len(graphs.graphs) == 1  # captured again in the new mode
