"""Shape buckets (issue 27): ``optimize(model, shape_buckets=...)`` serves calls of varying batch size and length from
one static graph per bucket, padding masked and outputs sliced back; padding that changes the outputs is refused."""

from __future__ import annotations

import copy
import json
import time
import warnings

import pytest
import torch
import torch.nn as nn
import transformers

import kernel_pytorch
from kernel_pytorch import report_of
from kernel_pytorch.compiled_call import RECOMPILE_LIMIT, RecompileLimitWarning
from kernel_pytorch.config import OptimizeConfig, ShapeBucketsConfig
from kernel_pytorch.errors import ConfigError
from kernel_pytorch.features.shape_buckets import (ShapeBucketError, auto_batch_buckets, auto_length_buckets,
                                                   warm_up)
from kernel_pytorch.features.shape_buckets.ladder import bucket_for
from kernel_pytorch.features.shape_buckets.wrapper import graphs_per_entry

from .conftest import rel_err, twin

FLOAT32 = OptimizeConfig().tolerance_for(torch.float32).outputs


# ----------------------------------------------------------------------------------------------------- models

def bert():
    config = transformers.BertConfig(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=80, max_position_embeddings=64)
    return transformers.BertModel(config), "last_hidden_state"


def distilbert():
    config = transformers.DistilBertConfig(vocab_size=101, dim=48, n_layers=2, n_heads=4, hidden_dim=80,
                                           max_position_embeddings=64)
    return transformers.DistilBertModel(config), "last_hidden_state"


def gpt2():
    config = transformers.GPT2Config(vocab_size=101, n_embd=48, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config), "logits"


def llama():
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config), "logits"


def tokens(batch: int, length: int, padded_rows: int = 0) -> dict[str, torch.Tensor]:
    """Fresh token ids and a mask of ones, the last ``padded_rows`` rows with their last 3 positions masked."""
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded_rows:
        mask[-padded_rows:, -3:] = 0
    return {"input_ids": torch.randint(3, 101, (batch, length)), "attention_mask": mask}


def optimized(make, **options):
    torch.manual_seed(0)
    model, key = make()
    model.eval()
    reference = twin(model)
    model = kernel_pytorch.optimize(model, example_inputs=tokens(2, 11), shape_buckets="auto", **options)
    return model, reference, key


class Embedded(nn.Module):
    """Token embeddings through ``mix`` (a function of the hidden states and the mask), then a linear head."""

    def __init__(self, mix=None):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 8)
        self.mix = mix or (lambda h, mask: h)

    def forward(self, input_ids, attention_mask=None):
        return self.out(self.mix(self.emb(input_ids), attention_mask))


