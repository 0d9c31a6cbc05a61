"""kernel-pytorch info: hardware, backend and plan, as tables and as JSON; demo and bench: the checkout's
scripts listed (the suites with what each runs on), run with their arguments and exit codes, unknown names
refused with the choices; help and listings in plain text; a reader that leaves early (| head) ends the
command quietly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_pytorch import cli
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
    assert {item["name"]: item["applies"] for item in data["plan"]}["cudnn"]


def test_info_with_an_unavailable_forced_device_fails_clearly(capsys):
    assert main(["info", "--device", "cuda"]) == 2
    assert "CUDA probe failed" in capsys.readouterr().out


def test_console_script_is_installed():
    done = subprocess.run([sys.executable, "-m", "kernel_pytorch.cli", "info", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["backend"] == "cpu"


@pytest.mark.parametrize("args", [["info", "--json"], ["info"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(args):
    """kernel-pytorch info --json | head -1: the pipe's reader is gone before the command writes (its read
    end is closed before the child has imported torch), so every write meets a broken pipe."""
    child = subprocess.Popen([sys.executable, "-m", "kernel_pytorch.cli", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    child.stdout.close()
    _, stderr = child.communicate(timeout=120)
    stderr = stderr.decode()
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
    assert child.returncode == 1  # what rich's Console exits with on a broken pipe, and Python's docs advise


@pytest.mark.parametrize("command", [[], ["info"], ["demo"], ["bench"]])
def test_help_is_plain_text(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: kernel-pytorch" in out
    assert "``" not in out  # argparse prints descriptions verbatim: no reST markup
    if not command:
        assert "The kernel-pytorch command." in out


# --------------------------------------------------------------------------------------------- demo, bench

ROOT = Path(__file__).resolve().parent.parent
DEMO_NAMES = sorted(p.stem for p in (ROOT / "demos").glob("*.py") if p.stem not in ("_common", "run_all_demos"))


def test_demo_list_names_every_demo_and_not_the_runner(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich's width: one line per row
    assert main(["demo", "--list"]) == 0
    out = capsys.readouterr().out
    assert len(DEMO_NAMES) >= 8
    for name in DEMO_NAMES:
        assert name in out
    assert "run_all_demos" not in out and "_common" not in out
    assert "FP8 training of a Llama-style LM" in out  # each demo's docstring summary
    assert "optimize on a hand-written Llama-style language model" in out  # its docstring's ``optimize``, plain
    assert "``" not in out


def test_unknown_demo_is_refused_with_the_choices(capsys):
    assert main(["demo", "no_such_demo", "--quick"]) == 2
    out = capsys.readouterr().out
    assert "unknown demo 'no_such_demo'" in out
    assert all(name in out for name in DEMO_NAMES)


def test_demo_runs_one_quick_demo_in_its_own_process(capfd):
    assert main(["demo", "hardware-and-backends.py", "--quick"]) == 0  # dashes and .py are accepted
    out = capfd.readouterr().out
    assert "backend cpu" in out
    assert any(line.startswith("result: ok") for line in out.splitlines())  # the demo's closing verdict
    assert "DEMO_RESULT" not in out and '"status"' not in out  # no machine-readable line


def test_bench_list_and_missing_or_unknown_suites(capsys):
    assert main(["bench", "--list"]) == 0
    listed = capsys.readouterr().out
    for suite in ("attention", "block_fusion", "fp8", "kernels", "memory", "ring_attention"):
        assert suite in listed
    assert "harness" not in listed  # a module, not a runnable suite
    assert "``" not in listed
    assert main(["bench"]) == 2
    assert "name a suite" in capsys.readouterr().out
    assert main(["bench", "e2e_nope"]) == 2
    out = capsys.readouterr().out
    assert "unknown benchmark suite 'e2e_nope'" in out and "fp8" in out


def _listed_rows(capsys) -> dict[str, str]:
    """bench --list's rows by suite name (COLUMNS set wide: one line per row)."""
    assert main(["bench", "--list"]) == 0
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in capsys.readouterr().out.splitlines()
            if line.startswith("│")]
    return {cells[0]: cells[1] for cells in rows if cells[0]}  # a folded summary's next line has no name


def test_bench_list_says_what_each_suite_runs_on(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    suites = cli._scripts("benchmarks")
    assert set(cli._SUITE_HARDWARE) == set(suites)  # every suite declared, none that is gone
    runs_on = _listed_rows(capsys)
    assert runs_on == cli._SUITE_HARDWARE
    assert runs_on["saved_activations"] == runs_on["render_readme_table"] == "CPU ok"
    assert runs_on["block_fusion"].startswith("CPU: smoke run only") and runs_on["fp8"].startswith("needs an FP8 GPU")
    assert runs_on["kernels"] == "needs a CUDA GPU"


def test_bench_list_takes_the_column_from_the_declarations(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setitem(cli._SUITE_HARDWARE, "kernels", cli._CPU_OK)
    monkeypatch.delitem(cli._SUITE_HARDWARE, "fp8")
    runs_on = _listed_rows(capsys)
    assert runs_on["kernels"] == "CPU ok"
    assert runs_on["fp8"].startswith("not declared")


def test_bench_passes_its_arguments_to_the_suite(capfd):
    assert main(["bench", "fp8", "--help"]) == 0
    out = capfd.readouterr().out
    assert "usage: fp8.py" in out and "--parts" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit code of the suite's no-GPU refusal")
def test_bench_returns_the_suite_exit_code(capfd):
    assert main(["bench", "fp8", "--quick"]) == 1
    assert "needs a CUDA GPU" in capfd.readouterr().err
