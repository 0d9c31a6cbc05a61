"""Variable request shapes: a BERT-base encoder answering requests of random batch size and length, eager against
``torch.compile``, ``torch.compile(dynamic=True)`` and ``kernel_pytorch.optimize(model, shape_buckets="auto")``.

    python benchmarks/variable_shapes.py [--quick | --device cpu] [--requests N] [--max-batch B] [--max-length L]
                                         [--providers ...] [--serve-all] [--out DIR]

The model is transformers' ``BertModel`` built from a config (no downloads): 12 layers, hidden 768, 12 heads, ffn
3072, its default (SDPA) attention, bf16 on the GPU, eval mode, every call under ``torch.no_grad()``. The requests
(seeded): batch sizes uniform in 1..32, lengths uniform in 16..512, token ids random, an attention mask of ones;
2,000 of them by default. ``--quick``: 2 layers and 300 requests; ``--device cpu``: a smoke run of the whole flow on
a tiny fp32 model and 20 requests (``torch.compile`` with the ``eager`` backend, TorchDynamo alone, and ``optimize``'s
reduce-overhead provider without compiling, to stay within seconds), not a measurement.

Providers, in this order by default (the fastest measured first, so that the others can be cut short): ``optimize
(shape_buckets, fine ladder, cuda_graphs)`` (batch sizes at powers of two and their halfway points, lengths in steps
of 16, every bucket captured at optimize: ``fine_ladder_options``); ``optimize (shape_buckets, split_batch,
cuda_graphs)`` (batch sizes at powers of two, a batch between them padded or split among smaller buckets by the
warm-up's times of every bucket, lengths in steps of 16: ``split_batch_options``); ``torch.compile (cuDNN attention
off)``; ``torch.compile``; ``optimize (shape_buckets, cuda_graphs)`` (each bucket replayed from a CUDA graph of its
own, ``shape_buckets={"cuda_graphs": True}``); ``optimize (shape_buckets)`` (the default compile: Inductor on a GPU);
``eager (cuDNN attention off)``; ``torch.compile (dynamic=True)``; ``optimize (shape_buckets, reduce-overhead)``
(Inductor's CUDA graphs); ``eager``. On the H100 PyTorch's SDPA picks cuDNN attention, which builds a plan for every
new shape (``diagnose_variable_shapes.py``); the two "cuDNN attention off" baselines run with
``torch.backends.cuda.enable_cudnn_sdp(False)``. ``--second-pass``: each provider serves its requests again, every
shape seen.

Each provider runs in a process of its own with empty Inductor and Triton caches (``--in-process``: all in this
one, for the CPU smoke run). In one process the providers changed each other's numbers: cuDNN's plans cached for a
shape by one baseline served the next, and a ``torch.compile`` with cuDNN attention on reused, from Inductor's
cache, the graph compiled with it off (SDPA's backend is chosen when the graph is traced).

Each provider gets a fresh model (same seed). Warm-up, timed apart (``warm_up_s``): one request of each distinct
(batch, length) bucket of ``shape_buckets="auto"`` that the requests reach, the first such request, so that every
provider has compiled what the timed pass needs (``torch.compile`` recompiles for new sizes until it generalizes
them; a bucket compiles once). Then all the requests in order, synchronized once at the end: ``total_s``,
``requests_per_s``, ``tokens_per_s`` (real tokens: batch x length, padding not counted). A provider whose timed
pass is still running when the fastest finished provider had served every request cannot be the fastest: it stops
there (``stopped``, ``requests_served``; its rates are over the requests it served), which keeps a full run within
one call of the GPU machine (in the run of results/variable_shapes.json the slow baselines used the call up).
``setup_s`` is
``optimize``'s own time (its padding check, first capture and verification). For the optimize providers: the
buckets the timed pass hit (calls, real and padded elements) and its padding waste (padding / real elements).

The target (issue 27): the best optimize provider's requests/s >= 1.5x the best of the three default baselines;
the second target line also counts the cuDNN-off ones.
Writes ``--out``/variable_shapes.json (``_quick``, ``_cpu``) and a PNG of requests/s and warm-up time per provider.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import (save_figure, scaled_run_args, scaled_run_parser, synchronize,  # noqa: E402
                                write_final_result, write_result)
from kernel_pytorch.features.shape_buckets.ladder import (auto_batch_buckets, auto_length_buckets,  # noqa: E402
                                                          bucket_for)

EAGER, COMPILE, COMPILE_DYNAMIC = "eager", "torch.compile", "torch.compile (dynamic=True)"
OURS, OURS_GRAPHS = "optimize (shape_buckets)", "optimize (shape_buckets, reduce-overhead)"
OURS_BUCKET_GRAPHS = "optimize (shape_buckets, cuda_graphs)"
OURS_FINE_GRAPHS = "optimize (shape_buckets, fine ladder, cuda_graphs)"
OURS_SPLIT_GRAPHS = "optimize (shape_buckets, split_batch, cuda_graphs)"
# PyTorch's SDPA picks cuDNN attention on the H100, which builds a plan per new shape (~5 ms an attention call,
# benchmarks/results/diagnose_variable_shapes.json): these baselines turn it off, as a user who knows may.
EAGER_NO_CUDNN, COMPILE_NO_CUDNN = "eager (cuDNN attention off)", "torch.compile (cuDNN attention off)"
PROVIDERS = (OURS_FINE_GRAPHS, OURS_SPLIT_GRAPHS, COMPILE_NO_CUDNN, COMPILE, OURS_BUCKET_GRAPHS, OURS, EAGER_NO_CUDNN,
             COMPILE_DYNAMIC, OURS_GRAPHS, EAGER)
BASELINES = (EAGER, COMPILE, COMPILE_DYNAMIC)  # the target: what a user gets with PyTorch's defaults
TUNED_BASELINES = (*BASELINES, EAGER_NO_CUDNN, COMPILE_NO_CUDNN)


def fine_ladder_options(s: Setup) -> dict[str, Any]:
    """Batch sizes at powers of two and their halfway points, lengths in steps of 16, every bucket captured at
    optimize: about a sixth of padding for this benchmark's requests instead of half with the auto ladders, at the
    price of ~10x the buckets, which only graphs captured ahead of the requests make affordable."""
    batches = sorted({b for p in range(s.max_batch.bit_length()) for b in (2**p, 3 * 2**p // 2)
                      if 1 <= b < s.max_batch} | {s.max_batch})
    lengths = sorted({*range(16, s.max_length + 1, 16), s.max_length})
    return {"shape_buckets": {"batch": batches, "length": lengths, "cuda_graphs": True, "warm_up": True}}


def split_batch_options(s: Setup) -> dict[str, Any]:
    """Batch buckets at powers of two, each batch between them padded or split among smaller buckets as the
    warm-up's times say is faster; lengths in steps of 16."""
    fine = fine_ladder_options(s)["shape_buckets"]
    return {"shape_buckets": {**fine, "batch": "auto", "max_batch": s.max_batch, "split_batch": True}}


