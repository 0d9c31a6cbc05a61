"""Activation offloading (kernel_pytorch/memory/activation_offload.py).

On the CPU the hooks pass tensors through (exact); the copy path is exercised with CPU -> CPU
"offloading" (``device="cpu"``, or ``_Offloader(source="cpu", target="cpu", pin=False)``), and the CUDA
stream and event logic with stand-ins that log what is asked of them. ``pytest -m gpu`` runs the CUDA
path itself.
"""

from __future__ import annotations

import contextlib
import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernel_pytorch.memory import (
    OffloadActivations,
    OffloadStats,
    activation_offload_stats,
    install_activation_offload,
    offload_activations,
    remove_activation_offload,
)
from kernel_pytorch.memory.activation_offload import _Offloaded, _Offloader
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

from .conftest import rel_err, twin
from .triton_interpreter import cuda_device

# Linear(256) -> GELU -> Linear(256) on a (64, 256) batch saves three 64 KiB activations (the input,
# GELU's input, the second linear's input) and one parameter view (the second weight, transposed).
ACTIVATION_BYTES = 64 * 256 * 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))


def _x() -> torch.Tensor:
    return torch.randn(64, 256, generator=torch.Generator().manual_seed(1))


def _lm() -> LlamaStyleLM:
    torch.manual_seed(0)
    return LlamaStyleLM(LlamaStyleConfig.tiny(n_layers=3)).train()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))


def _assert_same_gradients(model: nn.Module, reference: nn.Module) -> None:
    pairs = zip(model.named_parameters(), reference.named_parameters(), strict=True)
    for (name, p), (_, q) in pairs:
        assert torch.equal(p.grad, q.grad), name


# -- CPU: pass-through ------------------------------------------------------------------------------


def test_cpu_tensors_pass_through_and_gradients_are_exact():
    model = _lm()
    reference = twin(model)
    wrapped = OffloadActivations(model, min_bytes=0)

    loss = wrapped(_tokens()).square().mean()
    loss.backward()
    expected = reference(_tokens()).square().mean()
    expected.backward()

    assert torch.equal(loss, expected)
    _assert_same_gradients(model, reference)
    assert wrapped.stats.offloaded_tensors == 0 and wrapped.stats.restored_tensors == 0
    assert wrapped.stats.kept_tensors > 0


def test_pack_returns_the_very_tensor_it_keeps():
    offloader = _Offloader(min_bytes=0)  # default source: CUDA devices only
    t = torch.randn(512, 512)
    assert offloader.pack(t) is t
    assert offloader.unpack(t) is t


# -- the copy path, CPU -> CPU -----------------------------------------------------------------------


def test_offload_round_trips_values_and_strides():
    offloader = _Offloader(min_bytes=1024, source="cpu", target="cpu", pin=False)
    t = torch.randn(64, 32).t()  # a transposed (non-contiguous) tensor
    original = t.clone()

    packed = offloader.pack(t)
    assert isinstance(packed, _Offloaded)
    assert packed.copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    t.add_(1)  # what was packed is a copy, not a reference
    first, second = offloader.unpack(packed), offloader.unpack(packed)

    assert torch.equal(first, original) and torch.equal(second, original)
    assert first.stride() == original.stride()
    # Every unpack gets its own tensor: a backward that modified one would not touch the next.
    assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    assert offloader.stats == OffloadStats(offloaded_tensors=1, offloaded_bytes=64 * 32 * 4,
                                           restored_tensors=2, restored_bytes=2 * 64 * 32 * 4)


def test_views_with_gaps_stay_so_their_strides_survive():
    """k sliced out of a fused qkv output has gaps; a dense copy would come back with other strides,
    which a compiled backward rejects (it asserts the strides it saved)."""
    offloader = _Offloader(min_bytes=0, source="cpu", target="cpu", pin=False)
    qkv = torch.randn(4, 128, 3 * 64)
    k = qkv[..., 64:128]
    assert offloader.pack(k) is k
    assert isinstance(offloader.pack(qkv), _Offloaded)
    assert (offloader.stats.offloaded_tensors, offloader.stats.kept_tensors) == (1, 1)


