from __future__ import annotations

import copy

import pytest
import torch

from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles its own models; a clean dynamo cache keeps recompile limits and guards
    # from one test out of the next.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def tiny_lm():
    torch.manual_seed(0)
    return LlamaStyleLM(LlamaStyleConfig.tiny())


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """An unoptimized copy to compare against."""
    return copy.deepcopy(model)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm())
