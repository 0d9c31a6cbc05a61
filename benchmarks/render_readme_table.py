"""Render the measured results from the benchmark JSON files in benchmarks/results/: ``docs/results.md`` in
full, and the README's short table of headline results.

    python benchmarks/render_readme_table.py [--results DIR] [--readme PATH] [--docs PATH] [--headline] [--write]

docs/results.md has one section per suite file found (e2e.json, attention.json, kernels.json, fp8.json,
block_fusion.json, memory*.json, sparse_attention*.json, ring_attention.json, decode*.json; quick and CPU runs
of the same suites are left out, except memory_quick.json and decode_quick.json), then the tuning sweeps
(tune_*.json). Each section
names the device, date, torch, Triton and cuDNN versions and command of the run it holds, from the file's
``environment`` (and the environments of parts re-measured or run as separate commands), and links the
PNG plot beside the JSON. A missing file is listed as such; a missing key leaves a ``-`` in its cell; a
file whose layout is not understood gets one line saying why, never a crash. The headline table (the
same at the top of docs/results.md and in the README) takes a handful of rows from those files; a row
whose file or key is missing is named under the table instead.

Without ``--write`` it prints docs/results.md (``--headline``: the headline table only). ``--write``
writes docs/results.md whole and replaces what lies between the ``<!-- results:begin -->`` and
``<!-- results:end -->`` lines of the README with the headline table, and nothing else there; a README
without those markers is left as it is, said so, and the exit code is 1.

The one table not read from a JSON file, the design-time baselines (``DESIGN_BASELINES``), is labelled
as such where it is printed: those runs predate the result files.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "results.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
COMMAND = "python benchmarks/render_readme_table.py --write"
# How docs/results.md reaches the result files (the README links to docs/results.md instead).
RESULTS_LINK = "../benchmarks/results/"
_ERROR_CHARS = 70  # an error message in a cell: its start says what failed; the JSON has the line


# --------------------------------------------------------------------------------------------- helpers

def fmt(value: Any, digits: int = 1) -> str:
    """A cell: numbers rounded, booleans yes/no, None '-', text without the characters that break a table."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS - 3] + "..."


