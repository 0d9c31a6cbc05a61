"""Where the baselines of ``benchmarks/variable_shapes.py`` spend a request: a per-shape cost, or the kernels?

    python benchmarks/diagnose_variable_shapes.py [--requests N] [--out DIR]

Same model and requests as ``variable_shapes.py`` (BERT-base, bf16, batch 1..32 x length 16..512, seeded). For
eager and ``torch.compile``, each with PyTorch's default SDPA backends and with cuDNN attention turned off
(``torch.backends.cuda.enable_cudnn_sdp(False)``): seconds per request over ``--requests`` requests of shapes not
seen before (first pass), then over the same requests again (second pass: every shape seen). A first pass much
slower than the second is a cost paid once per shape. ``torch.compile`` is warmed up on the ten requests after
them first. Also: which SDPA backend PyTorch picks for one request's attention call (``torch._fused_sdp_choice``),
and the ten host-side ops that took the most time in an eager first pass (``torch.profiler``).

Prints a line per case and writes ``diagnose_variable_shapes.json`` and a PNG of the seconds per request.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import environment, save_figure, write_result  # noqa: E402
from benchmarks.variable_shapes import (Setup, build_model, cudnn_attention, make_requests, make_setup,  # noqa: E402
                                       serve)

_WARM_UP = 10  # requests compile warms up on (after the timed ones): enough for it to make the sizes dynamic


def seconds_per_request(model: Any, requests: list[dict[str, torch.Tensor]], s: Setup) -> float:
    return round(serve(model, requests, s)[0] / len(requests), 5)


def case(name: str, cudnn: bool, requests: list, warm: list, s: Setup) -> dict[str, Any]:
    """First and second pass of one provider with cuDNN attention on or off."""
    torch._dynamo.reset()
    with cudnn_attention(cudnn):
        model = build_model(s)
        if name == "torch.compile":
            model = torch.compile(model)
            serve(model, warm, s)
        result = {"provider": name, "cudnn_sdp": cudnn,
                  "first_pass_s_per_request": seconds_per_request(model, requests, s),
                  "second_pass_s_per_request": seconds_per_request(model, requests, s)}
    print(result, flush=True)
    return result


def sdpa_choice(s: Setup) -> dict[str, str]:
    """The backend PyTorch's dispatch picks for BERT's attention call at batch 8 x 300 tokens, with and without
    the all-ones padding mask transformers may pass."""
    from torch.nn.attention import SDPBackend

    q = torch.randn(8, s.heads, 300, s.hidden // s.heads, device="cuda", dtype=s.dtype)
    mask = torch.zeros(8, 1, 1, 300, device="cuda", dtype=s.dtype)
    return {label: SDPBackend(torch._fused_sdp_choice(q, q, q, attn_mask=m)).name
            for label, m in (("no mask", None), ("additive mask (B, 1, 1, L)", mask))}


def host_ops(requests: list, s: Setup) -> list[dict[str, Any]]:
    """The ten ops with the most host time over an eager first pass of ``requests``."""
    model = build_model(s)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        serve(model, requests, s)
    events = sorted(profile.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return [{"op": e.key, "calls": e.count, "self_host_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in events]


def plot(payload: dict[str, Any], path: Path) -> None:
    """Milliseconds per request per case: shapes seen for the first time, and again."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = payload["cases"]
    names = [f"{c['provider']}\ncuDNN attention {'on' if c['cudnn_sdp'] else 'off'}" for c in cases]
    fig, ax = plt.subplots(figsize=(8, 4))
    for offset, key, label in ((-0.2, "first_pass_s_per_request", "shapes seen for the first time"),
                               (0.2, "second_pass_s_per_request", "the same shapes again")):
        values = [c[key] * 1e3 for c in cases]
        bars = ax.bar([i + offset for i in range(len(cases))], values, width=0.4, label=label)
        for bar, value in zip(bars, values):
            ax.annotate(f"{value:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(range(len(cases)), names, fontsize=7)
    ax.set_ylabel("ms per request", fontsize=8)
    ax.legend(fontsize=7)
    fig.suptitle(f"BERT-base, {payload['requests_per_pass']} requests of random shape per pass, "
                 f"{payload['environment']['device']}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100, help="requests per pass (default 100)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args(argv)
    s = make_setup(argparse.Namespace(device="cuda", quick=False, requests=None, max_batch=None, max_length=None))
    everything = make_requests(s)
    chunks = [everything[i * args.requests:(i + 1) * args.requests] for i in range(5)]
    warm = everything[5 * args.requests:5 * args.requests + _WARM_UP]
    payload: dict[str, Any] = {"environment": environment(), "requests_per_pass": args.requests,
                               "sdpa_choice": sdpa_choice(s)}
    print(payload["sdpa_choice"], flush=True)
    # each case gets shapes of its own: a shape another case ran may be cached already
    payload["cases"] = [case(name, cudnn, chunk, warm, s) for (name, cudnn), chunk in
                        zip((("eager", True), ("eager", False), ("torch.compile", True), ("torch.compile", False)),
                            chunks)]
    payload["eager_host_ops"] = host_ops(chunks[4][:20], s)
    for op in payload["eager_host_ops"]:
        print(op, flush=True)
    write_result("diagnose_variable_shapes", payload, Path(args.out))
    plot(payload, Path(args.out) / "diagnose_variable_shapes.png")


if __name__ == "__main__":
    main()
