"""kernel_pytorch: ``model = kernel_pytorch.optimize(model)`` rewrites a PyTorch model for the hardware found."""

from __future__ import annotations

from kernel_pytorch.api import optimize, report_of
from kernel_pytorch.backends import Backend, get_backend
from kernel_pytorch.compiled_call import RecompileLimitWarning, UnoptimizedCallWarning
from kernel_pytorch.config import (Float8Config, GenerationConfig, MemoryConfig, OptimizeConfig, SparseAttentionConfig,
                                   Tolerance)
from kernel_pytorch.features.generation import Decoder, GenerationLimitError
from kernel_pytorch.errors import ConfigError, HardwareUnavailableError, KernelPytorchError, PassError, UnknownPassError
from kernel_pytorch.hardware import HardwareInfo, detect_hardware
from kernel_pytorch.report import OptimizationReport

__version__ = "0.1.0"

__all__ = [
    "optimize",
    "report_of",
    "OptimizeConfig",
    "Float8Config",
    "MemoryConfig",
    "GenerationConfig",
    "Decoder",
    "GenerationLimitError",
    "SparseAttentionConfig",
    "Tolerance",
    "detect_hardware",
    "HardwareInfo",
    "get_backend",
    "Backend",
    "OptimizationReport",
    "KernelPytorchError",
    "ConfigError",
    "HardwareUnavailableError",
    "PassError",
    "UnknownPassError",
    "RecompileLimitWarning",
    "UnoptimizedCallWarning",
    "__version__",
]
