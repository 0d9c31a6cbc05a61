"""Find the hardware this process runs on and what it can do: :func:`detect_hardware` -> :class:`HardwareInfo`.

Detection is a list of probes tried in order (ROCm, CUDA, Intel XPU, TPU, then CPU, which always works).
The first probe that finds a device wins; every probe tried leaves a line in ``HardwareInfo.probes`` saying
what it found or why it found nothing, so "why am I on the CPU?" has an answer. A probe never raises: any
exception inside one becomes an ``"unavailable: <ExcType>: <message>"`` line and detection moves on.

Only public torch APIs are read (``torch.version``, ``torch.cuda.*``, ``torch.xpu.*``,
``torch.backends.cudnn.*``), so tests simulate each vendor by monkeypatching those.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from typing import Any, Callable, NamedTuple, Optional, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernel_pytorch.device_names import DEVICE_ALIASES, VENDORS, DeviceName, Vendor
from kernel_pytorch.errors import HardwareUnavailableError

__all__ = ["HardwareInfo", "detect_hardware"]

ENV_DEVICE = "KERNEL_PYTORCH_DEVICE"

# PyTorch's FP8 dtype names. NVIDIA (sm_89+) and AMD gfx950 / RDNA4 use the OCP formats; MI300 (gfx942)
# uses the "fnuz" variants (no negative zero, no infinities, exponent bias one higher), which are not
# interchangeable: a float8_e4m3fn tensor fed to an MI300 matmul is an error, not a rounding difference.
_FP8_OCP = ("float8_e4m3fn", "float8_e5m2")
_FP8_FNUZ = ("float8_e4m3fnuz", "float8_e5m2fnuz")

# cuDNN's fused SDPA (torch's CUDNN_ATTENTION backend) needs cuDNN 9 (version() >= 90000; cuDNN 9
# encodes 9.19.0 as 91900, cuDNN 8 encoded 8.9.2 as 8902) and an Ampere or newer GPU (sm_80).
_CUDNN_ATTENTION_MIN_VERSION = 90000
_CUDNN_ATTENTION_MIN_CC = (8, 0)
_FP8_MIN_CC = (8, 9)  # Ada (sm_89) and Hopper (sm_90) added FP8 tensor cores
_TENSOR_CORE_MIN_CC = (7, 0)  # Volta

# AMD CDNA architectures with matrix cores (MFMA): MI100 gfx908, MI200 gfx90a, MI300 gfx94x, MI350 gfx95x.
_AMD_MATRIX_CORE_PREFIXES = ("gfx908", "gfx90a", "gfx94", "gfx95")

# x86 flags worth knowing for CPU kernels: AVX2/AVX-512 vector width, native bf16/fp16 dot products,
# and AMX tile matmul (Sapphire Rapids+), which oneDNN uses for bf16/int8 linear layers.
_CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
# Flags meaning the CPU computes bf16 natively ("bf16" is the aarch64 spelling in /proc/cpuinfo Features).
_CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
_CPUINFO_PATH = "/proc/cpuinfo"
_MEMINFO_PATH = "/proc/meminfo"

# What to tell a user whose forced device was not found.
_FIX_HINTS = {
    "nvidia": "install a CUDA build of torch (https://pytorch.org/get-started/locally/) and check that "
    "`nvidia-smi` lists the GPU and CUDA_VISIBLE_DEVICES does not hide it",
    "amd": "install a ROCm build of torch (https://pytorch.org/get-started/locally/) and check that "
    "`rocm-smi` lists the GPU and HIP_VISIBLE_DEVICES does not hide it",
    "intel": "install an XPU build of torch (pip install torch --index-url "
    "https://download.pytorch.org/whl/xpu) and the Intel GPU driver",
    "tpu": "install torch_xla with TPU support (pip install 'torch_xla[tpu]') on a Cloud TPU VM, or set "
    "PJRT_DEVICE=TPU",
}

T = TypeVar("T")


class HardwareInfo(BaseModel):
    """The device found by :func:`detect_hardware` and the features the backends choose by.

    Only ``vendor`` and ``device_name`` are required, so tests can describe hardware they do not have::

        gpu = HardwareInfo(vendor="nvidia", device_name="an sm_90 GPU", compute_capability=(9, 0),
                           bf16=True, fp8=True, fp8_formats=("float8_e4m3fn", "float8_e5m2"))
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vendor: Vendor
    device_name: str
    device_count: int = Field(1, ge=1, description="Devices of this vendor visible to the process.")
    compute_capability: Optional[tuple[int, int]] = Field(None, description="NVIDIA only, e.g. (9, 0).")
    gfx_arch: Optional[str] = Field(None, description="AMD only, e.g. 'gfx942'.")
    memory_bytes: Optional[int] = Field(None, ge=0, description="Per device; total RAM for the CPU.")
    bf16: bool = Field(False, description="bfloat16 computed natively (not emulated).")
    fp8: bool = False
    fp8_formats: tuple[str, ...] = Field((), description="torch dtype names the hardware computes in.")
    tensor_cores: bool = Field(False, description="Matrix units: NVIDIA tensor cores, AMD MFMA, Intel XMX.")
    cudnn_attention: bool = Field(False, description="cuDNN fused SDPA usable (cuDNN >= 9, sm_80+).")
    cudnn_version: Optional[int] = None
    flash_attn_version: Optional[str] = None
    cudnn_frontend_version: Optional[str] = Field(None, description="nvidia-cudnn-frontend, whose graph API "
                                                  "builds cuDNN's sliding-window attention (kernel 'cudnn_band').")
    transformer_engine_version: Optional[str] = None
    triton_version: Optional[str] = None
    triton_usable: bool = Field(False, description="Triton installed and a GPU backend for it present.")
    distributed_backends: tuple[str, ...] = ()
    cpu_isa: tuple[str, ...] = Field((), description="Host CPU features, plus torch's 'torch:<capability>'.")
    torch_version: str = Field(default_factory=lambda: str(torch.__version__))
    probes: dict[str, str] = Field(default_factory=dict, description="probe name -> 'ok: ...' / 'unavailable: ...'")

    @model_validator(mode="after")
    def _consistent(self) -> HardwareInfo:
        if self.fp8 != bool(self.fp8_formats):
            raise ValueError(f"fp8={self.fp8} contradicts fp8_formats={self.fp8_formats}")
        not_dtypes = [name for name in self.fp8_formats if not isinstance(getattr(torch, name, None), torch.dtype)]
        if not_dtypes:
            raise ValueError(f"fp8_formats {not_dtypes} are not torch dtype names (e.g. 'float8_e4m3fn')")
        if self.compute_capability is not None and self.vendor != "nvidia":
            raise ValueError(f"compute_capability is NVIDIA's; vendor is '{self.vendor}'")
        if self.gfx_arch is not None and self.vendor != "amd":
            raise ValueError(f"gfx_arch is AMD's; vendor is '{self.vendor}'")
        return self

    def summary(self) -> str:
        """One line, e.g. ``cpu: AMD EPYC x1, 23.5 GiB, bf16, torch:AVX512``; a GPU's is in
        ``benchmarks/results/info_h100.txt``."""
        parts = [f"{self.device_name} x{self.device_count}"]
        if self.compute_capability is not None:
            parts.append(f"sm_{self.compute_capability[0]}{self.compute_capability[1]}")
        if self.gfx_arch is not None:
            parts.append(self.gfx_arch)
        if self.memory_bytes is not None:
            parts.append(f"{self.memory_bytes / 2**30:.1f} GiB")
        if self.bf16:
            parts.append("bf16")
        if self.fp8:
            parts.append(f"fp8 ({', '.join(self.fp8_formats)})")
        if self.cudnn_attention:
            parts.append("cuDNN attention")
        if self.vendor == "cpu":
            parts.extend(isa for isa in self.cpu_isa if isa.startswith("torch:"))
        return f"{self.vendor}: {', '.join(parts)}"


