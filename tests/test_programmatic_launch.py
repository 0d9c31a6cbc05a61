"""Programmatic dependent launch (kernel_pytorch/ops/programmatic_launch.py): when a launch carries it, and on the
GPU a chain of PDL launches, each reading the one before it, replayed from a CUDA graph on fresh inputs against
float64 (a kernel that read its input before the previous grid finished would read the replay before's values)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch._library.triton import set_wrap_triton_enabled

from .triton_interpreter import cuda_device

PL = importlib.import_module("kernel_pytorch.ops.programmatic_launch")
DL = importlib.import_module("kernel_pytorch.ops.decode_linear")


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm())


def test_cpu_tensors_launch_without_pdl():
    assert PL.pdl_arguments(torch.ones(2)) == {"PDL": False}
    assert not PL.read_weights_early(PL.pdl_arguments(torch.ones(2)))


def test_fake_tensors_launch_without_pdl():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fake = torch.empty(2)
    assert PL.pdl_arguments(fake) == {"PDL": False}


@pytest.mark.gpu
def test_gpu_direct_launches_carry_pdl_and_read_weights_early_only_under_capture(monkeypatch):
    x = torch.ones(2, device=cuda_device())
    supported = torch.cuda.get_device_capability()[0] >= 9
    seen = {}

    def launch_of_x() -> tuple[dict, bool]:
        launch = PL.pdl_arguments(x)
        return launch, PL.read_weights_early(launch)

    with set_wrap_triton_enabled(False):  # as PyTorch runs a triton_op's body eagerly
        seen["eager"] = launch_of_x()
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            seen["captured"] = launch_of_x()
            with set_wrap_triton_enabled(True):  # Inductor's generated code launches it: its launcher drops the option
                seen["wrapped"] = launch_of_x()
            monkeypatch.setattr(PL, "ENABLED", False)
            seen["switched off"] = launch_of_x()
    on, off = {"PDL": True, "launch_pdl": True}, {"PDL": False}
    expected = {"eager": (on, False), "captured": (on, True)} if supported else \
        {"eager": (off, False), "captured": (off, False)}
    assert seen == {**expected, "wrapped": (off, False), "switched off": (off, False)}


@pytest.mark.gpu
def test_gpu_chain_of_launches_replayed_from_a_cuda_graph_matches_float64():
    torch.manual_seed(0)
    device = cuda_device()
    weights = [torch.randn(2048, 2048, device=device, dtype=torch.bfloat16) / 45 for _ in range(6)]
    x = torch.empty(1, 2048, device=device, dtype=torch.bfloat16)

    def chain(h):
        for w in weights:  # each launch reads the output of the one before (the op: its body launches directly)
            h = DL.grouped_linear(h, [w])
        return h

    x.normal_()
    chain(x)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for _ in range(20):
        x.normal_()
        graph.replay()
        expected = x.double()
        for w in weights:
            expected = F.linear(expected, w.double()).to(torch.bfloat16).double()
        assert rel(out, expected) < 2e-2