class TokenBatchNorm(nn.Module):
    """BatchNorm1d over the tokens' channels: (batch, channels, length)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 8)

    def forward(self, input_ids, attention_mask=None):
        return self.out(self.norm(self.emb(input_ids).transpose(1, 2)).transpose(1, 2))


def running_mean(h, mask):
    return h.cumsum(dim=1) / torch.arange(1, h.shape[1] + 1).view(1, -1, 1)


def masked_mean(h, mask):
    weights = mask.unsqueeze(-1).to(h.dtype)
    return (h * weights).sum(1) / weights.sum(1)


def small(mix=None, train=False, dynamic=None, **buckets):
    torch.manual_seed(0)
    model = (Embedded(mix) if mix != "batch_norm" else TokenBatchNorm()).train(train)
    reference = twin(model)
    example = {"input_ids": torch.randint(0, 50, (2, 9)), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    model = kernel_pytorch.optimize(model, example_inputs=example, shape_buckets=buckets or "auto", dynamic=dynamic)
    return model, reference


def note(model) -> str:
    notes = [n for n in report_of(model).notes if n.startswith("shape buckets")]
    assert len(notes) == 1, report_of(model).notes
    return notes[0]


# ------------------------------------------------------------------------------------------- ladders, config

def test_auto_ladders():
    assert auto_batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert auto_batch_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert auto_length_buckets(512) == (16, 32, 48, 64, 80, 96, 112, 128, 192, 256, 384, 512)
    assert auto_length_buckets(4096)[-6:] == (768, 1024, 1536, 2048, 3072, 4096)
    assert auto_length_buckets(100) == (16, 32, 48, 64, 80, 96, 100)
    assert (bucket_for(16, (16, 32)), bucket_for(17, (16, 32)), bucket_for(33, (16, 32))) == (16, 32, None)


def test_config_shorthands():
    assert OptimizeConfig().shape_buckets is None
    assert OptimizeConfig(shape_buckets=False).shape_buckets is None
    assert OptimizeConfig(shape_buckets="auto").shape_buckets == ShapeBucketsConfig()
    assert OptimizeConfig(shape_buckets=[64, 128]).shape_buckets.length == (64, 128)
    config = OptimizeConfig(shape_buckets={"batch": [1, 8]})
    assert OptimizeConfig.model_validate(config.model_dump()) == config  # dumped and read back


@pytest.mark.parametrize("options, line", [
    ({"shape_buckets": "on"}, "shape_buckets takes None or False (off), 'auto', a list of sequence lengths, a "
                              "ShapeBucketsConfig or a dict of its fields, got 'on'"),
    ({"shape_buckets": [32, 16]}, "shape_buckets.length=[32, 16] must be distinct sizes in ascending order"),
    ({"shape_buckets": {"batch": [4, 4]}}, "shape_buckets.batch=[4, 4] must be distinct sizes in ascending order"),
    ({"shape_buckets": {"batch": [1, 2], "max_batch": 8}},
     "shape_buckets.max_batch sets the largest bucket of batch='auto'; with batch=(1, 2) the largest listed bucket "
     "is the limit"),
    ({"shape_buckets": {"beyond_largest": "grow"}},
     "shape_buckets.beyond_largest='grow' is not allowed; use one of: 'error', 'new_bucket'"),
    ({"shape_buckets": "auto", "memory": {"offload_activations": True}},
     "shape_buckets does not combine with memory.offload_activations: bucketed calls run compiled entries of their "
     "own, outside its wrapper"),
])
def test_config_errors_are_one_line(options, line):
    with pytest.raises(ConfigError) as caught:
        OptimizeConfig(**options)
    assert str(caught.value) == line


# --------------------------------------------------------------------------------- transformers, end to end

# One graph serves every bucket (dynamic sizes); with dynamic=False, one static-shape graph per bucket hit.
@pytest.mark.parametrize("make, dynamic, graphs", [(bert, None, 1), (distilbert, None, 1), (gpt2, None, 1),
                                                   (llama, None, 1), (bert, False, 2), (llama, False, 2)])
def test_bucketed_outputs_equal_unbucketed(make, dynamic, graphs):
    model, reference, key = optimized(make, dynamic=dynamic)
    assert "padding the batch and the sequence kept the outputs" in note(model)
    assert report_of(model).verification.passed
    # (batch, length): on a bucket, just above one, into buckets already captured (the example's is (2, 16))
    for batch, length, padded_rows in ((4, 32, 1), (3, 17, 2), (4, 20, 1), (2, 16, 0), (2, 5, 0)):
        inputs = tokens(batch, length, padded_rows)
        with torch.no_grad():
            out, expected = model(**inputs), reference(**inputs)
        assert out[key].shape == expected[key].shape
        assert rel_err(out[key], expected[key]) < FLOAT32, (batch, length)
    report = report_of(model)
    # optimize's first call (the example, 2 x 11) counts too
    assert [(b.batch, b.length, b.calls) for b in report.shape_buckets] == [(2, 16, 3), (4, 32, 3)]
    assert report.graphs == graphs


def test_a_call_without_attention_mask_gets_one_and_a_pooled_output_is_sliced():
    model, reference, _ = optimized(bert)
    ids = torch.randint(3, 101, (3, 21))
    with torch.no_grad():
        out, expected = model(input_ids=ids), reference(input_ids=ids)
    assert out.pooler_output.shape == (3, 48) and out.last_hidden_state.shape == (3, 21, 48)
    assert rel_err(out.pooler_output, expected.pooler_output) < FLOAT32
    assert rel_err(out.last_hidden_state, expected.last_hidden_state) < FLOAT32


def test_training_with_labels_gives_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model, _ = llama()
    model.train()
    reference = twin(model)
    ids = torch.randint(3, 101, (2, 11))
    model = kernel_pytorch.optimize(model, example_inputs={"input_ids": ids, "labels": ids}, shape_buckets="auto")
    assert report_of(model).verification.compared_gradients
    ids = torch.randint(3, 101, (3, 21))
    out, expected = model(input_ids=ids, labels=ids), reference(input_ids=ids, labels=ids)
    assert report_of(model).shape_buckets[-1].padded_elements == 4 * 32
    assert rel_err(out.loss, expected.loss) < FLOAT32
    out.loss.backward()
    expected.loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-4, name


def test_state_dict_unchanged_and_a_deepcopy_keeps_its_buckets():
    torch.manual_seed(0)
    model, key = bert()
    model.eval()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    reference = twin(model)
    model = kernel_pytorch.optimize(model, example_inputs=tokens(2, 11), shape_buckets="auto")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    copied = copy.deepcopy(model)
    inputs = tokens(3, 17, 1)
    with torch.no_grad():
        out, expected = copied(**inputs), reference(**inputs)
    assert rel_err(out[key], expected[key]) < FLOAT32
    assert type(copied._compiled_call_impl).__name__ == "ShapeBucketCall"
    assert [(b.batch, b.length, b.calls) for b in report_of(copied).shape_buckets] == [(4, 32, 1)]
    assert [(b.batch, b.length, b.calls) for b in report_of(model).shape_buckets] == [(2, 16, 1)]  # optimize's
    assert note(copied) == note(model)


def test_a_model_returning_a_kv_cache_is_refused():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=101, n_embd=48, n_layer=2, n_head=4, n_positions=64,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)  # use_cache=True
    model = transformers.GPT2LMHeadModel(config).eval()
    model = kernel_pytorch.optimize(model, example_inputs=tokens(2, 11), shape_buckets="auto")
    assert "refused" in note(model) and "use_cache=False" in note(model) and "DynamicCache" in note(model)


# ----------------------------------------------------------------------------------------------- refusals

def test_a_cumsum_over_positions_refuses_sequence_padding_only():
    model, reference = small(running_mean)
    text = note(model)
    assert "lengths not bucketed: cumsum along the sequence (dim 1 of a" in text
    assert "padding the batch kept every output bit-identical" in text
    ids = torch.randint(0, 50, (3, 13))
    assert rel_err(model(ids), reference(ids)) < FLOAT32
    assert [(b.batch, b.length) for b in report_of(model).shape_buckets] == [(2, None), (4, None)]


def test_batchnorm_over_tokens_in_training_refuses_all_padding():
    model, reference = small("batch_norm", train=True)
    assert note(model) == ("shape buckets refused, calls run unbucketed: batch sizes and lengths not bucketed: "
                           "BatchNorm1d at 'norm' in training mode normalizes over the batch and the positions")
    ids = torch.randint(0, 50, (3, 13))
    assert rel_err(model(ids), reference(ids)) < FLOAT32
    assert report_of(model).shape_buckets == []


def test_unmasked_mean_pooling_is_refused_with_the_measured_error_and_masked_pooling_is_not():
    model, reference = small(lambda h, mask: h.mean(1))
    text = note(model)
    assert "lengths not bucketed: padding the batch and the sequence changed the outputs (worst the output " \
           "relative error" in text
    assert "seen: mean along the sequence" in text
    masked, reference = small(masked_mean)
    assert "batch 1, 2, 4, 8, 16, 32 x length 16, 32" in note(masked)
    ids, mask = torch.randint(0, 50, (3, 13)), torch.ones(3, 13, dtype=torch.long)
    mask[0, 9:] = 0
    assert rel_err(masked(ids, mask), reference(ids, mask)) < FLOAT32


def test_a_reduction_over_the_batch_refuses_batch_padding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    model.forward = lambda x: model[0](x - x.mean(0))
    model = kernel_pytorch.optimize(model, example_inputs=(torch.randn(3, 16),), shape_buckets="auto")
    assert "batch sizes not bucketed: mean along the batch (dim 0 of a" in note(model)
    assert "refused" in note(model)


def test_a_model_without_attention_mask_is_bucketed_by_batch_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    reference = twin(model)
    model = kernel_pytorch.optimize(model, example_inputs=(torch.randn(3, 16),), shape_buckets="auto")
    assert "lengths not bucketed: Sequential.forward takes no attention_mask to mask the padding with" in note(model)
    x = torch.randn(5, 16)
    assert rel_err(model(x), reference(x)) < FLOAT32
    assert [(b.batch, b.length, b.calls, b.real_elements, b.padded_elements)
            for b in report_of(model).shape_buckets] == [(4, None, 1, 3, 4), (8, None, 1, 5, 8)]


# ------------------------------------------------------------------------------- limits, report, warm-up

def test_a_batch_above_the_largest_bucket_is_a_one_line_error_or_a_new_bucket():
    model, _ = small(masked_mean, max_batch=4)
    ids, mask = torch.randint(0, 50, (5, 9)), torch.ones(5, 9, dtype=torch.long)
    with pytest.raises(ShapeBucketError) as caught:
        model(ids, mask)
    assert str(caught.value) == ("a batch of 5 is larger than the largest batch bucket (4): raise "
                                 "shape_buckets.max_batch, or set shape_buckets.beyond_largest='new_bucket'")
    grown, reference = small(masked_mean, batch=(1, 2, 4), beyond_largest="new_bucket")
    assert rel_err(grown(ids, mask), reference(ids, mask)) < FLOAT32
    assert ("shape buckets: a batch of 5, above the largest bucket (4), was served as a bucket of its own "
            "(beyond_largest='new_bucket')") in report_of(grown).notes


def test_report_gives_hits_and_padding_waste():
    model, _ = small(masked_mean, length=(16, 32))
    for batch, length in ((3, 16), (3, 10), (1, 20)):
        model(torch.randint(0, 50, (batch, length)), torch.ones(batch, length, dtype=torch.long))
    report = report_of(model)
    # optimize's first call on the example (2 x 9) first
    assert [(b.batch, b.length, b.calls, b.real_elements, b.padded_elements) for b in report.shape_buckets] == \
           [(2, 16, 1, 18, 32), (4, 16, 2, 78, 128), (1, 32, 1, 20, 32)]
    assert report.padding_waste() == pytest.approx(192 / 116 - 1)
    assert report.to_dict()["shape_buckets"][1] == {"batch": 4, "length": 16, "calls": 2, "real_elements": 78,
                                                    "padded_elements": 128}
    from rich.console import Console

    console = Console(width=200, record=True)
    report.print(console)
    printed = " ".join(console.export_text().split())  # rich wraps a table's title to the table's width
    assert "shape buckets (3 hit by 4 calls; padding waste 65.5% = padding / real elements)" in printed
    assert "batch 1, 2, 4, 8, 16, 32 x length 16, 32 (12 buckets)" in printed


def test_without_example_inputs_the_first_call_checks():
    torch.manual_seed(0)
    model = Embedded(running_mean)
    model = kernel_pytorch.optimize(model, shape_buckets="auto")
    assert not [n for n in report_of(model).notes if n.startswith("shape buckets")]
    model(torch.randint(0, 50, (3, 9)), torch.ones(3, 9, dtype=torch.long))
    assert "lengths not bucketed: cumsum along the sequence" in note(model)


@pytest.mark.parametrize("dynamic, graphs", [(None, 1), (False, 36)], ids=["dynamic-sizes", "static-per-bucket"])
def test_more_buckets_than_the_recompile_limit_stay_optimized(dynamic, graphs):
    lengths = tuple(range(14, 50, 2))  # 18 lengths: more than one static entry holds (half its recompile limit)
    model, reference = small(masked_mean, dynamic=dynamic, batch=(2, 4), length=lengths)  # 36 buckets
    assert graphs_per_entry() < len(lengths) and 2 * len(lengths) > RECOMPILE_LIMIT
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileLimitWarning)
        assert warm_up(model) == 36
        ids, mask = torch.randint(0, 50, (3, 47)), torch.ones(3, 47, dtype=torch.long)
        with torch.no_grad():  # as warm_up captured the buckets of a model optimized for inference
            assert rel_err(model(ids, mask), reference(ids, mask)) < FLOAT32
    report = report_of(model)
    assert report.graphs == graphs
    # warm-up calls are not counted: optimize's first call (2 x 9), then this one
    assert [(b.batch, b.length, b.calls) for b in report.shape_buckets] == [(2, 14, 1), (4, 48, 1)]


# ------------------------------------------------------------------------------------------------ benchmark

def test_variable_shapes_benchmark_smoke(tmp_path):
    from benchmarks import variable_shapes

    # On the CPU the two graph providers (Inductor's, the buckets' own) run as the plain optimize one: left out here.
    # torch.compile(dynamic=True) and the cuDNN-off baselines run the same code on the CPU as their neighbours here
    providers = ["eager", "torch.compile", "optimize (shape_buckets)",
                 "optimize (shape_buckets, fine ladder, cuda_graphs)", "optimize (shape_buckets, split_batch, cuda_graphs)"]
    variable_shapes.main(["--device", "cpu", "--serve-all", "--second-pass", "--in-process", "--out", str(tmp_path),
                          "--providers", *providers])
    result = json.loads((tmp_path / "variable_shapes_cpu.json").read_text())
    assert set(result["providers"]) == set(providers)
    for name, entry in result["providers"].items():
        assert entry["requests_per_s"] > 0 and entry["tokens_per_s"] > 0 and entry["second_pass_requests_per_s"] > 0
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the cuDNN-off provider restored PyTorch's setting
    ours = result["providers"]["optimize (shape_buckets)"]
    assert sum(b["calls"] for b in ours["buckets"]) == result["requests"]
    assert ours["padding_waste"] >= 0
    fine = result["providers"]["optimize (shape_buckets, fine ladder, cuda_graphs)"]
    assert fine["options"]["shape_buckets"] == {"batch": [1, 2], "length": [16, 32], "cuda_graphs": True,
                                                "warm_up": True}  # the smoke run's largest batch 2 and length 32
    assert fine["padding_waste"] >= 0
    assert [t["target"] for t in result["targets"]] == [1.5, 1.5]
    assert result["targets"][1]["baseline"] in variable_shapes.TUNED_BASELINES
    assert (tmp_path / "variable_shapes_cpu.png").exists()


def test_variable_shapes_runs_each_provider_in_a_process_of_its_own(tmp_path):
    from benchmarks import variable_shapes

    variable_shapes.main(["--device", "cpu", "--requests", "6", "--second-pass", "--out", str(tmp_path),
                          "--providers", "eager (cuDNN attention off)"])
    result = json.loads((tmp_path / "variable_shapes_cpu.json").read_text())
    assert result["processes"] == "one per provider, caches empty"
    served = result["providers"]["eager (cuDNN attention off)"]
    assert result["requests"] == 6 and served["requests_per_s"] > 0 and served["second_pass_requests_per_s"] > 0


def test_every_optimize_provider_names_its_options():
    from benchmarks import variable_shapes as v

    assert set(v.OPTIMIZE_OPTIONS) == {p for p in v.PROVIDERS if p.startswith("optimize")}
    assert v.OPTIMIZE_OPTIONS["optimize (shape_buckets, cuda_graphs)"] == {"shape_buckets": {"cuda_graphs": True}}
    assert v.OPTIMIZE_OPTIONS["optimize (shape_buckets, reduce-overhead)"] == {"compile": "reduce-overhead"}


def test_the_fine_ladder_halves_the_batch_steps_and_takes_every_16_tokens():
    from benchmarks import variable_shapes

    s = variable_shapes.make_setup(variable_shapes.parse_args([]))  # the full run: batch 1-32, lengths 16-512
    ladder = variable_shapes.fine_ladder_options(s)["shape_buckets"]
    assert ladder["batch"] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    assert ladder["length"] == list(range(16, 513, 16))


def test_variable_shapes_stops_a_provider_once_it_cannot_be_the_fastest():
    from benchmarks import variable_shapes

    s = variable_shapes.make_setup(variable_shapes.parse_args(["--device", "cpu"]))
    requests = variable_shapes.make_requests(s)
    calls = []

    def slow_model(**request):
        calls.append(request["input_ids"].shape)
        time.sleep(0.02)

    seconds, served = variable_shapes.serve(slow_model, requests, s, limit_s=0.05)
    assert 1 <= served < len(requests) and len(calls) == served and seconds >= 0.05
    assert variable_shapes.serve(slow_model, requests[:3], s)[1] == 3
    providers = {"a": {"total_s": 2.0}, "b": {"total_s": 1.0, "stopped": "..."}, "c": {"total_s": 3.0},
                 "d": {"error": "OutOfMemoryError"}}
    assert variable_shapes.fastest_finished(providers) == ("a", 2.0)
    assert variable_shapes.fastest_finished({"d": {"error": "x"}}) is None