def test_threshold_and_parameters_decide_what_moves():
    offloader = _Offloader(min_bytes=4096, source="cpu", target="cpu", pin=False)
    at_threshold, below = torch.randn(1024), torch.randn(1023)
    weight = nn.Parameter(torch.randn(64, 64))

    assert isinstance(offloader.pack(at_threshold), _Offloaded)
    assert offloader.pack(below) is below
    assert offloader.pack(weight) is weight
    view = weight.t()
    assert offloader.pack(view) is view  # linear saves weight.t(): offloading it frees nothing
    assert (offloader.stats.offloaded_tensors, offloader.stats.kept_tensors) == (1, 3)


def test_offload_path_gives_the_same_gradients_and_counts_bytes():
    model, reference = _mlp(), _mlp()
    with offload_activations(min_bytes=ACTIVATION_BYTES, device="cpu") as stats:
        out = model(_x())
    out.square().sum().backward()
    reference(_x()).square().sum().backward()

    _assert_same_gradients(model, reference)
    assert (stats.offloaded_tensors, stats.offloaded_bytes) == (3, 3 * ACTIVATION_BYTES)
    assert (stats.restored_tensors, stats.restored_bytes) == (3, 3 * ACTIVATION_BYTES)
    assert stats.kept_tensors == 1  # the transposed weight
    assert "3 tensors" in stats.describe()


def test_offload_path_on_a_transformer_with_retained_graph():
    model = _lm()
    reference = twin(model)
    wrapped = OffloadActivations(model, min_bytes=1024, device="cpu")

    loss = F.cross_entropy(wrapped(_tokens()).flatten(0, 1), _tokens().flatten())
    loss.backward(retain_graph=True)
    loss.backward()  # unpacks every offloaded tensor a second time
    expected = F.cross_entropy(reference(_tokens()).flatten(0, 1), _tokens().flatten())
    expected.backward(retain_graph=True)
    expected.backward()

    assert torch.equal(loss, expected)
    _assert_same_gradients(model, reference)
    assert wrapped.stats.offloaded_tensors > 0
    assert wrapped.stats.restored_tensors == 2 * wrapped.stats.offloaded_tensors
    assert wrapped.stats.kept_tensors > 0  # per-row norm statistics are under 1 KiB


def test_offload_path_around_a_compiled_module():
    model, reference = _mlp(), _mlp()
    wrapped = OffloadActivations(torch.compile(model, backend="aot_eager"), min_bytes=0, device="cpu")
    wrapped(_x()).square().sum().backward()
    reference(_x()).square().sum().backward()
    # The compiled graph's saved tensors went through the hooks: the same three activations.
    assert wrapped.stats.offloaded_tensors == 3
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) < 1e-6


# -- the wrapper -------------------------------------------------------------------------------------


def test_wrapper_keeps_state_dict_keys_and_loads_both_ways():
    model = _lm()
    plain_keys = list(model.state_dict())
    wrapped = OffloadActivations(model)
    assert list(wrapped.state_dict()) == plain_keys
    assert [n for n, _ in wrapped.named_parameters()] == [f"module.{k}" for k in plain_keys]

    other = _lm()
    with torch.no_grad():
        other.embed.weight.add_(1)
    wrapped.load_state_dict(other.state_dict())  # strict
    assert torch.equal(model.embed.weight, other.embed.weight)
    fresh = LlamaStyleLM(model.config)
    fresh.load_state_dict(wrapped.state_dict())
    assert torch.equal(fresh.embed.weight, other.embed.weight)

    # Nested: the wrapper's own name stays, the 'module.' inside it does not.
    parent = nn.Sequential(nn.Linear(4, 4), OffloadActivations(nn.Linear(4, 4)))
    assert list(parent.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    parent.load_state_dict(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).state_dict())


def test_wrapper_never_offloads_its_parameters_and_can_be_copied():
    wrapped = OffloadActivations(_mlp(), min_bytes=0, device="cpu")
    wrapped(_x()).sum().backward()
    assert (wrapped.stats.offloaded_tensors, wrapped.stats.kept_tensors) == (3, 1)

    clone = copy.deepcopy(wrapped)
    clone.stats.reset()
    clone(_x()).sum().backward()
    assert clone.stats.offloaded_tensors == 3 and wrapped.stats.offloaded_tensors == 3


# -- in place, around the model's call ---------------------------------------------------------------


