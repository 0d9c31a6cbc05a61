"""kernel_pytorch.timing: candidates are timed interleaved and keep their best round (CUDA events are
replaced by a scripted clock here; the GPU tests time real kernels)."""

from __future__ import annotations

from kernel_pytorch import timing


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
