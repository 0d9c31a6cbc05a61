"""Offloading of saved activations to CPU memory during the forward, and back during the backward.

Autograd keeps the tensors each op needs for its backward ("saved tensors") on the device until the
backward uses them; in training a transformer they are most of the GPU memory. ``offload_activations``
installs ``torch.autograd.graph.saved_tensors_hooks`` that move the large ones to CPU memory:

* **On a CUDA device.** A saved tensor of at least ``min_bytes`` is copied into pinned CPU memory on a
  side stream (one per device) that first waits for the current stream, so the copy sees the finished
  tensor and overlaps the compute that follows. The device tensor is kept referenced until the copy is
  done, so the caching allocator cannot hand its memory to another tensor while the copy still reads
  it: at each pack, tensors whose copy event has completed are dropped; beyond ``MAX_PENDING_COPIES``
  pending copies (and when the forward ends) the current stream is made to wait for the oldest copy's
  event and its tensor is dropped, which bounds the memory held without blocking the host. During the
  backward the tensor is copied back on the side stream (non-blocking) and the current
  stream waits for that copy before using it.
* **On the CPU, or below ``min_bytes``.** The hooks hand the tensor back unchanged: the result is exactly
  that of the model without the wrapper. The same holds for parameters (and views of them), which stay
  in memory anyway, and for tensor subclasses and non-strided layouts.

``device="cpu"`` makes CPU tensors take the offload path (a plain copy into other CPU memory and back):
no memory is saved, it exists to exercise the pack/unpack logic on machines without a GPU.

The memory saved is the device memory of saved tensors nothing else references; the price is PCIe
traffic (twice the offloaded bytes per step) and pinned host memory of the same size.

With ``torch.compile``, keep the hooks outside the compiled code: ``OffloadActivations(torch.compile(m))``
or ``m.compile(); OffloadActivations(m)`` offload the tensors the compiled graph saves, whereas
compiling the wrapper itself splits the graph at the hooks. Blocks under activation checkpointing save
through checkpoint's own hooks, so what they keep (their inputs) is not offloaded when they run eagerly;
in a compiled graph the checkpointed regions are part of the graph, whose saved tensors all go through
the hooks.

``install_activation_offload(model)`` does the same in place, for a model whose call was already routed
through a compiler (``kernel_pytorch.optimize``, ``model.compile()``): the hooks go around that call,
outside the compiled code, and the model keeps its identity, class and ``state_dict``. TorchDynamo
leaves Python saved-tensor hooks out of what it traces (only hooks that are FX graphs are inlined), so
the compiled graph is the same with and without them and AOTAutograd's saved tensors go through them at
run time (checked on CPU with Inductor: one graph, every saved tensor packed, gradients equal).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "DEFAULT_MIN_BYTES",
    "MAX_PENDING_COPIES",
    "OffloadActivations",
    "OffloadStats",
    "activation_offload_stats",
    "install_activation_offload",
    "offload_activations",
    "remove_activation_offload",
]

# Copies to CPU allowed in flight, each holding its device tensor, before the compute stream is made to
# wait for the oldest: a few let a copy overlap the ops after it, more only hold memory. A guess, not
# yet measured on a GPU (torchtune's OffloadActivations uses 5 the same way).
MAX_PENDING_COPIES = 4

# 1 MiB: small saved tensors (norms' per-row statistics, masks) free little memory for the fixed cost
# of a copy each; a real model's activations are far larger. Not yet tuned on a GPU.
DEFAULT_MIN_BYTES = 1 << 20

DeviceLike = str | torch.device | None


@dataclass
class OffloadStats:
    """Counters since the hooks were installed (or ``reset()``); a line for a report via ``describe()``.

    Example::

        with offload_activations() as stats:
            loss = model(x).sum()
        loss.backward()
        print(stats.offloaded_bytes, stats.describe())
    """

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    restored_tensors: int = 0
    restored_bytes: int = 0
    resident_tensors: int = 0
    """Offloaded tensors the backward needed before their copy was confirmed finished: the device tensor,
    still held, is handed back (no transfer). Every offloaded tensor comes back as restored or resident."""
    kept_tensors: int = 0
    """Saved tensors left in place: on another device, under ``min_bytes``, parameters, subclasses."""

    def reset(self) -> None:
        self.offloaded_tensors = self.offloaded_bytes = self.restored_tensors = self.restored_bytes = 0
        self.resident_tensors = self.kept_tensors = 0

    def describe(self) -> str:
        return (f"activation offload: {self.offloaded_tensors} tensors / {self.offloaded_bytes / (1 << 20):.1f} MiB "
                f"to CPU, {self.restored_tensors} restored, {self.resident_tensors} still resident when needed, "
                f"{self.kept_tensors} kept on device")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _is_parameter_like(tensor: torch.Tensor) -> bool:
    # Linear saves ``weight.t()``, a view of the parameter: offloading it would free nothing.
    base = tensor._base if tensor._is_view() else tensor
    return isinstance(tensor, nn.Parameter) or isinstance(base, nn.Parameter)


def _parse_device(device: DeviceLike, argument: str) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{argument}: not a device: {device!r} ({error})") from None


class _Offloaded:
    """What the pack hook returns for an offloaded tensor: its CPU copy and where it came from; on CUDA
    also the copy's event, and the device tensor with the stream it was made on, kept until released."""

    __slots__ = ("__weakref__", "copy", "device", "event", "original", "stream")

    def __init__(self, copy: torch.Tensor, device: torch.device, event: Any = None,
                 original: torch.Tensor | None = None, stream: Any = None):
        self.copy = copy
        self.device = device
        self.event = event
        self.original = original
        self.stream = stream

    def release_if_copied(self) -> bool:
        """Drop the device tensor if its copy has finished (no waiting); True when nothing is held."""
        if self.original is not None and (self.event is None or self.event.query()):
            self.original = None
        return self.original is None

    def release_in_stream_order(self) -> None:
        """Drop the device tensor now, its memory reusable only after the copy: the stream it was made
        on (where the allocator will hand its memory out again) waits for the copy's event. The host
        does not block."""
        if self.original is not None and self.event is not None:
            self.stream.wait_event(self.event)
        self.original = None