# optimize's options per provider (or a function of the setup giving them): shape_buckets="auto" unless given.
OPTIMIZE_OPTIONS = {OURS: {}, OURS_BUCKET_GRAPHS: {"shape_buckets": {"cuda_graphs": True}},
                    OURS_FINE_GRAPHS: fine_ladder_options, OURS_SPLIT_GRAPHS: split_batch_options,
                    OURS_GRAPHS: {"compile": "reduce-overhead"}}
SPEEDUP_TARGET = 1.5  # issue 27: over the best of the baselines


@dataclass(frozen=True)
class Setup:
    """Model size, request distribution and dtype of one run: ``full``, ``quick`` or ``cpu`` (smoke)."""

    scale: str
    device: str
    dtype: torch.dtype
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    requests: int
    max_batch: int
    min_length: int
    max_length: int
    compile_backend: str


def make_setup(args: argparse.Namespace) -> Setup:
    if args.device == "cpu":
        setup = Setup("cpu", "cpu", torch.float32, layers=2, hidden=32, heads=2, ffn=64, vocab=101, requests=20,
                      max_batch=2, min_length=4, max_length=32, compile_backend="eager")
    elif args.quick:
        setup = Setup("quick", "cuda", torch.bfloat16, layers=2, hidden=768, heads=12, ffn=3072, vocab=30522,
                      requests=300, max_batch=32, min_length=16, max_length=512, compile_backend="inductor")
    else:
        setup = Setup("full", "cuda", torch.bfloat16, layers=12, hidden=768, heads=12, ffn=3072, vocab=30522,
                      requests=2000, max_batch=32, min_length=16, max_length=512, compile_backend="inductor")
    changes = {name: value for name, value in (("requests", args.requests), ("max_batch", args.max_batch),
                                              ("max_length", args.max_length)) if value is not None}
    return Setup(**{**setup.__dict__, **changes})


