"""What the Triton-kernel test modules share: the interpreter marker, running the ``test_interp_*``
tests in a child pytest, routing CPU tensors to the Triton launchers, and the GPU fixture.

Triton's interpreter must be chosen before any ``@triton.jit`` function exists, so the interpreted
tests run in a child process started with ``TRITON_INTERPRET=1`` (see ``tests/test_norm_ops.py``).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

tu = importlib.import_module("kernel_pytorch.ops.triton_utils")

__all__ = ["INTERPRETED", "interp", "EAGER_OPCHECKS", "run_interpreted_tests", "route_to_triton", "cuda_device"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Deselected (tests/conftest.py) unless TRITON_INTERPRET=1; run_interpreted_tests runs them.
interp = pytest.mark.triton_interpret
# The AOT-dispatch checks trace an op's body; under the interpreter its kernels cannot be traced
# (wrap_triton refuses interpreted kernels, so tu.launch skips them on fake tensors): those checks run
# on the GPU.
EAGER_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def run_interpreted_tests(test_file: str) -> None:
    """Run ``test_file``'s ``test_interp_*`` tests in a child pytest under Triton's interpreter; fail
    with its output unless they all pass and none is skipped."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve()),
         "-k", "interp", "-m", "not gpu"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, report


def route_to_triton(monkeypatch, module, launchers: Iterable[str], thresholds: Iterable[str],
                    calls: dict[str, int] | None = None) -> dict[str, int]:
    """Send ``module``'s CPU tensors to its Triton launchers (interpreted kernels), small problems too
    (each name in ``thresholds`` set to 0); returns launch counts by launcher name (into ``calls`` when
    given, to count several modules together), so a test can tell which path ran."""
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    for name in thresholds:
        monkeypatch.setattr(module, name, 0)
    calls = {} if calls is None else calls

    def counting(name, fn):
        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    for name in launchers:
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    return calls


def cuda_device() -> torch.device:
    """The GPU for ``-m gpu`` tests; a clear failure, not a skip, where there is none."""
    if not torch.cuda.is_available():
        pytest.fail("gpu tests were selected (-m gpu) but torch.cuda.is_available() is False")
    return torch.device("cuda")
