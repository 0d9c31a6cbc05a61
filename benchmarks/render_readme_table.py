"""Render the README's results tables (Markdown) from the benchmark JSON files in benchmarks/results/.

    python benchmarks/render_readme_table.py [--results DIR] [--readme PATH] [--write]

One section per suite file found: attention.json, kernels.json, fp8.json, block_fusion.json, memory*.json
and e2e.json (quick, CPU and tuning files are not README material). Each section names the device, date,
torch version and command of the run it holds, from the file's ``environment`` (and the environments of
parts re-measured or run as separate commands). A missing file is listed as such; a missing key leaves a
``-`` in its cell; a file whose layout is not understood gets one line saying why, never a crash.

Prints the Markdown. ``--write`` replaces what lies between the ``<!-- results:begin -->`` and
``<!-- results:end -->`` lines of the README and nothing else; without those markers it prints the tables,
says so and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
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
    if not isinstance(env, dict):
        return "environment not recorded"
    date = str(env.get("date", "?"))[:10]
    return f"{env.get('device', '?')}, {date}, torch {env.get('torch', '?')}, `{env.get('command', '?')}`"


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
    return out


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
    return out + ([f"- {data['note']}"] if data.get("note") else [])


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


def render_e2e(data: dict) -> list[str]:
    intro = ("Median ms per training step (forward, loss, backward, fused AdamW) and per inference forward; "
             "'ready s': the provider's setup (optimize: capture, passes, compile, verification) plus its first "
             "call (torch.compile compiles there).")
    out = [intro]
    for name, entry in data.get("models", {}).items():
        info = entry.get("info", {})
        out.append(f"{name}: {info.get('model', '?')}, {count(info.get('parameters'))} parameters, batch "
                   f"{info.get('batch')} x {info.get('seq')}, {info.get('dtype', '?')}")
        rows = []
        for part in ("train", "inference"):
            for provider, r in entry.get(part, {}).get("providers", {}).items():
                rows.append([part, provider, _ms_or_error(r), cell(r, "items_per_s", 0), cell(r, "tflops"),
                             cell(r, "peak_gib", 2), cell(r, "speedup_vs_eager", 2), cell(r, "speedup_vs_compile", 2),
                             _ready_s(r), _rewrites(r.get("report")),
                             fmt((r.get("report") or {}).get("verified"))])
        unit = f"{info.get('unit', 'items')}/s"
        out.append(table(["part", "provider", "ms", unit, "TFLOP/s", "peak GiB", "vs eager", "vs torch.compile",
                          "ready s", "rewrites", "verified"], rows))
    if data.get("targets"):
        out += ["Targets (issue 9); miss ratio = value / target, > 1 is a miss by that factor:",
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


# One (title, renderer) per file name; memory*.json all go to render_memory.
SUITES: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "attention.json": ("Attention", render_attention),
    "kernels.json": ("Fused kernels", render_kernels),
    "fp8.json": ("FP8", render_fp8),
    "block_fusion.json": ("Block fusion", render_block_fusion),
    "memory.json": ("Memory", render_memory),
    "memory_quick.json": ("Memory (--quick)", render_memory),
    "sparse_attention.json": ("Sparse attention", render_sparse),
    "sparse_attention_topk.json": ("Top-k sparse attention", render_topk),
    "e2e.json": ("End to end", render_e2e),
}


def suite_files(results: Path) -> list[tuple[str, Path]]:
    """(file name, path) of the suites, in README order, memory*.json by glob (only known names render)."""
    names = [n for n in SUITES if not n.startswith("memory")]
    memory = sorted(p.name for p in results.glob("memory*.json") if p.name in SUITES)
    order = names[:4] + memory + names[4:]
    return [(name, results / name) for name in order]


def environments(data: dict) -> list[dict]:
    """The environments the file records: its own, per part ('environments'), per e2e model and part."""
    found = [data["environment"]] if isinstance(data.get("environment"), dict) else []
    found += [e for e in data.get("environments", {}).values() if isinstance(e, dict)]
    for entry in data.get("models", {}).values():
        found += [entry[p]["environment"] for p in ("train", "inference")
                  if isinstance(entry.get(p), dict) and isinstance(entry[p].get("environment"), dict)]
    # One per rendered line: the parts of one command differ only in the seconds of their dates.
    unique = {env_line(e): e for e in found}
    return list(unique.values())


def render_suite(name: str, path: Path) -> str:
    title, render = SUITES[name]
    try:
        data = json.loads(path.read_text())
        envs = environments(data)
        head = [f"### {title}", "", f"`benchmarks/results/{name}`, measured on " +
                "; ".join(env_line(e) for e in envs[:1]) + "."]
        if len(envs) > 1:
            head += ["", "Parts run as separate commands:"] + [f"- {env_line(e)}" for e in envs[1:]]
        body = blocks(render(data))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return f"### {title}\n\n`benchmarks/results/{name}` could not be rendered: {type(error).__name__}: {error}"
    return "\n".join(head + ["", body])


def render_all(results: Path) -> str:
    sections, missing = [], []
    for name, path in suite_files(results):
        if path.exists():
            sections.append(render_suite(name, path))
        else:
            missing.append(name)
    if missing:
        sections.append("No results yet for: " + ", ".join(missing) + ".")
    return "\n\n".join(sections) + "\n"


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
    parser.add_argument("--write", action="store_true", help="replace the README's block between the markers")
    args = parser.parse_args(argv)
    markdown = render_all(args.results)
    if not args.write:
        print(markdown, end="")
        return 0
    text = args.readme.read_text() if args.readme.exists() else ""
    updated = replace_block(text, markdown)
    if updated is None:
        print(markdown, end="")
        print(f"\n{args.readme} has no '{BEGIN}' ... '{END}' block: nothing written. Add the two marker lines "
              "where the tables belong.", file=sys.stderr)
        return 1
    args.readme.write_text(updated)
    print(f"wrote the results block of {args.readme} ({len(markdown.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
