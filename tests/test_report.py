"""The report's rendering: the verification line says what was compared and how it came out, and rewrite,
skip and rollback rows repeated once per captured graph are grouped (the records stay one per graph)."""

from __future__ import annotations

import copy
import math

import torch
from rich.console import Console
from torch import nn

import kernel_pytorch
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.report import (OptimizationReport, RewriteRecord, RollbackRecord, SkipRecord, VerificationRecord,
                                   _graph_list, natural_order)
from kernel_pytorch.verify import NOTHING_COMPARED, Comparison, Run, compare, compared_counts, run_reference

from .hf_models import llama


def _rendered(report: OptimizationReport, width: int = 200) -> str:
    console = Console(record=True, width=width)
    report.print(console)
    return console.export_text()


def _verification_line(report: OptimizationReport) -> str:
    """The verification row's text (width 400: one line)."""
    [line] = [line for line in _rendered(report, width=400).splitlines() if "│ verification" in line]
    return line.split("│")[2].strip()


def _table(text: str, title: str) -> tuple[str, list[tuple[str, ...]]]:
    """The full title and the rows of the rendered table whose title starts with ``title``; a row folded over
    several lines (an empty first cell) is joined back."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title + " ("))
    rows: list[list[str]] = []
    for line in lines[start + 1:]:
        if line.startswith("└"):
            break
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
    return lines[start].strip(), [tuple(row) for row in rows]


# -- compared_counts ----------------------------------------------------------------------------------------------


def _run(scale: float = 1.0, **changes) -> Run:
    outputs = {"['logits']": torch.arange(6.0).reshape(2, 3) * scale, "['hidden']": torch.ones(4),
               "['steps']": 3, **changes.pop("outputs", {})}
    gradients = {"weight": torch.full((3,), 2.0), "bias": torch.ones(3), "unused": None,
                 **changes.pop("gradients", {})}
    return Run(outputs, gradients)


def test_compared_counts_counts_tensors_and_sees_bit_identity():
    assert compared_counts(_run(), _run()) == (2, 2, True)  # the plain value 3 and the None gradient: no tensors
    assert compared_counts(_run(scale=1.0 + 1e-7), _run()) == (2, 2, False)
    assert compared_counts(_run(outputs={"['hidden']": torch.ones(4, dtype=torch.float64)}), _run())[2] is False
    assert compared_counts(_run(outputs={"['steps']": 4}), _run()) == (2, 2, False)


def test_relative_error_over_slices_equals_the_whole_computation(monkeypatch):
    from kernel_pytorch.verify import numerics

    torch.manual_seed(0)
    expected = torch.randn(3, 50, 7)
    expected[0, 3, 1], expected[2, 10, 4] = float("inf"), float("nan")
    actual = expected + 1e-3 * torch.randn_like(expected)
    actual[0, 3, 1], actual[2, 10, 4] = float("inf"), float("nan")
    finite = torch.isfinite(expected)
    whole = float((actual[finite].double() - expected[finite].double()).norm() / expected[finite].double().norm())
    rms = float(expected[finite].double().norm()) / math.sqrt(int(finite.sum()))
    monkeypatch.setattr(numerics, "_SLICE", 64)  # 17 slices, the non-finite values in two of them
    assert abs(numerics.relative_error(actual, expected) - whole) < 1e-12 * whole
    assert abs(numerics._rms(expected) - rms) < 1e-12 * rms
    moved = actual.clone()
    moved[2, 10, 4] = 0.0  # a NaN that became a number
    assert numerics.relative_error(moved, expected) == float("inf")


def test_the_referee_goes_to_the_gpu_the_host_or_nowhere_by_the_memory_each_has(monkeypatch):
    from kernel_pytorch.verify import referee

    weight = torch.zeros(1024, dtype=torch.bfloat16)
    outputs = Run({"['logits']": torch.zeros(256, dtype=torch.bfloat16)}, None)
    # float32 weight and gradient, twice over (16 KiB), and 4 float32 copies of the logits (4 KiB)
    assert referee.float32_bytes_needed([weight, torch.zeros(8)], True, outputs) == 16 * 1024 + 4 * 1024
    monkeypatch.setattr(referee, "float32_fits", lambda *a: None)
    assert referee.referee_device([weight], True, outputs) == (None, "")
    monkeypatch.setattr(referee, "float32_fits", lambda *a: "a float32 copy needs ~1.0 GiB, 0.1 GiB free on cuda:0")
    monkeypatch.setattr(referee, "available_host_bytes", lambda: 2**40)
    assert referee.referee_device([weight], True, outputs) == (torch.device("cpu"), referee.float32_fits())
    monkeypatch.setattr(referee, "available_host_bytes", lambda: 1024)
    device, why = referee.referee_device([weight], True, outputs)
    assert device is None and why.endswith("host memory available: 0.0 GiB"), why


def _loss_run(loss: float, logits: torch.Tensor) -> Run:
    return Run({"['loss']": torch.tensor(loss), "['logits']": logits}, None)


def test_a_float32_loss_of_a_bf16_model_is_judged_by_bf16_tolerance():
    """transformers computes the ``labels=`` loss in float32 from bf16 logits: its rounding is bf16's."""
    logits = torch.randn(4, 8).bfloat16()
    moved = compare(_loss_run(2.0 * (1 + 1e-3), logits), _loss_run(2.0, logits), OptimizeConfig())
    assert moved.ok and moved.tolerance == 2e-2, moved
    wrong = compare(_loss_run(2.0 * 1.1, logits), _loss_run(2.0, logits), OptimizeConfig())
    assert not wrong.ok and wrong.worst == "output ['loss']", wrong
    all_float32 = compare(_loss_run(2.0 * (1 + 1e-3), logits.float()), _loss_run(2.0, logits.float()),
                          OptimizeConfig())
    assert not all_float32.ok and all_float32.tolerance == 1e-5, all_float32