# ---------------------------------------------------------------------------------------------- workload

def build_model(s: Setup) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=s.vocab, hidden_size=s.hidden, num_hidden_layers=s.layers,
                                     num_attention_heads=s.heads, intermediate_size=s.ffn,
                                     max_position_embeddings=s.max_length)
    return transformers.BertModel(config).to(device=s.device, dtype=s.dtype).eval()


def make_requests(s: Setup) -> list[dict[str, torch.Tensor]]:
    """The seeded requests, on the device before any timing."""
    generator = torch.Generator().manual_seed(27)
    requests = []
    for _ in range(s.requests):
        batch = int(torch.randint(1, s.max_batch + 1, (), generator=generator))
        length = int(torch.randint(s.min_length, s.max_length + 1, (), generator=generator))
        ids = torch.randint(0, s.vocab, (batch, length), generator=generator)
        requests.append({"input_ids": ids.to(s.device),
                         "attention_mask": torch.ones(batch, length, dtype=torch.long, device=s.device)})
    return requests


def bucket_of(request: dict[str, torch.Tensor], s: Setup) -> tuple[int, int]:
    """The (batch, length) bucket ``shape_buckets="auto"`` serves ``request`` at."""
    batch, length = request["input_ids"].shape
    return (bucket_for(batch, auto_batch_buckets(s.max_batch)),
            bucket_for(length, auto_length_buckets(s.max_length)))


def warm_up_requests(requests: list[dict[str, torch.Tensor]], s: Setup) -> list[dict[str, torch.Tensor]]:
    """The first request of each distinct bucket the requests reach."""
    first: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for request in requests:
        first.setdefault(bucket_of(request, s), request)
    return list(first.values())


# ---------------------------------------------------------------------------------------------- providers

def apply_provider(provider: str, model: torch.nn.Module, s: Setup, example: dict, result: dict) -> Any:
    if provider in (EAGER, EAGER_NO_CUDNN):
        return model
    if provider in (COMPILE, COMPILE_DYNAMIC, COMPILE_NO_CUDNN):
        result["compile_backend"] = s.compile_backend
        return torch.compile(model, backend=s.compile_backend, dynamic=True if provider == COMPILE_DYNAMIC else None)
    import kernel_pytorch

    extra = OPTIMIZE_OPTIONS[provider]
    options = {"shape_buckets": "auto", **(extra(s) if callable(extra) else extra)}
    if s.device == "cpu":
        options.pop("compile", None)  # Inductor's C++ compile of every bucket would take minutes: the flow only
    result["options"] = options
    with torch.no_grad():
        return kernel_pytorch.optimize(model, example_inputs=example, mode="inference", **options)


def serve(model: Any, requests: list[dict[str, torch.Tensor]], s: Setup,
          limit_s: float | None = None) -> tuple[float, int]:
    """Seconds for the requests in order, synchronized once at the end, and how many were served: all, or those
    issued before the host's clock passed ``limit_s`` (the host runs ahead of the GPU, never behind, so no
    synchronization is needed to know the limit has passed)."""
    synchronize(s.device)
    started = time.perf_counter()
    served = 0
    with torch.no_grad():
        for request in requests:
            if limit_s is not None and time.perf_counter() - started > limit_s:
                break
            model(**request)
            served += 1
    synchronize(s.device)
    return time.perf_counter() - started, served


