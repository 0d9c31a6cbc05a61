"""Unpadded prompts prefill into an empty cache (kernel_pytorch/features/generation/empty_cache_prefill.py), on the
CPU: greedy tokens of six families equal the unoptimized model's at batch 1 and in batches of equal-length rows,
without and with prompt buckets (right padding); the prefill's attention is causal without a mask; one graph serves
every batch; a model that cannot take it prefills through the mask and the report says why. The replays are tested
on a GPU (tests/test_generation_gpu.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import kernel_pytorch
from kernel_pytorch import Decoder, report_of
from kernel_pytorch.features.generation import empty_cache_prefill
from kernel_pytorch.features.generation.empty_cache_prefill import (EmptyCachePrefill, empty_cache_refusal,
                                                                    fill_static_cache, static_layers_refusal)
from kernel_pytorch.features.generation.model_calls import new_static_cache
from kernel_pytorch.features.generation.prefill_graphs import prompt_bucket

from .generation_models import causal_lm, t5_model

REQUESTS = [(1, 1), (1, 7), (3, 16), (2, 21)]  # (batch, prompt length): no row padded


def _check_tokens(optimized, reference, buckets: bool) -> None:
    for batch, length in REQUESTS:
        input_ids = torch.randint(6, 128, (batch, length), generator=torch.Generator().manual_seed(length))
        expected = reference.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=12,
                                      do_sample=False)
        assert torch.equal(optimized.generate(input_ids, max_new_tokens=12, do_sample=False), expected), (batch, length)
        lane = optimized.generate.decoder.lane
        slots = prompt_bucket(length) if buckets else max(length, 2)  # right padding: a bucket, or one token at least
        assert (lane.prefilled_slots, lane.next_slot) == (slots, length + 11), (batch, length)


@pytest.mark.parametrize("family, buckets", [(family, False) for family in
                                             ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gpt2")]
                         + [("llama", True)])
def test_unpadded_prompts_keep_the_greedy_tokens(family, buckets):
    model = causal_lm(family)
    reference = copy.deepcopy(model)
    _check_tokens(kernel_pytorch.optimize(model, generation={"prefill_graphs": buckets}), reference, buckets)


def test_the_prefill_attends_causally_without_a_mask_in_one_graph_for_every_batch():
    optimized = kernel_pytorch.optimize(causal_lm("llama"))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch in (1, 3, 2):
        optimized.generate(torch.randint(6, 128, (batch, 9)), max_new_tokens=3, do_sample=False)
    # the prefill once; the decode step at batch 1 and at 2+
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 3
    attention = [r for r in report_of(optimized).rewrites if r.pass_name == "attention"]
    assert attention and all(r.location.startswith("causal_lm.") for r in attention)  # the prefill's own layers
    assert all("causal" in r.replacement and "no mask" in r.replacement for r in attention), attention


def test_a_model_without_logits_to_keep_prefills_through_the_mask_and_says_why(monkeypatch):
    monkeypatch.setattr(empty_cache_prefill, "takes_logits_to_keep", lambda model: False)
    model = causal_lm("llama")
    reference = copy.deepcopy(model)
    decoder = Decoder(kernel_pytorch.optimize(model))
    input_ids = torch.randint(6, 128, (1, 9))
    expected = reference(input_ids).logits[:, -1]
    torch.testing.assert_close(decoder.prefill(input_ids, max_new_tokens=4), expected, rtol=1e-4, atol=1e-4)
    assert not decoder.lane.takes_unpadded_prompts
    assert any("through a mask, not causally into an empty cache: LlamaForCausalLM.forward takes no logits_to_keep"
               in note for note in decoder.notes), decoder.notes


def test_what_cannot_prefill_into_an_empty_cache_says_why():
    assert "encoder-decoder" in empty_cache_refusal(t5_model())
    assert empty_cache_refusal(causal_lm("gpt2")) == ""
    layers = list(new_static_cache(causal_lm("llama"), 1, 16, torch.device("cpu"), torch.float32).layers)
    assert static_layers_refusal(layers) == ""
    del layers[0].cumulative_length
    assert static_layers_refusal(layers) == "StaticLayer keeps no keys, values and token counter tensors"


def test_the_keys_and_values_go_to_the_first_slots_and_the_counters_after_the_real_tokens():
    model = causal_lm("llama")
    layers = list(new_static_cache(model, 2, 32, torch.device("cpu"), torch.float32).layers)
    keys = tuple(torch.randn(2, 2, 8, 16) for _ in layers)
    values = tuple(torch.randn(2, 2, 8, 16) for _ in layers)
    fill_static_cache(layers, keys, values, torch.tensor([5]))
    for layer, key, value in zip(layers, keys, values):
        assert torch.equal(layer.keys[:, :, :8], key) and torch.equal(layer.values[:, :, :8], value)
        assert not layer.keys[:, :, 8:].any() and int(layer.cumulative_length) == 5
    wrapper = EmptyCachePrefill(model)
    assert wrapper.state_dict() == {} and not list(wrapper.parameters())  # the model is held, not registered