def table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(cell if isinstance(cell, str) else fmt(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def env_line(env: dict | None) -> str:
    """'device, date, torch X, Triton Y, cuDNN Z, `command`' (the versions the run recorded)."""
    if not isinstance(env, dict):
        return "environment not recorded"
    date = str(env.get("date", "?"))[:10]
    versions = [f"torch {env.get('torch', '?')}"]
    if env.get("triton"):
        versions.append(f"Triton {env['triton']}")
    if isinstance(env.get("cudnn"), int):
        versions.append(f"cuDNN {cudnn_version(env['cudnn'])}")
    return f"{env.get('device', '?')}, {date}, {', '.join(versions)}, `{env.get('command', '?')}`"


def cudnn_version(number: int) -> str:
    """torch.backends.cudnn.version()'s integer as a version: 91900 -> 9.19.0 (major * 10000 + minor * 100)."""
    return f"{number // 10000}.{number // 100 % 100}.{number % 100}"


def measured_on(env: dict | None) -> str:
    """'device, date' for the headline table."""
    if not isinstance(env, dict):
        return "-"
    return f"{env.get('device', '?')}, {str(env.get('date', '?'))[:10]}"


def union(dicts: Iterable[dict]) -> list[str]:
    """Keys of all ``dicts`` in order of first appearance (providers differ from row to row)."""
    keys: dict[str, None] = {}
    for d in dicts:
        keys.update(dict.fromkeys(d if isinstance(d, dict) else {}))
    return list(keys)


def cell(result: Any, key: str, digits: int = 1) -> str:
    """``result[key]`` formatted, 'error' when the result is an error, '-' when absent."""
    if isinstance(result, dict):
        if key in result:
            return fmt(result[key], digits)
        return "error" if "error" in result else "-"
    if isinstance(result, str):
        return "error" if result.startswith("error") else fmt(result)
    return fmt(result, digits)


def blocks(items: list[str]) -> str:
    """The renderer's items as Markdown blocks, a blank line apart, consecutive bullet lines kept as one list."""
    out: list[str] = []
    for item in items:
        if item.startswith("- ") and out and out[-1].splitlines()[-1].startswith("- "):
            out[-1] += "\n" + item
        else:
            out.append(item)
    return "\n\n".join(out)


def count(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def columns_table(rows: list[dict], columns: list[tuple[str, str, int]]) -> str:
    """A table of ``rows`` with the (key, header, digits) columns that at least one row has."""
    present = [c for c in columns if any(c[0] in r for r in rows)]
    return table([c[1] for c in present], [[fmt(r.get(key), digits) for key, _, digits in present] for r in rows])


# ----------------------------------------------------------------------------------------------- suites

def render_attention(data: dict) -> list[str]:
    rows = data.get("rows", [])
    providers = union(r.get("tflops", {}) for r in rows)
    header = ["head dim", "L", "batch", "causal", "pass", *providers, "optimize / fastest SDPA",
              "same, GPU time"]
    body = [[fmt(r.get("head_dim")), fmt(r.get("length")), fmt(r.get("batch")), fmt(r.get("causal")),
             "fwd+bwd" if r.get("backward") else "fwd", *[cell(r.get("tflops", {}), p) for p in providers],
             fmt(r.get("fraction_of_fastest_kernel"), 2), fmt(r.get("gpu_fraction_of_fastest_kernel"), 2)]
            for r in rows]
    out = ["TFLOP/s of a hand-written attention module and of the SDPA kernels, per shape.", table(header, body)]
    out += _remeasured(data, lambda key: f"hd {key[0]} L {key[1]}" + (" causal" if key[2] else "") +
                       (" fwd+bwd" if key[3] else " fwd"), "rows")
    return out + _note(data)


def _note(data: Any, label: str = "Note") -> list[str]:
    """The ``note`` a results file (or one of its parts) keeps beside its numbers, as a paragraph."""
    note = data.get("note") if isinstance(data, dict) else None
    return [f"{label}: {note}"] if isinstance(note, str) and note else []


def render_sparse(data: dict) -> list[str]:
    rows = data.get("rows", [])
    header = ["mask", "L", "pass", "attended", "optimize ms", "dense baseline", "fastest dense ms", "speedup",
              "same, GPU time", "vs SDPA-flash", "never slower than dense", "target"]
    body = [[r.get("kind"), fmt(r.get("length")), "fwd+bwd" if r.get("backward") else "fwd",
             fmt(r.get("attended_fraction"), 2), cell(r.get("ms", {}), "kernel_pytorch.optimize", 3),
             r.get("dense_baseline", "-"), fmt(r.get("best_dense_ms"), 3), fmt(r.get("speedup_vs_dense"), 2),
             fmt(r.get("gpu_speedup_vs_dense"), 2), fmt(r.get("speedup_vs_dense_flash"), 2),
             fmt(r.get("never_slower_than_dense")), fmt(r.get("target_speedup"))] for r in rows]
    out = ["Masked attention after `optimize` against dense attention (causal for the window, full for the "
           "block-sparse mask); never slower: against that and against the same mask run by the dense kernels.",
           table(header, body)]
    return out + _note(data)


def render_topk(data: dict) -> list[str]:
    rows = data.get("rows", [])
    header = ["budget", "L", "causal blocks kept", "optimize ms", "block choice ms", "best dense causal ms",
              "speedup", "error: random", "error: clustered", "error: heavy blocks"]
    body = [[r.get("budget"), fmt(r.get("length")), fmt(r.get("kept_fraction_of_causal_blocks"), 2),
             cell(r.get("ms", {}), "kernel_pytorch.optimize (top-k)", 3), cell(r.get("ms", {}), "block choice only", 3),
             fmt(r.get("best_dense_causal_ms"), 3), fmt(r.get("speedup_vs_dense_causal"), 2),
             *[cell(r.get("relative_error_vs_dense", {}), k, 3) for k in ("random", "clustered", "heavy blocks")]]
            for r in rows]
    return ["Top-k sparse attention (approximate, inference), forward; errors relative to dense.", table(header, body)]


def _remeasured(data: dict, name: Callable[[Any], str], key: str) -> list[str]:
    lines = []
    for entry in data.get("remeasured", []):
        what = ", ".join(name(item) for item in entry.get(key, []))
        lines.append(f"- re-measured ({what}): {entry.get('why', '')} ({env_line(entry.get('environment'))})")
    return lines


def _kernel_column(provider: str) -> str:
    return "PyTorch op" if provider.startswith("F.") else provider


def render_kernels(data: dict) -> list[str]:
    rows = data.get("rows", [])
    targets = {(t.get("op"), t.get("hidden"), t.get("backward")): t for t in data.get("targets", [])}
    columns = list(dict.fromkeys(_kernel_column(p) for p in union(r.get("results", {}) for r in rows)))
    header = ["op", "pass", "hidden", *columns, "of copy", "vs torch.compile"]
    body = []
    for r in rows:
        by_column = {}
        for provider, result in r.get("results", {}).items():
            text = cell(result, "gpu_gbps")
            by_column[_kernel_column(provider)] = f"{text} ({provider})" if provider.startswith("F.") else text
        target = targets.get((r.get("op"), r.get("hidden"), r.get("backward")), {})
        body.append([fmt(r.get("op")), "bwd" if r.get("backward") else "fwd", fmt(r.get("hidden")),
                     *[by_column.get(c, "-") for c in columns], fmt(target.get("gpu_fraction_of_copy"), 2),
                     fmt(target.get("gpu_vs_compile"), 2)])
    intro = ("GB/s on GPU time (CUDA-graph replays), 16384 rows; 'of copy': kernel_pytorch's share of a device "
             "copy of the same bytes; 'vs torch.compile': its speed over torch.compile of the model's code "
             "(> 1 faster).")
    out = [intro, table(header, body)]
    return out + _remeasured(data, str, "ops")


def render_fp8(data: dict) -> list[str]:
    out = []
    ceilings = data.get("ceilings", {})
    if ceilings.get("results"):
        out += [f"Matmul ceilings at {ceilings.get('m')}^3:",
                table(["matmul", "TFLOP/s", "vs bf16"], [[name, cell(r, "tflops"), cell(r, "vs_bf16", 2)]
                                                         for name, r in ceilings["results"].items()])]
    linear = data.get("linear", {})
    if linear.get("results"):
        shape = f"{linear.get('m')} x {linear.get('k')} x {linear.get('n')}"
        out += [f"Linear forward + backward at {shape}, quantization included:",
                table(["layer", "ms", "TFLOP/s", "GPU ms", "GPU TFLOP/s"],
                      [[name, cell(r, "ms", 3), cell(r, "tflops"), cell(r, "gpu_ms", 3), cell(r, "gpu_tflops")]
                       for name, r in linear["results"].items()])]
        for recipe, t in linear.get("targets", {}).items():
            out.append(f"- {recipe}: {fmt(t.get('speedup'), 3)}x per call, {fmt(t.get('gpu_speedup'), 3)}x GPU time "
                       f"(target {fmt(t.get('need'), 2)}x: {'met' if t.get('meets') else 'missed'} per call)")
        out += _note(linear, "Linear runs")
    numerics = data.get("numerics", {})
    if numerics.get("results"):
        out += ["SQNR against a float64 reference (dB):",
                table(["layer", "output", "grad input", "grad weight"],
                      [[name, cell(r, "output_sqnr_db", 2), cell(r, "grad_input_sqnr_db", 2),
                        cell(r, "grad_weight_sqnr_db", 2)] for name, r in numerics["results"].items()])]
    out += _fp8_sweep(data.get("sweep", []))
    model = data.get("model", {})
    if model.get("results"):
        env = env_line(model.get("environment", data.get("environment")))
        title = (f"Llama-style training step ({model.get('layers')} layers, batch {model.get('batch')} x "
                 f"{model.get('seq')}) through optimize ({env}):")
        out += [title,
                table(["setting", "ms", "vs bf16", "peak GiB", "FP8 layers", "verified", "optimize s"],
                      [[name, cell(r, "ms", 2), cell(r, "speedup", 3), cell(r, "peak_gib", 2), cell(r, "fp8_layers"),
                        cell(r, "verified"), cell(r, "optimize_s")] for name, r in model["results"].items()])]
    producers = data.get("producers", {})
    if producers:
        names = ("bf16", "fp8, amax by the cast", "fp8, amax from the producer")
        out += ["Quantization fused into the producing kernel, forward + backward, GPU ms:",
                table(["producer -> linear", "(M, K, N)", *names, "saved"],
                      [[case, f"({r.get('m')}, {r.get('k')}, {r.get('n')})", *(fmt(r["gpu_ms"].get(n), 4) for n in names),
                        fmt(r.get("fused_saves_ms"), 4)] for case, r in producers.items()])]
    return out


def _fp8_sweep(sweep: list[dict]) -> list[str]:
    """One line per recipe: at how many of the (M, K, N) points FP8 is faster per call."""
    lines = []
    recipes = union(row.get("fp8_wins", {}) for row in sweep)
    for recipe in recipes:
        known = [row["fp8_wins"][recipe] for row in sweep if row.get("fp8_wins", {}).get(recipe) is not None]
        lines.append(f"- sweep: fp8 {recipe} faster per call at {sum(known)} of {len(known)} (M, K, N) points")
    return lines


def render_block_fusion(data: dict) -> list[str]:
    rows: list[tuple[str, dict]] = []
    for r in data.get("launches", []):
        counts = {p: (c.get("kernels") if isinstance(c, dict) else c) for p, c in r.get("counts", {}).items()}
        rows.append((f"GPU kernels per block forward, {r.get('batch')} x {r.get('seq')}", counts))
    for r in data.get("train", []):
        rows.append((f"block forward + backward ms, {r.get('batch')} x {r.get('seq')}", r.get("ms", {})))
    for r in data.get("latency", []):
        rows.append((f"{r.get('layers')}-layer stack inference ms, {r.get('batch')} x {r.get('seq')}", r.get("ms", {})))
    providers = union(values for _, values in rows)
    out = [table(["", *providers], [[what, *[cell(values.get(p), "", 2) if values.get(p) is not None else "-"
                                             for p in providers]] for what, values in rows])]
    for r in data.get("train", []):
        out.append(f"- block step: {fmt(r.get('speedup_vs_compile'), 3)}x torch.compile; horizontal GEMM pass "
                   f"{fmt(r.get('horizontal_gemm_speedup'), 3)}x")
    return out


def render_memory(data: dict) -> list[str]:
    columns = [("case", "case", 1), ("tokens", "tokens", 1), ("tokens_per_step", "tokens per step", 1),
               ("step_ms", "step ms", 2), ("peak_gib", "peak GiB", 3), ("activation_gib", "activations GiB", 3),
               ("optimizer_state_gpu_gib", "optimizer state GPU GiB", 3),
               ("optimizer_state_host_gib", "optimizer state host GiB", 3), ("error", "error", 1)]
    out = []
    for part in ("offload", "checkpointing", "activation_offload"):
        if data.get(part):
            out += [f"{part}:", columns_table(data[part], columns)]
    if data.get("largest"):
        largest = [{**r, "billions": r["parameters"] / 1e9} if isinstance(r.get("parameters"), (int, float)) else r
                   for r in data["largest"]]
        out += ["largest model that trains:", columns_table(largest, [
            ("optimizer", "optimizer", 1), ("n_layers", "layers", 1), ("billions", "parameters (B)", 2),
            ("trained", "trained", 1), ("peak_gib", "peak GiB", 2), ("optimizer_state_host_gib", "host GiB", 2),
            ("error", "error", 1)])]
    out += [f"- {line}" for line in data.get("summary", [])]
    return out


E2E_PARTS = ("train", "train_long", "inference")  # benchmarks/e2e.py's parts, in table order


def render_e2e(data: dict) -> list[str]:
    intro = ("Median ms per training step (forward, loss, backward, fused AdamW) and per inference forward; "
             "'ready s': the provider's setup (optimize: capture, passes, compile, verification) plus its first "
             "call (torch.compile compiles there).")
    out = [intro]
    for name, entry in data.get("models", {}).items():
        info = entry.get("info", {})
        shape = (f"batch {info.get('batch')} x {info.get('seq')}" if "batch" in info
                 else "batch x length per part")
        out.append(f"{name}: {info.get('model', '?')}, {count(info.get('parameters'))} parameters, {shape}, "
                   f"{info.get('dtype', '?')}")
        rows = []
        parts = [part for part in E2E_PARTS if part in entry]
        for part in parts:
            for provider, r in entry.get(part, {}).get("providers", {}).items():
                label = f"{part} ({r['batch']} x {r['seq']})" if "batch" in r else part
                rows.append([label, provider, _ms_or_error(r), cell(r, "items_per_s", 0), cell(r, "tflops"),
                             cell(r, "peak_gib", 2), cell(r, "speedup_vs_eager", 2), cell(r, "speedup_vs_compile", 2),
                             _ready_s(r), _rewrites(r.get("report")),
                             fmt((r.get("report") or {}).get("verified"))])
        unit = f"{info.get('unit', 'items')}/s"
        out.append(table(["part", "provider", "ms", unit, "TFLOP/s", "peak GiB", "vs eager", "vs torch.compile",
                          "ready s", "rewrites", "verified"], rows))
        for part in parts:
            out += _note(entry.get(part), f"{name} {part}")
    if data.get("targets"):
        out += ["Targets; miss ratio = value / target, > 1 is a miss by that factor:",
                table(["target", "provider", "value", "target", "meets", "miss ratio"],
                      [[fmt(t.get("what")), fmt(t.get("provider")), f"{fmt(t.get('value'), 2)} {t.get('unit', '')}",
                        f"{fmt(t.get('target'), 2)} {t.get('unit', '')}",
                        {True: "yes", False: "**no**", None: "not measured"}[t.get("meets")],
                        fmt(t.get("miss_ratio"), 3)] for t in data["targets"]])]
    return out


def _ms_or_error(result: dict) -> str:
    return fmt(result["ms"], 2) if "ms" in result else fmt(result.get("error", "-"))


def _ready_s(result: dict) -> str:
    parts = [result.get("setup_s"), result.get("first_call_s")]
    return fmt(float(sum(parts))) if all(isinstance(p, (int, float)) for p in parts) else "-"


def _rewrites(report: dict | None) -> str:
    if not report:
        return "-"
    per_pass = report.get("rewrites_per_pass", {})
    return ", ".join(f"{name} {count}" for name, count in per_pass.items()) or "none"


def render_decode(data: dict) -> list[str]:
    """Decode tokens/s per sequence and share of the HBM limit per provider and batch; TTFT; warm-up."""
    lines = []
    for model, entry in data.get("models", {}).items():
        providers = entry.get("providers", {})
        batches = sorted({int(b) for p in providers.values() for b in p.get("batches", {})})
        rows = []
        for name, result in providers.items():
            rows.append(_decode_row_cells(name, result, batches, f"{fmt(result.get('warmup_s'))} s"))
            for arm, label in (("with_prefill_graphs", "with"), ("without_prefill_graphs", "without")):
                if isinstance(result.get(arm), dict):  # --prefill-graphs-ab: same process, same compiled graphs
                    rows.append(_decode_row_cells(f"{name}, {label} prefill graphs", result[arm], batches,
                                                  "(same warm-up)"))
        lines += [f"**{model}** ({measured_on(entry.get('environment'))})",
                  table(["provider", "warm-up", *[f"batch {b}: tokens/s per sequence (share of the HBM limit)"
                                                  for b in batches], "TTFT ms (512 / 4096)", "peak at the points"],
                        rows)]
    lines += [f"- {t}" for t in data.get("summary", []) if t.startswith("target")]
    return lines + _note(data)


def _decode_row_cells(name: str, result: dict, batches: list[int], warm_up: str) -> list[str]:
    points = result.get("batches", {})
    ttft = result.get("ttft_ms", {})
    return [name, warm_up, *[_decode_cell(points.get(str(b), {})) for b in batches],
            " / ".join(fmt(v) if isinstance(v, (int, float)) else "error" for v in ttft.values()),
            f"{fmt(result['points_peak_gib'])} GiB" if "points_peak_gib" in result else "-"]


def render_variable_shapes(data: dict) -> list[str]:
    """Requests served per second per provider, with warm-up, set-up, padding waste and graphs; the target."""
    rows = [[name, fmt(r.get("requests_per_s")), fmt(r.get("second_pass_requests_per_s", "-")),
             fmt(r.get("tokens_per_s")), f"{fmt(r.get('warm_up_s'))} s",
             f"{fmt(r.get('setup_s'))} s", f"{r['padding_waste']:.1%}" if "padding_waste" in r else "-",
             r.get("stopped") or r.get("error") or r.get("note") or ""]
            for name, r in data.get("providers", {}).items()]
    model = data.get("model", {})
    shapes = data.get("request_shapes", {})
    lines = [f"transformers {model.get('name')} ({model.get('layers')} layers, d {model.get('hidden')}), "
             f"{data.get('requests')} requests, batch {shapes.get('batch')} x length {shapes.get('length')} "
             f"(uniform, seeded), {data.get('dtype')}; processes: {data.get('processes', 'all providers in one')}.",
             table(["provider", "requests/s", "again, every shape seen", "tokens/s", "warm-up", "set-up",
                    "padding waste", "note"], rows)]
    return lines + [f"- {t}" for t in data.get("summary", []) if t.startswith("target")] + _note(data)


def _decode_cell(point: dict) -> str:
    if "decode_tokens_per_s_per_seq" not in point:
        return point.get("error", "not measured")
    share = point.get("hbm_share")
    return f"{fmt(point['decode_tokens_per_s_per_seq'])}" + (f" ({share:.0%})" if isinstance(share, float) else "")


def render_ring(data: dict) -> list[str]:
    """Ring attention (one row per tokens-per-GPU, one column per world size) and the model's memory fit."""
    worlds = [w for w in data.get("worlds", []) if isinstance(w, dict)]
    config = data.get("config", {})
    out = []
    if any(w.get("ring") for w in worlds):
        out.append(f"Ring attention forward + backward, causal, {config.get('heads_q')}/{config.get('heads_kv')} heads, "
                   f"head dim {config.get('head_dim')}, {config.get('dtype')}, {config.get('kernel')} blocks: TFLOP/s per "
                   "GPU, and in brackets the efficiency against N x the same kernel on one GPU at the same tokens per "
                   f"GPU (target {fmt(config.get('efficiency_target'), 2)}).")
        by_tokens: dict[Any, dict[int, dict]] = {}
        for w in worlds:
            for r in w.get("ring", []):
                by_tokens.setdefault(r.get("tokens_per_gpu"), {})[w.get("world_size")] = r
        sizes = [w.get("world_size") for w in worlds if w.get("ring")]
        single = {r.get("tokens"): r for w in worlds if w.get("world_size") == 1 for r in w.get("single_gpu", [])}
        kernels = union(r for r in single.values())
        kernels = [k for k in kernels if k != "tokens"]
        header = ["tokens per GPU", *[f"{n} GPU{'s' if n != 1 else ''}" for n in sizes],
                  *[f"one GPU, {k} (no ring)" for k in kernels]]
        body = [[fmt(tokens), *[f"{cell(row.get(n), 'tflops_per_gpu')} ({cell(row.get(n), 'efficiency', 2)})"
                                if row.get(n) else "-" for n in sizes],
                 *[cell(single.get(tokens, {}).get(k), "tflops") for k in kernels]]
                for tokens, row in by_tokens.items()]
        out.append(table(header, body))
        fits = [[fmt(w.get("world_size")), fmt(w["fit"].get("bytes_per_token_per_gpu")),
                 fmt(w["fit"].get("predicted_total_tokens"))] for w in worlds if isinstance(w.get("fit"), dict)]
        if fits:
            out += ["Attention memory, fitted: bytes per token per GPU and the longest sequence predicted to fit:",
                    table(["GPUs", "bytes per token per GPU", "predicted longest sequence (tokens)"], fits)]
        errors = [[fmt(w.get("world_size")), fmt(w["numerics"].get("tokens_per_gpu")),
                   *[fmt(max(w["numerics"].get(side, {}).values(), default=None), 4) for side in ("ring", "single_gpu")]]
                  for w in worlds if isinstance(w.get("numerics"), dict)]
        if errors:
            out += ["Worst relative error of output and gradients against fp32 attention on the full sequence:",
                    table(["GPUs", "tokens per GPU", "ring", "one GPU's kernel"], errors)]
    fits = [w for w in worlds if isinstance(w.get("model_fit"), dict)]
    if fits:
        model = data.get("model_config", {})
        layout = model.get("config", {})
        out.append(f"A model trained through `optimize(model, context_parallel=group)`: {model.get('model', '?')}, "
                   f"{layout.get('n_layers')} layers, d {layout.get('dim')}, {model.get('dtype')}, checkpointing "
                   f"{model.get('checkpointing')}, {model.get('optimizer')}; target: {model.get('target', '-')}.")
        out.append(table(["GPUs", "verified", "bytes per token per GPU", "fixed GiB", "predicted longest sequence",
                          "growth vs 1 GPU", "meets target"],
                         [[fmt(w.get("world_size")), fmt(w["model_fit"].get("verified")),
                           fmt(w["model_fit"].get("bytes_per_token_per_gpu")),
                           fmt(_gib(w["model_fit"].get("fixed_bytes")), 2),
                           fmt(w["model_fit"].get("predicted_total_tokens")),
                           fmt(w["model_fit"].get("growth_vs_1_gpu"), 2),
                           fmt(w["model_fit"].get("meets_target"))] for w in fits]))
    return out


def _gib(n: Any) -> float | None:
    return n / 2**30 if isinstance(n, (int, float)) else None


def render_tune_row_kernels(data: dict) -> list[str]:
    """The fastest setting per (op, pass, hidden) of the row-kernel sweep."""
    best: dict[tuple, dict] = {}
    for s in data.get("settings", []):
        key = (s.get("op"), s.get("backward"), s.get("hidden"))
        if isinstance(s.get("gbps"), (int, float)) and s["gbps"] > best.get(key, {}).get("gbps", -1):
            best[key] = s
    columns = ("elements_per_thread", "min_tile_elements", "rows_per_tile", "num_warps", "warps_per_sm")
    return [f"{len(data.get('settings', []))} settings timed; the fastest per op, pass and hidden size (GPU ms, GB/s, "
            "share of a device copy of the same bytes):",
            table(["op", "pass", "hidden", *columns, "ms", "GB/s", "of copy"],
                  [[fmt(op), "bwd" if bwd else "fwd", fmt(hidden), *[fmt(s.get(c)) for c in columns],
                    fmt(s.get("ms"), 4), fmt(s.get("gbps")), fmt(s.get("fraction_of_copy"), 3)]
                   for (op, bwd, hidden), s in best.items()])]


def render_tune_float8_amax(data: dict) -> list[str]:
    best = data.get("best", {})
    return [f"{len(data.get('cases', []))} operand shapes and modes timed; per mode, the setting with the least total "
            "GPU time over the shapes, against the setting used before the sweep:",
            table(["mode", "setting", "total ms", "setting before", "total ms before"],
                  [[mode, _setting(b.get("setting")), fmt(b.get("total_ms"), 4), _setting(b.get("current_setting")),
                    fmt(b.get("current_total_ms"), 4)] for mode, b in best.items()])]


def render_tune_decode_linear(data: dict) -> list[str]:
    """Per decode weight shape: cuBLAS per weight, cuBLAS on pre-concatenated weights, the best grouped GEMV tile."""
    rows = []
    for name, r in data.get("results", {}).items():
        ms, best = r.get("ms", {}), r.get("best_gemv")
        error = r.get("max_rel_error")
        rows.append([name, *[fmt(ms[key] * 1e3) if key in ms else "-" for key in ("cublas", "cublas_packed", best)],
                     fmt(best), f"{error:.1e}" if isinstance(error, float) else "-"])
    return ["GPU time (CUDA-graph replays, so weights of 32 MB and less stay in L2 between replays: read the columns "
            "against each other, not against the HBM bandwidth) of the linears of one decode token, in microseconds:",
            table(["weights, rows", "cuBLAS per weight", "cuBLAS, weights concatenated", "grouped GEMV, best tile",
                   "best tile", "max rel. error"], rows)]


def render_kernel_resources(data: dict) -> list[str]:
    """Per decode-kernel variant: registers, spills, shared memory and programs an SM holds (ptxas's report)."""
    rows = [[name, fmt(r.get("registers")), fmt(r.get("spill_bytes")), fmt(r.get("shared_bytes")),
             fmt(r.get("programs_per_sm")), fmt(r.get("notes") or "-")] for name, r in data.get("variants", {}).items()]
    return ["Compiled for sm_90a (H100) without a GPU, assembled by Triton's ptxas (`-v`); programs per SM from the "
            "registers alone (65536 per SM):",
            table(["variant", "registers", "spilled bytes", "shared bytes", "programs per SM", "note"], rows)]


def render_tune_flex_attention(data: dict) -> list[str]:
    out = [f"FlexAttention options for a causal sliding window of {data.get('window')}, {data.get('heads')} heads, head "
           f"dim {data.get('head_dim')}, {data.get('dtype')}: per length and direction, the candidate kept (fastest of "
           "those whose outputs match the default's) against cuDNN's dense causal kernel."]
    rows = []
    for r in data.get("rows", []):
        best = r.get("candidates", {}).get(r.get("best"), {})
        rows.append([fmt(r.get("length")), fmt(r.get("direction")), fmt(r.get("best")), _setting(best.get("options")),
                     fmt(best.get("ms"), 4), cell(r.get("cudnn_causal"), "ms", 4), fmt(best.get("vs_cudnn_causal"), 2)])
    out.append(table(["L", "pass", "kept", "options", "ms", "cuDNN causal ms", "speedup"], rows))
    return out + _note(data)


def _setting(setting: Any) -> str:
    if not isinstance(setting, dict):
        return fmt(setting)
    return ", ".join(f"{k} {v}" for k, v in setting.items()) or "defaults"


# One (title, renderer) per file name, in the order of docs/results.md. The quick files that are absent are not
# listed as missing (OPTIONAL_SUITES).
SUITES: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "e2e.json": ("End to end", render_e2e),
    "e2e_default_attention.json": ("End to end, default attention (issue 28)", render_e2e),
    "attention.json": ("Attention", render_attention),
    "kernels.json": ("Fused kernels", render_kernels),
    "fp8.json": ("FP8", render_fp8),
    "block_fusion.json": ("Block fusion", render_block_fusion),
    "memory.json": ("Memory", render_memory),
    "memory_quick.json": ("Memory (--quick)", render_memory),
    "sparse_attention.json": ("Sparse attention", render_sparse),
    "sparse_attention_topk.json": ("Top-k sparse attention", render_topk),
    "ring_attention.json": ("Ring attention", render_ring),
    "decode.json": ("Generation (decode)", render_decode),
    "decode_quick.json": ("Generation (decode, --quick: 64 new tokens)", render_decode),
    "decode_quick_prefill_graphs_ab.json": ("Generation: prefill graphs on and off (--quick)", render_decode),
    "decode_quick_uncompiled_prefill.json": ("Generation with the prefill uncompiled (--quick)", render_decode),
    "decode_quick_compiled_prefill.json": ("Generation with the prefill compiled (--quick)", render_decode),
    "decode_quick_7b_h100.json": ("Generation, 7B-class (--quick)", render_decode),
    "decode_quick_7b_symbolic_gemv_h100.json": ("Generation, 7B-class, symbolic_batch_gemv on (--quick)",
                                                render_decode),
    "decode_quick_7b_b32_h100.json": ("Generation, 7B-class, batch 32 (--quick)", render_decode),
    "decode_quick_7b_pdl_off_h100.json": ("Generation, 7B-class, without programmatic dependent launch (--quick)",
                                          render_decode),
    "decode_quick_pdl_h100.json": ("Generation, 1B-class, programmatic dependent launch (--quick)", render_decode),
    "decode_quick_symbolic_gemv_h100.json": ("Generation, 1B-class, symbolic_batch_gemv on (--quick)", render_decode),
    "decode_quick_cold.json": ("Generation warm-up with cold caches (--quick, optimize only)", render_decode),
    "decode_quick_h200.json": ("Generation on an H200 (--quick, 1B-class)", render_decode),
    "decode_quick_7b_h200.json": ("Generation on an H200 (--quick, 7B-class)", render_decode),
    "variable_shapes.json": ("Variable-shape serving (issue 27)", render_variable_shapes),
    "variable_shapes_recheck_h100.json": ("Variable-shape serving, re-checked against eager", render_variable_shapes),
}
OPTIONAL_SUITES = ("memory.json", "memory_quick.json", "decode_quick.json", "decode_quick_prefill_graphs_ab.json",
                   "decode_quick_uncompiled_prefill.json", "decode_quick_compiled_prefill.json",
                   "decode_quick_7b_h100.json", "decode_quick_7b_symbolic_gemv_h100.json",
                   "decode_quick_7b_b32_h100.json",
                   "decode_quick_7b_pdl_off_h100.json", "decode_quick_pdl_h100.json",
                   "decode_quick_symbolic_gemv_h100.json",
                   "decode_quick_cold.json",
                   "decode_quick_h200.json", "decode_quick_7b_h200.json", "variable_shapes.json",
                   "variable_shapes_recheck_h100.json")
TUNING: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "tune_row_kernels.json": ("Row kernels (norms, activations, RoPE)", render_tune_row_kernels),
    "tune_float8_amax.json": ("FP8 amax kernel", render_tune_float8_amax),
    "tune_flex_attention.json": ("FlexAttention options for sliding windows", render_tune_flex_attention),
    "tune_decode_linear.json": ("Grouped GEMV of decode steps", render_tune_decode_linear),
    "kernel_resources.json": ("Decode kernels' registers on an H100, compiled without a GPU", render_kernel_resources),
}


def suite_files(results: Path) -> list[tuple[str, Path]]:
    """(file name, path) of the suites, in docs/results.md order; the optional ones only where present."""
    return [(name, results / name) for name in SUITES if name not in OPTIONAL_SUITES or (results / name).exists()]


def environments(data: dict) -> list[dict]:
    """The environments the file records: its own, per part ('environments'), per e2e model and part, per
    re-measured row ('measured_in')."""
    found = [data["environment"]] if isinstance(data.get("environment"), dict) else []
    found += [e for e in data.get("environments", {}).values() if isinstance(e, dict)]
    for entry in data.get("models", {}).values():
        found += [entry[p]["environment"] for p in ("train", "inference")
                  if isinstance(entry.get(p), dict) and isinstance(entry[p].get("environment"), dict)]
    found += [r["measured_in"] for r in data.get("rows", []) if isinstance(r, dict) and isinstance(r.get("measured_in"), dict)]
    # One per rendered line: the parts of one command differ only in the seconds of their dates.
    unique = {env_line(e): e for e in found}
    return list(unique.values())


def anchor(title: str) -> str:
    """The id GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def plot_line(name: str, results: Path, link: str) -> str | None:
    png = Path(name).with_suffix(".png").name
    return f"Plot: [`benchmarks/results/{png}`]({link}{png})." if (results / png).exists() else None


def render_suite(name: str, path: Path, suites: dict = SUITES, level: str = "##", link: str = RESULTS_LINK) -> str:
    title, render = suites[name]
    try:
        data = json.loads(path.read_text())
        envs = environments(data)
        head = [f"{level} {title}", "", f"[`benchmarks/results/{name}`]({link}{name}), measured on " +
                "; ".join(env_line(e) for e in envs[:1]) + "."]
        if len(envs) > 1:
            head += ["", "Parts run as separate commands or re-measured:"] + [f"- {env_line(e)}" for e in envs[1:]]
        plot = plot_line(name, path.parent, link)
        head += ["", plot] if plot else []
        body = blocks(render(data))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"{level} {title}\n\n`benchmarks/results/{name}` could not be rendered: {type(error).__name__}: {error}"
    return "\n".join(head + ["", body])


def render_all(results: Path, link: str = RESULTS_LINK) -> str:
    """Every suite's section (## headings), then a line naming the suites with no file yet."""
    sections, missing = [], []
    for name, path in suite_files(results):
        if path.exists():
            sections.append(render_suite(name, path, link=link))
        else:
            missing.append(name)
    if missing:
        sections.append("No results yet for: " + ", ".join(missing) + ".")
    return "\n\n".join(sections) + "\n"


def render_tuning(results: Path, link: str = RESULTS_LINK) -> str:
    """The tuning sweeps behind constants in the kernels (### headings under one ## section)."""
    found = [render_suite(name, results / name, TUNING, "###", link) for name in TUNING if (results / name).exists()]
    if not found:
        return ""
    intro = ("## Tuning sweeps\n\nSweeps of a kernel's tuning constants; the code keeps the chosen values and names "
             "the file.")
    return "\n\n".join([intro, *found]) + "\n"


# ------------------------------------------------------------------------------------------ headline table

# The figures of the design notes that preceded docs/design.md, measured before the benchmark scripts wrote
# result files: (what, figure). Code comments that cite "the design-time baselines" point here.
DESIGN_BASELINES_SETUP = ("NVIDIA H100 80GB HBM3, torch 2.11+cu130, Triton 3.6, cuDNN 9.19, medians; measured when the "
                          "project began, before the benchmark scripts wrote result files")
DESIGN_BASELINES: tuple[tuple[str, str], ...] = (
    ("device-to-device copy", "3.00 TB/s (bytes read + written)"),
    ("bf16 matmul 8192^3", "776 TFLOP/s"),
    ("fp8 `torch._scaled_mm` 8192^3", "1273 TFLOP/s tensorwise, 1208 rowwise"),
    ("attention fwd, head dim 128, L 8192, bf16, non-causal",
     "naive eager 43, SDPA-flash 349, SDPA-cuDNN 613, FlexAttention 407 TFLOP/s"),
    ("attention fwd, the same, causal", "naive eager 15, SDPA-flash 338, SDPA-cuDNN 538, FlexAttention 382 TFLOP/s"),
    ("sliding window 1024, causal, L 16384", "FlexAttention 6.66x faster than dense causal flash"),
    ("RMSNorm fwd (16384 x 4096 bf16)", "eager 0.22, torch.compile 2.82, F.rms_norm 2.28 TB/s"),
    ("SwiGLU activation silu(g) * u (16384 x 11008)", "eager 1.81, torch.compile 3.02 TB/s"),
    ("Llama-style model (12 layers, d 2048, 16 heads / 4 kv, ffn 5632, vocab 32000), batch 4 x 2048, bf16, "
     "AdamW training step",
     "eager 192.8 ms, torch.compile 97.5 ms; the same model through transformers with SDPA attention: eager "
     "98.2 ms, + torch.compile 80.8 ms"),
)


def render_design_baselines() -> str:
    return "\n\n".join([
        "## Design-time baselines (no result file)",
        f"Not generated from a JSON file: these figures were recorded in the project's first design notes "
        f"({DESIGN_BASELINES_SETUP}). The suites above re-measure most of them (`fp8.json`'s ceilings, "
        "`attention.json`, `kernels.json`, `sparse_attention.json`, `e2e.json`); where the two differ, the "
        "suites are the later and reproducible measurement.",
        table(["what", "figure"], [list(row) for row in DESIGN_BASELINES])]) + "\n"


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def _provider_ms(part: dict, provider: str) -> float:
    return part["providers"][provider]["ms"]


def _part_env(entry: dict, part: str, provider: str) -> str:
    """'device, date' of a provider's measurement: its own date where it has one, else its part's."""
    env = dict(entry[part].get("environment") or {})
    date = entry[part]["providers"][provider].get("date")
    if date:
        env["date"] = date
    return measured_on(env)


def _dtype(name: Any) -> str:
    return str(name).removeprefix("torch.")


def _llama_row(results: Path, part: str) -> list[str]:
    entry = _load(results, "e2e.json")["models"]["llama_style"]
    info, data = entry["info"], entry[part]
    ours, compiled = _provider_ms(data, "optimize"), _provider_ms(data, "torch.compile")
    what = "training step (forward, loss, backward, AdamW)" if part == "train" else "inference forward"
    baseline, ratio = f"torch.compile {compiled:.2f} ms", f"{compiled / ours:.2f}x"
    hf = data["providers"].get("transformers sdpa + torch.compile", {}).get("ms")
    if hf:
        baseline += f"; transformers + SDPA + torch.compile {hf:.2f} ms"
        ratio += f"; {hf / ours:.2f}x"
    return [f"Llama-style LM, {count(info['parameters'])} parameters, {what}, batch {info['batch']} x {info['seq']}, "
            f"{_dtype(info['dtype'])}", f"{ours:.2f} ms", baseline, ratio, _part_env(entry, part, "optimize")]


def _model_name(entry: dict) -> str:
    model_class = entry["info"]["model"].split(",")[0].removeprefix("transformers ")
    return re.sub(r"(For[A-Za-z]+|LMHeadModel)$", "", model_class)


def _speedup_spans(models: dict, parts: tuple[str, ...]) -> tuple[list[str], str, str]:
    """The models' names, "part lo-hi x; ..." of optimize against torch.compile per part, and where measured."""
    names, ratios, envs = [], {part: [] for part in parts}, []
    for entry in models.values():
        names.append(_model_name(entry))
        for part in parts:
            if part in entry and "optimize" in entry[part].get("providers", {}):
                ratios[part].append(_provider_ms(entry[part], "torch.compile") / _provider_ms(entry[part], "optimize"))
                envs.append(_part_env(entry, part, "optimize"))
    if not names:
        raise KeyError("no transformers models")
    spans = "; ".join(f"{part} {min(r):.2f}-{max(r):.2f}x" if len(r) > 1 else f"{part} {r[0]:.2f}x"
                      for part, r in ratios.items() if r)
    return names, spans, "; ".join(sorted(set(envs)))


def _transformers_row(results: Path) -> list[str]:
    models = {name: entry for name, entry in _load(results, "e2e.json")["models"].items() if name != "llama_style"}
    names, spans, envs = _speedup_spans(models, ("train", "inference"))
    return [f"transformers {', '.join(names)} built from configs, attention as written "
            "(`attn_implementation='eager'`), training step and inference forward", "train and infer through optimize",
            "torch.compile of the same model", spans, envs]


def _default_attention_row(results: Path) -> list[str]:
    models = {name: entry for name, entry in _load(results, "e2e_default_attention.json")["models"].items()
              if name != "hf_llama_vocab128k"}  # the memory case has its own targets (docs/results.md)
    names, spans, envs = _speedup_spans(models, ("train", "train_long", "inference"))
    return [f"transformers {', '.join(names)} built from configs, default (SDPA) attention, `labels=` training step "
            "(4 x 2048; train_long 1 x 16384) and inference forward", "train and infer through optimize",
            "torch.compile of the same model", spans, envs]


def _attention_row(results: Path) -> list[str]:
    data = _load(results, "attention.json")
    rows = data["rows"]
    gpu = [r["gpu_fraction_of_fastest_kernel"] for r in rows if r.get("gpu_fraction_of_fastest_kernel") is not None]
    ours = [r["tflops"]["kernel_pytorch.optimize"] for r in rows if "kernel_pytorch.optimize" in r.get("tflops", {})]
    compiled = [r["tflops"]["kernel_pytorch.optimize"] / r["tflops"]["torch.compile (hand-written)"] for r in rows
                if isinstance(r.get("tflops", {}).get("torch.compile (hand-written)"), (int, float))
                and isinstance(r["tflops"].get("kernel_pytorch.optimize"), (int, float))]
    dims = "/".join(str(d) for d in sorted({r["head_dim"] for r in rows}))
    lengths = sorted({r["length"] for r in rows})
    return [f"hand-written attention module, {len(rows)} shapes (head dim {dims}, L {lengths[0]}-{lengths[-1]}, causal "
            "or not, fwd and fwd+bwd), bf16", f"up to {max(ours):.0f} TFLOP/s",
            "the fastest SDPA kernel at each shape; torch.compile of the module",
            f"{min(gpu):.2f}-{max(gpu):.2f}x (GPU time); {min(compiled):.1f}-{max(compiled):.1f}x (per call)",
            measured_on(data["environment"])]


def _fp8_step_row(results: Path) -> list[str]:
    entry = _load(results, "e2e.json")["models"]["llama_style"]
    fp8, bf16 = "optimize (fp8='auto', reduce-overhead)", "optimize (reduce-overhead)"
    ours, base = _provider_ms(entry["train"], fp8), _provider_ms(entry["train"], bf16)
    return ["FP8 training step of the same Llama-style LM, `fp8='auto'`, `compile='reduce-overhead'`", f"{ours:.2f} ms",
            f"bf16 through optimize, `compile='reduce-overhead'`, {base:.2f} ms", f"{base / ours:.3f}x",
            _part_env(entry, "train", fp8)]


def _fp8_linear_row(results: Path) -> list[str]:
    data = _load(results, "fp8.json")
    linear = data["linear"]
    ours, base = linear["results"]["fp8 tensorwise"]["ms"], linear["results"]["bf16 nn.Linear"]["ms"]
    env = data.get("environments", {}).get("linear", data["environment"])
    return [f"FP8 Linear forward + backward, {linear['m']} x {linear['k']} x {linear['n']}, tensorwise, quantization "
            "included", f"{ours:.3f} ms", f"bf16 nn.Linear {base:.3f} ms",
            f"{linear['speedup']['tensorwise']:.2f}x per call ({linear['gpu_speedup']['tensorwise']:.2f}x GPU time)",
            measured_on(env)]


def _window_row(results: Path) -> list[str]:
    rows = [r for r in _load(results, "sparse_attention.json")["rows"] if r.get("kind") == "window"]
    length = max(r["length"] for r in rows)
    fwd = next(r for r in rows if r["length"] == length and not r.get("backward"))
    both = next((r for r in rows if r["length"] == length and r.get("backward")), None)
    window = re.search(r"sliding window (\d+)", fwd.get("rewrite", ""))
    ratio = f"{fwd['speedup_vs_dense']:.2f}x per call ({fwd['gpu_speedup_vs_dense']:.2f}x GPU time)"
    if both:
        ratio += f"; fwd+bwd {both['speedup_vs_dense']:.2f}x"
    return [f"causal sliding-window attention{f' (window {window[1]})' if window else ''}, L {length}, forward, bf16",
            f"{fwd['ms']['kernel_pytorch.optimize']:.3f} ms", f"fastest dense causal kernel {fwd['best_dense_ms']:.3f} ms",
            ratio, measured_on(fwd.get("measured_in"))]


def _checkpointing_row(results: Path) -> list[str]:
    data = _load(results, "memory.json")
    cases = {r["case"]: r for r in data["checkpointing"]}
    off, full = cases["checkpointing off"], cases["checkpointing full"]
    params = next((r["parameters"] for r in data.get("offload", []) if "parameters" in r), None)
    size = f"{count(params)}-parameter " if params else ""
    return [f"full activation checkpointing, {size}Llama-style model, {off['tokens_per_step']} tokens per step",
            f"activations {full['activation_gib']:.1f} GiB, step {full['step_ms']:.0f} ms",
            f"checkpointing off: {off['activation_gib']:.1f} GiB, {off['step_ms']:.0f} ms",
            f"{full['activation_gib'] / off['activation_gib']:.2f}x the activations at "
            f"{full['step_ms'] / off['step_ms']:.2f}x the step time",
            measured_on(data.get("environments", {}).get("checkpointing"))]


def _decode_row(results: Path) -> tuple[list[str], str]:
    """From the newer of the full and the quick run (64 new tokens instead of 256), with its section."""
    names = [name for name in ("decode.json", "decode_quick.json") if (results / name).exists()] or ["decode.json"]
    runs = [(name, _load(results, name)) for name in names]  # none: decode.json's own "missing" line
    name, data = max(runs, key=lambda run: run[1]["models"]["1b"]["environment"].get("date", ""))
    entry = data["models"]["1b"]
    ours = entry["providers"]["optimize"]["batches"]["1"]
    loop = entry["providers"]["static loop (reduce-overhead)"]["batches"]["1"]
    return [f"generate(), 1B-class Llama (16 layers, d 2048), batch 1, prompt {data['prompt']}, "
            f"{data['new_tokens']} new tokens, bf16",
            f"{ours['decode_tokens_per_s_per_seq']:.0f} tokens/s ({ours['hbm_share']:.0%} of the HBM limit)",
            "a hand-written static-cache loop under torch.compile(mode='reduce-overhead')",
            f"{ours['decode_tokens_per_s_per_seq'] / loop['decode_tokens_per_s_per_seq']:.2f}x",
            measured_on(entry["environment"])], SUITES[name][0]


# (section of docs/results.md the row comes from, how to build it); a row whose file or key is missing is named.
HEADLINE: tuple[tuple[str, str, Callable[[Path], list[str]]], ...] = (
    ("Llama-style training step", "End to end", lambda results: _llama_row(results, "train")),
    ("Llama-style inference", "End to end", lambda results: _llama_row(results, "inference")),
    ("transformers models", "End to end", _transformers_row),
    ("transformers models, default attention", "End to end, default attention (issue 28)", _default_attention_row),
    ("attention", "Attention", _attention_row),
    ("FP8 training step", "End to end", _fp8_step_row),
    ("FP8 Linear", "FP8", _fp8_linear_row),
    ("sliding-window attention", "Sparse attention", _window_row),
    ("activation checkpointing", "Memory", _checkpointing_row),
    ("generate()", "Generation (decode)", _decode_row),
)


def render_headline(results: Path, doc: str = "docs/results.md") -> str:
    """The short table of headline results; ``doc``: how the table's links reach docs/results.md."""
    rows, missing = [], []
    for name, section, build in HEADLINE:
        try:
            row = build(results)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, StopIteration,
                ZeroDivisionError) as error:
            missing.append(f"{name} ({type(error).__name__}: {error})")
            continue
        if isinstance(row, tuple):  # a row that names the section it came from
            row, section = row
        rows.append([*row[:-1], f"{row[-1]} ([all]({doc}#{anchor(section)}))"])
    parts = [table(["what", "kernel_pytorch.optimize", "against", "speedup", "measured on"], rows) if rows else
             "No headline results: none of their files is in benchmarks/results/."]
    if missing:
        parts.append("Not shown, their result is missing: " + "; ".join(missing) + ".")
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------ docs/results.md

