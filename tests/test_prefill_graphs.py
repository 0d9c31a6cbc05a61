"""Prefills in prompt-length buckets (generation.prefill_graphs) on the CPU: prompts left-padded to their bucket keep
the unoptimized model's greedy tokens for several families, the cache is sized for the bucket (or the prompt where
the bucket does not fit), and what cannot be replayed says why. The replays themselves are tested on a GPU
(tests/test_generation_gpu.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.cache_utils import StaticSlidingWindowLayer

import kernel_pytorch
from kernel_pytorch import Decoder, report_of
from kernel_pytorch.features.generation.model_calls import new_static_cache
from kernel_pytorch.features.generation.prefill_graphs import (PrefillGraphs, buckets_below, host_counted_cache,
                                                                left_padded, padded_prompt_length, prompt_bucket)

from .generation_models import causal_lm, left_padded_prompts, t5_model


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "mistral_sliding"])  # qwen3: llama's layout
def test_prompts_padded_to_their_buckets_keep_the_tokens(family):
    model = causal_lm(family)
    reference = copy.deepcopy(model)
    optimized = kernel_pytorch.optimize(model, generation={"prefill_graphs": True})
    for batch, length in [(1, 1), (1, 5), (3, 9), (2, 17)]:
        input_ids, attention_mask = left_padded_prompts(batch, length)
        expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=14, do_sample=False)
        tokens = optimized.generate(input_ids, attention_mask=attention_mask, max_new_tokens=14, do_sample=False)
        assert torch.equal(tokens, expected), (family, batch, length)
        # the prefill runs over the bucket, the rows padded on the right; the steps overwrite the padding's slots
        lane = optimized.generate.decoder.lane
        assert (lane.prefilled_slots, lane.next_slot) == (prompt_bucket(length), length + 13), (family, batch, length)
    notes = [note for note in report_of(optimized).notes if "prefills of" in note]
    assert notes and all("run without CUDA graphs: no CUDA graphs on cpu" in note for note in notes), notes


def test_the_cache_holds_the_bucket_where_it_fits_and_the_prompt_where_it_does_not():
    prompt = torch.randint(6, 128, (1, 300))
    roomy, tight = (Decoder(causal_lm("llama"), max_length=length, prefill_graphs=True) for length in (1024, 512))
    roomy.prefill(prompt, max_new_tokens=100)
    tight.prefill(prompt, max_new_tokens=100)  # 512 + 100 tokens would not fit 512
    # the prompt prefills over its bucket, padded on the right, and the steps go on after it
    assert (roomy.lane.length, roomy.lane.prefilled_slots, roomy.lane.next_slot) == (768, 512, 300)
    assert (tight.lane.length, tight.lane.prefilled_slots, tight.lane.next_slot) == (512, 300, 300)


def test_warm_up_runs_a_prefill_at_every_bucket_of_each_lane():
    decoder = Decoder(causal_lm("llama"), prefill_graphs=True)
    decoder.warm_up(batch_sizes=(1,), cache_lengths=(256,), progress=False)
    (key, lane), = decoder.lanes.items()
    assert key == (1, 256, 0) and lane.hits == 1 + 4  # the warm-up request (padded to 16), then buckets 16 to 128


def test_buckets_and_left_padding():
    assert [prompt_bucket(n) for n in (1, 15, 16, 17, 512, 513)] == [16, 16, 16, 32, 512, 1024]
    assert buckets_below(256) == [16, 32, 64, 128] and buckets_below(257)[-1] == 256 and buckets_below(16) == []
    assert padded_prompt_length(300, 512) == 512 and padded_prompt_length(300, 511) == 300
    ids, mask = left_padded(torch.tensor([[7, 8, 9]]), torch.tensor([[0, 1, 1]]), 5)
    assert ids.tolist() == [[0, 0, 7, 8, 9]] and mask.tolist() == [[0, 0, 0, 1, 1]]


def test_caches_counting_tokens_on_the_host_are_not_replayed_and_say_why():
    # the lanes' caches have full-length layers (the window is in the mask): a window layer counts on the host
    plain = new_static_cache(causal_lm("gemma2"), 1, 64, torch.device("cpu"), torch.float32)
    reason = host_counted_cache([*plain.layers, StaticSlidingWindowLayer(max_cache_len=64, sliding_window=8)])
    assert reason.startswith("StaticSlidingWindowLayer count cached tokens on the host")
    assert host_counted_cache(list(plain.layers)) == ""
    graphs = PrefillGraphs(cuda_graphs=True, refusal=reason)
    assert not graphs.cuda_graphs and graphs.failure == reason
    ran = []
    logits = graphs.run(lambda ids, where: ran.append(ids.shape) or ids.float(),
                        (torch.ones(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long)), reset=lambda: None)
    assert ran == [(1, 16)] and logits.shape == (1, 16) and graphs.captured_lengths() == []


def test_auto_pads_prompts_only_where_the_steps_replay_cuda_graphs_on_a_cuda_device(monkeypatch):
    prompt = torch.randint(6, 128, (1, 20))
    on_cpu = Decoder(causal_lm("llama"))  # "auto" by default: the CPU has no CUDA graphs, so no padding
    assert not on_cpu.prefill_graphs and on_cpu.prefill_graphs_option == "auto"
    on_cpu.prefill(prompt, max_new_tokens=4)
    assert on_cpu.lane.prefilled_slots == 20 and on_cpu.lane.prefill_graphs is None
    on_cpu.set_prefill_graphs(True)  # forced: padded to the 32-token bucket even here
    assert on_cpu.prefill_graphs and on_cpu.prefill(prompt, max_new_tokens=4) is not None
    assert on_cpu.lane.prefilled_slots == 32
    on_cpu.set_prefill_graphs("auto")  # back to the option as given (the benchmark's A/B ends so)
    assert not on_cpu.prefill_graphs and on_cpu.prefill_graphs_option == "auto"
    # where the model sits on a CUDA device, "auto" follows generation.cuda_graphs; True and False are kept as given
    monkeypatch.setattr(Decoder, "_device", lambda self: torch.device("cuda", 0))
    assert Decoder(causal_lm("llama")).prefill_graphs
    assert not Decoder(causal_lm("llama"), cuda_graphs=False).prefill_graphs
    assert not Decoder(causal_lm("llama"), prefill_graphs=False).prefill_graphs
    assert not Decoder(t5_model()).prefill_graphs  # an encoder-decoder's decoder starts from one token


def test_no_graph_is_compiled_after_the_warm_up_where_model_sizes_equal_a_bucket():
    # The model's head dim (16) is the first prompt bucket and its KV heads (2) the warm-up's second batch:
    # TorchDynamo's duck sizing gave equal sizes one symbol, so specializing the head dim pinned the warm-up's first
    # prefill to prompts of 16 tokens, and the next bucket compiled again (5 graphs).
    model = causal_lm("llama")
    reference = copy.deepcopy(model)
    optimized = kernel_pytorch.optimize(model, generation={"prefill_graphs": True})
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    optimized.generate.warm_up(batch_sizes=(1, 2), progress=False)
    # the prefill and the step, each at batch 1 and at 2+, whatever the prompt bucket
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before + 4
    before += 4
    for batch, length in [(1, 100), (3, 30)]:  # a longer bucket, a larger batch
        input_ids, attention_mask = left_padded_prompts(batch, length)
        expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
        tokens = optimized.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens, expected), (batch, length)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