class _ProbeUnavailable(Exception):
    """Raised inside a probe to say, in words for the user, why its hardware is not there."""


class _Device(NamedTuple):
    """What a successful probe found: the vendor-specific fields of HardwareInfo and a one-line detail."""

    fields: dict[str, Any]
    detail: str


# ----------------------------------------------------------------------------------------------- probes


def _probe_rocm() -> _Device:
    if torch.version.hip is None:
        raise _ProbeUnavailable("torch.version.hip is None (not a ROCm build of torch)")
    if not torch.cuda.is_available():
        raise _ProbeUnavailable(
            f"torch.cuda.is_available() is False (ROCm {torch.version.hip} build; no AMD GPU visible)"
        )
    count, props = _read_cuda_api_devices()
    # gcnArchName carries target features after the arch: "gfx942:sramecc+:xnack-".
    gfx_arch = str(getattr(props, "gcnArchName", "") or "").split(":")[0] or None
    fp8_formats = _amd_fp8_formats(gfx_arch)
    name = str(props.name) or (gfx_arch or "AMD GPU")
    fields = dict(
        vendor="amd",
        device_name=name,
        device_count=count,
        gfx_arch=gfx_arch,
        memory_bytes=int(props.total_memory),
        # ROCm's is_bf16_supported() is True for every arch it builds for; kept as the one source of truth.
        bf16=bool(torch.cuda.is_bf16_supported()),
        fp8=bool(fp8_formats),
        fp8_formats=fp8_formats,
        tensor_cores=gfx_arch is not None and gfx_arch.startswith(_AMD_MATRIX_CORE_PREFIXES),
        # torch.backends.cudnn reports MIOpen on ROCm builds; cuDNN attention is NVIDIA-only.
        cudnn_attention=False,
        cudnn_version=None,
    )
    return _Device(fields, f"{name} x{count}, {gfx_arch}, HIP {torch.version.hip}")


