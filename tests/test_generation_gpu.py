"""The generation feature on an NVIDIA GPU: decode steps compiled by optimize's backend and replayed from CUDA
graphs. The first step's logits are within bf16 tolerance of eager transformers; replays equal the same steps run
without graphs; greedy tokens in float32 equal the unoptimized model's."""

from __future__ import annotations

import copy

import pytest
import torch

import kernel_pytorch
from kernel_pytorch import Decoder, report_of

from .conftest import rel_err
from .generation_models import RecordingStreamer, StopAfterToken, causal_lm, left_padded_prompts, t5_model

pytestmark = pytest.mark.gpu

_BF16_LOGITS = 3e-2  # relative error of a bf16 model's logits, rewritten kernels against eager


def _eager_first_step(model, input_ids, attention_mask):
    """Prefill and one decode step of transformers' own forward (dynamic cache): the step's logits."""
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True)
    tokens = out.logits[:, -1].argmax(-1, keepdim=True)
    mask = torch.cat([attention_mask, torch.ones_like(tokens)], dim=1)
    step = model(tokens, attention_mask=mask, position_ids=positions[:, -1:] + 1, past_key_values=out.past_key_values,
                 use_cache=True)
    return out.logits[:, -1].float(), tokens[:, 0], step.logits[:, -1].float()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("batch", [1, 3], ids=["one prompt", "left-padded batch"])
@torch.no_grad()
def test_first_decode_step_within_bf16_tolerance_of_eager(family, batch):
    model = causal_lm(family).to("cuda", torch.bfloat16)
    input_ids, attention_mask = (t.cuda() for t in left_padded_prompts(batch, 12))
    prefill_expected, first_tokens, step_expected = _eager_first_step(model, input_ids, attention_mask)
    decoder = Decoder(kernel_pytorch.optimize(copy.deepcopy(model)))
    prefill = decoder.prefill(input_ids, attention_mask, max_new_tokens=8).float()
    step = decoder.step(first_tokens).float()
    assert rel_err(prefill, prefill_expected) < _BF16_LOGITS
    assert rel_err(step, step_expected) < _BF16_LOGITS
    assert "logits" in decoder.lane.graphs  # the step was replayed from a CUDA graph


@torch.no_grad()
def test_cuda_graph_replays_equal_the_steps_run_without_graphs():
    """The same steps with and without CUDA graphs (a stale captured input would drift over 20 steps)."""
    model = kernel_pytorch.optimize(causal_lm("llama").to("cuda", torch.bfloat16))
    input_ids, attention_mask = (t.cuda() for t in left_padded_prompts(2, 10))
    runs = []
    for graphs in (False, True):
        decoder = Decoder(model, cuda_graphs=graphs)
        logits = [decoder.prefill(input_ids, attention_mask, max_new_tokens=20)]
        for _ in range(20):
            logits.append(decoder.step(logits[-1].argmax(-1)).clone())
        runs.append(torch.stack(logits))
        assert bool(decoder.lane.graphs) == graphs
    # Two decoders compile twice: Inductor may pick other kernel configs, so equal within bf16 rounding.
    assert rel_err(runs[1].float(), runs[0].float()) < 1e-2


@torch.no_grad()
def test_greedy_generate_float32_tokens_equal_the_unoptimized_model():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = causal_lm("qwen2").cuda()
    reference = copy.deepcopy(model)
    optimized = kernel_pytorch.optimize(model)
    for batch, length in [(1, 7), (3, 12)]:
        input_ids, attention_mask = (t.cuda() for t in left_padded_prompts(batch, length))
        expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False)
        tokens = optimized.generate(input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False)
        assert torch.equal(tokens, expected), (batch, length)
    lanes = optimized.generate.decoder.lanes.values()
    assert all("greedy" in lane.graphs for lane in lanes)
    assert any("lane of" in note for note in report_of(optimized).notes)


def test_a_streamer_and_a_stopping_criterion_around_cuda_graph_replays_keep_the_tokens():
    # the host reviews each step at the loop's checks between replays; a stopped row is padded in the buffers the
    # captured steps read (float32: the tokens are the unoptimized model's)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = causal_lm("qwen2").cuda()
    reference = copy.deepcopy(model)
    optimized = kernel_pytorch.optimize(model)
    input_ids, attention_mask = (t.cuda() for t in left_padded_prompts(3, 12))
    settings = dict(attention_mask=attention_mask, max_new_tokens=40, do_sample=False)
    greedy = reference.generate(input_ids, **settings)
    stop = StopAfterToken(int(greedy[1, -30]))  # row 1 stops mid-way, in its first chunk of replayed steps
    streamer = RecordingStreamer()
    expected = reference.generate(input_ids, stopping_criteria=[stop], **settings)
    tokens = optimized.generate(input_ids, stopping_criteria=[stop], streamer=streamer, **settings)
    assert torch.equal(tokens, expected)
    puts = [call[1] for call in streamer.calls if call[0] == "put"]
    assert streamer.calls[-1] == ("end",)
    assert torch.equal(torch.cat([puts[0], *(put.unsqueeze(1) for put in puts[1:])], dim=1), tokens.cpu())
    assert all("greedy" in lane.graphs for lane in optimized.generate.decoder.lanes.values())


