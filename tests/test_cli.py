"""kernel-pytorch info: hardware, backend and plan, as tables and as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

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