def test_install_in_place_offloads_and_remove_gives_the_call_back():
    model, reference = _mlp(), _mlp()
    keys = list(model.state_dict())
    stats = install_activation_offload(model, min_bytes=0, device="cpu")
    assert type(model) is nn.Sequential and list(model.state_dict()) == keys  # nothing wrapped
    assert activation_offload_stats(model) is stats

    model(_x()).square().sum().backward()
    reference(_x()).square().sum().backward()
    _assert_same_gradients(model, reference)
    # The three activations, not the parameters (nor the transposed weight, a view of one).
    assert (stats.offloaded_tensors, stats.restored_tensors, stats.kept_tensors) == (3, 3, 1)

    again = install_activation_offload(model, min_bytes=0, device="cpu")  # replaces, never nests
    assert model._compiled_call_impl.inner is None and again is not stats
    assert remove_activation_offload(model) and model._compiled_call_impl is None
    assert not remove_activation_offload(model) and activation_offload_stats(model) is None
    model(_x()).square().sum().backward()
    assert again.offloaded_tensors == 0


def test_install_goes_around_a_compiled_call_and_remove_restores_it():
    model, reference = _mlp(), _mlp()
    model.compile(backend="aot_eager")
    compiled = model._compiled_call_impl
    stats = install_activation_offload(model, min_bytes=0, device="cpu")
    assert model._compiled_call_impl.inner is compiled

    model(_x()).square().sum().backward()
    reference(_x()).square().sum().backward()
    assert stats.offloaded_tensors == 3  # what the compiled graph saves went through the hooks
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) < 1e-6
    remove_activation_offload(model)
    assert model._compiled_call_impl is compiled


def test_tensors_saved_while_a_backend_compiles_stay_and_are_not_counted(monkeypatch):
    # A dynamo backend verifying its graph on real tensors (kernel_pytorch's does) is not a forward of
    # the model: what it saves is neither moved nor counted.
    offloader = _Offloader(min_bytes=0, source="cpu", target="cpu", pin=False)
    t = torch.randn(64)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert offloader.pack(t) is t
    assert offloader.stats == OffloadStats()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert isinstance(offloader.pack(t), _Offloaded)


@pytest.mark.parametrize("call, argument", [
    (lambda: offload_activations(min_bytes=-1).__enter__(), "min_bytes"),
    (lambda: offload_activations(min_bytes=1.5).__enter__(), "min_bytes"),
    (lambda: offload_activations(device="gpu7").__enter__(), "device"),
    (lambda: OffloadActivations(_mlp(), min_bytes=-1), "min_bytes"),
    (lambda: install_activation_offload(_mlp(), min_bytes=-2), "min_bytes"),
])
def test_bad_arguments_are_named(call, argument):
    with pytest.raises(ValueError, match=f"^{argument}: "):
        call()


@pytest.mark.parametrize("call, argument", [
    (lambda: OffloadActivations("model"), "module"),
    (lambda: install_activation_offload("model"), "model"),
])
def test_what_is_not_a_module_is_a_type_error(call, argument):
    with pytest.raises(TypeError, match=f"^{argument}: expected an nn.Module, got str"):
        call()


# -- CUDA bookkeeping, with fake events --------------------------------------------------------------


class _FakeEvent:
    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done


class _FakeStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def _in_flight(offloader: _Offloader, done: list[bool], stream: _FakeStream) -> list[_Offloaded]:
    handles = [_Offloaded(torch.zeros(1), torch.device("cuda"), _FakeEvent(d), torch.ones(1), stream)
               for d in done]
    offloader._in_flight.extend(weakref.ref(h) for h in handles)
    return handles


def test_finished_copies_release_their_device_tensors_without_waiting():
    offloader, stream = _Offloader(), _FakeStream()
    handles = _in_flight(offloader, [True, True, False, True], stream)
    offloader._release_copied(keep=4)
    # The first two finished; the third is pending, so the fourth (later on the same stream) is kept
    # for the next look.
    assert [h.original is None for h in handles] == [True, True, False, False]
    assert stream.waited == [] and len(offloader._in_flight) == 2


def test_too_many_pending_copies_make_the_stream_wait_for_the_oldest():
    offloader, stream = _Offloader(), _FakeStream()
    handles = _in_flight(offloader, [False] * 6, stream)
    offloader._release_copied(keep=4)
    assert [h.original is None for h in handles] == [True, True, False, False, False, False]
    assert stream.waited == [handles[0].event, handles[1].event]
    offloader._release_copied(keep=0)  # the end of the forward
    assert all(h.original is None for h in handles) and len(stream.waited) == 6


