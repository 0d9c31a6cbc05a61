"""Simulated hardware for tests: the public torch APIs the probes read, monkeypatched.

AMD, TPU and Intel cannot be run here; the README says which rows were verified by simulation.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from types import SimpleNamespace

import torch

GiB = 2**30


def simulate_cuda_api(monkeypatch, props, *, count=1, bf16=True, cuda="13.0", hip=None, cudnn=91900):
    """Make this CPU build of torch look like a CUDA (or, with hip=..., ROCm) build with GPUs."""
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)


def nvidia_props(name, major, minor, memory):
    return SimpleNamespace(name=name, major=major, minor=minor, total_memory=memory, multi_processor_count=132)


def amd_props(name, gcn_arch, memory=192 * GiB):
    # ROCm builds report a CUDA-like major/minor too (9.4 for gfx942); the probe must not use it.
    return SimpleNamespace(name=name, major=9, minor=4, total_memory=memory, gcnArchName=gcn_arch)


def install_fake_torch_xla(monkeypatch, *, device_type="TPU", xla_device=None, extras=True):
    """A fake torch_xla with the parts the probe reads: runtime.device_type(), xla_model.xla_device()."""
    modules = {}
    for name in ("torch_xla", "torch_xla.core", "torch_xla.core.xla_model", "torch_xla.runtime"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)  # importlib.util.find_spec reads it
        modules[name] = module
        monkeypatch.setitem(sys.modules, name, module)
    runtime, xla_model = modules["torch_xla.runtime"], modules["torch_xla.core.xla_model"]
    runtime.device_type = lambda: device_type
    xla_model.xla_device = xla_device or (lambda: torch.device("cpu"))
    if extras:
        runtime.addressable_runtime_device_count = lambda: 4
        xla_model.xla_device_kind = lambda device=None: "TPU v5 lite"
        xla_model.get_memory_info = lambda device=None: {"bytes_used": 0, "bytes_limit": 16 * GiB}


def simulate_intel_xpu(monkeypatch, count=2):
    props = SimpleNamespace(
        name="Intel(R) Data Center GPU Max 1550", total_memory=64 * GiB, has_bfloat16_conversions=True
    )
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: count)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.xpu, "is_bf16_supported", lambda including_emulation=True: True)


def simulate_h100(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("NVIDIA H100 80GB HBM3", 9, 0, 80 * GiB))


def simulate_mi300x(monkeypatch):
    simulate_cuda_api(monkeypatch, amd_props("AMD Instinct MI300X", "gfx942:sramecc+:xnack-"), cuda=None, hip="6.2",
                      cudnn=None)
