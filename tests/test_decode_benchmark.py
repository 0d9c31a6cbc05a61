"""benchmarks/decode.py: the whole flow on the CPU (a tiny fp32 Llama, every provider: rows or errors, tokens
equal to transformers eager's, no HBM limit), and its HBM-limit arithmetic, targets, merge and arguments on
made-up numbers; benchmarks/profile_warm_up.py's timing of first calls and its report of what Dynamo compiled."""

from __future__ import annotations

import cProfile
import json
import pstats

import pytest
import torch

import kernel_pytorch
from benchmarks import decode
from benchmarks.harness import dynamo_snapshot
from benchmarks.profile_warm_up import SizePinningGuards, dynamo_line, time_generate_calls

from .generation_models import causal_lm


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> tuple[dict, object]:
    out = tmp_path_factory.mktemp("decode")
    # compile=False, the CPU's default anyway: --optimize reaches optimize and is recorded
    decode.main(["--device", "cpu", "--prefill-graphs-ab", "--optimize", '{"compile": false}', "--out", str(out)])
    return json.loads((out / "decode_cpu.json").read_text()), out


def test_cpu_run_has_every_provider_with_rows_or_an_error(cpu_run):
    data, out = cpu_run
    assert data["scale"] == "cpu" and data["targets"] == []
    providers = data["models"]["1b"]["providers"]
    assert list(providers) == list(decode.PROVIDERS)
    for name, result in providers.items():
        if "error" in result:  # a provider that raises is a row with its error (optimize's fast path is new)
            assert result["error"].split(":")[0], name
            continue
        assert result["warmup_s"] >= 0 and set(result["ttft_ms"]) == {"8", "32"}, name
        assert set(result["batches"]) == {"1", "2"}, name
        for point in result["batches"].values():
            assert "error" in point or point["decode_tokens_per_s"] == pytest.approx(
                point["decode_tokens_per_s_per_seq"] * point["batch"], rel=1e-3), (name, point)
    assert (out / "decode_cpu.png").stat().st_size > 0
    assert len(data["summary"]) == len(decode.PROVIDERS)


def test_cpu_run_marks_the_hbm_limit_not_applicable(cpu_run):
    data, _ = cpu_run
    assert data["hbm"] == {"not_applicable": "cpu run: no HBM limit"}
    for result in data["models"]["1b"]["providers"].values():
        for point in result.get("batches", {}).values():
            assert "hbm_share" not in point and "hbm_limit_tokens_per_s" not in point
            assert "error" in point or point["hbm_limit"] == "not applicable on cpu"


def test_cpu_run_tokens_agree_with_eager(cpu_run):
    data, _ = cpu_run
    providers = data["models"]["1b"]["providers"]
    assert len(providers[decode.EAGER]["tokens_batch1"]) == 8
    for name, result in providers.items():
        if "error" not in result:
            assert result["equal_leading_tokens_vs_eager"] == result["tokens_compared"] == 8, name


def test_cpu_run_records_what_each_provider_did(cpu_run):
    data, _ = cpu_run
    providers = data["models"]["1b"]["providers"]
    record = providers[decode.STATIC_COMPILE]["transformers_compile"]
    assert record["compiled_decode_steps"] is False and "cpu" in record["why_not"]  # transformers: GPUs only
    loop = providers[decode.STATIC_LOOP]
    assert "error" in loop or loop["compile"]["mode"] == "reduce-overhead"
    ours = providers[decode.OURS]
    assert isinstance(ours["report_generation_lines"], list) and ours["optimize_options"] == {"compile": False}
    if "error" not in ours:
        sweep = ours["recompiles"]
        assert len(sweep["batch_x_prompt"]) + len(sweep["errors"]) == 4 and sweep["graphs_compiled"] >= 0
        with_graphs = ours["with_prefill_graphs"]  # the same model, lanes rebuilt with prompt buckets
        assert set(with_graphs["ttft_ms"]) == {"8", "32"} and set(with_graphs["batches"]) == set(ours["batches"])
        assert with_graphs["lanes"].startswith("generation lanes: ") and "1 sequences x" in with_graphs["lanes"]
        # the peak memory of each arm's batch points and TTFTs: a GPU's figure, None on the CPU
        assert with_graphs["points_peak_gib"] is None and ours["points_peak_gib"] is None
        assert isinstance(ours["warm_up_recompile_reasons"], list)