@torch.no_grad()
def test_sampling_steps_replay_from_cuda_graphs_with_fresh_random_numbers():
    model = kernel_pytorch.optimize(causal_lm("llama").to("cuda", torch.bfloat16))
    input_ids, attention_mask = (t.cuda() for t in left_padded_prompts(2, 10))
    greedy = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False)
    top1 = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=True, top_k=1)
    assert torch.equal(top1, greedy)  # one token left to draw: the greedy one
    draws = [model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=True,
                            temperature=1.5) for _ in range(2)]
    assert not torch.equal(*draws)  # each replay draws new random numbers
    assert all("sample" in lane.graphs for lane in model.generate.decoder.lanes.values())


@torch.no_grad()
def test_t5_float32_tokens_equal_the_unoptimized_model_with_graphs():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = t5_model().cuda()
    reference = copy.deepcopy(model)
    optimized = kernel_pytorch.optimize(model)
    input_ids = torch.randint(2, 64, (3, 11), device="cuda")
    expected = reference.generate(input_ids, max_new_tokens=16, do_sample=False)
    assert torch.equal(optimized.generate(input_ids, max_new_tokens=16, do_sample=False), expected)
    assert all("greedy" in lane.graphs for lane in optimized.generate.decoder.lanes.values())


@torch.no_grad()
def test_prefill_graph_replays_equal_the_padded_prefill_run_without_graphs():
    """Prompts of 9 and 12 tokens padded to the 16-token bucket: the replayed prefill's logits (two prompts through one
    captured graph) and the step after each equal the same padded prefill and step run without graphs."""
    model = kernel_pytorch.optimize(causal_lm("llama").to("cuda", torch.bfloat16))
    outputs = []
    for graphs in (False, True):
        decoder = Decoder(model, cuda_graphs=graphs, prefill_graphs=True)
        run = []
        for length in (9, 12):
            input_ids, attention_mask = (t.cuda() for t in left_padded_prompts(2, length))
            run.append(decoder.prefill(input_ids, attention_mask, max_new_tokens=8).clone())
            run.append(decoder.step(run[-1].argmax(-1)).clone())
        outputs.append(torch.stack(run))
        prefills = decoder.lane.prefill_graphs
        assert prefills.captured_lengths() == ([16] if graphs else []) and (prefills.cuda_graphs == graphs)
    # Two decoders compile twice: Inductor may pick other kernel configs, so equal within bf16 rounding.
    assert rel_err(outputs[1].float(), outputs[0].float()) < 1e-2


@torch.no_grad()
def test_warm_up_captures_the_prefill_buckets_of_each_lane():
    model = kernel_pytorch.optimize(causal_lm("llama").to("cuda", torch.bfloat16))
    decoder = Decoder(model, prefill_graphs=True)
    decoder.warm_up(batch_sizes=(1,), cache_lengths=(256,), progress=False)
    assert decoder.lanes[(1, 256, 0)].prefill_graphs.captured_lengths() == [16, 32, 64, 128]
    assert "prefills replayed at 16, 32, 64, 128 tokens" in decoder.summary()


@torch.no_grad()
def test_empty_cache_prefill_replays_equal_the_prefill_run_without_graphs():
    """Prompts of 9 and 16 tokens (batch 1) and a left-padded batch of 12 prefill into an empty cache, their rows rolled
    and right-padded to the 16-token bucket: the replayed prefills' logits and the step after each equal the same run
    without graphs, and are within bf16 tolerance of eager transformers."""
    model = causal_lm("llama").to("cuda", torch.bfloat16)
    optimized = kernel_pytorch.optimize(copy.deepcopy(model))
    prompts = [tuple(t.cuda() for t in left_padded_prompts(batch, length))
               for batch, length in [(1, 9), (1, 16), (3, 12)]]
    expected = [_eager_first_step(model, *prompt) for prompt in prompts]
    runs = []
    for graphs in (False, True):
        decoder = Decoder(optimized, cuda_graphs=graphs, prefill_graphs=True)
        run = []
        for (input_ids, attention_mask), (prefill_expected, first_tokens, step_expected) in zip(prompts, expected):
            run.append(decoder.prefill(input_ids, attention_mask, max_new_tokens=8).float())
            run.append(decoder.step(first_tokens).float())
            assert rel_err(run[-2], prefill_expected) < _BF16_LOGITS and rel_err(run[-1], step_expected) < _BF16_LOGITS
            assert (decoder.lane.prefilled_slots, decoder.lane.next_slot) == (16, input_ids.shape[1] + 1)
        assert (("empty cache", 16) in decoder.lane.prefill_graphs.graphs) == graphs
        runs.append(torch.cat(run))
    # Two decoders compile twice: Inductor may pick other kernel configs, so equal within bf16 rounding.
    assert rel_err(runs[1], runs[0]) < 1e-2