class _Offloader:
    """The pack/unpack pair behind ``offload_activations``.

    ``source``: the device whose saved tensors are offloaded (``None``: every CUDA device; a device
    type such as ``"cuda"`` matches every index). ``target``: where the copies go (CPU memory).
    ``pin``: pinned host memory, needed for asynchronous copies from CUDA. ``exclude``: storages never
    offloaded (a module's parameters and buffers).

    Tests use ``_Offloader(source="cpu", target="cpu", pin=False)`` to run the copy logic on CPU tensors.
    """

    def __init__(self, min_bytes: int = DEFAULT_MIN_BYTES, source: DeviceLike = None, target: DeviceLike = "cpu",
                 pin: bool | None = None, stats: OffloadStats | None = None,
                 exclude: frozenset[int] = frozenset()):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes: expected a non-negative int, got {min_bytes!r}")
        self.min_bytes = min_bytes
        self.source = _parse_device(source, "device")
        self.target = _parse_device(target, "target")
        # Pinned memory only helps (and only exists) when a CUDA device is there to copy from.
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.stats = stats if stats is not None else OffloadStats()
        self.exclude = exclude
        self._streams: dict[torch.device, Any] = {}
        # Copies to CPU still reading their device tensor; weak, so a freed graph frees them too.
        self._in_flight: deque[weakref.ref] = deque()

    # -- deciding ------------------------------------------------------------------------------------

    def _from_source(self, tensor: torch.Tensor) -> bool:
        if self.source is None:
            return tensor.device.type == "cuda"
        if self.source.index is None:
            return tensor.device.type == self.source.type
        return tensor.device == self.source

    def should_offload(self, tensor: torch.Tensor) -> bool:
        return (self._from_source(tensor)
                and _nbytes(tensor) >= self.min_bytes
                and tensor.layout == torch.strided
                # Subclasses (DTensor, float8 wrappers...) carry state a plain copy would lose;
                # parameters stay in memory anyway, offloading them would free nothing.
                and type(tensor) is torch.Tensor
                and not _is_parameter_like(tensor)
                # A view with gaps (k and v sliced out of one fused qkv GEMM output) would come back
                # dense, with other strides, and Inductor's compiled backward asserts the strides of what
                # it saved (test_gpu_activation_offload_through_optimize_trains_the_same failed on them with
                # "expected stride ..."). Such views stay on the device.
                and _dense(tensor)
                and tensor.untyped_storage().data_ptr() not in self.exclude)

    # -- the hooks -----------------------------------------------------------------------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        if torch.compiler.is_compiling():
            # A dynamo backend checking its graph on real tensors (kernel_pytorch's verifies each rewrite
            # in training by running forward and backward) is not the model's forward: counting those runs
            # made optimize's first call report several times the bytes a step moves (docs/kernels.md,
            # "Memory wrappers"). Their tensors stay where they are, uncounted.
            return tensor
        if not self.should_offload(tensor):
            self.stats.kept_tensors += 1
            return tensor
        self._release_copied()
        if tensor.device.type == "cuda":
            handle = self._pack_cuda(tensor)
        else:
            handle = _Offloaded(tensor.detach().to(self.target, copy=True), tensor.device)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += _nbytes(tensor)
        return handle

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.original is not None:
            # Its copy to CPU had not been confirmed finished, so the device tensor is still here:
            # hand it back, no transfer needed.
            self.stats.resident_tensors += 1
            return packed.original
        if packed.device.type == "cuda":
            tensor = self._unpack_cuda(packed)
        else:
            tensor = packed.copy.to(packed.device, copy=True)
        self.stats.restored_tensors += 1
        self.stats.restored_bytes += _nbytes(tensor)
        return tensor

    # -- CUDA ----------------------------------------------------------------------------------------

    def _side_stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack_cuda(self, tensor: torch.Tensor) -> _Offloaded:
        # The device tensor stays referenced until its copy is known finished (or the stream that made
        # it waits for the copy): the allocator cannot reuse its memory while the side stream reads it.
        stream = self._side_stream(tensor.device)
        # The tensor was produced on the current stream: the copy must start after it is finished.
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            copy = _empty_host_like(tensor, self.target, self.pin)
            copy.copy_(tensor.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        handle = _Offloaded(copy, tensor.device, event, tensor, torch.cuda.current_stream(tensor.device))
        self._in_flight.append(weakref.ref(handle))
        return handle

    def _unpack_cuda(self, packed: _Offloaded) -> torch.Tensor:
        stream = self._side_stream(packed.device)
        current = torch.cuda.current_stream(packed.device)
        with torch.cuda.stream(stream):
            # Same stream as the copy out, so the copy back is ordered after it (also across unpacks
            # of the same tensor with retain_graph=True).
            tensor = torch.empty_like(packed.copy, device=packed.device)
            tensor.copy_(packed.copy, non_blocking=True)
        current.wait_stream(stream)
        # Allocated on the side stream, used and freed on the current one: tell the allocator.
        tensor.record_stream(current)
        return tensor

    def _release_copied(self, keep: int = MAX_PENDING_COPIES) -> None:
        """Drop the device tensors of finished copies; beyond ``keep`` pending ones, release the oldest
        in stream order."""
        while self._in_flight:
            handle = self._in_flight[0]()
            if handle is not None and not handle.release_if_copied():
                break  # copies finish in stream order: the later ones are pending too
            self._in_flight.popleft()
        while len(self._in_flight) > keep:
            handle = self._in_flight.popleft()()
            if handle is not None:
                handle.release_in_stream_order()

    # -- installing ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def hooks(self) -> Iterator[OffloadStats]:
        try:
            with _eager_saved_tensors_hooks(self.pack, self.unpack):
                yield self.stats
        finally:
            # The forward is over: no device tensor should wait for the backward on the device.
            self._release_copied(keep=0)

    # Streams and in-flight copies belong to one process and one run: a deep copy or pickle of a
    # wrapped model starts without them.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_streams", "_in_flight")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _streams={}, _in_flight=deque())


def _eager_saved_tensors_hooks(pack: Any, unpack: Any) -> Any:
    """``torch.autograd.graph.saved_tensors_hooks(pack, unpack)`` with both hooks hidden from TorchDynamo.

    Autograd calls the hooks from C++; inside a ``torch.compile`` region whose frames dynamo skipped
    (``nn.Sequential(...).compile()``: torch's own frames run eagerly under dynamo's frame callback)
    dynamo would trace each call as a new frame, with graph breaks on every storage pointer read, and
    fold ``torch.compiler.is_compiling()`` to True there (measured on torch 2.13: nothing was offloaded).
    Hidden, they run as plain Python, and ``is_compiling()`` is True only while dynamo compiles.
    """
    return torch.autograd.graph.saved_tensors_hooks(torch._dynamo.disable(pack), torch._dynamo.disable(unpack))


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``empty_like`` keeps ``tensor``'s strides: a copy made with them is then the same layout."""
    return torch.empty_like(tensor, device="meta").stride() == tensor.stride()


def _empty_host_like(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """Uninitialized (optionally pinned) memory with ``tensor``'s size and strides (only dense tensors are
    offloaded, see ``_dense``, so the strides cover exactly its elements); ``empty_like`` cannot pin."""
    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=device, pin_memory=pin)


@contextlib.contextmanager
def offload_activations(min_bytes: int = DEFAULT_MIN_BYTES, device: DeviceLike = None) -> Iterator[OffloadStats]:
    """Within the block, saved tensors of at least ``min_bytes`` on ``device`` are offloaded to CPU
    memory and brought back when the backward needs them (the backward may run after the block).

    Args:
        min_bytes: smaller saved tensors stay where they are (default 1 MiB).
        device: whose saved tensors are offloaded; ``None`` (default): every CUDA device. ``"cpu"``
            exercises the copy path on CPU tensors (testing only, saves nothing).

    Yields the ``OffloadStats`` counters, updated as tensors are packed and unpacked.

    On a CPU-only machine (the default ``device``) nothing is moved and results are exact; see the
    module docstring for what happens on a GPU.

    Example::

        with offload_activations(min_bytes=4 << 20) as stats:
            loss = model(x).sum()
        loss.backward()
        print(stats.describe())
    """
    offloader = _Offloader(min_bytes=min_bytes, source=device)
    with offloader.hooks() as stats:
        yield stats


class OffloadActivations(nn.Module):
    """``module`` whose forward runs under ``offload_activations``; its own parameters and buffers
    are never offloaded.

    The ``state_dict`` keys are ``module``'s own (no ``module.`` prefix), so checkpoints load both
    ways. ``stats`` accumulates across forwards; ``stats.reset()`` clears it.

    Example::

        model = OffloadActivations(model, min_bytes=1 << 20)
        model(x).sum().backward()
        print(model.stats.offloaded_bytes)
    """

    def __init__(self, module: nn.Module, min_bytes: int = DEFAULT_MIN_BYTES, device: DeviceLike = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
        self.module = module
        # One offloader for the wrapper's life: its side streams and in-flight copies span forwards.
        self._offloader = _Offloader(min_bytes=min_bytes, source=device)
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)

    @property
    def stats(self) -> OffloadStats:
        return self._offloader.stats

    @property
    def min_bytes(self) -> int:
        return self._offloader.min_bytes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Storages are read at each call: the module may have moved device since the last one.
        self._offloader.exclude = _state_storages(self.module)
        with self._offloader.hooks():
            return self.module(*args, **kwargs)


def _state_storages(module: nn.Module) -> frozenset[int]:
    return frozenset(t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()])


