"""Backend choice and plans per vendor. NVIDIA, AMD, Intel and TPU are simulated (their probes'
torch APIs monkeypatched, a fake torch_xla); the chosen pipeline then runs here on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from kernel_pytorch import OptimizeConfig, api, detect_hardware, get_backend, optimize, report_of
from kernel_pytorch.backends import AmdBackend, CpuBackend, IntelBackend, NvidiaBackend, TpuBackend
from kernel_pytorch.hardware import HardwareInfo
from kernel_pytorch.passes import get_pass
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

from .conftest import rel_err, twin
from .simulated_hardware import (GiB, install_fake_torch_xla, nvidia_props, simulate_cuda_api, simulate_h100,
                                 simulate_intel_xpu, simulate_mi300x)

SIMULATIONS = {
    "nvidia": (simulate_h100, NvidiaBackend, "inductor"),
    "amd": (simulate_mi300x, AmdBackend, "inductor"),
    "intel": (simulate_intel_xpu, IntelBackend, "inductor"),
    "tpu": (install_fake_torch_xla, TpuBackend, "openxla"),
}


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv("KERNEL_PYTORCH_DEVICE", raising=False)


def _plan(backend, **config):
    return {item.name: item for item in backend.plan(OptimizeConfig(**config))}


def test_this_machine_gets_the_cpu_backend():
    backend = get_backend(detect_hardware())
    assert isinstance(backend, CpuBackend)
    compiler = [item for item in backend.plan() if item.kind == "compiler"][0]
    assert compiler.name.startswith("eager") and "compile='auto' on cpu" in compiler.reason


@pytest.mark.parametrize("vendor", SIMULATIONS)
def test_simulated_vendor_gets_its_backend_and_pass_list(monkeypatch, vendor):
    simulate, backend_type, compiler = SIMULATIONS[vendor]
    simulate(monkeypatch)
    hardware = detect_hardware()
    backend = get_backend(hardware)
    assert hardware.vendor == vendor and type(backend) is backend_type
    assert backend.compiler == compiler and backend.compile_by_default
    passes = [item.name for item in backend.plan() if item.kind == "pass" and item.applies]
    # fp8=False and no context_parallel group by default: those two passes are off; so are passes for other hardware.
    runs_here = [name for name in backend_type.graph_passes if get_pass(name).unavailable_reason(hardware) is None]
    by_default = [name for name in runs_here if name not in ("fp8", "context_parallel")]
    assert passes == by_default and passes[0] == "normalize"
    with_fp8 = [item.name for item in backend.plan(OptimizeConfig(fp8=True)) if item.kind == "pass" and item.applies]
    assert with_fp8 == [name for name in runs_here if name != "context_parallel" and (name != "fp8" or hardware.fp8)]


@pytest.mark.parametrize("vendor", SIMULATIONS)
def test_simulated_vendor_pipeline_runs_on_cpu_tensors(monkeypatch, vendor):
    # Probes are simulated for detection only: left in place, the fake torch.cuda would mislead
    # dynamo itself into looking for a GPU.
    with monkeypatch.context() as simulated:
        SIMULATIONS[vendor][0](simulated)
        hardware = detect_hardware()
    monkeypatch.setattr(api, "detect_hardware", lambda device="auto": hardware)
    torch.manual_seed(0)
    model = LlamaStyleLM(LlamaStyleConfig.tiny()).eval()
    reference = twin(model)
    optimize(model, example_inputs=(torch.randint(0, 97, (2, 9)),), compile=False)
    report = report_of(model)
    assert report.backend == vendor and report.hardware.vendor == vendor
    assert report.verification is not None and report.verification.passed
    tokens = torch.randint(0, 97, (3, 12))
    with torch.no_grad():
        assert rel_err(model(tokens), reference(tokens)) < 1e-5


def test_h100_plan_has_cudnn_attention_fp8_and_inductor(monkeypatch):
    simulate_h100(monkeypatch)
    hardware = detect_hardware()
    hardware = hardware.model_copy(update={"triton_usable": True, "triton_version": "3.6.0"})
    plan = _plan(get_backend(hardware))
    for kernel in ("cudnn", "flash", "fp8-scaled-mm", "triton", "flex"):
        assert plan[kernel].applies, kernel
    assert not plan["flash_attn"].applies and "not installed" in plan["flash_attn"].reason
    assert "inductor (default)" in plan


def test_a100_plan_has_no_fp8_and_says_why(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("NVIDIA A100-SXM4-80GB", 8, 0, 80 * GiB))
    plan = _plan(get_backend(detect_hardware()))
    assert not plan["fp8-scaled-mm"].applies
    assert "8.9" in plan["fp8-scaled-mm"].reason and "(8, 0)" in plan["fp8-scaled-mm"].reason
    assert plan["cudnn"].applies


def test_gpu_without_triton_runs_graphs_eagerly_and_says_why():
    hardware = HardwareInfo(vendor="nvidia", device_name="sim", compute_capability=(9, 0), triton_usable=False)
    compiler, why = get_backend(hardware).compiler_choice(OptimizeConfig())
    assert compiler.name == "eager" and "Triton is not usable" in why


def test_compile_mode_and_opt_out():
    hardware = HardwareInfo(vendor="nvidia", device_name="sim", compute_capability=(9, 0), triton_usable=True)
    backend = get_backend(hardware)
    assert backend.compiler_choice(OptimizeConfig(compile="max-autotune"))[0].mode == "max-autotune"
    assert backend.compiler_choice(OptimizeConfig(compile=False))[0].name == "eager"
    cpu = get_backend(HardwareInfo(vendor="cpu", device_name="sim"))
    assert cpu.compiler_choice(OptimizeConfig(compile=True))[0].name in ("inductor", "eager")


def test_mi300_plan_has_fnuz_fp8(monkeypatch):
    simulate_mi300x(monkeypatch)
    hardware = detect_hardware()
    assert hardware.fp8_formats == ("float8_e4m3fnuz", "float8_e5m2fnuz")
    assert _plan(get_backend(hardware))["fp8-scaled-mm"].applies


def test_tpu_without_a_working_openxla_falls_back_to_eager_with_a_note(monkeypatch):
    install_fake_torch_xla(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    reference = twin(model)
    optimize(model, example_inputs=(torch.randn(2, 4),))
    report = report_of(model)
    assert report.compiler.startswith("openxla")
    assert any("compiler openxla failed" in note and "running it eagerly" in note for note in report.notes)
    x = torch.randn(3, 4)
    assert rel_err(model(x), reference(x)) < 1e-6


def test_backend_refuses_hardware_of_another_vendor():
    with pytest.raises(ValueError, match="serves nvidia, not cpu"):
        NvidiaBackend(HardwareInfo(vendor="cpu", device_name="x"))


def test_forced_device_through_optimize_config():
    model = torch.nn.Linear(3, 3)
    optimize(model, device="cpu")
    assert report_of(model).backend == "cpu"
    with pytest.raises(Exception, match="CUDA"):
        optimize(torch.nn.Linear(3, 3), device="cuda")
