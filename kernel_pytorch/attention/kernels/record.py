"""``AttentionKernel``: what is known about one attention kernel, in one record that the op
(:mod:`kernel_pytorch.ops.attention`), the dispatcher (:mod:`kernel_pytorch.attention.dispatch`) and the
backends' plans all read. The records themselves are in :mod:`kernel_pytorch.attention.kernels.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from kernel_pytorch.attention.kernels.problem import AttentionProblem

if TYPE_CHECKING:
    from kernel_pytorch.hardware import HardwareInfo

__all__ = ["AttentionKernel", "HeadDims", "ROUTES", "OP_CHECKS"]

# How attention() runs a kernel: F.scaled_dot_product_attention itself; the kernel_pytorch::attention_fwd /
# attention_bwd custom ops around an aten kernel; or a direct call of a kernel that traces and differentiates
# under torch.compile on its own.
ROUTES = ("sdpa", "custom_op", "direct")
# The limits attention() may refuse itself, with a ValueError, before calling the kernel.
OP_CHECKS = frozenset({"dropout", "dtype", "head_dims", "device"})


def _usable_anywhere(hardware: HardwareInfo) -> Optional[str]:
    return None


@dataclass(frozen=True)
class HeadDims:
    """The head dims (E of q/k, Ev of v) a kernel computes."""

    low: int = 1
    high: Optional[int] = None  # None: no upper limit
    multiple_of: int = 1
    value_equal: bool = False  # Ev must equal E
    padded: bool = False  # attention() pads E up to multiple_of (zero columns change no score), as SDPA does


@dataclass(frozen=True, kw_only=True)
class AttentionKernel:
    """One attention kernel: its name (``attention(..., kernel=name)``), where and on what it runs, which
    SDPA features it computes, and its entry points.

    Example::

        cudnn = KERNELS["cudnn"]
        cudnn.dtypes, cudnn.takes_mask, cudnn.why_not(problem, hardware)
    """

    name: str
    description: str  # one line: the backends' plan shows it
    device: str  # "cuda" (ROCm too) | "cpu" | "any"
    route: str  # one of ROUTES
    dtypes: tuple[torch.dtype, ...]  # what it computes
    head_dims: HeadDims = HeadDims()
    takes_mask: bool = False  # an attn_mask tensor
    takes_pattern: bool = False  # a recognized mask pattern in place of the tensor (attention(..., pattern=...))
    native_gqa: bool = True  # K/V with fewer heads than q as they are (else repeated per query head)
    mask_grad: bool = False  # a gradient for an attn_mask that requires grad
    dropout: bool = True
    bottom_right_causal: bool = False  # is_causal with Lq != Lk aligned bottom right (SDPA: top left)
    rng_on_host: bool = False  # its dropout RNG state is on the CPU outside CUDA-graph capture
    trains_in_cuda_graphs: bool = True  # its backward captures into CUDA graphs
    softcap: bool = False  # scores soft-capped, cap * tanh(score / cap), before the mask (Gemma-2)
    measured_only: bool = False  # chosen only when measured fastest on a GPU, never as an unmeasured guess
    # The limits attention() refuses itself (a subset of OP_CHECKS); the others are the kernel's own errors.
    op_checks: frozenset[str] = frozenset()
    # Raises ValueError for the patterns (with is_causal and the lengths) it does not compute; None: any.
    pattern_check: Optional[Callable[..., None]] = None
    # Why it cannot run a problem on the hardware found (None: it can); called with this record first.
    limits: Callable[[AttentionKernel, AttentionProblem, HardwareInfo], Optional[str]]
    # What the hardware must have for it at all (None: usable), for the backends' plans.
    requires: Callable[[HardwareInfo], Optional[str]] = _usable_anywhere
    # Entry points, by route: "sdpa" and "direct" take SDPA's arguments and return the output; "custom_op"
    # takes (q, k, v, mask, dropout_p, is_causal, scale, compute_log_sumexp) and returns (out, lse, rng_a,
    # rng_b), its backward the gradients (kernel_pytorch.attention.kernels.aten_sdpa).
    forward: Callable[..., Any]
    backward: Optional[Callable[..., Any]] = None  # None: the kernel's own autograd

    def __post_init__(self) -> None:
        if self.route not in ROUTES or not self.op_checks <= OP_CHECKS:
            raise ValueError(f"attention kernel {self.name!r}: route {self.route!r}, op_checks {set(self.op_checks)}")

    def why_not(self, problem: AttentionProblem, hardware: HardwareInfo) -> Optional[str]:
        """Why this kernel cannot run ``problem`` on ``hardware`` (``None``: it can)."""
        if problem.softcap is not None and not self.softcap:
            return f"{self.name} has no soft-capping of the scores"
        return self.limits(self, problem, hardware)
