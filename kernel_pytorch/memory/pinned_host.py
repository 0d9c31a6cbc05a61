"""The offloaded optimizer's pinned host memory: one block per kind (master, ``exp_avg``, ``exp_avg_sq``, and
the gradient landing buffer per parameter dtype), each a CPU tensor at the start of its own anonymous memory
mapping, with every parameter's view carved at a 64-byte boundary.

The transport (offload_transport.py) registers each block with ``cudaHostRegister``
(``torch.cuda.cudart()``). PyTorch's caching host allocator (``pin_memory=True``) rounds each allocation up
to a power of two, which would cost up to 2x the states' size; registration pins exactly the bytes needed
(rounded up to whole pages). The block's storage starts at the registered address, which is the one
address ``Tensor.is_pinned()`` asks CUDA about, so the blocks and their views report ``is_pinned()``
truthfully (PyTorch refuses copies of unpinned host memory during CUDA graph capture). Otherwise
``copy_(..., non_blocking=True)`` does not consult ``is_pinned()``: it issues ``cudaMemcpyAsync`` on
the tensor's own address (asynchronous for registered memory) and records events only for blocks of
its caching host allocator, so the ordering of every copy against the host's reads
and writes of these blocks is the transport's own (events, stream waits, a synchronize before
unregistering). The available host memory (host_memory.py) is checked before allocating.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kernel_pytorch.memory.host_memory import _check_host_memory

if TYPE_CHECKING:
    from kernel_pytorch.memory.offload_transport import _Transport

__all__ = ["pinned_bytes_for"]

# Each parameter's view starts on a 64-byte boundary: a cache line and an AVX-512 vector, so the CPU
# kernels never split a vector load across parameters; costs < 64 bytes per parameter and kind.
_ALIGN_BYTES = 64


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