def _probe_cuda() -> _Device:
    if torch.version.cuda is None:
        build = f"ROCm build, torch.version.hip={torch.version.hip}" if torch.version.hip else "CPU build of torch"
        raise _ProbeUnavailable(f"torch.version.cuda is None ({build})")
    if not torch.cuda.is_available():
        raise _ProbeUnavailable(
            f"torch.cuda.is_available() is False (CUDA {torch.version.cuda} build; no GPU visible or driver missing)"
        )
    count, props = _read_cuda_api_devices()
    cc = (int(props.major), int(props.minor))
    fp8_formats = _FP8_OCP if cc >= _FP8_MIN_CC else ()
    cudnn_version = _cudnn_version()
    cudnn_attention = (
        cudnn_version is not None and cudnn_version >= _CUDNN_ATTENTION_MIN_VERSION and cc >= _CUDNN_ATTENTION_MIN_CC
    )
    fields = dict(
        vendor="nvidia",
        device_name=str(props.name),
        device_count=count,
        compute_capability=cc,
        memory_bytes=int(props.total_memory),
        # including_emulation=False: the default also answers True on a T4 (sm_75), where bf16 runs as
        # slow emulated float32 math; a backend choosing a dtype wants the native answer.
        bf16=bool(torch.cuda.is_bf16_supported(including_emulation=False)),
        fp8=bool(fp8_formats),
        fp8_formats=fp8_formats,
        tensor_cores=cc >= _TENSOR_CORE_MIN_CC,
        cudnn_attention=cudnn_attention,
        cudnn_version=cudnn_version,
    )
    return _Device(fields, f"{props.name} x{count}, sm_{cc[0]}{cc[1]}, CUDA {torch.version.cuda}")