def _info() -> dict:
    return {"weight_bytes": 1000, "embedding_bytes": 200, "embedding_row_bytes": 2, "kv_bytes_per_token": 4,
            "config": {"vocab_size": 100}}


def test_decode_step_bytes_and_hbm_limit():
    # weights 1000 - embedding 200 + 3 rows x 2 B, then 3 sequences x 4 B per token x 10 tokens
    assert decode.decode_step_bytes(_info(), 3, 10.0) == 806 + 120
    s = decode.make_setup(quick=False, device="cuda")  # prompt 512, 256 new tokens: mean cache length 640
    limit = decode.hbm_limit(_info(), {"copy_gb_per_s": 1.0}, 2, s)
    step = 1000 - 200 + 2 * 2 + 2 * 4 * 640
    assert limit["mean_cache_length"] == 640 and limit["step_bytes"] == step
    assert limit["hbm_limit_tokens_per_s_per_seq"] == round(1e9 / step, 1)
    assert limit["hbm_limit_tokens_per_s"] == round(2e9 / step, 1)
    assert decode.hbm_limit(_info(), {"not_applicable": "cpu"}, 1, s) == {}


def _provider(per_seq: dict[int, float], share: float | None = None, ttft: dict | None = None, **extra) -> dict:
    batches = {str(b): {"decode_tokens_per_s_per_seq": v} for b, v in per_seq.items()}
    if share is not None:
        batches["1"]["hbm_share"] = share
    return {"batches": batches, "ttft_ms": ttft or {}, **extra}


def test_targets_meets_and_misses():
    payload = {"scale": "full", "models": {"1b": {"providers": {
        decode.STATIC_COMPILE: _provider({1: 90.0}, ttft={"512": 30.0, "4096": {"error": "OutOfMemoryError: x"}}),
        decode.STATIC_LOOP: _provider({1: 100.0, 8: 80.0}, ttft={"512": 25.0, "4096": 200.0}),
        decode.OURS: _provider({1: 140.0, 8: 120.0}, share=0.5, ttft={"512": 20.0, "4096": 250.0},
                               warmup_s=45.0, recompiles={"graphs_compiled": 3}),
    }}}}
    got = {t["what"]: t for t in decode.targets(payload)}
    share = got["batch-1 decode, share of the HBM limit"]
    assert (share["target"], share["meets"], share["miss_ratio"], share["missed_by"]) == (0.55, False, 1.1, 0.05)
    b1, b8 = got["batch-1 decode >= 1.3x static loop (reduce-overhead)"], got[
        "batch-8 decode >= 1.3x static loop (reduce-overhead)"]
    assert (b1["target"], b1["meets"], b1["missed_by"]) == (130.0, True, None)
    assert (b8["target"], b8["meets"]) == (104.0, True)
    prefix = "TTFT at prompt {} <= the faster of transformers static compile and static loop (reduce-overhead)"
    assert (got[prefix.format(512)]["target"], got[prefix.format(512)]["meets"]) == (25.0, True)
    long = got[prefix.format(4096)]
    assert (long["target"], long["meets"], long["miss_ratio"]) == (200.0, False, 1.25)  # the error is no time
    assert got["warm-up (setup + first generate)"]["meets"] is True
    recompiles = got["graphs compiled after warm-up (recompile sweep)"]
    assert (recompiles["meets"], recompiles["miss_ratio"], recompiles["missed_by"]) == (False, None, 3)
    missing = decode.targets({"scale": "full", "models": {"7b": {"providers": {decode.OURS: {"error": "E: x"}}}}})
    assert [t["meets"] for t in missing] == [None, None] and missing[0]["target"] == 0.8
    assert decode.targets({**payload, "scale": "cpu"}) == []


