"""AdamW whose fp32 master weights and moments live in pinned CPU memory (ZeRO-Offload style).

``OffloadedOptimizer`` is a ``torch.optim.Optimizer``: LR schedulers, ``zero_grad`` and ``state_dict``
work as with ``torch.optim.AdamW``. Each parameter ("offloaded") keeps, in pinned host memory, an fp32
master copy, ``exp_avg`` and ``exp_avg_sq`` (12 bytes per element) plus a landing buffer for its
gradient in the parameter's dtype; the GPU keeps only the parameter and its gradient. Optionally a
prefix of the parameters (``gpu_fraction``) stays "resident": fp32 masters and moments on the GPU,
updated there by ``torch.optim.AdamW(fused=True)``. Both parts use the same math (fp32 masters, fp32
moments), so the split changes speed and memory, not the result.

What overlaps with what, per training step (one CUDA device; "current stream" is the user's):

1. **Backward -> gradient copies.** A ``register_post_accumulate_grad_hook`` on each offloaded parameter
   copies its gradient, as soon as autograd has accumulated it, into the pinned landing buffer on a
   side stream (D2H) that first waits for the current stream. The copies run while backward computes
   the gradients of earlier layers.
2. **Backward tail -> CPU update.** ``step()`` takes the offloaded parameters in the order their
   gradients were copied, in buckets of ``_BUCKET_NUMEL`` elements within one parameter group; for each
   bucket it waits for that bucket's copy events only, then runs the fused multi-threaded CPU AdamW
   (``torch._fused_adamw_``). The first buckets (last layers) are updated while the GPU may still be
   finishing the backward and copying the gradients of the first layers. (With ``max_grad_norm`` the
   clip coefficient needs every gradient first: the host waits for the end of backward once.)
3. **CPU update -> parameter copies.** As soon as a bucket is updated its parameters are copied back
   (H2D) on a second side stream, cast to the parameter dtype (bf16 casting is done on the CPU into the
   landing buffer, which halves the bytes sent), while the CPU updates the next bucket. The resident
   part is updated by fused AdamW on the current stream, launched before the CPU work, so it overlaps
   all of the above.
4. **Next forward.** At the end of ``step()`` the current stream waits for the last parameter copy
   (the simplest correct choice: the optimizer sees parameters, not modules, so it cannot order each
   layer's forward after just that layer's copy). The host returns from ``step()`` without waiting.

Gradient accumulation (several backwards before ``step()``): autograd accumulates into ``p.grad`` on
the GPU as usual, and every backward's hook copies the accumulated gradient again; the copy taken in
the last backward (the one ``step()`` uses) is never older than the others on the same stream, so the
earlier ones are simply overwritten. This costs PCIe bandwidth that is otherwise idle during backward,
and it is the only choice that hides the final copies behind the last backward without being told
the number of micro-batches. ``step()`` checks each gradient against its copy (same tensor, same
version counter): a gradient set by hand, changed in place after backward (``GradScaler.unscale_``,
``torch.nn.utils.clip_grad_norm_``) or never seen by the hook is copied again then, synchronously, so
the update always uses ``p.grad`` as it is when ``step()`` is called. ``self.clip_grad_norm_`` scales
the landed copies on the host instead, so it costs no copy.

Pinned memory: one block per kind (master, ``exp_avg``, ``exp_avg_sq``, and the gradient landing
buffer per parameter dtype), each a CPU tensor at the start of its own anonymous memory mapping,
registered with ``cudaHostRegister`` (``torch.cuda.cudart()``), with every parameter's view carved at a
64-byte boundary. PyTorch's caching host allocator (``pin_memory=True``) rounds each allocation up to a
power of two, which would cost up to 2x the states' size; registration pins exactly the bytes needed
(rounded up to whole pages). The block's storage starts at the registered address, which is the one
address ``Tensor.is_pinned()`` asks CUDA about, so the blocks and their views report ``is_pinned()``
truthfully (PyTorch refuses copies of unpinned host memory during CUDA graph capture). Otherwise
``copy_(..., non_blocking=True)`` does not consult ``is_pinned()``: it issues ``cudaMemcpyAsync`` on
the tensor's own address (asynchronous for registered memory) and records events only for blocks of
its caching host allocator, so the ordering of every copy against the host's reads
and writes of these blocks is the transport's own (events, stream waits, a synchronize before
unregistering). The available host memory (``MemAvailable``) is checked before allocating.

Master weights follow the parameters: if a parameter is written outside the optimizer (loading a model
checkpoint after building the optimizer), its version counter changes and the next ``step()``
re-reads it into the master, unless the master already rounds to it (then the master's extra bits are
kept). ``state_dict()`` has ``torch.optim.AdamW``'s format (per parameter index ``step``,
``exp_avg``, ``exp_avg_sq``, plus ``master_param`` for non-fp32 parameters, which AdamW ignores), so a
checkpoint moves between the two either way.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kernel_pytorch.errors import HardwareUnavailableError

__all__ = ["OffloadedOptimizer", "pinned_bytes_for"]

# A bucket is the unit of "wait for its gradients, update it on the CPU, send it back". Measured on this
# repository's 2-core CPU machine: one torch._fused_adamw_ call costs ~7 us of overhead, while 4M fp32
# elements take milliseconds, so the overhead stays under 1%; a bucket's bf16 gradients (8 MiB) cross
# PCIe Gen5 x16 (~50 GB/s nominal, not measured here) in ~0.2 ms, so the CPU starts long before the last
# gradients land. To be re-tuned on a GPU machine.
_BUCKET_NUMEL = 1 << 22

# Each parameter's view starts on a 64-byte boundary: a cache line and an AVX-512 vector, so the CPU
# kernels never split a vector load across parameters; costs < 64 bytes per parameter and kind.
_ALIGN_BYTES = 64

# torch.nn.utils.clip_grad_norm_ divides by (total_norm + 1e-6); the same constant gives the same
# coefficient bit for bit.
_CLIP_EPS = 1e-6

# gpu_fraction="auto" leaves 10% of the GPU free after the measured peak: the peak of later steps can
# differ (allocator fragmentation, other batch shapes), and an out-of-memory error costs a whole run.
_AUTO_MARGIN_FRACTION = 0.10

# Keys torch.optim.AdamW keeps in every param group: carried with AdamW's values so that state dicts
# match key for key; only amsgrad=False and maximize=False are supported.
_ADAMW_FORMAT_KEYS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


# ----------------------------------------------------------------------------------------------------
# The update math (pure CPU, tested against torch.optim.AdamW)
# ----------------------------------------------------------------------------------------------------


def _host_adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step in place on CPU fp32 tensors (the math of ``torch.optim.AdamW``): increments each
    ``steps`` counter (0-d fp32 tensors), then runs ATen's fused CPU kernel, which splits each tensor
    over the intra-op threads (``torch.get_num_threads()``). ``grads`` must be fp32 like ``params``
    (the kernel refuses mixed dtypes)."""
    if not params:
        return
    # AdamW(fused=True) counts the step before calling the kernel, which reads the new count.
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=False, maximize=False,
    )