def _probe_xpu() -> _Device:
    if not hasattr(torch, "xpu"):
        raise _ProbeUnavailable("this torch has no torch.xpu module")
    if not torch.xpu.is_available():
        raise _ProbeUnavailable("torch.xpu.is_available() is False (no Intel GPU visible, or not an XPU build)")
    count = int(torch.xpu.device_count())
    if count < 1:
        raise _ProbeUnavailable("torch.xpu.device_count() is 0")
    props = torch.xpu.get_device_properties(0)
    fields = dict(
        vendor="intel",
        device_name=str(props.name),
        device_count=count,
        memory_bytes=int(props.total_memory),
        bf16=bool(torch.xpu.is_bf16_supported(including_emulation=False)),
        # Intel data-center and Arc GPUs have XMX matrix engines; none of them computes FP8 in torch yet.
        tensor_cores=True,
    )
    return _Device(fields, f"{props.name} x{count}")


def _probe_tpu() -> _Device:
    if importlib.util.find_spec("torch_xla") is None:
        raise _ProbeUnavailable("torch_xla is not installed")
    xla_runtime = importlib.import_module("torch_xla.runtime")
    # device_type() reads PJRT_DEVICE, which `import torch_xla` sets to "TPU" when it finds libtpu and a
    # TPU chip. Deciding on it first keeps a CPU machine with torch_xla installed from starting the XLA
    # runtime; on a TPU the runtime starts below (so call detection inside an xmp.spawn'd function, not
    # before it: torch_xla refuses to spawn once the parent has touched a device).
    device_type = xla_runtime.device_type()
    if device_type != "TPU":
        raise _ProbeUnavailable(f"torch_xla.runtime.device_type() is {device_type!r}, not 'TPU' (PJRT_DEVICE)")
    xla_model = importlib.import_module("torch_xla.core.xla_model")
    torch_xla = importlib.import_module("torch_xla")
    # torch_xla.device() replaced xm.xla_device() (deprecated in torch_xla 2.7); either raises without a TPU.
    device = (getattr(torch_xla, "device", None) or xla_model.xla_device)()
    count_fn = getattr(xla_runtime, "addressable_runtime_device_count", None)
    count = _optional(lambda: int(count_fn()), 1) if count_fn is not None else 1
    kind_fn = getattr(xla_model, "xla_device_kind", None)  # e.g. "TPU v5 lite"; newer torch_xla only
    name = _optional(lambda: str(kind_fn(device)), "TPU") if kind_fn is not None else "TPU"
    fields = dict(
        vendor="tpu",
        device_name=name,
        device_count=count,
        memory_bytes=_tpu_memory_bytes(xla_model, device),
        bf16=True,  # every TPU generation's MXU multiplies bf16
    )
    return _Device(fields, f"{name} x{count} ({device})")


def _probe_cpu() -> _Device:
    flags, model_name = _read_cpuinfo()
    name = model_name or platform.processor() or platform.machine() or "CPU"
    fields = dict(
        vendor="cpu",
        device_name=name,
        device_count=1,  # one torch "cpu" device, however many cores
        memory_bytes=_total_ram_bytes(),
        bf16=bool(flags & _CPU_BF16_FLAGS),
    )
    return _Device(fields, f"{name}, {os.cpu_count()} logical cores")


# Probe name in HardwareInfo.probes, its function, the vendor it finds, its name in messages; "auto" tries
# them in this order. ROCm goes before CUDA because a ROCm build answers torch.cuda.is_available() too
# (HIP poses as CUDA).
_PROBES: tuple[tuple[str, Callable[[], _Device], str, str], ...] = (
    ("rocm", _probe_rocm, "amd", "ROCm"),
    ("cuda", _probe_cuda, "nvidia", "CUDA"),
    ("xpu", _probe_xpu, "intel", "XPU"),
    ("tpu", _probe_tpu, "tpu", "TPU"),
    ("cpu", _probe_cpu, "cpu", "CPU"),
)


# ---------------------------------------------------------------------------------------------- helpers


def _read_cuda_api_devices() -> tuple[int, Any]:
    """Device count and device 0's properties through torch.cuda (shared by CUDA and ROCm builds).

    Device 0 stands for all: mixed GPUs in one process are rare and the backends pick one code path.
    """
    count = int(torch.cuda.device_count())
    if count < 1:
        raise _ProbeUnavailable("torch.cuda.device_count() is 0")
    return count, torch.cuda.get_device_properties(0)


