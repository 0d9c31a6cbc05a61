"""shape_buckets.cuda_graphs on an NVIDIA GPU: each bucket's calls replayed from a CUDA graph of its own equal the
unoptimized model, outputs stay the caller's after later replays, graphs are captured again after the model's
parameters move, and a batch split among smaller buckets (split_batch) replays their graphs."""

from __future__ import annotations

import pytest
import torch

import kernel_pytorch
from kernel_pytorch import report_of
from kernel_pytorch.features.shape_buckets.graphs import GRAPHS_NOTE
from kernel_pytorch.features.shape_buckets.wrapper import bucket_call

from .conftest import rel_err, twin
from .test_shape_buckets import bert, tokens

pytestmark = pytest.mark.gpu

_FLOAT32 = 1e-4  # TF32 off: the rewritten kernels against eager in float32


def _cuda(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.cuda() for name, value in inputs.items()}


def _graphs_note(model) -> str:
    notes = [note for note in report_of(model).notes if note.startswith(GRAPHS_NOTE)]
    assert len(notes) == 1, report_of(model).notes
    return notes[0]


def _optimized_bert(shape_buckets: dict):
    """BERT on the GPU in float32 (TF32 off), optimized with ``shape_buckets``; its unoptimized twin and output key."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model, key = bert()
    model = model.eval().cuda()
    reference = twin(model)
    optimized = kernel_pytorch.optimize(model, example_inputs=_cuda(tokens(2, 11)), shape_buckets=shape_buckets)
    return optimized, reference, key


@torch.no_grad()
def test_bucket_replays_equal_the_model_and_outputs_stay_the_callers():
    model, reference, key = _optimized_bert({"cuda_graphs": True})
    calls = [(3, 17, 2), (4, 32, 1), (4, 20, 0), (3, 17, 2)]  # the last two reach buckets already captured
    kept = []
    for batch, length, padded_rows in calls:
        inputs = _cuda(tokens(batch, length, padded_rows))
        out, expected = model(**inputs)[key], reference(**inputs)[key]
        assert out.shape == expected.shape and rel_err(out, expected) < _FLOAT32, (batch, length)
        kept.append((out, expected))
    for out, expected in kept:  # later replays rewrote the graphs' memory, not the outputs handed out
        assert rel_err(out, expected) < _FLOAT32
    graphs = bucket_call(model).graphs.graphs
    assert len(graphs) == 2 and _graphs_note(model).startswith(f"{GRAPHS_NOTE} 2 shape buckets replayed")


@torch.no_grad()
def test_graphs_are_captured_again_after_a_parameter_moves():
    model, reference, key = _optimized_bert({"cuda_graphs": True})
    inputs = _cuda(tokens(3, 17, 1))
    model(**inputs)
    captured = len(bucket_call(model).graphs.graphs)  # the example inputs' bucket too: optimize called it
    embedding = model.embeddings.word_embeddings
    embedding.weight = torch.nn.Parameter(embedding.weight.detach() * 2)  # a new tensor: a replay would read the old
    reference.embeddings.word_embeddings.weight.mul_(2)
    assert rel_err(model(**inputs)[key], reference(**inputs)[key]) < 1e-3
    assert any(note.startswith(f"bucket CUDA graphs dropped: the model's parameters or buffers moved since {captured} "
                               "were") for note in report_of(model).notes)
    assert _graphs_note(model).startswith(f"{GRAPHS_NOTE} 1 shape buckets replayed")  # the one captured again


@torch.no_grad()
def test_split_batches_replay_graphs_equal_to_the_model():
    model, reference, key = _optimized_bert({"batch": (1, 2, 4), "length": (16, 32), "warm_up": True,
                                             "split_batch": True, "cuda_graphs": True})
    call = bucket_call(model)
    assert len(call.bucket_seconds) == 6 and all(seconds > 0 for seconds in call.bucket_seconds.values())
    # the batch-4 buckets made slow: 3 rows split as 2 + 1
    call.set_bucket_seconds({bucket: 10.0 if bucket.batch == 4 else 1.0 for bucket in call.bucket_seconds})
    inputs = _cuda(tokens(3, 20, 1))
    out, expected = model(**inputs), reference(**inputs)
    for name in (key, "pooler_output"):
        assert out[name].shape == expected[name].shape and rel_err(out[name], expected[name]) < _FLOAT32, name
    assert len(call.graphs.graphs) == 6  # every bucket captured at the warm-up, none since
