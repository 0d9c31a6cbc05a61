"""benchmarks/render_readme_table.py on the committed results (each table of docs/results.md names its device
and carries the numbers of its JSON file; the README's headline table carries them too, between its markers
and nothing else; the committed docs/results.md and README block are what the renderer writes),
benchmarks/e2e.py: arguments, the case list, FLOPs, targets, and one CPU case merged, plotted and rendered,
and benchmarks/ring_attention.py's model part: its fit, growth and merge, and its per-rank flow on 2 gloo ranks."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from benchmarks import e2e, harness
from benchmarks import render_readme_table as render
from benchmarks.harness import earlier_parts
from benchmarks import ring_attention as ring_bench
from kernel_pytorch.testing import LlamaStyleConfig

from .spawned_ranks import run_in_spawned_ranks

RESULTS = render.RESULTS_DIR


def _committed(name: str) -> dict:
    path = RESULTS / name
    if not path.exists():
        pytest.skip(f"benchmarks/results/{name} is not in this checkout")
    return json.loads(path.read_text())


def _section(markdown: str, title: str) -> str:
    """The lines of one '## title' section."""
    start = markdown.index(f"## {title}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start:end if end >= 0 else None]


def _line(section: str, prefix: str) -> str:
    matches = [line for line in section.splitlines() if line.startswith(prefix)]
    assert len(matches) == 1, (prefix, matches)
    return matches[0]


# ------------------------------------------------------------------------------------------------ render

@pytest.fixture(scope="module")
def markdown() -> str:
    return render.render_all(RESULTS)


def test_attention_table_has_the_device_and_the_best_optimize_row(markdown):
    data = _committed("attention.json")
    section = _section(markdown, "Attention")
    assert data["environment"]["device"] in section.splitlines()[2]
    row = max(data["rows"], key=lambda r: r["tflops"].get("kernel_pytorch.optimize", 0))
    line = _line(section, f"| {row['head_dim']} | {row['length']} | {row['batch']} | "
                          f"{'yes' if row['causal'] else 'no'} | {'fwd+bwd' if row['backward'] else 'fwd'} |")
    assert f"| {row['tflops']['kernel_pytorch.optimize']:.1f} |" in line
    assert f"| {row['fraction_of_fastest_kernel']:.2f} |" in line
    assert len([l for l in section.splitlines() if l.startswith("| ") and l[2].isdigit()]) == len(data["rows"])


def test_kernels_table_has_gpu_bandwidth_and_targets(markdown):
    data = _committed("kernels.json")
    section = _section(markdown, "Fused kernels")
    assert data["environment"]["device"] in section
    row = next(r for r in data["rows"] if "gpu_gbps" in r["results"].get("kernel_pytorch (compiled graph)", {}))
    line = _line(section, f"| {row['op']} | {'bwd' if row['backward'] else 'fwd'} | {row['hidden']} |")
    assert f"| {row['results']['kernel_pytorch (compiled graph)']['gpu_gbps']:.1f} |" in line
    target = next(t for t in data["targets"] if (t["op"], t["hidden"], t["backward"]) ==
                  (row["op"], row["hidden"], row["backward"]))
    assert line.endswith(f"| {target['gpu_fraction_of_copy']:.2f} | {target['gpu_vs_compile']:.2f} |")


def test_fp8_and_block_fusion_tables_carry_their_numbers(markdown):
    fp8 = _committed("fp8.json")
    section = _section(markdown, "FP8")
    assert fp8["environment"]["device"] in section
    if "model" in fp8:  # measured by its own command: its environment is shown with the table
        bf16 = fp8["model"]["results"]["bf16"]
        assert f"| {bf16['ms']:.2f} |" in _line(section, "| bf16 |")
        assert fp8["model"]["environment"]["command"] in section
    blocks = _committed("block_fusion.json")
    section = _section(markdown, "Block fusion")
    train = blocks["train"][0]
    line = _line(section, f"| block forward + backward ms, {train['batch']} x {train['seq']} |")
    assert f"| {train['ms']['optimize']:.2f} |" in line


def test_missing_and_malformed_files_do_not_stop_the_others(tmp_path):
    (tmp_path / "kernels.json").write_text("{not json")
    (tmp_path / "block_fusion.json").write_text(json.dumps({"environment": {"device": "GPU-X"}, "train": [{}]}))
    markdown = render.render_all(tmp_path)
    assert "`benchmarks/results/kernels.json` could not be rendered: JSONDecodeError" in markdown
    assert "GPU-X" in _section(markdown, "Block fusion")
    assert ("No results yet for: e2e.json, e2e_default_attention.json, attention.json, fp8.json, "
            "sparse_attention.json, sparse_attention_topk.json, ring_attention.json, decode.json.") in markdown
    headline = render.render_headline(tmp_path)
    assert "No headline results" in headline and "Llama-style training step (FileNotFoundError" in headline


def test_write_renders_the_docs_page_and_only_the_readme_block(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    (results / "block_fusion.json").write_text(json.dumps(
        {"environment": {"device": "GPU-Y", "date": "2030-01-02T00:00:00", "command": "python3 b.py", "triton": "9.9"},
         "train": [{"batch": 4, "seq": 2048, "ms": {"eager": 15.0, "optimize": 4.6098}}]}))
    (results / "block_fusion.png").write_bytes(b"png")
    (results / "memory.json").write_text(json.dumps(
        {"environments": {"checkpointing": {"device": "GPU-Y", "date": "2030-01-03T00:00:00"}},
         "offload": [{"parameters": 2 * 10**9}],
         "checkpointing": [{"case": "checkpointing off", "tokens_per_step": 8192, "step_ms": 100.0, "activation_gib": 10.0},
                           {"case": "checkpointing full", "tokens_per_step": 8192, "step_ms": 125.0, "activation_gib": 3.0}]}))
    readme, docs = tmp_path / "README.md", tmp_path / "docs" / "results.md"
    before, after = "# title\n\nintro\n", "\n## later\n\ntext\n"
    readme.write_text(f"{before}{render.BEGIN}\nold table\n{render.END}{after}")
    arguments = ["--results", str(results), "--readme", str(readme), "--docs", str(docs), "--write"]
    assert render.main(arguments) == 0
    text = readme.read_text()
    assert text.startswith(before + render.BEGIN + "\n") and text.endswith(render.END + after)
    assert "old table" not in text
    row = _line(text, "| full activation checkpointing, 2.00B-parameter Llama-style model, 8192 tokens per step |")
    assert "| activations 3.0 GiB, step 125 ms | checkpointing off: 10.0 GiB, 100 ms |" in row
    assert "| 0.30x the activations at 1.25x the step time | GPU-Y, 2030-01-03 ([all](docs/results.md#memory)) |" in row
    assert "Not shown, their result is missing: Llama-style training step" in text
    page = docs.read_text()
    assert page.startswith("# Measured results\n") and render.COMMAND in page
    section = _section(page, "Block fusion")
    assert "GPU-Y, 2030-01-02, torch ?, Triton 9.9, `python3 b.py`" in section
    assert "](../benchmarks/results/block_fusion.png)" in section and "| 4.61 |" in section
    assert "](#memory))" in _section(page, "Headline results")  # links within the page
    assert "## Design-time baselines (no result file)" in page
    assert render.main(arguments) == 0
    assert readme.read_text() == text and docs.read_text() == page  # a second write changes nothing

    readme.write_text("no markers here\n")
    capsys.readouterr()
    assert render.main(arguments) == 1
    assert readme.read_text() == "no markers here\n"
    captured = capsys.readouterr()
    assert "0.30x the activations" in captured.out and "nothing written there" in captured.err


def test_headline_rows_carry_the_numbers_of_their_files():
    e2e_data, fp8 = _committed("e2e.json"), _committed("fp8.json")
    headline = render.render_headline(RESULTS)
    train = e2e_data["models"]["llama_style"]["train"]["providers"]
    row = next(line for line in headline.splitlines() if line.startswith("| Llama-style LM") and "training step" in line)
    assert f"| {train['optimize']['ms']:.2f} ms | torch.compile {train['torch.compile']['ms']:.2f} ms" in row
    assert f"| {train['torch.compile']['ms'] / train['optimize']['ms']:.2f}x;" in row
    fp8_row = _line(headline, "| FP8 Linear forward + backward")
    assert f"{fp8['linear']['speedup']['tensorwise']:.2f}x per call" in fp8_row
    attention = _committed("attention.json")
    fractions = [r["gpu_fraction_of_fastest_kernel"] for r in attention["rows"]]
    assert f"| {min(fractions):.2f}-{max(fractions):.2f}x (GPU time);" in _line(headline, "| hand-written attention")
    assert "Not shown" not in headline  # every headline file is committed


def test_committed_docs_and_readme_are_what_the_renderer_writes():
    """Re-run `python benchmarks/render_readme_table.py --write` after changing a result file or the renderer."""
    page = render.DOCS
    if not page.exists():
        pytest.skip("docs/results.md is not in this checkout")
    assert page.read_text() == render.render_results_doc(RESULTS)
    readme = render.README.read_text()
    assert render.replace_block(readme, render.render_headline(RESULTS)) == readme


# --------------------------------------------------------------------------------------------------- e2e

def test_e2e_arguments_and_cases():
    assert e2e.parse_args([]).models == list(e2e.MODELS)
    assert e2e.parse_args(["--quick"]).models == list(e2e.QUICK_MODELS)
    with pytest.raises(SystemExit):
        e2e.parse_args(["--models", "resnet"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--quick", "--device", "cpu"])
    args = e2e.parse_args(["--models", "gpt2", "llama_style", "--providers", "optimize (fp8=True)", "eager"])
    # gpt2 has no FP8 provider; per model, train before inference; eager first within a part
    fp8 = "optimize (fp8=True)"
    assert e2e.cases(args) == [("gpt2", "train", "eager"), ("gpt2", "inference", "eager"),
                               ("llama_style", "train", "eager"), ("llama_style", "train", fp8),
                               ("llama_style", "inference", "eager"), ("llama_style", "inference", fp8)]


def test_stack_dumps_are_started_only_when_asked_for_a_positive_period(monkeypatch):
    started = []
    monkeypatch.setattr(harness, "start_stack_dumps", started.append)
    e2e.parse_args([])
    assert not started
    e2e.parse_args(["--stack-dumps", "90"])
    assert started == [90.0]
    with pytest.raises(SystemExit):
        e2e.parse_args(["--stack-dumps", "0"])


def test_stack_dumps_show_every_threads_current_function():
    ready, release = threading.Event(), threading.Event()

    def waiting_in_a_named_function():
        ready.set()
        release.wait(10)

    worker = threading.Thread(target=waiting_in_a_named_function, name="the-worker")
    worker.start()
    ready.wait(10)
    try:
        stacks = harness.format_stacks()
    finally:
        release.set()
        worker.join()
    assert "Thread the-worker:" in stacks and "waiting_in_a_named_function" in stacks
    assert "test_stack_dumps_show_every_threads_current_function" in stacks  # the calling thread too


def test_llama_style_step_flops_match_the_issue():
    s = e2e.make_setup(quick=False, device="cuda")
    with torch.device("meta"):  # the 12-layer model's shapes without its memory
        model = e2e.LlamaStyleLM(e2e.llama_style_config(s))
    c = model.config
    w = e2e.Workload(model, (), {}, torch.empty(0), 4 * 2048, (c.n_layers, 4, c.n_heads, 2048, c.head_dim, True))
    assert round(e2e.step_flops(w, training=True) / 1e12, 1) == 32.7  # issue 9: "about 32.7 TFLOP"


def test_e2e_targets_meets_and_miss_ratio():
    def part(**ms):
        return {"providers": {name: {"ms": v} for name, v in ms.items()}}

    train = part(**{"optimize": 80.0, "optimize (fp8=True)": 92.0, "optimize (fp8='auto')": 64.0})
    train["providers"]["optimize"]["peak_gib"] = 12.0
    payload = {"scale": "full", "models": {
        "llama_style": {"train": train, "inference": {"providers": {"optimize": {"error": "OutOfMemoryError"}}}},
        "gpt2": {"train": part(**{"torch.compile": 50.0, "optimize": 40.0})}}}
    got = {(t["model"], t["part"], t["unit"], t["target"]): t for t in e2e.targets(payload)}
    bf16 = got["llama_style", "train", "ms", 75.0]
    assert (bf16["meets"], bf16["miss_ratio"]) == (False, round(80 / 75, 3))
    fp8 = got["llama_style", "train", "ms", 65.0]
    assert (fp8["provider"], fp8["value"], fp8["meets"]) == ("optimize (fp8='auto')", 64.0, True)
    assert got["llama_style", "inference", "ms", 22.0]["meets"] is None  # an error is not a measurement
    assert got["llama_style", "train", "GiB", 13.2]["meets"] is True
    assert (got["gpt2", "train", "ms", 50.0]["meets"], got["gpt2", "train", "ms", 50.0]["miss_ratio"]) == (True, 0.8)
    assert all(t["model"] == "gpt2" for t in e2e.targets({**payload, "scale": "quick"}))


def test_e2e_cpu_cases_merge_plot_and_render(tmp_path):
    base = ["--device", "cpu", "--models", "llama_style", "--parts", "inference", "--out", str(tmp_path)]
    e2e.main(base + ["--providers", "eager", "optimize", "--fresh"])
    e2e.main(base + ["--providers", "torch.compile"])  # merged into the same file
    data = json.loads((tmp_path / "e2e_cpu.json").read_text())
    providers = data["models"]["llama_style"]["inference"]["providers"]
    assert list(providers) == ["eager", "torch.compile", "optimize"]
    ours = providers["optimize"]
    assert ours["report"]["rewrites_per_pass"]["attention"] == 2 and ours["report"]["verified"] is True
    assert ours["speedup_vs_compile"] == round(providers["torch.compile"]["ms"] / ours["ms"], 3)
    assert (tmp_path / "e2e_cpu.png").stat().st_size > 0
    (tmp_path / "e2e.json").write_text((tmp_path / "e2e_cpu.json").read_text())  # the name the README reads
    section = _section(render.render_all(tmp_path), "End to end")
    assert f"| inference | optimize | {ours['ms']:.2f} |" in section


# -------------------------------------------------------------------------------------- ring attention

def _model_fit(world_size: int, bytes_per_token: int, fixed: int) -> dict:
    points = [{"tokens_per_gpu": t, "peak_memory_bytes": bytes_per_token * t + fixed} for t in (8192, 16384, 32768)]
    return {"points": points, **ring_bench._fit_prediction(points, 100 * 10**9, world_size)}


def test_ring_attention_model_growth_against_n_fold():
    """1 MB per token on one GPU; 2% more on two (meets 0.9 x N), 20% more on four (misses it)."""
    worlds = [{"world_size": n, "model_fit": _model_fit(n, per_token, 5 * 10**9)}
              for n, per_token in ((1, 10**6), (2, 1_020_000), (4, 1_200_000))]
    ring_bench.model_growth(worlds)
    fits = [w["model_fit"] for w in worlds]
    assert [f["bytes_per_token_per_gpu"] for f in fits] == [10**6, 1_020_000, 1_200_000]
    assert fits[0]["fixed_bytes"] == 5 * 10**9
    # (100 GB x 0.95 - 5 GB) / bytes per token, rounded down to 1024 tokens, x N
    assert [f["predicted_total_tokens"] for f in fits] == [89088, 2 * 88064, 4 * 74752]
    assert [f["growth_vs_1_gpu"] for f in fits] == [1.0, round(2 * 88064 / 89088, 3), round(4 * 74752 / 89088, 3)]
    assert [f["meets_target"] for f in fits] == [True, True, False]


def test_ring_attention_model_run_keeps_the_attention_rows():
    previous = [{"world_size": 1, "device": "GPU-Z", "ring": [{"ms": 1.0}], "fit": {"x": 1}, "model_fit": {"old": 1}},
                {"world_size": 8, "device": "GPU-Z", "ring": [{"ms": 2.0}]}]
    new = [{"world_size": 1, "device": "GPU-Z", "model_fit": {"new": 1}},
           {"world_size": 2, "device": "GPU-Z", "model_fit": {"new": 2}}]
    merged = ring_bench.merge_worlds(previous, new, ("model",))
    assert [w["world_size"] for w in merged] == [1, 2, 8]
    assert merged[0] == {"world_size": 1, "device": "GPU-Z", "ring": [{"ms": 1.0}], "fit": {"x": 1},
                         "model_fit": {"new": 1}}
    assert merged[2] == previous[1]
    rerun = ring_bench.merge_worlds(merged, [{"world_size": 1, "device": "GPU-Z", "ring": []}], ("attention",))
    assert "fit" not in rerun[0] and rerun[0]["ring"] == [] and rerun[0]["model_fit"] == {"new": 1}


def test_ring_attention_model_run_merges_over_an_attention_file_of_another_kernel():
    """A model-only run (default --kernel flash) over attention rows measured with cudnn: their efficiency
    and the file's config stay cudnn's; each part keeps its environment."""
    previous = {"environment": {"command": "attention run"}, "config": {"kernel": "cudnn"},
                "worlds": [{"world_size": 1, "device": "GPU-Z", "single_gpu": [{"tokens": 8192, "cudnn": {"tflops": 500}}],
                            "ring": [{"tokens_per_gpu": 8192, "tflops": 450}]}]}
    options = ring_bench.run_options(ring_bench.parse_args(["--parts", "model"]), [1])
    worlds = [{"world_size": 1, "device": "GPU-Z", "model_fit": _model_fit(1, 10**6, 0)}]
    payload = ring_bench._payload(previous, worlds, options, "flash")
    assert payload["config"]["kernel"] == "cudnn"
    assert payload["worlds"][0]["ring"][0]["efficiency"] == 0.9
    assert payload["worlds"][0]["model_fit"]["growth_vs_1_gpu"] == 1.0
    assert payload["environments"]["attention"] == {"command": "attention run"}
    assert set(payload["environments"]) == {"attention", "model"} and payload["model_config"]["checkpointing"] == "off"
    other_device = ring_bench._payload(previous, [{**worlds[0], "device": "GPU-Y"}], options, "flash")
    assert [set(w) for w in other_device["worlds"]] == [{"world_size", "device", "model_fit"}]  # nothing merged


def test_ring_attention_arguments():
    args = ring_bench.parse_args(["--quick", "--parts", "model"])
    options = ring_bench.run_options(args, [1, 2])
    assert options["parts"] == ("model",)
    model = options["model"]
    assert (model["config"].n_layers, model["config"].dim, model["tokens"]) == (2, 2048, (4096, 8192))
    assert model["config"].max_seq_len == 2 * 8192  # RoPE rows for the longest sequence of any world
    full = ring_bench.run_options(ring_bench.parse_args([]), [1, 2, 4])["model"]
    assert full["config"] == LlamaStyleConfig(max_seq_len=4 * 16384) and full["tokens"] == (4096, 8192, 16384)
    with pytest.raises(SystemExit):  # the model's causal mask is proven up to 16384 tokens per GPU
        ring_bench.parse_args(["--model-tokens-per-gpu", "8192", "32768"])


def _ring_model_cases(world_size: int) -> dict:
    options = {"config": LlamaStyleConfig.tiny(max_seq_len=64), "tokens": (8, 16), "runs": 1,
               "example_tokens_per_gpu": 4}
    return ring_bench.model_part(world_size, options, device="cpu")


@pytest.mark.distributed
def test_ring_attention_model_part_runs_context_parallel_on_cpu(tmp_path):
    """The model part's per-rank flow on 2 gloo ranks (tiny fp32 model; no memory statistics on the CPU, so
    no fit): optimize verified the context-parallel model and rewrote its attention and RoPE."""
    ranks = run_in_spawned_ranks(_ring_model_cases, (2,), tmp_path, join_timeout_s=90)[2]
    for result in ranks:
        assert result["verified"] is True
        assert result["rewrites"] == ["context parallel: 2 RoPE table(s) indexed at the global positions",
                                      "context parallel: 2 attention call(s) -> ring_attention over the group"]
        assert result["graphs"] == 3  # the example inputs' length, then one capture per length (static shapes)
        assert [(p["tokens_per_gpu"], p["total_tokens"]) for p in result["points"]] == [(8, 16), (16, 32)]
        assert all(p["ms"] > 0 and "peak_memory_bytes" not in p for p in result["points"])
        assert "predicted_total_tokens" not in result


def test_fp8_run_of_some_parts_keeps_the_others(tmp_path):
    path = tmp_path / "fp8.json"
    path.write_text(json.dumps({"environment": {"date": "then"}, "ceilings": {"a": 1}, "sweep": [{"m": 1}],
                                "environments": {"sweep": {"date": "before"}}}))
    kept = earlier_parts(path, ["ceilings", "sweep", "linear"])
    assert kept["ceilings"] == {"a": 1} and kept["sweep"] == [{"m": 1}] and "linear" not in kept
    assert kept["environments"] == {"ceilings": {"date": "then"}, "sweep": {"date": "before"}}
    assert earlier_parts(path, ["linear"]) == {}
    assert earlier_parts(tmp_path / "none.json", ["sweep"]) == {}