def _amd_fp8_formats(gfx_arch: str | None) -> tuple[str, ...]:
    if gfx_arch is None:
        return ()
    if gfx_arch == "gfx942":  # MI300X/MI300A/MI325X: fnuz FP8
        return _FP8_FNUZ
    if gfx_arch == "gfx950" or gfx_arch.startswith("gfx12"):  # MI350 and RDNA4 moved to OCP FP8
        return _FP8_OCP
    return ()


def _cudnn_version() -> int | None:
    if not torch.backends.cudnn.is_available():
        return None
    version = torch.backends.cudnn.version()
    return int(version) if version is not None else None


def _tpu_memory_bytes(xla_model: Any, device: Any) -> int | None:
    get_info = getattr(xla_model, "get_memory_info", None)
    if get_info is None:
        return None
    info = _optional(lambda: dict(get_info(device)), {})
    # torch_xla >= 2.5 reports bytes_limit; older versions reported kb_total.
    if "bytes_limit" in info:
        return int(info["bytes_limit"])
    if "kb_total" in info:
        return int(info["kb_total"]) * 1024
    return None


def _optional(read: Callable[[], T], default: T) -> T:
    """A detail of a device already known to work; failing to read it loses the detail, not the device."""
    try:
        return read()
    except Exception:  # noqa: BLE001 - any failure here means only "detail unknown"
        return default


