"""``generation={"prefill_any_batch": True}`` on the CPU: one prefill graph serves batch 1 and larger batches
(TorchDynamo compiles a batch-1 call for batch 1 alone otherwise), with the unoptimized model's greedy tokens for three
families of unlike structure and T5, batch 1 and left-padded batches."""

from __future__ import annotations

import copy

import pytest
import torch
import kernel_pytorch

from .generation_models import causal_lm, left_padded_prompts, t5_model

REQUESTS = [(1, 5), (3, 9), (1, 12), (2, 17)]


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _tokens_and_graphs(model, reference, requests, **extra) -> int:
    """Greedy tokens of ``model`` and ``reference`` compared per request; the TorchDynamo graphs ``model`` compiled."""
    before = _graphs()
    for batch, length in requests:
        input_ids, attention_mask = left_padded_prompts(batch, length)
        expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False,
                                      **extra)
        tokens = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False, **extra)
        assert torch.equal(tokens, expected), (batch, length)
    return _graphs() - before


def _optimized(model, **generation):
    """``model`` optimized with these generation options, and an untouched twin to compare with."""
    reference = copy.deepcopy(model)
    return kernel_pytorch.optimize(model, generation=generation), reference


# Three families of unlike structure (GQA with RoPE; learned positions and Conv1D; soft-capped sliding windows):
# the option is experimental and off, and every family's tokens are checked without it in test_generation.py.
@pytest.mark.parametrize("family", ["gemma2", "gpt2", "llama"])
def test_one_prefill_graph_serves_every_batch_with_the_same_tokens(family):
    model, reference = _optimized(causal_lm(family), prefill_any_batch=True)
    # the prefill once; the decode step at batch 1 and at 2+ (its batch-1 graph keeps one-row kernels)
    assert _tokens_and_graphs(model, reference, REQUESTS) == 3


def test_without_the_option_batch_one_gets_a_prefill_graph_of_its_own():
    model, reference = _optimized(causal_lm("llama"))
    assert _tokens_and_graphs(model, reference, REQUESTS) == 4


def test_t5_encoder_and_prefill_serve_every_batch():
    model, reference = _optimized(t5_model(vocab_size=128), prefill_any_batch=True)
    # the encoder and the decoder's prefill once each; the decode step at batch 1 and at 2+
    assert _tokens_and_graphs(model, reference, REQUESTS) == 4


def test_the_warm_up_still_compiles_every_graph_later_requests_need():
    model, reference = _optimized(causal_lm("llama"), prefill_any_batch=True)
    model.generate.warm_up(batch_sizes=(1, 2), progress=False)
    assert _tokens_and_graphs(model, reference, [(1, 1), (1, 30), (2, 7), (4, 12), (3, 200)]) == 0


@pytest.mark.parametrize("make, graphs", [(lambda: causal_lm("llama"), 2), (lambda: t5_model(vocab_size=128), 3)],
                         ids=["llama", "t5"])
def test_the_first_batch_above_one_compiles_for_every_larger_batch(make, graphs):
    # Without a batch-1 bucket (batch 1 padded to 2), batches 2 and 4: the prefill and the step compiled once each
    # (and T5's encoder), where the first batch size used to compile for itself alone. T5's decoder prompt is 2
    # tokens wide, which duck sizing (off in the generation calls) tied to a batch of 2.
    model, reference = _optimized(make(), batch_buckets=(2, 4, 8))
    assert _tokens_and_graphs(model, reference, REQUESTS) == graphs