def test_merge_keeps_the_batch_points_not_measured_again():
    old = {"warmup_s": 9.0, "batches": {"1": {"date": "then", "x": 1}, "32": {"date": "then", "x": 32}}}
    new = {"warmup_s": 5.0, "batches": {"8": {"date": "now", "x": 8}, "1": {"date": "now", "x": 1}}}
    merged = decode.merge_provider(old, new)
    assert merged["warmup_s"] == 5.0 and list(merged["batches"]) == ["1", "8", "32"]
    assert [p["date"] for p in merged["batches"].values()] == ["now", "now", "then"]
    assert decode.merge_provider(old, {"error": "E: x"}) == {"error": "E: x"}


def test_arguments():
    assert decode.parse_args([]).models == ["1b", "7b"]
    assert decode.parse_args(["--quick"]).models == ["1b"]
    quick = decode.make_setup(quick=True, device="cuda")
    assert (quick.batches, quick.new_tokens, quick.prompt) == ((1,), 64, 512)
    with pytest.raises(SystemExit):
        decode.parse_args(["--quick", "--device", "cpu"])
    with pytest.raises(SystemExit):
        decode.parse_args(["--models", "70b"])
    args = decode.parse_args(["--providers", "optimize", "--batches", "1", "8"])
    assert args.providers == ["optimize"] and args.batches == [1, 8]


def test_generation_lines_of_a_report():
    report = {"notes": ["generation: lane of 1 sequences", "verified"], "graphs": 2,
              "rewrites": [{"pass_name": "generation", "location": "model", "replacement": "static loop"},
                           {"pass_name": "norms", "location": "model.norm", "replacement": "RMSNorm"}]}
    assert decode.generation_lines(report) == ["notes: generation: lane of 1 sequences",
                                               "rewrites: pass_name=generation; location=model; replacement=static loop"]
    assert decode.generation_lines({"notes": []}) == []


def test_decode_kernel_lines_count_each_decision_once():
    rewrite = {"pass_name": "decode_linear", "replacement": "q_proj + k_proj + v_proj (1 rows) -> grouped_linear"}
    report = {"rewrites": [rewrite, dict(rewrite), {"pass_name": "norms", "replacement": "RMSNorm"},
                           {"pass_name": "attention", "replacement": "attention (cudnn)"}],
              "skipped": [{"pass_name": "decode_attention", "reason": "SDPA kept, faster here"}]}
    assert decode.decode_kernel_lines(report) == [
        "2 x decode_linear rewrite: q_proj + k_proj + v_proj (1 rows) -> grouped_linear",
        "1 x attention rewrite: attention (cudnn)",
        "1 x decode_attention skip: SDPA kept, faster here"]


def test_profile_warm_up_times_and_profiles_the_first_calls_and_tells_recompiles_apart():
    model = kernel_pytorch.optimize(causal_lm("llama"), generation=True)
    profiler = cProfile.Profile()
    line = time_generate_calls(model, 2, profiler, prompt=12, new_tokens=3)
    assert line.startswith("generate at batch 2 (prompt 12, 3 new tokens): first ") and ", second " in line
    assert any(name == "generate" for (_, _, name) in pstats.Stats(profiler).stats)
    before = dynamo_snapshot()
    model.generate(torch.ones(5, 7, dtype=torch.long), max_new_tokens=2)  # batch 8's lane: nothing compiled
    assert dynamo_line(before, "a call").endswith("counters moved none; recompile reasons: none")
    before = dynamo_snapshot()
    model.generate(torch.ones(1, 7, dtype=torch.long), max_new_tokens=2)  # batch 1: graphs of its own
    line = dynamo_line(before, "a call")
    assert "counters moved {'unique_graphs': 2" in line and "2 <= kwargs['input_ids'].size()[0]" in line


def test_size_pinning_guards_print_only_the_guards_that_pin_a_size(capsys):
    compiled = torch.compile(lambda x: x * 2 if x.shape[0] == 3 else x + 1, dynamic=True, backend="eager")
    with SizePinningGuards():
        compiled(torch.randn(3))  # Eq(s, 3): the size pinned
        compiled(torch.randn(5))  # Ne(s, 3): not a pin
    printed = capsys.readouterr().out
    assert printed.count("== guard: ") == 1 and "Eq(" in printed and "Ne(" not in printed
