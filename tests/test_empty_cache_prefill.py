"""Prompts prefill into an empty cache (kernel_pytorch/features/generation/empty_cache_prefill.py), on the CPU:
greedy tokens of six families equal the unoptimized model's at batch 1 and in left-padded batches, without and with
prompt buckets; the rows are rolled and their keys and values scattered back to the left-padded layout; the prefill's
attention is causal without a mask; what cannot take it (a model, a mask with a hole) prefills through the mask and
the report says why. The replays are tested on a GPU (tests/test_generation_gpu.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import kernel_pytorch
from kernel_pytorch import Decoder, report_of
from kernel_pytorch.features.generation import empty_cache_prefill
from kernel_pytorch.features.generation.empty_cache_prefill import (EmptyCachePrefill, empty_cache_refusal,
                                                                    is_left_padded, rolled_prompt, scatter_into,
                                                                    static_layers_refusal)
from kernel_pytorch.features.generation.model_calls import new_static_cache
from kernel_pytorch.features.generation.prefill_graphs import prompt_bucket

from .generation_models import causal_lm, left_padded_prompts, t5_model

REQUESTS = [(1, 1), (1, 7), (3, 16), (2, 21)]  # (batch, prompt length); rows after the first are left-padded


def _check_tokens(optimized, reference, buckets: bool) -> None:
    for batch, length in REQUESTS:
        input_ids, attention_mask = left_padded_prompts(batch, length, seed=length)
        expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
        tokens = optimized.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
        assert torch.equal(tokens, expected), (batch, length)
        lane = optimized.generate.decoder.lane
        slots = prompt_bucket(length) if buckets else max(length, 2)  # right padding: a bucket, or one token at least
        assert (lane.prefilled_slots, lane.next_slot) == (slots, length + 11), (batch, length)
        # the prefill set every layer's counter after the prompt; each step advanced it
        assert [int(counter) for counter in lane._cache_counters()] == [length + 11] * len(lane._cache_layers())


@pytest.mark.parametrize("family, buckets", [(family, False) for family in
                                             ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gpt2")]
                         + [("llama", True)])
def test_prompts_into_an_empty_cache_keep_the_greedy_tokens(family, buckets):
    model = causal_lm(family)
    reference = copy.deepcopy(model)
    _check_tokens(kernel_pytorch.optimize(model, generation={"prefill_graphs": buckets}), reference, buckets)


def test_the_prefill_attends_causally_without_a_mask():
    optimized = kernel_pytorch.optimize(causal_lm("llama"))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch in (1, 3, 2):
        input_ids, attention_mask = left_padded_prompts(batch, 9)
        optimized.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False)
    # the prefill and the decode step at batch 1 and at 2+ (padded rows or not)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 4
    assert any("prompts prefill into an empty cache with causal attention" in n for n in report_of(optimized).notes)
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
    assert not decoder.lane.takes_empty_cache_prefills
    assert any("through its mask, not into an empty cache: LlamaForCausalLM.forward takes no logits_to_keep"
               in note for note in decoder.notes), decoder.notes


def test_a_mask_with_a_hole_prefills_through_the_mask_and_says_why():
    model = causal_lm("qwen2")
    reference = copy.deepcopy(model)
    optimized = kernel_pytorch.optimize(model)
    input_ids, attention_mask = left_padded_prompts(2, 10)
    attention_mask[0, 4] = 0  # a hole in the first row
    expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(optimized.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8,
                                          do_sample=False), expected)
    assert any("its attention mask is not left padding" in note for note in report_of(optimized).notes)


def test_what_cannot_prefill_into_an_empty_cache_says_why():
    assert "encoder-decoder" in empty_cache_refusal(t5_model())
    assert empty_cache_refusal(causal_lm("gpt2")) == ""
    layers = list(new_static_cache(causal_lm("llama"), 1, 16, torch.device("cpu"), torch.float32).layers)
    assert static_layers_refusal(layers) == ""
    del layers[0].cumulative_length
    assert static_layers_refusal(layers) == "StaticLayer keeps no keys, values and token counter tensors"


def test_left_padding_is_recognized():
    assert is_left_padded(torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1]]))
    assert not is_left_padded(torch.tensor([[1, 0, 1]]))  # a hole
    assert not is_left_padded(torch.tensor([[1, 1, 0]]))  # no token at the end


def test_rows_are_rolled_to_start_with_their_tokens_and_go_back_to_their_slots():
    # a prompt of width 4 in a bucket of 6; row 1 has 2 tokens of left padding
    input_ids = torch.tensor([[11, 12, 13, 14, 0, 0], [0, 0, 23, 24, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]])
    rolled = rolled_prompt(input_ids, attention_mask, torch.tensor([4]))
    assert rolled.input_ids.tolist() == [[11, 12, 13, 14, 0, 0], [23, 24, 0, 0, 0, 0]]
    assert rolled.positions.tolist() == [list(range(6))] * 2 and rolled.last.tolist() == [3, 1]
    assert rolled.slot_of.tolist() == [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 0, 1]]
    layers = list(new_static_cache(causal_lm("llama"), 2, 32, torch.device("cpu"), torch.float32).layers)
    keys = tuple(torch.randn(2, 2, 6, 16) for _ in layers)
    values = tuple(torch.randn(2, 2, 6, 16) for _ in layers)
    for layer, key, value in zip(layers, keys, values):
        scatter_into(layer, key, value, rolled.slot_of)
    assert int(rolled.written) == 4  # the prompt's width: the slots the cache holds after the prefill
    for layer, key, value in zip(layers, keys, values):
        assert torch.equal(layer.keys[0, :, :4], key[0, :, :4]) and torch.equal(layer.values[0, :, :4], value[0, :, :4])
        # row 1's two tokens back at slots 2 and 3, as in the left-padded layout the decode steps read
        assert torch.equal(layer.keys[1, :, 2:4], key[1, :, :2])
        assert torch.equal(layer.values[1, :, 2:4], value[1, :, :2])
        assert not layer.keys[:, :, 6:].any()


def test_the_wrapper_holds_the_model_without_state_of_its_own():
    wrapper = EmptyCachePrefill(causal_lm("llama"))
    assert wrapper.state_dict() == {} and not list(wrapper.parameters())