def render_results_doc(results: Path) -> str:
    """docs/results.md, whole."""
    suites = [(title, anchor(title)) for name, (title, _) in SUITES.items()
              if not name.startswith("memory") or (results / name).exists()]
    contents = ", ".join(f"[{title}](#{target})" for title, target in suites)
    intro = f"""# Measured results

Generated by `{COMMAND}`
from the JSON files in `benchmarks/results/` (the same command writes the README's headline table): edit
the renderer or re-run a benchmark, not this file. Each section names the machine, date, torch, Triton and
cuDNN versions and the command of its run, and links the plot drawn from the same file. Where a part was
run by a separate command or re-measured later, its own line says so.

How to read them: baselines run in the same process as `optimize` (eager PyTorch, `torch.compile` of the
same model, the fastest library kernel for the job). "Per call" times include the host's work (launches,
Python); "GPU time" replays the call as a CUDA graph and measures the GPU alone. Speedups above 1 are
faster than the baseline. Why the code makes each choice these numbers support is in
[attention.md](attention.md), [kernels.md](kernels.md) and [passes.md](passes.md); the history of each
figure, in [CHANGELOG.md](../CHANGELOG.md).

Sections: {contents}, [Tuning sweeps](#tuning-sweeps), [Design-time baselines](#{anchor("Design-time baselines (no result file)")}).

## Headline results"""
    return "\n\n".join([intro, render_headline(results, doc="").strip(), render_all(results).strip(),
                        render_tuning(results).strip(), render_design_baselines().strip()]).replace("\n\n\n", "\n\n") + "\n"


