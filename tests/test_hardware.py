"""Tests of hardware detection: the real CPU of this machine, and every other vendor simulated by
monkeypatching the public torch APIs the probes read (or a fake ``torch_xla`` package for TPUs)."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError

import pydantic
import pytest
import torch

import kernel_pytorch.hardware as hardware
from kernel_pytorch.errors import HardwareUnavailableError
from kernel_pytorch.hardware import HardwareInfo, detect_hardware

from .simulated_hardware import GiB, amd_props, install_fake_torch_xla, nvidia_props, simulate_cuda_api, simulate_intel_xpu



@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    # A developer's shell may set it; every test starts from "auto".
    monkeypatch.delenv(hardware.ENV_DEVICE, raising=False)


# ------------------------------------------------------------------------------------ this machine (CPU)


def test_this_machine_is_cpu_and_probes_say_why():
    info = detect_hardware()
    assert info.vendor == "cpu"
    assert list(info.probes) == ["rocm", "cuda", "xpu", "tpu", "cpu"]
    assert info.probes["rocm"] == "unavailable: torch.version.hip is None (not a ROCm build of torch)"
    assert info.probes["cuda"] == "unavailable: torch.version.cuda is None (CPU build of torch)"
    assert info.probes["xpu"].startswith("unavailable: torch.xpu.is_available() is False")
    assert info.probes["tpu"] == "unavailable: torch_xla is not installed"
    assert info.probes["cpu"].startswith("ok: ")
    assert info.device_count == 1 and info.device_name
    assert info.memory_bytes is not None and info.memory_bytes > GiB
    assert info.compute_capability is None and info.gfx_arch is None
    assert not info.fp8 and info.fp8_formats == () and not info.tensor_cores and not info.cudnn_attention
    assert info.triton_usable is False  # no GPU backend for Triton here, installed or not
    assert info.torch_version == torch.__version__
    assert "gloo" in info.distributed_backends
    assert set(info.distributed_backends) <= {"nccl", "gloo", "mpi", "xccl", "ucc"}
    assert info.summary().startswith(f"cpu: {info.device_name} x1, ")


def test_cpu_isa_reads_proc_cpuinfo_and_torch_capability():
    # Whatever this host is (CI's and developers' machines differ: AVX-512 or AVX2 only), the listed ISA
    # extensions are exactly the ones of interest that its /proc/cpuinfo names (the parser itself is checked
    # on a given file below).
    info, (flags, _) = detect_hardware(), hardware._read_cpuinfo()
    assert flags or not sys.platform.startswith("linux")  # a Linux host's file was read
    assert [f for f in info.cpu_isa if not f.startswith("torch:")] == [
        f for f in hardware._CPU_FLAGS_OF_INTEREST if f in flags]
    assert f"torch:{torch.backends.cpu.get_cpu_capability()}" in info.cpu_isa
    assert info.bf16 == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def test_cpu_flags_from_a_given_cpuinfo(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    block = (
        "processor\t: {}\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
        "flags\t\t: fpu avx2 avx512f amx_tile amx_bf16\n"
    )
    cpuinfo.write_text(block.format(0) + "\n" + block.format(1).replace("amx_bf16", ""))
    monkeypatch.setattr(hardware, "_CPUINFO_PATH", str(cpuinfo))
    info = detect_hardware("cpu")
    assert info.device_name == "Intel(R) Xeon(R) Platinum 8480+"
    assert info.cpu_isa[:4] == ("avx2", "avx512f", "amx_tile", "amx_bf16")
    assert info.bf16 is True


def test_unreadable_cpuinfo_gives_no_flags_but_still_a_cpu(monkeypatch, tmp_path):
    monkeypatch.setattr(hardware, "_CPUINFO_PATH", str(tmp_path / "missing"))
    info = detect_hardware("cpu")
    assert info.vendor == "cpu" and info.device_name
    assert all(isa.startswith("torch:") for isa in info.cpu_isa)
    assert info.bf16 is False


def test_hardware_info_is_frozen_and_validated():
    info = detect_hardware()
    with pytest.raises(pydantic.ValidationError):
        info.vendor = "nvidia"
    with pytest.raises(pydantic.ValidationError):
        HardwareInfo(vendor="cpu", device_name="x", unknown_field=1)  # extra="forbid"
    with pytest.raises(pydantic.ValidationError, match="contradicts"):
        HardwareInfo(vendor="nvidia", device_name="x", fp8=True)
    with pytest.raises(pydantic.ValidationError, match="not torch dtype names"):
        HardwareInfo(vendor="nvidia", device_name="x", fp8=True, fp8_formats=("e4m3",))
    with pytest.raises(pydantic.ValidationError, match="NVIDIA's"):
        HardwareInfo(vendor="amd", device_name="x", compute_capability=(9, 4))
    with pytest.raises(pydantic.ValidationError):
        HardwareInfo(vendor="gpu", device_name="x")


def test_distributed_backends_empty_without_torch_distributed(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    assert detect_hardware().distributed_backends == ()


# ---------------------------------------------------------------------------------------- NVIDIA (simulated)


def test_simulated_h100(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("NVIDIA H100 80GB HBM3", 9, 0, 80 * GiB), count=8)
    info = detect_hardware()
    assert info.vendor == "nvidia"
    assert info.device_name == "NVIDIA H100 80GB HBM3" and info.device_count == 8
    assert info.compute_capability == (9, 0) and info.gfx_arch is None
    assert info.memory_bytes == 80 * GiB
    assert info.bf16 and info.tensor_cores
    assert info.fp8 and info.fp8_formats == ("float8_e4m3fn", "float8_e5m2")
    assert info.cudnn_version == 91900 and info.cudnn_attention
    assert list(info.probes) == ["rocm", "cuda"]  # stops at the first probe that finds hardware
    assert info.probes["cuda"] == "ok: NVIDIA H100 80GB HBM3 x8, sm_90, CUDA 13.0"
    assert info.summary() == (
        "nvidia: NVIDIA H100 80GB HBM3 x8, sm_90, 80.0 GiB, bf16, fp8 (float8_e4m3fn, float8_e5m2), cuDNN attention"
    )


def test_simulated_a100_has_no_fp8_but_cudnn_attention(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("NVIDIA A100-SXM4-80GB", 8, 0, 80 * GiB))
    info = detect_hardware("nvidia")
    assert info.compute_capability == (8, 0)
    assert not info.fp8 and info.fp8_formats == ()
    assert info.cudnn_attention and info.bf16 and info.tensor_cores


def test_simulated_t4_has_no_fp8_bf16_or_cudnn_attention(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("Tesla T4", 7, 5, 15 * GiB), bf16=False)
    info = detect_hardware("cuda")
    assert info.compute_capability == (7, 5)
    assert not info.fp8 and not info.bf16
    assert not info.cudnn_attention and info.cudnn_version == 91900  # cuDNN 9 is there, sm_75 is too old
    assert info.tensor_cores  # Turing has (fp16) tensor cores


def test_bf16_asks_for_native_support_not_emulation(monkeypatch):
    # torch.cuda.is_bf16_supported() defaults to including_emulation=True, which is True on a T4.
    simulate_cuda_api(monkeypatch, nvidia_props("Tesla T4", 7, 5, 15 * GiB))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert detect_hardware().bf16 is False


def test_cudnn_8_gives_no_cudnn_attention(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("NVIDIA H100 80GB HBM3", 9, 0, 80 * GiB), cudnn=8902)
    info = detect_hardware()
    assert info.cudnn_version == 8902 and not info.cudnn_attention


def test_no_cudnn_gives_no_cudnn_attention(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("NVIDIA H100 80GB HBM3", 9, 0, 80 * GiB), cudnn=None)
    info = detect_hardware()
    assert info.cudnn_version is None and not info.cudnn_attention


def test_cuda_build_without_gpu_falls_back_to_cpu(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("unused", 9, 0, GiB))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = detect_hardware()
    assert info.vendor == "cpu"
    assert info.probes["cuda"].startswith("unavailable: torch.cuda.is_available() is False (CUDA 13.0 build")


# ------------------------------------------------------------------------------------------- AMD (simulated)


def test_simulated_mi300x(monkeypatch):
    props = amd_props("AMD Instinct MI300X", "gfx942:sramecc+:xnack-")
    simulate_cuda_api(monkeypatch, props, count=8, cuda=None, hip="6.2")
    info = detect_hardware()
    assert info.vendor == "amd"
    assert info.device_name == "AMD Instinct MI300X" and info.device_count == 8
    assert info.gfx_arch == "gfx942" and info.compute_capability is None
    assert info.fp8 and info.fp8_formats == ("float8_e4m3fnuz", "float8_e5m2fnuz")
    assert info.tensor_cores and info.bf16
    assert not info.cudnn_attention and info.cudnn_version is None  # cudnn on ROCm is MIOpen
    assert list(info.probes) == ["rocm"]
    assert info.probes["rocm"] == "ok: AMD Instinct MI300X x8, gfx942, HIP 6.2"
    assert info.summary().startswith("amd: AMD Instinct MI300X x8, gfx942, 192.0 GiB, bf16, fp8 (float8_e4m3fnuz")


@pytest.mark.parametrize(
    ("gcn_arch", "fp8_formats", "tensor_cores"),
    [
        ("gfx950:sramecc+:xnack-", ("float8_e4m3fn", "float8_e5m2"), True),  # MI355X: OCP FP8
        ("gfx1201", ("float8_e4m3fn", "float8_e5m2"), False),  # RDNA4: OCP FP8, not CDNA
        ("gfx90a:sramecc+:xnack-", (), True),  # MI250X: matrix cores, no FP8
        ("gfx1100", (), False),  # RDNA3
    ],
)
def test_amd_arch_table(monkeypatch, gcn_arch, fp8_formats, tensor_cores):
    simulate_cuda_api(monkeypatch, amd_props("AMD GPU", gcn_arch), cuda=None, hip="6.4")
    info = detect_hardware("rocm")
    assert info.gfx_arch == gcn_arch.split(":")[0]
    assert info.fp8_formats == fp8_formats and info.fp8 == bool(fp8_formats)
    assert info.tensor_cores is tensor_cores


def test_forced_nvidia_on_rocm_build_names_the_rocm_build(monkeypatch):
    simulate_cuda_api(monkeypatch, amd_props("AMD Instinct MI300X", "gfx942"), cuda=None, hip="6.2")
    with pytest.raises(HardwareUnavailableError, match=r"torch.version.cuda is None \(ROCm build"):
        detect_hardware("nvidia")


# ------------------------------------------------------------------------------------- Intel XPU (simulated)


def test_simulated_intel_xpu(monkeypatch):
    simulate_intel_xpu(monkeypatch)
    info = detect_hardware()
    assert info.vendor == "intel"
    assert info.device_name == "Intel(R) Data Center GPU Max 1550" and info.device_count == 2
    assert info.memory_bytes == 64 * GiB and info.bf16 and info.tensor_cores and not info.fp8
    assert list(info.probes) == ["rocm", "cuda", "xpu"]
    assert info.probes["xpu"] == "ok: Intel(R) Data Center GPU Max 1550 x2"


# ------------------------------------------------------------------------------------------- TPU (simulated)


def test_simulated_tpu(monkeypatch):
    install_fake_torch_xla(monkeypatch)
    info = detect_hardware()
    assert info.vendor == "tpu"
    assert info.device_name == "TPU v5 lite" and info.device_count == 4 and info.memory_bytes == 16 * GiB
    assert info.bf16 and not info.fp8
    assert list(info.probes) == ["rocm", "cuda", "xpu", "tpu"]
    assert info.probes["tpu"].startswith("ok: TPU v5 lite x4")


def test_simulated_tpu_of_an_older_torch_xla(monkeypatch):
    install_fake_torch_xla(monkeypatch, extras=False)  # no device kind, count or memory functions
    info = detect_hardware("xla")
    assert info.vendor == "tpu" and info.device_name == "TPU" and info.device_count == 1
    assert info.memory_bytes is None


def test_torch_xla_on_a_cpu_host_is_not_a_tpu(monkeypatch):
    def must_not_start_runtime():
        raise AssertionError("the XLA runtime was started on a non-TPU host")

    install_fake_torch_xla(monkeypatch, device_type="CPU", xla_device=must_not_start_runtime)
    info = detect_hardware()
    assert info.vendor == "cpu"
    assert info.probes["tpu"] == "unavailable: torch_xla.runtime.device_type() is 'CPU', not 'TPU' (PJRT_DEVICE)"


def test_torch_xla_that_raises_falls_back_to_cpu(monkeypatch):
    def broken_device():
        raise RuntimeError("Failed to get TPU metadata")

    install_fake_torch_xla(monkeypatch, xla_device=broken_device)
    info = detect_hardware()
    assert info.vendor == "cpu"
    assert info.probes["tpu"] == "unavailable: RuntimeError: Failed to get TPU metadata"


# ------------------------------------------------------------------------------------ probes never raise


def test_a_raising_probe_falls_through_and_records_why(monkeypatch):
    def broken(index=None):
        raise RuntimeError("HIP error: invalid device ordinal")

    simulate_cuda_api(monkeypatch, None, cuda=None, hip="6.2")
    monkeypatch.setattr(torch.cuda, "get_device_properties", broken)
    info = detect_hardware()
    assert info.vendor == "cpu"
    assert info.probes["rocm"] == "unavailable: RuntimeError: HIP error: invalid device ordinal"
    assert info.probes["cpu"].startswith("ok: ")


def test_zero_devices_is_unavailable(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("unused", 9, 0, GiB), count=0)
    info = detect_hardware()
    assert info.vendor == "cpu" and info.probes["cuda"] == "unavailable: torch.cuda.device_count() is 0"


# --------------------------------------------------------------------------------------------- overrides


def test_forced_cpu_runs_only_the_cpu_probe_even_on_a_gpu_machine(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("NVIDIA H100 80GB HBM3", 9, 0, 80 * GiB))
    info = detect_hardware("cpu")
    assert info.vendor == "cpu" and list(info.probes) == ["cpu"]


def test_env_variable_overrides_auto(monkeypatch):
    simulate_cuda_api(monkeypatch, nvidia_props("NVIDIA H100 80GB HBM3", 9, 0, 80 * GiB))
    monkeypatch.setenv(hardware.ENV_DEVICE, "cpu")
    assert detect_hardware().vendor == "cpu"
    assert detect_hardware("nvidia").vendor == "nvidia"  # an explicit argument beats the environment
    monkeypatch.setenv(hardware.ENV_DEVICE, "")
    assert detect_hardware().vendor == "nvidia"  # empty means unset


def test_forced_cuda_on_this_cpu_machine_raises_with_the_reason():
    with pytest.raises(HardwareUnavailableError) as excinfo:
        detect_hardware("cuda")
    message = str(excinfo.value)
    assert "device='cuda' was requested (by device='cuda')" in message  # as written, not the vendor
    assert "CUDA probe failed: unavailable: torch.version.cuda is None (CPU build of torch)" in message
    assert "install a CUDA build of torch" in message


def test_forced_device_from_env_names_the_env_variable(monkeypatch):
    monkeypatch.setenv(hardware.ENV_DEVICE, "TPU")
    with pytest.raises(HardwareUnavailableError, match=r"KERNEL_PYTORCH_DEVICE='TPU'.*torch_xla is not installed"):
        detect_hardware()


@pytest.mark.parametrize("device", ["gpu", "nvidia-h100", ""])
def test_unknown_device_name_raises_value_error_listing_valid_names(device):
    with pytest.raises(ValueError, match=r"valid names: \['auto', 'nvidia', 'amd', 'tpu', 'intel', 'cpu', 'cuda'"):
        detect_hardware(device)


def test_unknown_device_name_from_env_raises(monkeypatch):
    monkeypatch.setenv(hardware.ENV_DEVICE, "quantum")
    with pytest.raises(ValueError, match="KERNEL_PYTORCH_DEVICE"):
        detect_hardware()


# ------------------------------------------------------------------------------------ optional packages


def test_flash_attn_and_transformer_engine_versions_from_metadata(monkeypatch):
    installed = {"flash_attn": "2.8.3", "transformer-engine": "2.6.0"}

    def fake_version(name):
        if name not in installed:
            raise PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(hardware, "distribution_version", fake_version)
    info = detect_hardware()
    assert info.flash_attn_version == "2.8.3"  # found under its second spelling
    assert info.transformer_engine_version == "2.6.0"


def test_missing_optional_packages_are_none(monkeypatch):
    def nothing_installed(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(hardware, "distribution_version", nothing_installed)
    info = detect_hardware()
    assert info.flash_attn_version is None and info.transformer_engine_version is None


def test_triton_usable_only_with_a_gpu(monkeypatch):
    monkeypatch.setattr(hardware, "_triton_version", lambda: "3.6.0")
    on_cpu = detect_hardware()
    assert on_cpu.triton_version == "3.6.0" and not on_cpu.triton_usable
    simulate_cuda_api(monkeypatch, nvidia_props("NVIDIA H100 80GB HBM3", 9, 0, 80 * GiB))
    assert detect_hardware().triton_usable
    monkeypatch.setattr(hardware, "_triton_version", lambda: None)
    assert not detect_hardware().triton_usable  # a GPU but no Triton
