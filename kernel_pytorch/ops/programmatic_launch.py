"""Programmatic dependent launch (PDL, NVIDIA sm_90 and newer) for the decode step's chain of short launches.

At batch 1 a decode step is a chain of launches of a few microseconds each (a layer's GEMVs, its RoPE and
cache write, its attention), and between two of them the GPU drains one grid and ramps up the next. A kernel
launched with the PDL attribute may be scheduled while the grid before it still runs: its programs start, then
wait (``griddepcontrol.wait``) until that grid has finished and its writes are visible, and only then read or
write their inputs, so nothing the grid before writes is read earlier than without PDL; what overlaps is the
launch and the programs' start. Each kernel then lets the next one launch (``griddepcontrol.launch_dependents``).

Which launches carry the attribute: those our own code makes on sm_90 or newer (an op's body running eagerly, as
the ops do in ``generate()``'s decode step and prefills, where they are opaque to Inductor). Inductor's generated
launcher drops Triton's launch options (``PDL=False`` under ``wrap_triton``). A launch without the attribute waits
for the whole grid before it, as any launch does.

The decode GEMV also reads the first chunk of its weights before the wait, but only while a CUDA graph is being
captured (:func:`read_weights_early`): in a captured decode step or prefill no kernel writes a weight, while an eager
call may follow the very copy that wrote one (``load_state_dict``). That choice is a runtime argument of the kernel,
so both kinds of launch share one compiled kernel.

``KERNEL_PYTORCH_PDL=0`` turns it off (the A/B switch of benchmarks/decode.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
from torch._library.triton import is_wrap_triton_enabled
from torch._subclasses.fake_tensor import is_fake

from kernel_pytorch.ops import triton_utils as tu
from kernel_pytorch.ops.triton_utils import tl

__all__ = ["ENABLED", "pdl_arguments", "read_weights_early", "wait_for_previous_grid"]

ENABLED = os.environ.get("KERNEL_PYTORCH_PDL", "1") != "0"

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton before 3.4, or none: PDL is never on, so the kernels never reach these names
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def _device_supports_pdl(device_index: int) -> bool:
    """sm_90 or newer on CUDA (not ROCm), with a Triton whose launcher takes ``launch_pdl``."""
    if gdc_wait is None or torch.version.hip is not None:
        return False
    from triton.backends.nvidia.compiler import CUDAOptions
    fields = {field.name for field in dataclasses.fields(CUDAOptions)}
    return "launch_pdl" in fields and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_arguments(tensor: torch.Tensor) -> dict:
    """The keyword arguments of a launch for ``tensor`` of a kernel that calls :func:`wait_for_previous_grid`
    (``PDL``): with PDL (module docstring), ``PDL=True`` and Triton's ``launch_pdl=True``; otherwise ``PDL=False``
    alone. (Without Triton there is no ``gdc_wait`` and no device supports PDL.)"""
    on = (ENABLED and tensor.is_cuda and not is_fake(tensor) and not is_wrap_triton_enabled()
          and _device_supports_pdl(tensor.get_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def read_weights_early(launch: dict) -> bool:
    """Whether a launch with :func:`pdl_arguments`' ``launch`` may read weights before its wait: with PDL, under
    CUDA-graph capture only."""
    return launch["PDL"] and torch.cuda.is_current_stream_capturing()


@tu.jit
def wait_for_previous_grid(PDL: tl.constexpr):
    """In a kernel launched with :func:`pdl_arguments`, before it reads anything the grid before may write (anything
    but weights) or writes anything: wait for that grid, then let the next launch start (module docstring).
    Nothing with ``PDL`` off."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
