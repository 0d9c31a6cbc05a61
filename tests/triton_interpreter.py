"""What the Triton-kernel test modules share: the interpreter marker, running the ``test_interp_*``
tests in a child pytest (one for all the modules of a session), routing CPU tensors to the Triton launchers,
and the GPU fixture.

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
from xml.etree import ElementTree

import pytest
import torch

tu = importlib.import_module("kernel_pytorch.ops.triton_utils")

__all__ = ["INTERPRETED", "interp", "EAGER_OPCHECKS", "InterpretedRun", "run_interpreted_tests", "route_to_triton",
           "cuda_device"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Deselected (tests/conftest.py) unless TRITON_INTERPRET=1; run_interpreted_tests runs them.
interp = pytest.mark.triton_interpret
# The AOT-dispatch checks trace an op's body; under the interpreter its kernels cannot be traced
# (wrap_triton refuses interpreted kernels, so tu.launch skips them on fake tensors): those checks run
# on the GPU.
EAGER_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


class InterpretedRun:
    """One child pytest under Triton's interpreter (``TRITON_INTERPRET=1``) that runs the ``test_interp_*``
    tests of several test modules at once: one interpreter start-up, import of torch, Triton and
    kernel_pytorch, and collection (~9 s on CI's 2 cores) for all of them instead of one per module. It runs
    at the first :meth:`check` and records each test's outcome (JUnit XML); each module's check then judges
    its own tests only. The ``interpreted_tests`` fixture (tests/conftest.py) gives the session's one run."""

    def __init__(self, test_files: Iterable[str], report_dir: Path, timeout_s: float = 900):
        self.test_files = tuple(sorted({str(Path(f).resolve()) for f in test_files}))
        self.report_dir = Path(report_dir)
        self.timeout_s = timeout_s
        self._outcome: tuple[str, dict[str, list[tuple[str, str, str]]]] | None = None

    def _run(self) -> tuple[str, dict[str, list[tuple[str, str, str]]]]:
        """(the child's output tail, or why it gave no results; {module: [(test, outcome, message)]})."""
        root = Path(__file__).resolve().parents[1]
        junit = self.report_dir / "interpreted.xml"
        env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *self.test_files,
                 "-k", "interp", "-m", "not gpu", f"--junitxml={junit}", "-o", "junit_family=xunit2"],
                cwd=root, env=env, capture_output=True, text=True, timeout=self.timeout_s, check=False)
        except subprocess.TimeoutExpired as error:
            return f"the interpreted tests ran past {self.timeout_s} s: {error}", {}
        report = proc.stdout[-6000:] + proc.stderr[-3000:]
        # 0: all passed, 1: some failed (the XML says which); anything else (a collection error, a crash, an
        # interrupt) leaves no outcome to trust for any module.
        if proc.returncode not in (0, 1) or not junit.is_file():
            return f"the child pytest exited with {proc.returncode}:\n{report}", {}
        cases: dict[str, list[tuple[str, str, str]]] = {}
        for case in ElementTree.parse(junit).iter("testcase"):
            problems = [child for child in case if child.tag in ("failure", "error", "skipped")]
            outcome = problems[0].tag if problems else "passed"
            message = "\n".join(f"{p.get('message', '')}\n{p.text or ''}" for p in problems)
            cases.setdefault(case.get("classname", ""), []).append((case.get("name", ""), outcome, message))
        return report, cases

    def check(self, test_file: str) -> None:
        """Fail unless ``test_file``'s interpreted tests all ran and passed (none skipped), with their
        failures and the child's output."""
        test_file = str(Path(test_file).resolve())
        assert test_file in self.test_files, f"{test_file} did not ask for the interpreted_tests fixture"
        if self._outcome is None:
            self._outcome = self._run()
        report, cases = self._outcome
        root = Path(__file__).resolve().parents[1]
        module = ".".join(Path(test_file).relative_to(root).with_suffix("").parts)
        mine = [case for classname, found in cases.items()
                if classname == module or classname.startswith(module + ".") for case in found]
        assert mine, f"no interpreted test of {module} ran:\n{report}"
        bad = [f"{name}: {outcome}\n{message[-3000:]}" for name, outcome, message in mine if outcome != "passed"]
        assert not bad, "\n\n".join(bad[:10]) + f"\n\n{len(bad)} of {len(mine)} not passed\n{report}"


def run_interpreted_tests(test_file: str, run: InterpretedRun) -> None:
    """Run ``test_file``'s ``test_interp_*`` tests in a child pytest under Triton's interpreter (``run``,
    shared with the session's other modules that ask for the ``interpreted_tests`` fixture); fail with its
    output unless they all pass and none is skipped."""
    run.check(test_file)


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