def test_compared_counts_a_gradient_counts_when_a_tensor_on_either_side():
    with_unused = _run(gradients={"unused": torch.zeros(3)})
    assert compared_counts(with_unused, _run()) == (2, 3, False)  # zeros against None: compared, not identical
    assert compared_counts(_run(), with_unused) == (2, 3, False)


def test_compared_counts_matches_what_compare_compares():
    no_gradients = Run(_run().outputs, None)
    assert compared_counts(no_gradients, _run()) == (2, 0, True)
    other_structure = Run({"['logits']": torch.zeros(2, 3)}, None)
    assert compared_counts(other_structure, _run()) == (0, 0, False)
    assert not compare(other_structure, _run(), OptimizeConfig()).ok


def test_compared_counts_on_a_model_against_its_copy():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    twin = copy.deepcopy(model)
    x = torch.randn(5, 4)
    run = run_reference(model, (x,), None, dict(model.named_parameters()))
    assert compared_counts(run_reference(twin, (x,), None, dict(twin.named_parameters())), run) == (1, 4, True)
    with torch.no_grad():
        twin[2].bias.add_(1e-3)
    assert compared_counts(run_reference(twin, (x,), None, dict(twin.named_parameters())), run) == (1, 4, False)


def test_the_nothing_compared_sentinel_is_not_described_as_an_output():
    assert compare(Run({}, None), Run({}, None), OptimizeConfig()).worst == NOTHING_COMPARED  # behaviour kept
    text = Comparison(True, NOTHING_COMPARED, 0.0, 1.0).describe()
    assert not text.startswith(NOTHING_COMPARED) and "every error 0" in text


# -- the verification line -----------------------------------------------------------------------------------------


def _verified(rewritten: bool = True, **fields) -> OptimizationReport:
    record = dict(passed=True, worst="output ['logits']", error=1.87e-7, tolerance=1e-5, compared_gradients=True,
                  outputs_compared=3, gradients_compared=12)
    rewrites = [RewriteRecord(pass_name="norms", location="norm", replacement="RMSNorm", graph="graph 0")]
    return OptimizationReport(graphs=1, rewrites=rewrites if rewritten else [],
                              verification=VerificationRecord(**{**record, **fields}))


def test_verification_says_when_nothing_was_compared():
    line = _verification_line(_verified(worst=NOTHING_COMPARED, error=0.0, tolerance=1.0, compared_gradients=False,
                                        outputs_compared=0, gradients_compared=0, identical=True))
    assert line == "passed: no tensor outputs to compare"


def test_verification_says_bit_identical():
    line = _verification_line(_verified(worst=NOTHING_COMPARED, error=0.0, tolerance=1.0, identical=True))
    assert line == "passed: all 3 outputs and 12 gradients bit-identical to the original"
    one = _verified(worst=NOTHING_COMPARED, error=0.0, tolerance=1.0, outputs_compared=1, gradients_compared=0,
                    compared_gradients=False, identical=True)
    assert _verification_line(one) == "passed: 1 output bit-identical to the original"