def _clip_coefficient(total_norm: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` computed as ``torch.nn.utils`` does."""
    return torch.clamp(max_norm / (total_norm + _CLIP_EPS), max=1.0)


@contextlib.contextmanager
def _cpu_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with ``num_threads`` intra-op threads (restored after); ``None`` keeps torch's."""
    if num_threads is None or num_threads == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------------
# Host memory
# ----------------------------------------------------------------------------------------------------


def _available_host_bytes() -> int:
    """Host memory the kernel can hand out without swapping: ``MemAvailable`` (free + reclaimable
    page cache), or free pages where /proc/meminfo is missing; in a container whose memory cgroup has a
    limit, no more than the room left under it. /proc/meminfo shows the whole machine there, and going
    over the cgroup's limit gets the process killed instead of a MemoryError."""
    available = None
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = _cgroup_room()
    return available if room is None else min(available, room)


# Where the memory cgroup's files are (a module constant so tests can point it at a directory of theirs).
_CGROUP_ROOT = "/sys/fs/cgroup"
# cgroup v1 reports "no limit" as a page-rounded 2**63 - 1.
_NO_LIMIT = 1 << 60

# (limit, usage, memory.stat key of reclaimable page cache) per cgroup version.
_CGROUP_FILES = (("memory.max", "memory.current", "file"),
                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_cache"))


def _cgroup_room() -> int | None:
    """Bytes left under this process's memory cgroup limit (usage minus reclaimable page cache); None
    without a limit or without cgroup files."""
    for limit_file, usage_file, cache_key in _CGROUP_FILES:
        limit_text = _read(os.path.join(_CGROUP_ROOT, limit_file))
        usage_text = _read(os.path.join(_CGROUP_ROOT, usage_file))
        if limit_text is None or usage_text is None:
            continue
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            return None
        stat_file = os.path.join(_CGROUP_ROOT, os.path.dirname(limit_file), "memory.stat")
        cache = _stat_value(_read(stat_file) or "", cache_key)
        return max(0, int(limit_text) - int(usage_text) + cache)
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat_value(stat: str, key: str) -> int:
    for line in stat.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _check_host_memory(needed: int, what: str) -> None:
    available = _available_host_bytes()
    if needed > available:
        raise MemoryError(
            f"OffloadedOptimizer needs {needed} bytes ({needed / 2**30:.2f} GiB) of pinned host memory "
            f"for {what}, but only {available} bytes ({available / 2**30:.2f} GiB) are available "
            "(MemAvailable): keep more of the states on the GPU (gpu_fraction=...) or free host memory")


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def _host_block(numel: int, dtype: torch.dtype) -> Tensor:
    """A zero-filled CPU tensor of ``numel`` elements at the start of its own private anonymous mapping
    of ``numel * itemsize`` bytes rounded up to whole pages: page-aligned, nothing else in its pages, and
    its storage starts where its data starts (``Tensor.is_pinned()`` asks CUDA about the storage's first
    byte, not the tensor's). The mapping lives as long as the storage (the block or any view of it)."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    span = _aligned(numel * dtype.itemsize, mmap.PAGESIZE)
    mapping = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor keeps the mmap object (and so the mapping) alive through the buffer it exports.
    return torch.frombuffer(mapping, dtype=dtype, count=numel)


def _carve(numels: Sequence[int], dtype: torch.dtype) -> tuple[list[int], int]:
    """Offsets (in elements) of consecutive views of ``numels`` in one block, each starting on a
    ``_ALIGN_BYTES`` boundary, and the block's total length."""
    align = max(1, _ALIGN_BYTES // dtype.itemsize)
    offsets, end = [], 0
    for n in numels:
        offsets.append(end)
        end = _aligned(end + n, align)
    return offsets, end


def _host_layout(params: Sequence[Tensor]) -> tuple[tuple[list[int], int], dict[torch.dtype, tuple[dict[int, int], int]]]:
    """Where each parameter's views go: (offsets, length) of the fp32 blocks, and per parameter dtype
    ({parameter index: offset}, length) of its gradient landing block."""
    numels = [p.numel() for p in params]
    grad_layout = {}
    for dtype in sorted({p.dtype for p in params}, key=str):
        members = [i for i, p in enumerate(params) if p.dtype == dtype]
        offsets, length = _carve([numels[i] for i in members], dtype)
        grad_layout[dtype] = (dict(zip(members, offsets)), length)
    return _carve(numels, torch.float32), grad_layout


def _layout_bytes(fp32_len: int, grad_layout: dict[torch.dtype, tuple[dict[int, int], int]]) -> int:
    # master, exp_avg and exp_avg_sq in fp32, plus the landing blocks in the parameters' dtypes.
    return 3 * fp32_len * 4 + sum(length * dtype.itemsize for dtype, (_, length) in grad_layout.items())


def pinned_bytes_for(params: Iterable[Tensor]) -> int:
    """Pinned host bytes ``OffloadedOptimizer(params)`` (``gpu_fraction=0``) allocates, exactly: fp32
    master, ``exp_avg`` and ``exp_avg_sq`` (12 bytes per element) and a gradient landing buffer in each
    parameter's dtype, every view 64-byte aligned. Needs no GPU.

    Example::

        pinned_bytes_for(model.parameters()) / 2**30   # 14.0 bytes per bf16 parameter, in GiB
    """
    params = list(params)
    (_, fp32_len), grad_layout = _host_layout(params)
    return _layout_bytes(fp32_len, grad_layout)


class _HostStore:
    """The pinned blocks of a set of offloaded parameters and each parameter's views into them.

    Blocks: ``master``, ``exp_avg``, ``exp_avg_sq`` (fp32), and ``grad`` per parameter dtype (the
    gradient landing buffer, which for non-fp32 parameters also carries the cast parameter back).
    """

    def __init__(self, params: Sequence[Tensor], transport: _Transport):
        self._transport = transport
        numels = [p.numel() for p in params]
        (fp32_offsets, fp32_len), grad_layout = _host_layout(params)
        self.nbytes = _layout_bytes(fp32_len, grad_layout)
        _check_host_memory(self.nbytes, f"the states of {len(params)} offloaded parameters")
        self._blocks: list[Tensor] = []
        kinds = {kind: self._pin(fp32_len, torch.float32) for kind in ("master", "exp_avg", "exp_avg_sq")}
        grads = {dtype: self._pin(length, dtype) for dtype, (_, length) in grad_layout.items()}
        # One memset per block, instead of one per parameter, starts the moments at zero.
        kinds["exp_avg"].zero_()
        kinds["exp_avg_sq"].zero_()
        self.views: list[dict[str, Tensor]] = []
        for i, p in enumerate(params):
            offset, n = fp32_offsets[i], numels[i]
            views = {kind: block[offset:offset + n].view(p.shape) for kind, block in kinds.items()}
            grad_offset = grad_layout[p.dtype][0][i]
            views["grad"] = grads[p.dtype][grad_offset:grad_offset + n].view(p.shape)
            self.views.append(views)

    def _pin(self, numel: int, dtype: torch.dtype) -> Tensor:
        block = self._transport.pin(numel, dtype)
        self._blocks.append(block)
        return block

    def release(self) -> None:
        """Unpin and drop the blocks (views already handed out keep the memory, unpinned)."""
        for block in self._blocks:
            self._transport.unpin(block)
        self._blocks.clear()


# ----------------------------------------------------------------------------------------------------
# Transports: where copies run. _CudaTransport is the real one; _SyncTransport runs the same call
# sequence on CPU tensors with synchronous copies, so the optimizer's logic is tested without a GPU.
# ----------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------
# Per-parameter records
# ----------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _HostSlot:
    """An offloaded parameter: its pinned views, step counter and the state of its gradient copy."""

    index: int
    group: int
    param: Tensor
    master: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    grad: Tensor
    step: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))
    stepped: bool = False
    param_version: int = -1
    # (weak reference to the gradient tensor copied, its version then) and the copy's handle.
    copied: tuple[weakref.ref, int] | None = None
    handle: Any = None
    # Clip coefficients applied to p.grad by clip_grad_norm_ after the copy was taken.
    scales: list[Tensor] = field(default_factory=list)

    def copy_is_current(self) -> bool:
        grad = self.param.grad
        return (grad is not None and self.copied is not None and self.copied[0]() is grad
                and grad._version == self.copied[1])

    def forget_copy(self) -> None:
        self.copied, self.handle = None, None
        self.scales.clear()

    def state(self) -> dict[str, Tensor]:
        state = {"step": self.step, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.param.dtype != torch.float32:
            state["master_param"] = self.master
        return state


@dataclass(eq=False)
class _DeviceSlot:
    """A resident parameter; ``master`` is what the inner fused AdamW updates: the parameter itself
    when it is fp32, else an fp32 copy on its device."""

    index: int
    group: int
    param: Tensor
    master: Tensor
    param_version: int = -1


def _master_matches(master: Tensor, param: Tensor) -> bool:
    """Whether ``master`` rounds to ``param`` (then it holds the same weights with more bits); compared
    on the master's device, so a host master costs no GPU memory."""
    return master.shape == param.shape and torch.equal(
        master.to(param.dtype), param.detach().to(master.device))


def _device_copy(t: Tensor, device: torch.device) -> Tensor:
    """A new fp32 tensor on ``device`` with ``t``'s values (never an alias, unlike ``Tensor.to``)."""
    out = torch.empty(t.shape, dtype=torch.float32, device=device)
    out.copy_(t)
    return out


def _fused_state(step: float, exp_avg: Tensor, exp_avg_sq: Tensor, device: torch.device) -> dict[str, Tensor]:
    """A parameter's state as ``torch.optim.AdamW(fused=True)`` keeps it: fp32 moments and an fp32 step
    counter, all on the parameter's device."""
    return {"step": torch.tensor(step, dtype=torch.float32, device=device),
            "exp_avg": _device_copy(exp_avg, device), "exp_avg_sq": _device_copy(exp_avg_sq, device)}


def _prefix_within(sizes: Sequence[int], budget: float) -> int:
    """How many leading ``sizes`` fit in ``budget`` together."""
    total = 0
    for count, size in enumerate(sizes):
        if total + size > budget:
            return count
        total += size
    return len(sizes)


def _resident_bytes(p: Tensor) -> int:
    """GPU bytes that making ``p`` resident costs: fp32 moments, and for non-fp32 parameters an fp32
    master and the fp32 gradient the fused kernel reads."""
    return p.numel() * (8 if p.dtype == torch.float32 else 16)


def _scales_to_host(slots: Sequence[_HostSlot]) -> None:
    """Bring the clip coefficients pending on ``slots`` to the CPU, one transfer per coefficient."""
    on_host: dict[int, Tensor] = {}
    for slot in slots:
        for c in slot.scales:
            if id(c) not in on_host:
                on_host[id(c)] = c.to("cpu")
        slot.scales = [on_host[id(c)] for c in slot.scales]


def _buckets(slots: Sequence[_HostSlot], max_numel: int) -> Iterator[list[_HostSlot]]:
    """Consecutive runs of ``slots`` within one parameter group, of at most ``max_numel`` elements
    (or one parameter, if larger)."""
    bucket: list[_HostSlot] = []
    numel = 0
    for slot in slots:
        if bucket and (slot.group != bucket[0].group or numel + slot.param.numel() > max_numel):
            yield bucket
            bucket, numel = [], 0
        bucket.append(slot)
        numel += slot.param.numel()
    if bucket:
        yield bucket


def _validate_hyperparameters(group: dict[str, Any]) -> None:
    lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
    if not lr >= 0.0:
        raise ValueError(f"invalid learning rate {lr}: must be >= 0")
    if not (0.0 <= float(beta1) < 1.0 and 0.0 <= float(beta2) < 1.0):
        raise ValueError(f"invalid betas {group['betas']}: each must be in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"invalid eps {eps}: must be >= 0")
    if not wd >= 0.0:
        raise ValueError(f"invalid weight_decay {wd}: must be >= 0")


def _validate_options(optimizer: str, gpu_fraction: float | str, max_grad_norm: float | None,
                      num_threads: int | None) -> None:
    if not isinstance(optimizer, str) or optimizer.lower() != "adamw":
        raise ValueError(f"optimizer={optimizer!r} is not supported: OffloadedOptimizer implements 'adamw'")
    if gpu_fraction != "auto" and (
            isinstance(gpu_fraction, bool) or not isinstance(gpu_fraction, (int, float))
            or not 0.0 <= gpu_fraction <= 1.0):
        raise ValueError(f"gpu_fraction={gpu_fraction!r}: expected a number in [0, 1] or 'auto'")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: expected None or a number > 0")
    if num_threads is not None and not (isinstance(num_threads, int) and num_threads >= 1):
        raise ValueError(f"num_threads={num_threads!r}: expected None or an integer >= 1")


# ----------------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------------


class OffloadedOptimizer(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments in pinned CPU memory, updated on the CPU while the GPU
    finishes backward; equal to ``torch.optim.AdamW`` (fp32 parameters) within fp32 rounding.

    Args:
        params: parameters or param groups, all on one CUDA device (fp32, bf16 or fp16).
        optimizer: ``"adamw"`` (the only update implemented).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        gpu_fraction: fraction of the parameters, by bytes, whose states stay on the GPU and are updated
            there by ``torch.optim.AdamW(fused=True)``: the longest prefix, in parameter order, whose
            bytes are at most ``gpu_fraction`` of the total. The first parameters are chosen because
            backward produces their gradients last, so their copies would have the least backward to
            hide behind. ``"auto"``: the first step runs fully offloaded; then the prefix whose GPU
            states (8 bytes per element, 16 for non-fp32 parameters) fit in the GPU memory that step
            never needed (free memory minus the step's peak above what is reserved now, minus 10% of
            the GPU) moves to the GPU, and the host blocks shrink to the rest.
        max_grad_norm: clip the global 2-norm of all gradients (GPU and host parts) to this value
            before each update, as ``torch.nn.utils.clip_grad_norm_`` would. The norm is computed on
            the GPU, where every gradient is; resident gradients are scaled there, the copies of
            offloaded ones on the host (their ``p.grad`` is left unscaled: it is about to be zeroed).
        num_threads: intra-op CPU threads for the update (``None``: ``torch.get_num_threads()``).

    Raises:
        RuntimeError (``HardwareUnavailableError``): no CUDA GPU, or parameters not on one CUDA device.
        MemoryError: the pinned blocks would not fit in the available host memory.

    Example::

        model = Model().cuda()
        opt = OffloadedOptimizer(model.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        for x, y in loader:
            loss_fn(model(x), y).backward()   # gradients stream to the host as they are produced
            opt.step()                        # CPU AdamW, parameters stream back to the GPU
            opt.zero_grad()
            sched.step()
        torch.save(opt.state_dict(), "opt.pt")   # loads into torch.optim.AdamW too
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer: str = "adamw",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        gpu_fraction: float | str = 0.0,
        max_grad_norm: float | None = None,
        num_threads: int | None = None,
        *,
        _transport: _Transport | None = None,
    ):
        _validate_options(optimizer, gpu_fraction, max_grad_norm, num_threads)
        self._ready = False
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    **_ADAMW_FORMAT_KEYS}
        super().__init__(params, defaults)
        for group in self.param_groups:
            _validate_hyperparameters(group)
        self._params: list[Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._group_of: list[int] = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        for p in self._params:
            if not p.is_floating_point() or p.is_complex():
                raise ValueError(f"OffloadedOptimizer updates floating-point parameters, got {p.dtype}")
        self._transport = _transport if _transport is not None else _CudaTransport.for_params(self._params)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.num_threads = num_threads
        self.gpu_fraction = gpu_fraction
        self._auto_pending = gpu_fraction == "auto"
        self._closed = False

        sizes = [p.numel() * p.element_size() for p in self._params]
        n_resident = 0 if gpu_fraction == "auto" else _prefix_within(sizes, float(gpu_fraction) * sum(sizes))
        self._device_slots: dict[int, _DeviceSlot] = {}
        self._inner: torch.optim.AdamW | None = None
        self._add_device_slots(range(n_resident), {})
        self._host_store: _HostStore | None = None
        self._host_slots: dict[int, _HostSlot] = {}
        self._build_host_slots(range(n_resident, len(self._params)), carry={})
        # Offloaded gradients in the order their copies were issued (re-issued ones move to the end).
        self._landed: dict[int, _HostSlot] = {}
        self_ref = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(_grad_ready_hook(self_ref, i))
            for i, p in enumerate(self._params) if p.requires_grad]
        self._ready = True

    # --- construction helpers ------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_ready", False):
            raise NotImplementedError(
                "OffloadedOptimizer lays out its pinned memory at construction: pass every param group "
                "to the constructor")
        super().add_param_group(param_group)

    def _add_device_slots(self, indices: Iterable[int], carry: dict[int, dict[str, Tensor]]) -> None:
        """Make ``indices`` resident (with their states from ``carry`` where given) and rebuild the
        inner fused AdamW over every resident master."""
        for i in indices:
            p = self._params[i]
            master = p if p.dtype == torch.float32 else p.detach().float()
            self._device_slots[i] = _DeviceSlot(i, self._group_of[i], p, master, p._version)
        old_state = self._inner.state if self._inner is not None else {}
        if not self._device_slots:
            return
        groups = []
        for gi, group in enumerate(self.param_groups):
            masters = [s.master for s in self._device_slots.values() if s.group == gi]
            if masters:
                groups.append({"params": masters, "_group": gi, **self._hyper(group)})
        self._inner = torch.optim.AdamW(groups, fused=True)
        for slot in self._device_slots.values():
            if slot.master in old_state:
                self._inner.state[slot.master] = old_state[slot.master]
            elif slot.index in carry:
                c = carry[slot.index]
                self._inner.state[slot.master] = _fused_state(
                    float(c["step"]), c["exp_avg"], c["exp_avg_sq"], slot.master.device)
                if slot.master is not slot.param:
                    slot.master.copy_(c["master"])
                self._publish_device(slot)

    def _build_host_slots(self, indices: Iterable[int], carry: dict[int, _HostSlot]) -> None:
        """Lay out one pinned store for ``indices`` and fill each slot: from ``carry`` (an older slot of
        the same parameter) where given, else master = the parameter, moments = 0."""
        indices = list(indices)
        old_store = self._host_store
        self._host_store = _HostStore([self._params[i] for i in indices], self._transport)
        self._host_slots = {}
        for i, views in zip(indices, self._host_store.views):
            p = self._params[i]
            slot = _HostSlot(i, self._group_of[i], p, views["master"], views["exp_avg"], views["exp_avg_sq"],
                             views["grad"])
            old = carry.get(i)
            if old is not None:
                for kind in ("master", "exp_avg", "exp_avg_sq"):
                    getattr(slot, kind).copy_(getattr(old, kind))
                slot.step.copy_(old.step)
                slot.stepped, slot.param_version = old.stepped, old.param_version
            else:
                self._master_from_param(slot)
            self._host_slots[i] = slot
            if slot.stepped:
                self.state[p] = slot.state()
        if old_store is not None:
            old_store.release()

    def _master_from_param(self, slot: _HostSlot) -> None:
        # Cast on the CPU (no fp32 temporary on the GPU), and not through the landing buffer, which may
        # hold this step's gradient.
        slot.master.copy_(slot.param.detach().to("cpu"))
        slot.param_version = slot.param._version

    @staticmethod
    def _hyper(group: dict[str, Any]) -> dict[str, Any]:
        return {"lr": group["lr"], "betas": tuple(group["betas"]), "eps": group["eps"],
                "weight_decay": group["weight_decay"]}

    # --- introspection -------------------------------------------------------------------------------

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory held (states, masters and gradient landing buffers)."""
        return 0 if self._host_store is None else self._host_store.nbytes

    @property
    def resident_fraction(self) -> float:
        """Fraction of the parameter bytes whose states are on the GPU now."""
        total = sum(p.numel() * p.element_size() for p in self._params)
        resident = sum(s.param.numel() * s.param.element_size() for s in self._device_slots.values())
        return resident / total if total else 0.0

    # --- gradients -----------------------------------------------------------------------------------

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        slot = self._host_slots.get(index)
        grad = param.grad
        if self._closed or slot is None or grad is None or grad.is_sparse:
            return
        self._issue_copy(slot, grad)

    def _issue_copy(self, slot: _HostSlot, grad: Tensor) -> None:
        slot.handle = self._transport.to_host(grad, slot.grad)
        slot.copied = (weakref.ref(grad), grad._version)
        slot.scales.clear()
        self._landed.pop(slot.index, None)
        self._landed[slot.index] = slot

    def _grads(self) -> list[Tensor]:
        grads = [p.grad for p in self._params if p.grad is not None]
        for g in grads:
            if g.is_sparse:
                raise RuntimeError("OffloadedOptimizer does not support sparse gradients")
        return grads

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale all gradients so that their global 2-norm is at most ``max_norm``, exactly as
        ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` does (``p.grad`` is scaled in place), and
        return the total norm before clipping (a tensor on the parameters' device). Host copies already
        taken are scaled on the host at ``step()`` instead of being copied again.

        Example::

            loss.backward()
            norm = opt.clip_grad_norm_(1.0)
            opt.step()
        """
        self._check_open()
        grads = self._grads()
        if not grads:
            return torch.tensor(0.0)
        total = torch.nn.utils.get_total_norm(grads)
        coef = _clip_coefficient(total, float(max_norm))
        current = [s for s in self._landed.values() if s.copy_is_current()]
        for slot in current:
            # Scaling p.grad in place must not race the side-stream copy still reading it.
            self._transport.device_waits(slot.handle)
        torch.nn.utils.clip_grads_with_norm_(self._params, float(max_norm), total)
        for slot in current:
            slot.scales.append(coef)
            slot.copied = (slot.copied[0], slot.param.grad._version)
        return total

    # --- the step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter that has a gradient; see the module docstring for what
        overlaps. Returns ``closure()``'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        transport = self._transport
        transport.begin_step()
        self._refresh_masters()
        self._grads()  # rejects sparse gradients before anything is updated
        pending = self._host_order()
        host_coef = None
        if self.max_grad_norm is not None:
            host_coef = self._clip_for_step(self.max_grad_norm)
        self._step_resident()
        if host_coef is not None:
            # The only host-device synchronization the clipping needs: all gradients are in the norm.
            host_coef = host_coef.to("cpu")
        _scales_to_host(pending)
        with _cpu_threads(self.num_threads):
            for bucket in _buckets(pending, _BUCKET_NUMEL):
                self._step_bucket(bucket, host_coef)
        transport.end_step()
        for slot in self._host_slots.values():
            slot.forget_copy()
        self._landed.clear()
        if self._auto_pending:
            self._auto_pending = False
            self._apply_auto_fraction()
        return loss

    def _host_order(self) -> list[_HostSlot]:
        """Offloaded parameters with a gradient, in landing order; gradients with no current copy (set
        by hand, changed after backward, never hooked) are copied now and go last."""
        landed = [s for s in self._landed.values() if s.param.grad is not None and s.copy_is_current()]
        seen = {s.index for s in landed}
        late = [s for s in self._host_slots.values() if s.param.grad is not None and s.index not in seen]
        for slot in late:
            self._issue_copy(slot, slot.param.grad)
        return landed + late

    def _clip_for_step(self, max_norm: float) -> Tensor:
        """Clip coefficient of the global norm (on the GPU); scales the resident gradients there and
        returns the coefficient for the host copies."""
        grads = self._grads()
        total = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
        resident = [s.param for s in self._device_slots.values()]
        torch.nn.utils.clip_grads_with_norm_(resident, max_norm, total)
        return _clip_coefficient(total, max_norm)

    def _step_resident(self) -> None:
        """Launch the fused AdamW of the resident part on the current stream (asynchronous)."""
        if self._inner is None:
            return
        for inner_group in self._inner.param_groups:
            inner_group.update(self._hyper(self.param_groups[inner_group["_group"]]))
        stepped = [s for s in self._device_slots.values() if s.param.grad is not None]
        for slot in stepped:
            if slot.master is not slot.param:
                slot.master.grad = slot.param.grad.float()
        self._inner.step()
        for slot in stepped:
            if slot.master is not slot.param:
                slot.param.detach().copy_(slot.master)
                slot.master.grad = None
                slot.param_version = slot.param._version
            self._publish_device(slot)

    def _step_bucket(self, bucket: list[_HostSlot], host_coef: Tensor | None) -> None:
        """Wait for the bucket's gradient copies, update it on the CPU, send the parameters back."""
        group = self.param_groups[bucket[0].group]
        grads = []
        for slot in bucket:
            self._transport.wait_host(slot.handle)
            # Scale in the gradient's dtype, as the same multiplication on the GPU would round.
            for coef in slot.scales:
                slot.grad.mul_(coef)
            if host_coef is not None:
                slot.grad.mul_(host_coef)
            grads.append(slot.grad if slot.grad.dtype == torch.float32 else slot.grad.float())
        beta1, beta2 = group["betas"]
        _host_adamw_(
            [s.master for s in bucket], grads, [s.exp_avg for s in bucket], [s.exp_avg_sq for s in bucket],
            [s.step for s in bucket], lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
            eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))
        for slot in bucket:
            if slot.grad.dtype == torch.float32:
                source = slot.master
            else:
                # The landing buffer is free again: the cast parameter goes back through it, half the
                # bytes of the fp32 master for bf16.
                slot.grad.copy_(slot.master)
                source = slot.grad
            self._transport.to_device(slot.param, source)
            slot.param_version = slot.param._version
            if not slot.stepped:
                slot.stepped = True
                self.state[slot.param] = slot.state()

    def _refresh_masters(self) -> None:
        """Re-read the masters of parameters written outside the optimizer since its last write."""
        for slot in self._host_slots.values():
            if slot.param._version != slot.param_version:
                if not _master_matches(slot.master, slot.param):
                    self._master_from_param(slot)
                slot.param_version = slot.param._version
        for slot in self._device_slots.values():
            if slot.master is not slot.param and slot.param._version != slot.param_version:
                if not _master_matches(slot.master, slot.param):
                    slot.master.copy_(slot.param.detach())
                slot.param_version = slot.param._version

    def _publish_device(self, slot: _DeviceSlot) -> None:
        inner = self._inner.state.get(slot.master) if self._inner is not None else None
        if not inner:
            return
        state = {"step": inner["step"], "exp_avg": inner["exp_avg"], "exp_avg_sq": inner["exp_avg_sq"]}
        if slot.master is not slot.param:
            state["master_param"] = slot.master
        self.state[slot.param] = state

    # --- gpu_fraction="auto" -------------------------------------------------------------------------

    def _apply_auto_fraction(self) -> None:
        """After the first step: move the longest prefix of offloaded parameters whose GPU states fit in
        the measured headroom to the GPU, and shrink the pinned blocks to the rest."""
        self._transport.synchronize()
        offloaded = sorted(self._host_slots)
        count = _prefix_within([_resident_bytes(self._params[i]) for i in offloaded],
                               self._transport.headroom_bytes())
        if count == 0:
            return
        moving, staying = offloaded[:count], offloaded[count:]
        carry = {}
        for i in moving:
            s = self._host_slots[i]
            if s.stepped:
                carry[i] = {"step": s.step, "exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq, "master": s.master}
        old_slots = dict(self._host_slots)
        self._add_device_slots(moving, carry)
        for i in moving:
            if i not in carry:
                self.state.pop(self._params[i], None)
        try:
            self._build_host_slots(staying, carry=old_slots)
        except MemoryError as err:
            # Shrinking needs the new blocks before the old ones go; without room, keep the old blocks
            # (the moved parameters' views there just stay unused).
            warnings.warn(f"gpu_fraction='auto': pinned blocks not shrunk ({err})", stacklevel=3)
            self._host_slots = {i: old_slots[i] for i in staying}

    # --- state dict ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s format: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"
        [, "master_param"]}}, "param_groups": [...]}``, with ``step`` a CPU fp32 scalar. The moments
        are fp32 tensors that alias the optimizer's memory (CPU for offloaded parameters, GPU for
        resident ones); like AdamW's, they are references: copy them to keep a snapshot.

        Example::

            adamw = torch.optim.AdamW(model.parameters())
            adamw.load_state_dict(opt.state_dict())
        """
        self._check_open()
        state = super().state_dict()
        # In parameter order, as AdamW lists it (ours fills in landing order); "step" on the CPU for every
        # parameter, as AdamW without fused/capturable keeps it (the resident part's fused AdamW keeps it
        # on the GPU; a mix would load into AdamW's foreach path with steps on two devices).
        state["state"] = {i: {**s, "step": s["step"].to("cpu")} for i, s in sorted(state["state"].items())}
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim.AdamW`` (same parameters, same groups).
        Moments are stored in fp32 whatever their saved dtype; a saved ``master_param`` is kept if, at
        the next ``step()``, it rounds to the parameter (load the model before or after), else the
        parameter becomes the master (a stale master, e.g. after AdamW trained on).

        Example::

            opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
        """
        self._check_open()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                             f"this optimizer {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size "
                                 "of optimizer's group")
            for key in ("amsgrad", "maximize"):
                if saved.get(key, False):
                    raise ValueError(f"loaded state dict has {key}=True, which OffloadedOptimizer does not "
                                     "implement")
        self._transport.synchronize()
        id_map = {}
        for group, saved in zip(self.param_groups, saved_groups):
            id_map.update(zip(saved["params"], range(len(id_map), len(id_map) + len(group["params"]))))
            params = group["params"]
            names = group.get("param_names")
            group.clear()
            group.update({k: v for k, v in saved.items() if k != "params"})
            group["params"] = params
            if names is not None and "param_names" not in group:
                group["param_names"] = names
            _validate_hyperparameters(group)
        saved_state = {id_map[k]: v for k, v in state_dict["state"].items() if k in id_map}
        self.state.clear()
        self._landed.clear()
        for i in range(len(self._params)):
            self._load_param_state(i, saved_state.get(i))

    def _load_param_state(self, index: int, saved: dict[str, Any] | None) -> None:
        p = self._params[index]
        if saved:
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                if key in saved and tuple(saved[key].shape) != tuple(p.shape):
                    raise ValueError(f"state of parameter {index}: {key} has shape {tuple(saved[key].shape)}, "
                                     f"the parameter {tuple(p.shape)}")
        # A saved master is taken as is and checked against the parameter at the next step() (version
        # -1 forces it), so it survives whichever of model and optimizer checkpoints is loaded first.
        master_saved = saved.get("master_param") if saved else None
        if index in self._host_slots:
            slot = self._host_slots[index]
            slot.forget_copy()
            if master_saved is not None:
                slot.master.copy_(master_saved)
                slot.param_version = -1
            else:
                self._master_from_param(slot)
            if saved:
                slot.exp_avg.copy_(saved["exp_avg"])
                slot.exp_avg_sq.copy_(saved["exp_avg_sq"])
                slot.step.fill_(float(saved["step"]))
                slot.stepped = True
                self.state[p] = slot.state()
            else:
                slot.exp_avg.zero_()
                slot.exp_avg_sq.zero_()
                slot.step.zero_()
                slot.stepped = False
            return
        slot = self._device_slots[index]
        if slot.master is not slot.param:
            slot.master.copy_(p.detach() if master_saved is None else master_saved)
            slot.param_version = p._version if master_saved is None else -1
        self._inner.state.pop(slot.master, None)
        if saved:
            device = slot.master.device
            self._inner.state[slot.master] = _fused_state(
                float(saved["step"]), saved["exp_avg"], saved["exp_avg_sq"], device)
            self._publish_device(slot)

    # --- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the gradient hooks and unpin the host memory; the optimizer cannot step afterwards."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hook_handles:
            handle.remove()
        self._transport.synchronize()
        if self._host_store is not None:
            self._host_store.release()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("OffloadedOptimizer was closed; build a new one")


def _grad_ready_hook(optimizer_ref: weakref.ref, index: int):
    """The post-accumulate-grad hook of parameter ``index``; holds the optimizer weakly, so the
    parameters do not keep it (and its pinned memory) alive."""

    def hook(param: Tensor) -> None:
        optimizer = optimizer_ref()
        if optimizer is not None:
            optimizer._on_grad_ready(index, param)

    return hook