# --------------------------------------------------------------------------------------------------
# In place, around the model's (compiled) call
# --------------------------------------------------------------------------------------------------


class _OffloadedCall:
    """What ``install_activation_offload`` puts in ``model._compiled_call_impl``: the call found there
    (dynamo's entry after ``optimize`` or ``model.compile()``; the plain ``_call_impl`` otherwise) run
    under the offloader's hooks. ``nn.Module.__call__`` takes this slot before anything else, so the
    hooks sit outside the compiled code."""

    def __init__(self, model: nn.Module, offloader: _Offloader, inner: Any):
        self.model = model
        self.offloader = offloader
        self.inner = inner  # the previous _compiled_call_impl, None for the plain call

    @property
    def stats(self) -> OffloadStats:
        return self.offloader.stats

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self.inner if self.inner is not None else self.model._call_impl
        if not torch.is_grad_enabled():
            return call(*args, **kwargs)  # nothing is saved for backward: no hooks, no per-call cost
        # Storages are read at each call: the model may have moved device since the last one.
        self.offloader.exclude = _state_storages(self.model)
        with self.offloader.hooks():
            return call(*args, **kwargs)


def install_activation_offload(model: nn.Module, min_bytes: int = DEFAULT_MIN_BYTES,
                               device: DeviceLike = None) -> OffloadStats:
    """Offload ``model``'s saved activations in place: every later ``model(...)`` runs under
    ``offload_activations(min_bytes, device)``, its own parameters and buffers excluded. Returns the
    ``OffloadStats`` counters, updated at each call.

    Unlike ``OffloadActivations(model)`` nothing is wrapped: ``model`` keeps its class, identity and
    ``state_dict``. Install after compiling (``kernel_pytorch.optimize`` or ``model.compile()``: the
    hooks go around the compiled call, outside the compiled code); compiling afterwards replaces the
    call and drops the hooks. ``optimize(model, memory={"offload_activations": True})`` calls this for you.

    Example::

        model = kernel_pytorch.optimize(model, example_inputs=(tokens,))
        stats = install_activation_offload(model, min_bytes=4 << 20)
        model(tokens).sum().backward()
        print(stats.describe())
        remove_activation_offload(model)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    remove_activation_offload(model)
    call = _OffloadedCall(model, _Offloader(min_bytes=min_bytes, source=device), model._compiled_call_impl)
    model._compiled_call_impl = call
    return call.stats


def remove_activation_offload(model: nn.Module) -> bool:
    """Undo ``install_activation_offload``: the model's call is what it was before. True when there was
    something to undo.

    Example::

        stats = install_activation_offload(model)
        remove_activation_offload(model)   # True
    """
    call = getattr(model, "_compiled_call_impl", None)
    if not isinstance(call, _OffloadedCall):
        return False
    model._compiled_call_impl = call.inner
    return True


def activation_offload_stats(model: nn.Module) -> OffloadStats | None:
    """The counters of the offload ``install_activation_offload`` (or ``optimize(memory={"offload_activations": ...})``)
    put on ``model``; ``None`` when its activations are not offloaded.

    Example::

        print(activation_offload_stats(model).describe())
    """
    call = getattr(model, "_compiled_call_impl", None)
    while call is not None and not isinstance(call, _OffloadedCall):
        call = getattr(call, "inner", None)  # wrappers outside it (context parallelism)
    return None if call is None else call.stats


# The wrapped module's name; the state_dict hooks hide it so the keys are the module's own.
_PREFIX = "module."


def _strip_prefix(wrapper: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    inner = prefix + _PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is None:
        return
    # Version metadata (modules migrate old checkpoints with it) under the unprefixed names too; the
    # inner module's own entry takes the wrapper's place.
    for key in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
        metadata[prefix[:-1] if key == inner[:-1] else prefix + key[len(inner):]] = metadata.pop(key)


def _add_prefix(wrapper: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any) -> None:
    inner = prefix + _PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is None:
        return
    # Let the inner modules find their version entries (added, the caller's entries stay as they are).
    for key in [k for k in metadata if k == prefix[:-1] or (k.startswith(prefix) and not k.startswith(inner))]:
        metadata.setdefault(inner[:-1] if key == prefix[:-1] else inner + key[len(prefix):], metadata[key])