def test_verification_says_nothing_was_rewritten_and_what_was_compared():
    identical = _verified(rewritten=False, worst=NOTHING_COMPARED, error=0.0, tolerance=1.0, identical=True)
    assert _verification_line(identical) == ("passed: nothing was rewritten; all 3 outputs and 12 gradients "
                                             "bit-identical to the original")
    # Nothing rewritten, yet the compiler's reordering changed the last bits.
    assert _verification_line(_verified(rewritten=False)) == (
        "passed: nothing was rewritten; worst output ['logits'] error 1.87e-07 (tolerance 1e-05); "
        "3 outputs, 12 gradients compared")


def test_verification_worst_error_then_what_was_compared():
    assert _verification_line(_verified()) == ("passed: worst output ['logits'] error 1.87e-07 (tolerance 1e-05); "
                                               "3 outputs, 12 gradients compared")
    failed = _verified(passed=False, worst="gradient of layers.0.weight", error=3e-3)
    assert _verification_line(failed) == ("FAILED: worst gradient of layers.0.weight error 3.00e-03 "
                                          "(tolerance 1e-05); 3 outputs, 12 gradients compared")


def test_verification_says_why_gradients_were_not_compared():
    line = _verification_line(_verified(compared_gradients=False, gradients_compared=0,
                                        not_compared="optimize ran under torch.inference_mode()"))
    assert line == ("passed: worst output ['logits'] error 1.87e-07 (tolerance 1e-05); 3 outputs compared; "
                    "gradients not compared: optimize ran under torch.inference_mode()")


def test_verification_never_prints_the_sentinel_as_an_output():
    # Every error 0 without bit-identity (NaN in the same places): compare keeps the sentinel as ``worst``.
    line = _verification_line(_verified(worst=NOTHING_COMPARED, error=0.0, tolerance=1.0))
    assert NOTHING_COMPARED not in line
    assert line == "passed: every error 0 (equal values, not bit-identical); 3 outputs, 12 gradients compared"


def test_verification_by_float32_referee_keeps_its_detail_and_adds_the_counts():
    line = _verification_line(_verified(rule="float32 referee", detail="output ['logits']: within 2.1e-02"))
    assert line == "passed (float32 referee): output ['logits']: within 2.1e-02; 3 outputs, 12 gradients compared"


def test_a_record_without_counts_renders_as_before_and_round_trips():
    legacy = VerificationRecord(passed=True, worst="output ['logits']", error=1.87e-7, tolerance=1e-5,
                                compared_gradients=False)
    assert _verification_line(OptimizationReport(rewrites=_verified().rewrites, verification=legacy)) == (
        "passed: worst output ['logits'] error 1.87e-07 (tolerance 1e-05)")
    data = _verified(not_compared="no trainable inputs").to_dict()["verification"]
    assert data["outputs_compared"] == 3 and data["gradients_compared"] == 12 and data["identical"] is False
    assert data["not_compared"] == "no trainable inputs"
    assert OptimizationReport.model_validate(_verified().to_dict()) == _verified()


# -- grouped rewrite, skip and rollback rows -----------------------------------------------------------------------


def _many_graphs_report() -> OptimizationReport:
    """What a generate() leaves: the same rewrites in graphs 0-3 and 7 (graphs 4-6 hit other code), a kernel
    choice that differs for the symbolic-shape graphs, module-pass records and a model-level skip."""
    graphs = ["graph 0", "graph 1", "graph 2", "graph 3", "graph 7"]
    rewrites = [RewriteRecord(pass_name="activations", location="mlp", replacement="packed", graph="modules")]
    skipped = [SkipRecord(pass_name="fp8", location="(model)", reason="fp8=False")]
    rollbacks = []
    for graph in graphs:
        for layer in (10, 2, 0):  # out of order: the table orders them naturally
            rewrites.append(RewriteRecord(pass_name="norms", location=f"layers.{layer}.norm", replacement="RMSNorm",
                                          graph=graph))
            kernel = "cudnn" if graph in ("graph 0", "graph 7") else "sdpa (symbolic shapes)"
            rewrites.append(RewriteRecord(pass_name="attention", location=f"layers.{layer}.attn",
                                          replacement=f"attention: {kernel}", graph=graph))
        skipped.append(SkipRecord(pass_name="horizontal_gemm", location="layers.0.mlp", reason="too few tokens",
                                  graph=graph))
        rollbacks.append(RollbackRecord(pass_name="rope", graph=graph, reason="rolled back: error 1e-2"))
    return OptimizationReport(graphs=8, rewrites=rewrites, skipped=skipped, rollbacks=rollbacks)


