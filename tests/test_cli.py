"""kernel-pytorch info: hardware, backend and plan, as tables and as JSON; demo and bench: the checkout's
scripts listed, run with their arguments and exit codes, unknown names refused with the choices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_pytorch.cli import main

from .simulated_hardware import simulate_h100


def test_info_on_this_machine(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "hardware: cpu" in out and "backend: cpu" in out and "normalize" in out


def test_info_json_for_a_simulated_h100(monkeypatch, capsys):
    simulate_h100(monkeypatch)
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["vendor"] == "nvidia"
    assert data["hardware"]["compute_capability"] == [9, 0]
    assert data["hardware"]["fp8"] and data["hardware"]["cudnn_attention"]
    assert {item["name"]: item["applies"] for item in data["plan"]}["sdpa-cudnn"]


def test_info_with_an_unavailable_forced_device_fails_clearly(capsys):
    assert main(["info", "--device", "cuda"]) == 2
    assert "CUDA probe failed" in capsys.readouterr().out


def test_console_script_is_installed():
    done = subprocess.run([sys.executable, "-m", "kernel_pytorch.cli", "info", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["backend"] == "cpu"


# --------------------------------------------------------------------------------------------- demo, bench

ROOT = Path(__file__).resolve().parent.parent
DEMO_NAMES = sorted(p.stem for p in (ROOT / "demos").glob("*.py") if p.stem not in ("_common", "run_all_demos"))


def test_demo_list_names_every_demo_and_not_the_runner(capsys):
    assert main(["demo", "--list"]) == 0
    out = capsys.readouterr().out
    assert len(DEMO_NAMES) >= 8
    for name in DEMO_NAMES:
        assert name in out
    assert "run_all_demos" not in out and "_common" not in out
    assert "FP8 training of a Llama-style LM" in out  # each demo's docstring summary


def test_unknown_demo_is_refused_with_the_choices(capsys):
    assert main(["demo", "sparse_attention", "--quick"]) == 2
    out = capsys.readouterr().out
    assert "unknown demo 'sparse_attention'" in out
    assert all(name in out for name in DEMO_NAMES)


def test_demo_runs_one_quick_demo_in_its_own_process(capfd):
    assert main(["demo", "hardware-and-backends.py", "--quick"]) == 0  # dashes and .py are accepted
    out = capfd.readouterr().out
    result = json.loads(next(line for line in out.splitlines() if line.startswith("DEMO_RESULT "))[len("DEMO_RESULT "):])
    assert result["status"] == "ok"
    assert "backend cpu" in out


def test_bench_list_and_missing_or_unknown_suites(capsys):
    assert main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out
    for suite in ("attention", "block_fusion", "fp8", "kernels", "memory", "ring_attention"):
        assert suite in listed
    assert "harness" not in listed  # a module, not a runnable suite
    assert main(["bench"]) == 2
    assert "name a suite" in capsys.readouterr().out
    assert main(["bench", "e2e_nope"]) == 2
    out = capsys.readouterr().out
    assert "unknown benchmark suite 'e2e_nope'" in out and "fp8" in out


def test_bench_passes_its_arguments_to_the_suite(capfd):
    assert main(["bench", "fp8", "--help"]) == 0
    out = capfd.readouterr().out
    assert "usage: fp8.py" in out and "--parts" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit code of the suite's no-GPU refusal")
def test_bench_returns_the_suite_exit_code(capfd):
    assert main(["bench", "fp8", "--quick"]) == 1
    assert "needs a CUDA GPU" in capfd.readouterr().err