def bucket_hits(model: Any) -> dict[tuple[int, int | None], tuple[int, int, int]]:
    """(batch, length) -> (calls, real elements, padded elements) so far, from the model's report."""
    import kernel_pytorch

    return {(b.batch, b.length): (b.calls, b.real_elements, b.padded_elements)
            for b in kernel_pytorch.report_of(model).shape_buckets}


def hits_between(before: dict, after: dict) -> list[dict]:
    """The buckets' calls and elements between two ``bucket_hits`` readings."""
    hits = []
    for key, (calls, real, padded) in after.items():
        earlier = before.get(key, (0, 0, 0))
        if calls > earlier[0]:
            hits.append({"batch": key[0], "length": key[1], "calls": calls - earlier[0],
                         "real_elements": real - earlier[1], "padded_elements": padded - earlier[2]})
    return hits


def run_provider(provider: str, s: Setup, requests: list, warm: list, fastest: tuple[str, float] | None = None,
                 second_pass: bool = False) -> dict:
    """Build, set up, warm up, serve the requests (stopping once past ``fastest``: the fastest finished provider
    and its seconds for all of them), then with ``second_pass`` serve the requests it served again (every shape
    seen); errors are recorded, not raised."""
    result: dict[str, Any] = {}
    try:
        with cudnn_attention(provider not in (EAGER_NO_CUDNN, COMPILE_NO_CUDNN)):
            _measure(provider, s, requests, warm, fastest, second_pass, result)
    except Exception as error:  # one provider's failure (out of memory, a compile error) must not end the run
        result["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    _release(s)
    return result


@contextlib.contextmanager
def cudnn_attention(allowed: bool):
    """PyTorch's cuDNN SDPA backend left as it is (``allowed``) or turned off inside; as it was after."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(before and allowed)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def _measure(provider: str, s: Setup, requests: list, warm: list, fastest: tuple[str, float] | None,
             second_pass: bool, result: dict[str, Any]) -> None:
    """:func:`run_provider`'s measurement, into ``result`` (the model goes with this frame)."""
    model = build_model(s)
    started = time.perf_counter()
    model = apply_provider(provider, model, s, requests[0], result)
    result["setup_s"] = round(time.perf_counter() - started, 2)
    result["warm_up_s"] = round(serve(model, warm, s)[0], 2)
    before = bucket_hits(model) if provider in OPTIMIZE_OPTIONS else {}
    total, served = serve(model, requests, s, None if fastest is None else fastest[1])
    tokens = sum(r["input_ids"].numel() for r in requests[:served])
    result.update(total_s=round(total, 3), requests_per_s=round(served / total, 2),
                  tokens_per_s=round(tokens / total, 1))
    if served < len(requests):
        result.update(requests_served=served, stopped=f"slower than {fastest[0]} ({fastest[1]:.1f} s for all "
                                                      f"{len(requests)} requests): stopped after {served}")
    if provider in OPTIMIZE_OPTIONS:
        _add_bucket_summary(result, model, before)
    if second_pass:
        result["second_pass_requests_per_s"] = round(served / serve(model, requests[:served], s)[0], 2)


def run_isolated(provider: str, args: argparse.Namespace, fastest: tuple[str, float] | None) -> dict:
    """:func:`run_provider` in a fresh Python process with empty Inductor and Triton caches (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="variable_shapes_") as scratch:
        result_path = Path(scratch) / "provider.json"
        command = [sys.executable, __file__, "--child", provider, str(result_path), "--device", args.device,
                   *(["--quick"] if args.quick else []), *(["--second-pass"] if args.second_pass else []),
                   *[f"--{name.replace('_', '-')}={getattr(args, name)}" for name in ("requests", "max_batch",
                                                                                    "max_length")
                     if getattr(args, name) is not None],
                   *(["--stop-after", fastest[0], str(fastest[1])] if fastest else [])]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{scratch}/inductor",
               "TRITON_CACHE_DIR": f"{scratch}/triton"}
        child = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if child.returncode != 0 or not result_path.exists():
            last = (child.stdout.strip().splitlines() or ["no output"])[-1]
            return {"error": f"the provider's process exited with status {child.returncode}: {last}"}
        return json.loads(result_path.read_text())


def run_child(args: argparse.Namespace) -> None:
    """The ``--child`` process: one provider's :func:`run_provider`, written to the path given."""
    provider, path = args.child
    s = make_setup(args)
    requests = make_requests(s)
    fastest = (args.stop_after[0], float(args.stop_after[1])) if args.stop_after else None
    result = run_provider(provider, s, requests, warm_up_requests(requests, s), fastest, args.second_pass)
    Path(path).write_text(json.dumps(result))


def fastest_finished(providers: dict[str, dict]) -> tuple[str, float] | None:
    """The provider that served every request fastest so far, and its seconds; None before any did."""
    finished = {name: r["total_s"] for name, r in providers.items() if "total_s" in r and "stopped" not in r}
    if not finished:
        return None
    name = min(finished, key=finished.get)
    return name, finished[name]


def _add_bucket_summary(result: dict, model: Any, before: dict) -> None:
    import kernel_pytorch

    report = kernel_pytorch.report_of(model)
    hits = hits_between(before, bucket_hits(model))
    real = sum(h["real_elements"] for h in hits)
    result.update(buckets=hits, padding_waste=round(sum(h["padded_elements"] for h in hits) / real - 1, 4),
                  graphs=report.graphs, verification=report.verification_line(),
                  notes=[n for n in report.notes if n.startswith("shape buckets")])


def _release(s: Setup) -> None:
    gc.collect()
    torch._dynamo.reset()
    if s.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ targets, plot

def targets(providers: dict) -> list[dict]:
    """The best optimize provider's requests/s over the best baseline's, against SPEEDUP_TARGET."""
    def best(names: tuple[str, ...]) -> str | None:
        rates = {p: providers[p]["requests_per_s"] for p in names if "requests_per_s" in providers.get(p, {})}
        return max(rates, key=rates.get) if rates else None

    def against(baselines: tuple[str, ...], what: str) -> dict:
        ours, baseline = best(tuple(OPTIMIZE_OPTIONS)), best(baselines)
        ratio = (round(providers[ours]["requests_per_s"] / providers[baseline]["requests_per_s"], 3)
                 if ours and baseline else None)
        return {"what": f"optimize(shape_buckets) requests/s >= {SPEEDUP_TARGET}x the best of {what}",
                "provider": ours, "baseline": baseline, "value": ratio, "target": SPEEDUP_TARGET, "unit": "x",
                "meets": None if ratio is None else ratio >= SPEEDUP_TARGET}

    return [against(BASELINES, "eager, torch.compile and torch.compile(dynamic=True)"),
            against(TUNED_BASELINES, "those and eager or torch.compile with cuDNN attention off")]


def summary_lines(payload: dict) -> list[str]:
    lines = []
    for name, r in payload["providers"].items():
        if "requests_per_s" in r:
            waste = f", padding waste {r['padding_waste']:.1%}" if "padding_waste" in r else ""
            stopped = f"; {r['stopped']}" if "stopped" in r else ""
            if "second_pass_requests_per_s" in r:
                stopped += f"; again, every shape seen: {r['second_pass_requests_per_s']} requests/s"
            lines.append(f"{name}: {r['requests_per_s']} requests/s, {r['tokens_per_s']:.0f} tokens/s "
                         f"(warm-up {r['warm_up_s']} s, setup {r['setup_s']} s{waste}{stopped})")
        else:
            lines.append(f"{name}: {r.get('error', 'no time')}")
    for t in payload["targets"]:
        verdict = {True: "meets", False: "MISSED", None: "not measured"}[t["meets"]]
        lines.append(f"target: {t['what']}: {t['value']}x ({t['provider']} vs {t['baseline']}) -> {verdict}")
    return lines


def plot(payload: dict, path: Path) -> None:
    """Requests/s per provider (left) and warm-up seconds (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    providers = payload["providers"]
    names = list(providers)
    second = any("second_pass_requests_per_s" in r for r in providers.values())
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    panels = [(axes[0], "requests_per_s", "requests / s", -0.2 if second else 0.0),
              *([(axes[0], "second_pass_requests_per_s", "requests / s", 0.2)] if second else []),
              (axes[1], "warm_up_s", "warm-up s", 0.0)]
    for ax, key, label, offset in panels:
        values = [providers[p].get(key, 0.0) for p in names]
        colors = ["tab:red" if p in OPTIMIZE_OPTIONS else "tab:grey" for p in names]
        bars = ax.bar([i + offset for i in range(len(names))], values, width=0.4 if offset else 0.8, color=colors,
                      alpha=0.5 if key.startswith("second") else 1.0,
                      label={"requests_per_s": "first pass",
                             "second_pass_requests_per_s": "every shape seen"}.get(key))
        for bar, p in zip(bars, names):
            text = f"{providers[p][key]:g}" if key in providers[p] else "-"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=6)
        ax.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=7)
        ax.set_ylabel(label, fontsize=8)
    if second:
        axes[0].legend(fontsize=7)
    fig.suptitle(f"BERT ({payload['model']['layers']} layers), {payload['requests']} requests of random shape, "
                 f"{payload['environment']['device']} ({payload['scale']})", fontsize=9)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = scaled_run_parser(__doc__, "2 layers, 300 requests")
    parser.add_argument("--requests", type=int, default=None, help="how many requests (default by scale)")
    parser.add_argument("--max-batch", type=int, default=None, help="largest request batch (default 32)")
    parser.add_argument("--max-length", type=int, default=None, help="longest request (default 512)")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--serve-all", action="store_true",
                        help="every provider serves every request (none stops once it cannot be the fastest)")
    parser.add_argument("--second-pass", action="store_true",
                        help="each provider then serves its requests again: every shape seen (caches per shape "
                             "warm, as in a server that has run a while)")
    parser.add_argument("--in-process", action="store_true",
                        help="every provider in this process (they can change each other's numbers: docstring)")
    parser.add_argument("--child", nargs=2, metavar=("PROVIDER", "RESULT_JSON"), help=argparse.SUPPRESS)
    parser.add_argument("--stop-after", nargs=2, metavar=("PROVIDER", "SECONDS"), help=argparse.SUPPRESS)
    args = scaled_run_args(parser, argv)
    return args


def result_name(s: Setup) -> str:
    return "variable_shapes" + {"full": "", "quick": "_quick", "cpu": "_cpu"}[s.scale]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/variable_shapes.py needs a CUDA GPU (or --device cpu for a smoke run)")
    if args.child:
        return run_child(args)
    s = make_setup(args)
    started = time.perf_counter()
    requests = make_requests(s)
    warm = warm_up_requests(requests, s)
    payload: dict[str, Any] = {
        "scale": s.scale, "dtype": str(s.dtype), "requests": len(requests),
        "model": {"name": "BertModel", "layers": s.layers, "hidden": s.hidden, "heads": s.heads, "ffn": s.ffn},
        "request_shapes": {"batch": [1, s.max_batch], "length": [s.min_length, s.max_length]},
        "tokens": sum(r["input_ids"].numel() for r in requests), "warm_up_requests": len(warm),
        "processes": "all providers in one" if args.in_process else "one per provider, caches empty", "providers": {}}
    for provider in args.providers:
        case_started = time.perf_counter()
        fastest = None if args.serve_all else fastest_finished(payload["providers"])
        payload["providers"][provider] = (run_provider(provider, s, requests, warm, fastest, args.second_pass)
                                          if args.in_process else run_isolated(provider, args, fastest))
        shown = {k: v for k, v in payload["providers"][provider].items() if k not in ("buckets", "notes")}
        print(f"{provider} ({time.perf_counter() - case_started:.0f} s): {shown}", flush=True)
        payload["targets"] = targets(payload["providers"])
        write_result(result_name(s), payload, args.out)  # kept up to date if the command is cut off
    payload["targets"] = targets(payload["providers"])
    payload["summary"] = summary_lines(payload)
    payload["seconds"] = round(time.perf_counter() - started, 1)
    write_final_result(result_name(s), payload, args.out, plot)


if __name__ == "__main__":
    main()