class _SimulatedCuda:
    """Stand-ins for torch.cuda's streams and events that log what the CUDA path asks of them."""

    def __init__(self):
        self.log: list[tuple] = []
        self.current = self.Stream(name="current")

    def Stream(self, device=None, name="side"):
        cuda = self

        class Stream:
            def __init__(self):
                self.name = name

            def wait_stream(self, other):
                cuda.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                cuda.log.append(("wait_event", self.name))

        return Stream()

    def Event(self):
        cuda = self

        class Event:
            def record(self, stream):
                cuda.log.append(("record", stream.name))

            def query(self):
                return False

        return Event()

    def current_stream(self, device=None):
        return self.current

    def stream(self, stream):
        self.log.append(("use", stream.name))
        return contextlib.nullcontext()


def test_simulated_cuda_path_orders_streams_and_events(monkeypatch):
    cuda = _SimulatedCuda()
    for name in ("Stream", "Event", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: cuda.log.append(("record_stream", s.name)))
    offloader = _Offloader(min_bytes=0, pin=False)
    t = torch.randn(32, 48)

    handle = offloader._pack_cuda(t)
    # The side stream waits for the tensor's producer, copies, records the copy's event; the device
    # tensor is held meanwhile.
    assert cuda.log == [("wait_stream", "side", "current"), ("use", "side"), ("record", "side")]
    assert handle.original is t and torch.equal(handle.copy, t)
    offloader._release_copied(keep=0)  # the end of the forward: the producing stream waits, t is dropped
    assert cuda.log[-1] == ("wait_event", "current") and handle.original is None

    restored = offloader._unpack_cuda(handle)
    # Copied back on the side stream; the current stream waits for it and owns the result.
    assert cuda.log[-3:] == [("use", "side"), ("wait_stream", "current", "side"), ("record_stream", "current")]
    assert torch.equal(restored, t)


def test_unpack_hands_back_a_device_tensor_still_held():
    offloader = _Offloader()
    held = torch.randn(4)
    handle = _Offloaded(torch.zeros(4), torch.device("cuda"), _FakeEvent(False), held, _FakeStream())
    assert offloader.unpack(handle) is held


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.fixture
def cuda() -> torch.device:
    return cuda_device()


def _deep_mlp(device: torch.device, width: int = 2048, depth: int = 8) -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*layers).to(device)


@pytest.mark.gpu
def test_gpu_gradients_equal_with_offload(cuda):
    model = _deep_mlp(cuda, width=1024, depth=4)
    reference = twin(model)
    x = torch.randn(4096, 1024, device=cuda)
    wrapped = OffloadActivations(model, min_bytes=1 << 20)

    loss = wrapped(x).square().mean()
    loss.backward()
    expected = reference(x).square().mean()
    expected.backward()

    assert rel_err(loss, expected) < 1e-6
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) < 1e-6, name
    assert wrapped.stats.offloaded_tensors >= 8  # each linear's input and each GELU's input, 16 MiB each
    assert wrapped.stats.restored_tensors == wrapped.stats.offloaded_tensors


@pytest.mark.gpu
def test_gpu_peak_memory_is_lower_with_offload(cuda):
    # 16 x (Linear 2048 + GELU) on an (8192, 2048) float32 batch: 64 MiB per activation, 32 saved (2 GiB)
    # against 256 MiB of weights and the 64 MiB input.
    model = _deep_mlp(cuda, depth=16)
    x = torch.randn(8192, 2048, device=cuda)

    def forward_peak(module: nn.Module) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = module(x).square().mean()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return peak

    forward_peak(model)  # warm-up: cuBLAS workspaces
    plain = forward_peak(model)
    offloaded = forward_peak(OffloadActivations(model, min_bytes=1 << 20))
    # Expected about 2.4 GiB against 0.8 GiB: with offloading only the activations being computed and
    # at most MAX_PENDING_COPIES + 1 whose copy is in flight stay on the GPU.
    assert offloaded < 0.6 * plain, (plain, offloaded)


def test_a_tensor_needed_before_its_copy_finished_comes_back_resident_and_is_counted():
    # On a GPU the backward can need a tensor whose copy to the host is not confirmed yet: the device
    # tensor, still held, goes back (no transfer), counted as resident, not restored.
    offloader = _Offloader(source="cpu", target="cpu", pin=False)
    tensor = torch.randn(64, 32)
    handle = _Offloaded(tensor.clone(), tensor.device, event=None, original=tensor)
    assert offloader.unpack(handle) is tensor
    stats = offloader.stats
    assert (stats.resident_tensors, stats.restored_tensors) == (1, 0)
    assert "1 still resident" in stats.describe()
