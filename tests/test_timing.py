"""kernel_pytorch.timing: candidates are timed interleaved and keep their best round (CUDA events are
replaced by a scripted clock here, CUDA-graph capture by stand-ins; the GPU tests time real kernels and
capture real graphs)."""

from __future__ import annotations

import pytest
import torch

from kernel_pytorch import timing

from .triton_interpreter import cuda_device


def test_candidates_are_interleaved_and_keep_their_best_round(monkeypatch):
    # cuDNN's first round is slow (clocks rising), as measured once on the H100: 1.42 then 1.165 ms.
    scripted = {"cudnn": [1.42, 1.165, 1.17], "flash": [1.20, 1.21, 1.19]}
    calls, order = {name: 0 for name in scripted}, []

    def fake_median(fn, warmup, runs):
        name = fn()
        order.append(name)
        calls[name] += 1
        return scripted[name][calls[name] - 1]

    monkeypatch.setattr(timing, "median_cuda_ms", fake_median)
    warmed = []
    candidates = {name: (lambda name=name: (warmed.append(name), name)[1]) for name in scripted}
    best = timing.fastest_cuda_ms(candidates, rounds=3, warmup=2)
    assert best == {"cudnn": 1.165, "flash": 1.19}
    assert order == ["cudnn", "flash"] * 3
    assert warmed[:4] == ["cudnn", "cudnn", "flash", "flash"]  # every candidate warm before round one


# ------------------------------------------------------------------------------- CUDA-graph GPU time

class _Replayed:
    """Stands in for a captured CUDA graph: replay() says whose it is, for the scripted clock."""

    def __init__(self, name: str):
        self.name = name

    def replay(self) -> str:
        return self.name


def test_graph_timer_checks_its_arguments_before_touching_the_gpu():
    step = {"a": lambda: None}
    with pytest.raises(ValueError, match="no candidates"):
        timing.fastest_cuda_graph_ms({})
    for bad in ({"rounds": 0}, {"warmup": 0}, {"runs": -1}, {"calls_per_graph": 0}, {"calls_per_graph": 2.5}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
            timing.fastest_cuda_graph_ms(step, **bad)


def test_graph_timer_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        timing.fastest_cuda_graph_ms({"a": lambda: None})


def test_graph_timer_divides_replays_by_the_calls_captured_and_keeps_the_best_round(monkeypatch):
    scripted = {"bf16": [8.0, 6.4, 7.2], "fp8": [4.0, 4.8, 3.2]}  # ms per replay of 8 calls
    calls, order, captured = {name: 0 for name in scripted}, [], {}

    def fake_median(fn, warmup, runs):
        name = fn()
        order.append(name)
        calls[name] += 1
        return scripted[name][calls[name] - 1]

    def fake_capture(candidates, warmup, calls_per_graph):
        captured.update(names=list(candidates), warmup=warmup, calls=calls_per_graph)
        return {name: _Replayed(name) for name in candidates}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "captured_calls", fake_capture)
    monkeypatch.setattr(timing, "median_cuda_ms", fake_median)
    timed = timing.fastest_cuda_graph_ms({"bf16": lambda: None, "fp8": lambda: None}, warmup=3, calls_per_graph=8)
    assert timed.ms == {"bf16": 0.8, "fp8": 0.4}
    assert timed.method == timing.GRAPH_TIME and timed.fallback is None and timed.describe() == "GPU time (CUDA graph)"
    assert order == ["bf16", "fp8"] * 3  # interleaved rounds
    assert captured == {"names": ["bf16", "fp8"], "warmup": 3, "calls": 8}


def test_graph_timer_captures_a_call_per_copy_of_a_rotating_candidate(monkeypatch):
    captured = {}

    def fake_capture(candidates, warmup, calls_per_graph):
        captured["calls"] = calls_per_graph
        return {name: _Replayed(name) for name in candidates}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "captured_calls", fake_capture)
    monkeypatch.setattr(timing, "median_cuda_ms", lambda fn, warmup, runs: 13.0)  # ms per replay
    copies = list(range(13))
    timed = timing.fastest_cuda_graph_ms({"a": timing.rotating(lambda c: c, copies), "b": lambda: None}, rounds=1)
    assert captured["calls"] == 13 and timed.ms == {"a": 1.0, "b": 1.0}  # each graph 13 calls, the time per call
    timing.fastest_cuda_graph_ms({"a": timing.rotating(lambda c: c, copies[:2])}, rounds=1, calls_per_graph=8)
    assert captured["calls"] == 8  # fewer copies than calls: the calls asked for