def test_rewrites_are_grouped_with_counts_and_graphs_in_natural_order():
    report = _many_graphs_report()
    title, rows = _table(_rendered(report), "rewrites")
    assert title == "rewrites (10 in 31 records over 5 graphs and the modules)"
    assert rows == [
        ("activations", "mlp", "packed", "1", "modules"),
        ("norms", "layers.0.norm", "RMSNorm", "5", "graph 0-3, 7"),
        ("norms", "layers.2.norm", "RMSNorm", "5", "graph 0-3, 7"),
        ("norms", "layers.10.norm", "RMSNorm", "5", "graph 0-3, 7"),
        ("attention", "layers.0.attn", "attention: cudnn", "2", "graph 0, 7"),
        ("attention", "layers.0.attn", "attention: sdpa (symbolic shapes)", "3", "graph 1-3"),
        ("attention", "layers.2.attn", "attention: cudnn", "2", "graph 0, 7"),
        ("attention", "layers.2.attn", "attention: sdpa (symbolic shapes)", "3", "graph 1-3"),
        ("attention", "layers.10.attn", "attention: cudnn", "2", "graph 0, 7"),
        ("attention", "layers.10.attn", "attention: sdpa (symbolic shapes)", "3", "graph 1-3"),
    ]


def test_skips_and_rollbacks_are_grouped_too():
    text = _rendered(_many_graphs_report())
    title, rows = _table(text, "skipped")
    assert title == "skipped (2 in 6 records over 5 graphs and the model)"
    assert rows == [("fp8", "(model)", "fp8=False", "1", "-"),
                    ("horizontal_gemm", "layers.0.mlp", "too few tokens", "5", "graph 0-3, 7")]
    title, rows = _table(text, "rolled back")
    assert title == "rolled back (1 in 5 records over 5 graphs)"
    assert rows == [("rope", "rolled back: error 1e-2", "5", "graph 0-3, 7")]


def test_the_records_stay_one_per_graph():
    report = _many_graphs_report()
    _rendered(report)
    data = report.to_dict()
    assert len(report.rewrites) == len(data["rewrites"]) == 31 and len(data["skipped"]) == 6
    assert [r["graph"] for r in data["rewrites"] if r["location"] == "layers.2.norm"] == [
        "graph 0", "graph 1", "graph 2", "graph 3", "graph 7"]


def test_graph_lists_and_natural_order():
    assert _graph_list(["graph 7", "graph 1", "graph 0", "graph 2", "graph 3", "graph 1"]) == "graph 0-3, 7"
    assert _graph_list(["graph 10", "graph 9", "graph 2"]) == "graph 2, 9-10"
    assert _graph_list(["modules"]) == "modules" and _graph_list([""]) == "-"
    names = ["layers.10", "", "0", "layers.2", "h.1", "layers.2.x"]
    assert sorted(names, key=natural_order) == ["", "0", "h.1", "layers.2", "layers.2.x", "layers.10"]


def test_a_transformers_model_called_at_two_lengths_renders_each_rewrite_once():
    torch.manual_seed(0)
    model, inputs, _ = llama()
    model.eval()
    kernel_pytorch.optimize(model, example_inputs=inputs)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 101, (2, 13)))  # a second sequence length: a second graph
    report = kernel_pytorch.report_of(model)
    assert report.graphs >= 2
    title, rows = _table(_rendered(report), "rewrites")
    keys = [row[:3] for row in rows]
    assert len(keys) == len(set(keys)), keys
    assert sum(int(row[3]) for row in rows) == len(report.rewrites) > len(rows)
    norm_rows = [row for row in rows if row[0] == "norms"]
    assert norm_rows and all(row[3:] == ("2", "graph 0-1") for row in norm_rows), norm_rows
    assert title.startswith(f"rewrites ({len(rows)} in {len(report.rewrites)} records over 2 graphs")


def test_bracketed_text_is_printed_as_written_not_read_as_markup():
    report = OptimizationReport(rewrites=[RewriteRecord(pass_name="attention", location="layers.0.attn",
                                                        replacement="attention[sdpa]: causal", graph="graph 0")],
                                notes=["kernel [flex] chosen"])
    console = Console(record=True, width=200)
    console.print(report)
    text = console.export_text()
    assert "attention[sdpa]: causal" in text and "kernel [flex] chosen" in text


def test_unless_out_of_memory_returns_none_and_empties_the_cache_after_the_failed_run(monkeypatch):
    from kernel_pytorch.verify import numerics

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    def out_of_memory():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 46.97 GiB")

    assert numerics.unless_out_of_memory(lambda: 3) == 3 and not emptied
    assert numerics.unless_out_of_memory(out_of_memory) is None and emptied == [True]
