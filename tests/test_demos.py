"""demos/: every demo runs with --quick in its own process, validates its numerics and reports through the
runner's ``DEMO_RESULT`` line; the runner lists every demo and turns a crash or a failed check into a
failure and a non-zero exit.

All eight quick demos take ~25 s together on a quiet 2-core CPU (each a fresh Python importing torch).
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

DEMOS_DIR = Path(__file__).resolve().parent.parent / "demos"
_TIMEOUT_S = 300  # per demo; the slowest takes ~8 s alone, several times that on a loaded CI machine


@pytest.fixture(scope="module")
def runner():
    """demos/run_all_demos.py as a module (it imports demos/_common.py by its name, as the demos do)."""
    sys.path.insert(0, str(DEMOS_DIR))
    try:
        yield importlib.import_module("run_all_demos")
    finally:
        sys.path.remove(str(DEMOS_DIR))


def test_the_runner_runs_every_demo_script(runner):
    scripts = {p.name for p in DEMOS_DIR.glob("*.py")} - {"_common.py", "run_all_demos.py"}
    assert {script for _, script in runner.DEMOS} == scripts
    assert len({title for title, _ in runner.DEMOS}) == len(runner.DEMOS)


def _notes(result: dict) -> str:
    return "; ".join(result.get("notes", []))


def _check_fp8(result: dict) -> None:
    assert "dB" in _notes(result)
    if not torch.cuda.is_available():
        assert "speed: skipped: needs an FP8 GPU" in _notes(result) and result["speedup"] is None


def _check_memory(result: dict) -> None:
    assert result["memory_saved_mb"] > 0
    if not torch.cuda.is_available():
        assert "activation and optimizer offload: skipped: need a CUDA GPU" in _notes(result)
        log = " ".join(result["log"].split())  # the demo's own output says why, for each
        assert "activation offload: skipped: needs a CUDA GPU" in log
        assert "optimizer offload: skipped: needs a CUDA GPU" in log


CHECKS = {
    "hardware_and_backends.py": lambda r: None,
    "attention_rewrite.py": lambda r: r["speedup"] > 0,
    "fused_kernels.py": lambda r: "worst gradient error" in _notes(r),
    "fp8_training.py": _check_fp8,
    "block_fusion.py": lambda r: "GEMMs per block step" in _notes(r) and r["speedup"] > 0,
    "ring_attention.py": lambda r: "worst error" in _notes(r),
    "memory_wrappers.py": _check_memory,
    "optimize_transformer.py": lambda r: r["speedup"] > 0,
}


@pytest.mark.parametrize("script", [
    pytest.param(script, marks=[pytest.mark.distributed] if script == "ring_attention.py" else [])
    for script in CHECKS])
def test_quick_demo_passes_its_own_checks(runner, script):
    result = runner.run_demo(script, quick=True, timeout_s=_TIMEOUT_S)
    assert result["status"] == "ok", f"{script}: {_notes(result)}\n{result.get('log', '')[-3000:]}"
    assert result["seconds"] < _TIMEOUT_S
    assert CHECKS[script](result) is not False, result


_FAILING_DEMO = """
import sys
sys.path.insert(0, {demos!r})
from _common import DemoResult, demo_main

def run(args):
    {body}

demo_main("a demo whose check fails", run)
"""


def _write_demo(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(_FAILING_DEMO).format(demos=str(DEMOS_DIR), body=body))
    return path


def test_a_failed_check_or_a_crash_is_a_failure_and_a_non_zero_exit(runner, tmp_path, monkeypatch, capsys):
    failed = _write_demo(tmp_path, "failed_check.py", 'return DemoResult("failed", notes=["logits differ"])')
    crashed = _write_demo(tmp_path, "crashed.py", 'raise AssertionError("no rewrite")')
    silent = tmp_path / "silent.py"
    silent.write_text("print('no result line')\n")  # exits 0 without saying what it checked

    results = {path.name: runner.run_demo(path, quick=True, timeout_s=60) for path in (failed, crashed, silent)}
    assert {name: r["status"] for name, r in results.items()} == dict.fromkeys(results, "failed")
    assert results["failed_check.py"]["notes"] == ["logits differ"]
    assert "AssertionError: no rewrite" in _notes(results["crashed.py"])
    assert "exit code 0" in _notes(results["silent.py"])

    monkeypatch.setattr(runner, "DEMOS", (("a good one", "hardware_and_backends.py"), ("a failing one", str(failed))))
    assert runner.main(["--quick"]) == 1
    out = capsys.readouterr().out
    assert "1 demo(s) failed: a failing one" in out and "logits differ" in out


def test_only_and_list(runner, capsys):
    assert runner.main(["--list"]) == 0
    assert "fp8_training" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        runner.main(["--only", "sparse_attention"])
    assert exit_info.value.code == 2
    assert "unknown demo(s) sparse_attention" in capsys.readouterr().err
