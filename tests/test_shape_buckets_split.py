"""shape_buckets.split_batch: the fastest split by measured bucket times, rows split and outputs joined equal to the
unbucketed model, and the cases it refuses."""

from __future__ import annotations

import pytest
import torch
import transformers

import kernel_pytorch
from kernel_pytorch import report_of
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.errors import ConfigError
from kernel_pytorch.features.shape_buckets.batch_split import fastest_splits, join_outputs, splittable
from kernel_pytorch.features.shape_buckets.padding import BATCH, LENGTH, CallShape
from kernel_pytorch.features.shape_buckets.wrapper import bucket_call

from .conftest import rel_err, twin
from .test_shape_buckets import bert, tokens

FLOAT32 = OptimizeConfig().tolerance_for(torch.float32).outputs
_SPLIT = {"batch": (1, 2, 4), "length": (16, 32), "warm_up": True, "split_batch": True}


def test_the_fastest_split_pads_or_splits_by_the_times():
    buckets = (1, 2, 4, 8)
    cheap_small = fastest_splits(buckets, {1: 1.0, 2: 1.1, 4: 1.2, 8: 10.0})
    assert sorted(cheap_small) == list(range(1, 9))  # every batch size up to the largest bucket
    assert cheap_small[5] == ((4, 4), (1, 1))  # 2.2 against 10 padded
    assert cheap_small[7] == ((4, 4), (3, 4))  # 2.4: the rest padded, against 3.3 split
    assert cheap_small[3] == ((3, 4),)  # padded to 4: 1.2 against 2.1 for 2 + 1
    assert fastest_splits(buckets, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.5})[5] == ((5, 8),)
    assert cheap_small[8] == ((4, 4), (4, 4))  # even a bucket's own size can split


def test_outputs_are_joined_along_each_leafs_batch_dim():
    known = {"['last_hidden_state']": ((0, BATCH), (1, LENGTH)), "['pooled']": ((1, BATCH),)}
    parts = [{"last_hidden_state": torch.randn(rows, 5, 3), "pooled": torch.randn(3, rows)} for rows in (2, 1)]
    joined = join_outputs([{k: v.clone() for k, v in p.items()} for p in parts], known)
    assert torch.equal(joined["last_hidden_state"], torch.cat([p["last_hidden_state"] for p in parts], 0))
    assert torch.equal(joined["pooled"], torch.cat([p["pooled"] for p in parts], 1))
    assert splittable(known) == ""
    assert splittable({"['loss']": (), **known}) == "['loss'] has no batch dim to join the calls' rows along"


def _timed(seconds_of):
    """BERT optimized with split_batch, its buckets' measured times replaced by ``seconds_of(bucket)``; its
    unoptimized twin, output key and bucket call."""
    torch.manual_seed(0)
    model, key = bert()
    model.eval()
    reference = twin(model)
    model = kernel_pytorch.optimize(model, example_inputs=tokens(2, 11), shape_buckets=_SPLIT)
    call = bucket_call(model)
    assert set(call.bucket_seconds) == {CallShape(b, n) for b in (1, 2, 4) for n in (16, 32)}
    assert set(call.splits) == {CallShape(b, n) for b in (1, 2, 3, 4) for n in (16, 32)}  # planned at the warm-up
    call.set_bucket_seconds({bucket: seconds_of(bucket) for bucket in call.bucket_seconds})
    return model, reference, key


@torch.no_grad()
def test_a_split_batch_equals_the_unbucketed_model_and_each_call_is_counted():
    # the batch-4 buckets made slow: 3 rows split as 2 + 1
    model, reference, key = _timed(lambda bucket: 10.0 if bucket.batch == 4 else 1.0)
    before = {(r.batch, r.length): r.calls for r in report_of(model).shape_buckets}
    inputs = tokens(3, 20, padded_rows=1)
    out, expected = model(**inputs), reference(**inputs)
    for name in (key, "pooler_output"):
        assert out[name].shape == expected[name].shape and rel_err(out[name], expected[name]) < FLOAT32, name
    after = {(r.batch, r.length): r.calls for r in report_of(model).shape_buckets}
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {(2, 32): 1, (1, 32): 1}
    assert any(note.startswith("shape buckets: split_batch: every bucket's call timed") for note in
               report_of(model).notes)


@torch.no_grad()
def test_a_batch_is_padded_where_that_is_faster():
    model, reference, key = _timed(lambda bucket: 1.0)  # every bucket as fast: one padded call beats two
    inputs = tokens(3, 20)
    assert rel_err(model(**inputs)[key], reference(**inputs)[key]) < FLOAT32
    assert {(r.batch, r.length) for r in report_of(model).shape_buckets if r.calls} >= {(4, 32)}
    assert (2, 32) not in {(r.batch, r.length) for r in report_of(model).shape_buckets}


def test_a_loss_over_the_batch_is_padded_with_a_note():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=80, max_position_embeddings=64)
    model = transformers.BertForMaskedLM(config).eval()
    example = {**tokens(2, 11), "labels": torch.randint(3, 101, (2, 11))}
    with torch.no_grad():
        model = kernel_pytorch.optimize(model, example_inputs=example, shape_buckets=_SPLIT)
    assert bucket_call(model).bucket_seconds == {} and bucket_call(model).splits == {}
    assert any(note.startswith("shape buckets: split_batch not used: ['loss'] has no batch dim")
               for note in report_of(model).notes), report_of(model).notes


@pytest.mark.parametrize("options", [{"split_batch": True}, {"split_batch": True, "warm_up": True, "batch": None}])
def test_split_batch_without_timed_batch_buckets_is_a_config_error(options):
    with pytest.raises(ConfigError, match="split_batch chooses between padding and splitting by timing"):
        kernel_pytorch.optimize(bert()[0], shape_buckets=options)