def _read_cpuinfo() -> tuple[frozenset[str], str | None]:
    """The first processor's flags and model name from /proc/cpuinfo; empty/None where unreadable."""
    try:
        with open(_CPUINFO_PATH, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:  # not Linux, or /proc not mounted
        return frozenset(), None
    flags: frozenset[str] = frozenset()
    model_name = None
    # Every core repeats the same block; the first one is enough and the file can be ~1 MB on big hosts.
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("flags", "Features"):  # x86 spelling, aarch64 spelling
            flags = frozenset(value.split())
        elif key == "model name" and model_name is None:
            model_name = value.strip() or None
    return flags, model_name


def _cpu_isa() -> tuple[str, ...]:
    flags, _ = _read_cpuinfo()
    isa = [flag for flag in _CPU_FLAGS_OF_INTEREST if flag in flags]
    # What ATen's CPU kernels were dispatched to (DEFAULT, AVX2, AVX512, SVE256, ...).
    capability = _optional(torch.backends.cpu.get_cpu_capability, None)
    if capability:
        isa.append(f"torch:{capability}")
    return tuple(isa)


def _total_ram_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # os.sysconf is POSIX-only; names vary by platform
        pass
    try:
        with open(_MEMINFO_PATH, encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _package_version(*distribution_names: str) -> str | None:
    """Installed version of the first distribution found, without importing it (flash-attn, TE are heavy)."""
    for name in distribution_names:
        try:
            return distribution_version(name)
        except PackageNotFoundError:
            continue
    return None


def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    # The module is "triton" whichever wheel provides it: upstream, or torch's pinned builds.
    return _package_version("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu") or "unknown"


def _distributed_backends() -> tuple[str, ...]:
    import torch.distributed as dist

    if not dist.is_available():
        return ()
    found = []
    for name in ("nccl", "gloo", "mpi", "xccl", "ucc"):
        # is_xccl_available / is_ucc_available are recent; older torch lacks the function, not the answer.
        is_available = getattr(dist, f"is_{name}_available", None)
        if is_available is not None and _optional(lambda: bool(is_available()), False):
            found.append(name)
    return tuple(found)


# ------------------------------------------------------------------------------------------ entry point


def _run_probe(probe: Callable[[], _Device]) -> tuple[_Device | None, str]:
    try:
        device = probe()
    except _ProbeUnavailable as exc:
        return None, f"unavailable: {exc}"
    except Exception as exc:  # noqa: BLE001 - a broken driver or odd build must not stop detection
        return None, f"unavailable: {type(exc).__name__}: {exc}"
    return device, f"ok: {device.detail}"


class _Request(NamedTuple):
    """The vendor (or "auto") asked for, the name as the user wrote it ('cuda'), and where: the argument or
    the environment variable (e.g. "KERNEL_PYTORCH_DEVICE='cuda'")."""

    vendor: str
    written: str
    source: str


def _requested_device(device: str) -> _Request:
    # An OptimizeConfig's device is already the vendor ('cuda' -> 'nvidia'); messages echo what was written.
    written = device.written if isinstance(device, DeviceName) else device
    source = f"device={written!r}"
    requested = device.strip().lower()
    if requested == "auto":
        env_value = os.environ.get(ENV_DEVICE, "")
        if env_value.strip():
            requested, written, source = env_value.strip().lower(), env_value, f"{ENV_DEVICE}={env_value!r}"
    requested = DEVICE_ALIASES.get(requested, requested)
    if requested != "auto" and requested not in VENDORS:
        valid = ["auto", *VENDORS, *DEVICE_ALIASES]
        raise ValueError(f"unknown device {written!r} (from {source}); valid names: {valid}")
    return _Request(requested, written, source)


def detect_hardware(device: str = "auto") -> HardwareInfo:
    """Probe the hardware and return what was found.

    ``device`` is ``"auto"`` (try ROCm, CUDA, Intel XPU, TPU, then CPU; the environment variable
    ``KERNEL_PYTORCH_DEVICE`` overrides it), or a vendor (``nvidia``, ``amd``, ``intel``, ``tpu``, ``cpu``)
    or alias (``cuda``, ``rocm``, ``hip``, ``xpu``, ``xla``) to run only that vendor's probe.

    Raises ``ValueError`` for an unknown name and :class:`HardwareUnavailableError` when a requested
    vendor's probe fails; ``"auto"`` never raises.

    Example::

        >>> info = detect_hardware()
        >>> info.summary()   # on a GPU machine: benchmarks/results/info_h100.txt
        'cpu: AMD EPYC x1, 23.5 GiB, bf16, torch:AVX512'
        >>> info.probes["rocm"]
        'unavailable: torch.version.hip is None (not a ROCm build of torch)'
    """
    requested, written, source = _requested_device(device)
    probes: dict[str, str] = {}
    found: _Device | None = None
    for name, probe, vendor, label in _PROBES:
        if requested not in ("auto", vendor):
            continue
        found, probes[name] = _run_probe(probe)
        if found is not None:
            break
        if requested == vendor != "cpu":
            raise HardwareUnavailableError(
                f"device={written!r} was requested (by {source}) but the {label} probe failed: "
                f"{probes[name]}. To fix: {_FIX_HINTS[vendor]}; or use device='auto' to fall back."
            )
    if found is None:
        # Only reached if the CPU probe itself raised (its helpers already catch what they expect):
        # the CPU is there regardless, so report it by name alone rather than fail.
        found = _Device({"vendor": "cpu", "device_name": platform.machine() or "CPU"}, "")
    vendor = found.fields["vendor"]
    triton_version = _triton_version()
    return HardwareInfo(
        **found.fields,
        flash_attn_version=_package_version("flash-attn", "flash_attn"),
        cudnn_frontend_version=_package_version("nvidia-cudnn-frontend"),
        transformer_engine_version=_package_version("transformer-engine", "transformer_engine"),
        triton_version=triton_version,
        # Triton compiles for NVIDIA, AMD and (with torch's pytorch-triton-xpu) Intel GPUs; on a CPU it
        # only runs under TRITON_INTERPRET=1, which is a test tool, not a fast path.
        triton_usable=triton_version is not None and vendor in ("nvidia", "amd", "intel"),
        distributed_backends=_distributed_backends(),
        cpu_isa=_cpu_isa(),
        torch_version=str(torch.__version__),
        probes=probes,
    )
