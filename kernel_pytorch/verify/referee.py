"""Where a float32 referee run goes (:class:`~kernel_pytorch.verify.numerics.NoiseAwareCheck`): on the GPU when a
float32 copy of the low-precision tensors fits beside what is there, else on the host (the per-graph checks and the
end-to-end one alike), and the tensors it runs on (:func:`referee_copy`).

At vocabulary 128256 and 8 x 2048 tokens a 12-layer model's float32 run needs about 47 GiB beyond the checks' own
runs, which an 80 GB GPU does not have after them; judged by tolerance alone, the bf16 logits (2.5e-2 from the bf16
original, about the original's own error against float32) failed the 2e-2 tolerance and every rewrite was rolled
back. The host holds the float32 copy instead, slower (its matmuls on the CPU) but a verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
import torch.nn as nn

from kernel_pytorch.memory.host_memory import available_host_bytes
from kernel_pytorch.verify.numerics import LOW_PRECISION, Run

__all__ = ["float32_bytes_needed", "float32_fits", "host_referee", "referee_device", "referee_copy"]

GIB = 2**30


def float32_bytes_needed(tensors: Sequence[torch.Tensor], gradients: bool, outputs: Optional[Run] = None) -> int:
    """Bytes a float32 run needs: the low-precision ``tensors`` (parameters, buffers, inputs) in float32, with
    their gradients, twice over for the activations; ``outputs`` (the low-precision run's) four float32 copies
    each with gradients (the outputs, and the projection's weights, upcast and product), one without."""
    low = [t for t in tensors if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION]
    needed = 2 * sum(t.numel() * 4 for t in low) * (2 if gradients else 1)
    if outputs is not None:
        needed += sum(v.numel() * 4 * (4 if gradients else 1) for v in outputs.outputs.values()
                      if isinstance(v, torch.Tensor) and v.is_floating_point())
    return needed


def float32_fits(tensors: Sequence[torch.Tensor], gradients: bool, outputs: Optional[Run] = None) -> str | None:
    """None if the float32 run (:func:`float32_bytes_needed`) fits in the free memory of the GPU the tensors are
    on (always, on the CPU); else why not. The driver's free memory, not counting the caching allocator's free
    blocks: counting them, the graph check's referee ran at vocab 128256 and the compile after it ran out of
    memory (H100)."""
    low = [t for t in tensors if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION and t.is_cuda]
    if not low:
        return None
    needed = float32_bytes_needed(tensors, gradients, outputs)
    free, _ = torch.cuda.mem_get_info(low[0].device)
    if free < needed:
        return f"a float32 copy needs ~{needed / GIB:.1f} GiB, {free / GIB:.1f} GiB free on {low[0].device}"
    return None


def referee_device(tensors: Sequence[torch.Tensor], gradients: bool, outputs: Optional[Run] = None,
                   nothing_compiles_after: bool = False) -> tuple[Optional[torch.device], str]:
    """Where the float32 run goes: ``(None, "")`` where the tensors are; ``(cpu, why)`` on the host, the GPU
    lacking the memory; ``(None, why not)`` nowhere (neither has it). ``nothing_compiles_after`` (the end-to-end
    check, after the first call compiled everything): the caching allocator's unused blocks are released first, so
    that they count as free (the per-graph checks before it leave most of the GPU held by the allocator; the H100
    figures are in the CHANGELOG)."""
    if nothing_compiles_after and any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        torch.cuda.empty_cache()
    on_gpu = float32_fits(tensors, gradients, outputs)
    if on_gpu is None:
        return None, ""
    return host_referee(tensors, gradients, outputs, on_gpu)


def host_referee(tensors: Sequence[torch.Tensor], gradients: bool, outputs: Optional[Run], why: str
                 ) -> tuple[Optional[torch.device], str]:
    """``(cpu, why)`` where the host has the memory for the float32 run, else ``(None, why not)``: the fallback of a
    referee that ran out of memory on the GPU."""
    needed, available = float32_bytes_needed(tensors, gradients, outputs), available_host_bytes()
    if available < needed:
        return None, f"{why}; host memory available: {available / GIB:.1f} GiB"
    return torch.device("cpu"), why


def referee_copy(value: Any, device: torch.device | None) -> Any:
    """``value`` for the float32 run: low-precision tensors upcast, tensors moved to ``device`` (None: kept
    where they are), parameters still parameters, leaves with the same ``requires_grad``."""
    if not isinstance(value, torch.Tensor):
        return value
    detached = value.detach()
    moved = detached.float() if detached.dtype in LOW_PRECISION else detached
    moved = moved.to(device) if device is not None else moved
    if moved is detached:  # unchanged: the tensor itself (an integer buffer, a float32 parameter or input)
        return value
    if isinstance(value, nn.Parameter):
        return nn.Parameter(moved, value.requires_grad)
    return moved.requires_grad_(value.requires_grad)