def test_graph_timer_falls_back_to_per_call_timing_when_capture_fails(monkeypatch):
    def failing_capture(candidates, warmup, calls_per_graph):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors might "
                           "be asynchronously reported at some other API call")

    per_call = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing, "captured_calls", failing_capture)
    monkeypatch.setattr(timing, "median_cuda_ms", lambda fn, warmup, runs: (per_call.append(fn()), 1.5)[1])
    timed = timing.fastest_cuda_graph_ms({"a": lambda: "a", "b": lambda: "b"}, rounds=2)
    assert timed.ms == {"a": 1.5, "b": 1.5} and per_call == ["a", "b", "a", "b"]  # every candidate per call
    assert timed.method == timing.PER_CALL
    assert timed.fallback == ("CUDA-graph capture failed (RuntimeError: CUDA error: operation not permitted when "
                              "stream is capturing)")
    assert timed.describe().startswith("per call, CUDA-graph capture failed")


@pytest.mark.gpu
def test_gpu_graph_time_leaves_out_the_host_time_of_many_small_launches():
    device = cuda_device()
    x = torch.zeros(1, device=device)

    def many_launches():
        for _ in range(64):
            x.add_(1)

    timed = timing.fastest_cuda_graph_ms({"launches": many_launches})
    per_call = timing.fastest_cuda_ms({"launches": many_launches})
    assert timed.method == timing.GRAPH_TIME, timed.fallback
    # 64 launches of ~5 us of host time each against ~2 us of GPU time each: replayed, the host is gone.
    assert 0 < timed.ms["launches"] < 0.7 * per_call["launches"], (timed.ms, per_call)


@pytest.mark.gpu
def test_gpu_graph_timer_falls_back_on_a_host_sync():
    device = cuda_device()
    x = torch.ones(1024, device=device)
    timed = timing.fastest_cuda_graph_ms({"sum": lambda: x.sum(), "item": lambda: x.sum().item()})
    assert timed.method == timing.PER_CALL and "CUDA-graph capture failed" in timed.fallback, timed
    assert set(timed.ms) == {"sum", "item"} and all(ms > 0 for ms in timed.ms.values())
    x.add_(1)  # the GPU still works after the failed capture
    assert float(x.sum()) == 2048.0
    assert torch.randn(4, device=device).isfinite().all()  # and so does its random number generator


def test_timings_say_which_candidate_won_and_in_microseconds():
    timings = timing.Timings({"cuBLAS": 0.0156, "gemv": 0.0042}, timing.GRAPH_TIME)
    assert timings.faster("gemv", "cuBLAS") and not timings.faster("cuBLAS", "gemv")
    assert not timings.faster("untimed", "gemv") and timings.faster("gemv", "untimed")
    assert timings.in_microseconds() == "cuBLAS 15.6 us, gemv 4.2 us"


def test_median_ms_off_cuda_times_each_call_on_the_host_clock():
    import time

    calls = []

    def sleep_2ms():
        calls.append(1)
        time.sleep(0.002)

    ms = timing.median_ms(sleep_2ms, torch.device("cpu"), warmup=1, runs=3)
    assert len(calls) == 4 and ms >= 2.0  # the warm-up untimed, then the median of three calls that each slept 2 ms


def test_weight_copies_read_over_twice_the_l2_and_rotating_calls_take_them_in_turn(monkeypatch):
    class _Properties:
        L2_cache_size = 50 * 2**20

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Properties())
    made = []
    copies = timing.weight_copies(lambda: made.append(len(made)) or made[-1], 8 * 2**20, torch.device("cuda"))
    assert copies == list(range(13))  # ceil(100 MB / 8 MB)
    assert len(timing.weight_copies(lambda: 0, 60 * 2**20, torch.device("cuda"))) == 2
    assert len(timing.weight_copies(lambda: 0, 300 * 2**20, torch.device("cuda"))) == 1  # a 7B gate/up: itself
    seen = []
    call = timing.rotating(seen.append, ["a", "b", "c"])
    for _ in range(5):
        call()
    assert seen == ["a", "b", "c", "a", "b"]
