"""demos/: every demo runs with --quick in its own process, validates its numerics and writes its result to
the file the runner names (run by hand it prints only a person's lines); the runner lists every demo, turns
a crash or a failed check into a failure and a non-zero exit, and says why a speedup is below 1.0 and
whether that is expected.

All nine quick demos take ~40 s together on a quiet 2-core CPU (each a fresh Python importing torch).
"""

from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from rich.console import Console

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


def _rendered(runner, results: dict) -> dict[str, str]:
    """The runner's summary table as a person reads it, the text of each demo's row (folded lines joined)."""
    console = Console(file=io.StringIO(), width=400, record=True)
    console.print(runner._summary(results))
    rows: dict[str, str] = {}
    name = None
    for line in console.export_text().splitlines():
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        name = cells[0] or name
        rows[name] = " ".join(filter(None, [rows.get(name, ""), *cells[1:]]))
    return rows


def _slower_on_this_cpu(result: dict) -> None:
    """fused_kernels and optimize_transformer: on a CPU a slowdown is expected, and the result says why."""
    if not torch.cuda.is_available():
        assert result["slowdown_expected"].startswith("expected on a CPU: compile='auto' leaves Inductor off")


def _check_fused_kernels(result: dict) -> None:
    assert "worst gradient error" in _notes(result)
    _slower_on_this_cpu(result)


def _check_optimize_transformer(result: dict) -> None:
    assert result["speedup"] > 0
    _slower_on_this_cpu(result)


def _check_fp8(result: dict) -> None:
    assert "dB" in _notes(result)
    if not torch.cuda.is_available():
        assert "speed: skipped: needs an FP8 GPU" in _notes(result) and result["speedup"] is None


def _check_sparse_attention(result: dict) -> None:
    """The window (exact) gives the speedup; top-k's reported error is in the notes, under its bound."""
    assert result["speedup"] > 0
    assert "window " in _notes(result) and "worst gradient error" in _notes(result)
    assert "top-k error" in _notes(result) and "reported (bound 2e-02)" in _notes(result)
    if not torch.cuda.is_available():  # the window runs dense on a CPU, and the result says why
        assert result["slowdown_expected"].startswith("expected on a CPU: the window is recognized but runs on the "
                                                      "dense kernel")
        assert "sliding window 64" in result["log"] and "recognized, run dense" in " ".join(result["log"].split())


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
    "sparse_attention.py": _check_sparse_attention,
    "fused_kernels.py": _check_fused_kernels,
    "fp8_training.py": _check_fp8,
    "block_fusion.py": lambda r: "GEMMs per block step" in _notes(r) and r["speedup"] > 0,
    "ring_attention.py": lambda r: "worst error" in _notes(r),
    "memory_wrappers.py": _check_memory,
    "optimize_transformer.py": _check_optimize_transformer,
}


@pytest.mark.parametrize("script", [
    pytest.param(script, marks=[pytest.mark.distributed] if script == "ring_attention.py" else [])
    for script in CHECKS])
def test_quick_demo_passes_its_own_checks(runner, script):
    result = runner.run_demo(script, quick=True, timeout_s=_TIMEOUT_S)
    assert result["status"] == "ok", f"{script}: {_notes(result)}\n{result.get('log', '')[-3000:]}"
    assert result["seconds"] < _TIMEOUT_S
    assert CHECKS[script](result) is not False, result
    row = _rendered(runner, {script: result})[script]
    if result.get("speedup") is not None and result["speedup"] < 1:  # timings vary: checked when it happens
        assert f"slower ({result['speedup']:.2f}x), " in row, row
        assert (result.get("slowdown_expected") or "not expected here") in row, row
    assert "DEMO_RESULT" not in result["log"]


def test_the_summary_says_why_a_speedup_is_below_one(runner):
    reason = "expected on a CPU: compile='auto' leaves Inductor off there, so the rewritten graphs run op by op"
    results = {"expected": {"status": "ok", "speedup": 0.78, "notes": ["worst gradient error 4e-07"],
                            "slowdown_expected": reason, "seconds": 4.0},
               "unexpected": {"status": "ok", "speedup": 0.7, "notes": [], "slowdown_expected": None, "seconds": 2.0},
               "faster": {"status": "ok", "speedup": 1.5, "notes": ["fused"], "slowdown_expected": "never shown",
                          "seconds": 1.0},
               "crashed": {"status": "failed", "notes": ["exit code 1, no result written"], "seconds": 1.0}}
    rows = _rendered(runner, results)
    assert rows["expected"].startswith("ok 0.78x")  # status stays the numerics' verdict
    assert f"slower (0.78x), {reason}; worst gradient error 4e-07" in rows["expected"]
    assert "slower (0.70x), not expected here" in rows["unexpected"]
    assert "slower" not in rows["faster"] and "never shown" not in rows["faster"]
    assert "slower" not in rows["crashed"] and "exit code 1, no result written" in rows["crashed"]


def test_a_demo_run_by_hand_prints_no_result_line_and_the_runner_still_gets_it(runner):
    environment = {name: value for name, value in os.environ.items() if name != runner.RESULT_FILE_ENV}
    by_hand = subprocess.run([sys.executable, str(DEMOS_DIR / "hardware_and_backends.py"), "--quick"],
                             capture_output=True, text=True, timeout=_TIMEOUT_S, env=environment, check=False)
    assert by_hand.returncode == 0, by_hand.stderr
    assert "DEMO_RESULT" not in by_hand.stdout and '"status"' not in by_hand.stdout
    assert "result: ok" in by_hand.stdout  # the closing verdict, for a person

    result = runner.run_demo("hardware_and_backends.py", quick=True, timeout_s=_TIMEOUT_S)
    assert result["status"] == "ok" and "not available: " in _notes(result)
    assert "DEMO_RESULT" not in result["log"]


def test_demo_help_is_plain_text(runner, capsys):
    with pytest.raises(SystemExit):
        runner.main(["--help"])
    assert "``" not in capsys.readouterr().out
    done = subprocess.run([sys.executable, str(DEMOS_DIR / "optimize_transformer.py"), "--help"],
                          capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr
    assert "optimize on a hand-written Llama-style language model" in done.stdout and "``" not in done.stdout


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
        runner.main(["--only", "no_such_demo"])
    assert exit_info.value.code == 2
    assert "unknown demo(s) no_such_demo" in capsys.readouterr().err
