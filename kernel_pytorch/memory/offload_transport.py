"""Where the offloaded optimizer's copies run. ``_CudaTransport`` is the real one: two side streams on one
CUDA device, gradients to pinned host blocks (D2H) and parameters back (H2D). ``_SyncTransport`` runs the
same call sequence on CPU tensors with synchronous copies, so the optimizer's logic is tested without a
GPU."""

from __future__ import annotations

import mmap
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from kernel_pytorch.errors import HardwareUnavailableError
from kernel_pytorch.memory.pinned_host import _aligned, _host_block

__all__: list[str] = []  # package-private: offloaded_optimizer.py imports the transports by name

# gpu_fraction="auto" leaves 10% of the GPU free after the measured peak: the peak of later steps can
# differ (allocator fragmentation, other batch shapes), and an out-of-memory error costs a whole run.
_AUTO_MARGIN_FRACTION = 0.10


class _Transport:
    """What the optimizer needs from the device: pinned blocks, asynchronous copies, ordering."""

    def pin(self, numel: int, dtype: torch.dtype) -> Tensor: ...
    def unpin(self, block: Tensor) -> None: ...
    def to_host(self, grad: Tensor, host: Tensor) -> Any: ...        # returns a handle for wait_host
    def wait_host(self, handle: Any) -> None: ...                  # the host waits for one to_host
    def device_waits(self, handle: Any) -> None: ...               # the current stream waits for it
    def begin_step(self) -> None: ...
    def to_device(self, param: Tensor, host: Tensor) -> None: ...
    def end_step(self) -> None: ...
    def synchronize(self) -> None: ...
    def headroom_bytes(self) -> int: ...


def _unregister_host_memory(ptr: int, device: torch.device) -> None:
    # Copies still reading or writing the block must end before its pages are unpinned.
    torch.cuda.synchronize(device)
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister failed with cudaError {err}")


class _CudaTransport(_Transport):
    """Two side streams on one CUDA device: ``d2h`` for gradients, ``h2d`` for parameters."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._finalizers: dict[int, weakref.finalize] = {}

    @classmethod
    def for_params(cls, params: Sequence[Tensor]) -> _CudaTransport:
        """The transport of ``params``' GPU; a clear error unless they all live on one CUDA device."""
        if not torch.cuda.is_available():
            raise HardwareUnavailableError(
                "OffloadedOptimizer needs a CUDA GPU, and torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); use torch.optim.AdamW on this machine")
        devices = sorted({str(p.device) for p in params})
        if any(not d.startswith("cuda") for d in devices):
            raise HardwareUnavailableError(
                f"OffloadedOptimizer needs the parameters on a CUDA GPU, found them on {devices}: "
                "move the model first (model.cuda()), then build the optimizer")
        if len(devices) != 1:
            raise HardwareUnavailableError(
                f"OffloadedOptimizer handles the parameters of one GPU, found {devices}: "
                "build one optimizer per device")
        return cls(torch.device(devices[0]))

    def pin(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A CPU tensor of exactly ``numel`` elements in page-locked memory: ``_host_block``'s mapping,
        registered whole with cudaHostRegister (flag 1, cudaHostRegisterPortable, as in
        ``torch.cuda._pin_memory_utils``) from the storage's first byte, so ``is_pinned()`` is true for
        the block and its views; unregistered when the returned tensor is collected or ``unpin`` is
        called, and always before its memory can be freed (views only keep the storage)."""
        block = _host_block(numel, dtype)
        if numel == 0:
            return block
        ptr = block.data_ptr()
        span = _aligned(block.nbytes, mmap.PAGESIZE)
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, span, 1))
        if err != 0:
            raise RuntimeError(
                f"cudaHostRegister of {span} bytes failed with cudaError {err}: the host may be out of "
                "lockable memory (check `ulimit -l` and other pinned allocations)")
        finalizer = weakref.finalize(block, _unregister_host_memory, ptr, self.device)
        # At interpreter exit the process releases the pages anyway; CUDA may already be torn down.
        finalizer.atexit = False
        self._finalizers[block.data_ptr()] = finalizer
        return block

    def unpin(self, block: Tensor) -> None:
        finalizer = self._finalizers.pop(block.data_ptr(), None)
        if finalizer is not None:
            finalizer()

    def to_host(self, grad: Tensor, host: Tensor) -> torch.cuda.Event:
        # The gradient was produced on the current stream (autograd sets it for the hook).
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            host.copy_(grad, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        # The caching allocator must not hand the gradient's memory out again before the copy read it
        # (zero_grad(set_to_none=True) may drop it first).
        grad.record_stream(self.d2h)
        return event

    def wait_host(self, handle: torch.cuda.Event) -> None:
        handle.synchronize()

    def device_waits(self, handle: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(handle)

    def begin_step(self) -> None:
        # Parameter copies must not overwrite weights that the backward still reads.
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))

    def to_device(self, param: Tensor, host: Tensor) -> None:
        with torch.cuda.stream(self.h2d):
            param.detach().copy_(host, non_blocking=True)

    def end_step(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.h2d)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def headroom_bytes(self) -> int:
        """GPU memory a training step has never needed: free now, minus what the step's peak took on
        top of what is reserved now (``max_memory_reserved`` since start or the last peak reset),
        minus ``_AUTO_MARGIN_FRACTION`` of the total."""
        free, total = torch.cuda.mem_get_info(self.device)
        peak_extra = torch.cuda.max_memory_reserved(self.device) - torch.cuda.memory_reserved(self.device)
        return max(0, free - peak_extra - int(_AUTO_MARGIN_FRACTION * total))


class _SyncTransport(_Transport):
    """The CUDA transport's calls on CPU tensors, done synchronously: lets the optimizer's bookkeeping
    (hooks, accumulation, clipping, partition, state dicts) run and be tested without a GPU. Counts
    the copies so tests can tell which path ran."""

    def __init__(self, headroom: int = 0):
        self.headroom = headroom
        self.copies_to_host = 0
        self.copies_to_device = 0
        self.bytes_to_device = 0
        self.pinned_blocks: list[Tensor] = []

    def pin(self, numel: int, dtype: torch.dtype) -> Tensor:
        block = _host_block(numel, dtype)  # the CUDA transport's memory, unregistered
        self.pinned_blocks.append(block)
        return block

    def unpin(self, block: Tensor) -> None:
        self.pinned_blocks = [b for b in self.pinned_blocks if b is not block]

    def to_host(self, grad: Tensor, host: Tensor) -> None:
        self.copies_to_host += 1
        host.copy_(grad)

    def wait_host(self, handle: Any) -> None:
        return None

    def device_waits(self, handle: Any) -> None:
        return None

    def begin_step(self) -> None:
        return None

    def to_device(self, param: Tensor, host: Tensor) -> None:
        self.copies_to_device += 1
        self.bytes_to_device += host.numel() * host.element_size()
        param.detach().copy_(host)

    def end_step(self) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def headroom_bytes(self) -> int:
        return self.headroom