def replace_block(text: str, block: str) -> str | None:
    """``text`` with what lies between the markers replaced by ``block``; None without both markers."""
    start = text.find(BEGIN)
    end = text.find(END, start + len(BEGIN)) if start >= 0 else -1
    if start < 0 or end < 0:
        return None
    return text[:start + len(BEGIN)] + "\n" + block.strip() + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--docs", type=Path, default=DOCS, help="where --write puts the full results (docs/results.md)")
    parser.add_argument("--headline", action="store_true", help="print the README's headline table only")
    parser.add_argument("--write", action="store_true",
                        help="write docs/results.md and replace the README's block between the markers")
    args = parser.parse_args(argv)
    headline = render_headline(args.results)
    if not args.write:
        print(headline if args.headline else render_results_doc(args.results), end="")
        return 0
    document = render_results_doc(args.results)
    args.docs.parent.mkdir(parents=True, exist_ok=True)
    args.docs.write_text(document)
    print(f"wrote {args.docs} ({len(document.splitlines())} lines)")
    text = args.readme.read_text() if args.readme.exists() else ""
    updated = replace_block(text, headline)
    if updated is None:
        print(headline, end="")
        print(f"\n{args.readme} has no '{BEGIN}' ... '{END}' block: nothing written there. Add the two marker "
              "lines where the headline table belongs.", file=sys.stderr)
        return 1
    args.readme.write_text(updated)
    print(f"wrote the headline table of {args.readme} ({len(headline.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
