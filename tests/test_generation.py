"""The generation feature on the CPU: ``optimize(model)`` then an unchanged ``model.generate()`` gives the tokens of
the unoptimized model (float32, greedy), for several families, batch 1 and left-padded batches, several prompt
lengths; what it does not serve goes to transformers' loop with a report line; limits give clear errors."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import transformers

import kernel_pytorch
from kernel_pytorch import Decoder, GenerationLimitError, report_of
from kernel_pytorch.capture import CompilerChoice
from kernel_pytorch.compiled_call import RecompileLimitWarning
from kernel_pytorch.features.generation import FastGenerate
from kernel_pytorch.features.generation.sampling import draw, warped_scores

from .generation_models import (FAMILIES, RecordingStreamer, StopAfterToken, byte_level_tokenizer, causal_lm,
                                left_padded_prompts, t5_model)


def _pair(family: str):
    """The model optimized, and an untouched twin to compare with."""
    return _pair_of(causal_lm(family))


def _pair_of(model):
    reference = copy.deepcopy(model)
    return kernel_pytorch.optimize(model), reference


def _generation_notes(model) -> list[str]:
    return [note for note in report_of(model).notes if note.startswith("generation")]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_the_unoptimized_model(family):
    model, reference = _pair(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecompileLimitWarning)
        for batch, length, extra in [(1, 5, {}), (1, 1, {}), (3, 9, {}), (3, 9, {"min_new_tokens": 4}), (2, 17, {})]:
            input_ids, attention_mask = left_padded_prompts(batch, length)
            expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=14,
                                          do_sample=False, **extra)
            tokens = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=14, do_sample=False,
                                    **extra)
            assert torch.equal(tokens, expected), (family, batch, length, extra)
    notes = _generation_notes(model)
    assert any("lane of" in note for note in notes), notes  # the static-cache loop served them
    assert [note for note in notes if note.startswith("generation lanes")] == [model.generate.decoder.summary()]
    assert "1 sequences x 256 tokens (2 requests)" in model.generate.decoder.summary()  # the (1, 5), (1, 1) prompts
    assert not any("transformers' own loop" in note for note in notes), notes


def test_eos_stops_rows_and_pads_them_as_transformers_does():
    model, reference = _pair("llama")
    input_ids, attention_mask = left_padded_prompts(3, 6)
    # every token an EOS candidate: the greedy token of the first step ends some rows at once
    first = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=1, do_sample=False)[:, -1]
    eos = [int(first[0]), int(first[2])]
    expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=40, do_sample=False,
                                  eos_token_id=eos, pad_token_id=0)
    tokens = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=40, do_sample=False,
                            eos_token_id=eos, pad_token_id=0)
    assert torch.equal(tokens, expected)
    assert (tokens[0, 7:] == 0).all()  # row 0 ended at its first token and is padded after it


def test_attention_mask_inferred_from_pad_tokens_like_transformers():
    model, reference = _pair("qwen2")
    input_ids, _ = left_padded_prompts(3, 8)
    expected = reference.generate(input_ids, max_new_tokens=9, do_sample=False)
    assert torch.equal(model.generate(input_ids, max_new_tokens=9, do_sample=False), expected)


def test_requests_the_loop_does_not_serve_go_to_transformers_with_a_report_line():
    model, reference = _pair("llama")
    input_ids, attention_mask = left_padded_prompts(2, 6)
    for kwargs, reason in [({"num_beams": 2}, "beam search"), ({"repetition_penalty": 1.3}, "repetition_penalty"),
                           ({"do_sample": True, "typical_p": 0.5}, "sampling with typical_p")]:
        torch.manual_seed(0)
        expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, **kwargs)
        torch.manual_seed(0)
        tokens = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, **kwargs)
        assert torch.equal(tokens, expected)
        assert any(reason in note and "transformers' own loop" in note for note in _generation_notes(model)), reason


def test_decoder_step_api_matches_the_model_with_its_own_cache():
    model = causal_lm("mistral")
    decoder = Decoder(kernel_pytorch.optimize(copy.deepcopy(model)), batch_buckets=(1, 4))
    input_ids, attention_mask = left_padded_prompts(3, 7)
    logits = decoder.prefill(input_ids, attention_mask, max_new_tokens=6)
    prompt_positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    expected = model(input_ids, attention_mask=attention_mask, position_ids=prompt_positions, use_cache=True)
    torch.testing.assert_close(logits, expected.logits[:, -1], rtol=1e-4, atol=1e-5)
    cache, mask = expected.past_key_values, attention_mask
    positions = attention_mask.sum(-1, keepdim=True)
    for _ in range(5):
        tokens = logits.argmax(-1)
        logits = decoder.step(tokens)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step = model(tokens[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache,
                     use_cache=True)
        cache, positions = step.past_key_values, positions + 1
        torch.testing.assert_close(logits, step.logits[:, -1], rtol=1e-4, atol=1e-5)
    assert logits.shape == (3, 128)  # the bucket's filler row is not returned


def test_limits_give_errors_naming_the_option():
    model, _ = _pair("llama")
    model.generate.config = model.generate.config.model_copy(update={"max_length": 64, "batch_buckets": (1, 2)})
    with pytest.raises(GenerationLimitError, match=r"max_length=64.*generation=\{'max_length'"):
        model.generate(torch.randint(6, 128, (1, 60)), max_new_tokens=10, do_sample=False)
    with pytest.raises(GenerationLimitError, match=r"batch of 3 .*batch_buckets=\(1, 2\)"):
        model.generate(torch.randint(6, 128, (3, 5)), max_new_tokens=2, do_sample=False)
    decoder = Decoder(causal_lm("llama"))
    with pytest.raises(RuntimeError, match="before prefill"):
        decoder.step(torch.zeros(1, dtype=torch.long))


def test_an_uncompiled_prefill_keeps_the_tokens_and_compiles_only_the_steps(monkeypatch):
    compilers = []
    compile_graph = CompilerChoice.compile

    def recording(self, gm, example_inputs):
        compilers.append(self.name)
        return compile_graph(self, gm, example_inputs)

    monkeypatch.setattr(CompilerChoice, "compile", recording)
    model = causal_lm("llama")
    reference = copy.deepcopy(model)
    optimized = kernel_pytorch.optimize(model, compile=True, generation={"compile_prefill": False})
    input_ids, attention_mask = left_padded_prompts(2, 9)
    tokens = optimized.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6,
                                                  do_sample=False))
    assert compilers == ["eager", "inductor"]  # the prefill's graph, then the step's
    assert any("compile_prefill=False" in note for note in _generation_notes(optimized))


def test_warm_up_fits_a_cache_shorter_than_the_lengths_asked():
    decoder = Decoder(causal_lm("gpt2"), max_length=64)
    decoder.warm_up(batch_sizes=(1,), cache_lengths=(256, 512), progress=False)  # both above max_length
    assert [key[:2] for key in decoder.lanes] == [(1, 64)]


def test_a_full_cache_is_an_error_not_a_wrong_token():
    decoder = Decoder(causal_lm("gpt2"), max_length=256)
    logits = decoder.prefill(torch.randint(6, 128, (1, 250)), max_new_tokens=6)
    for _ in range(6):
        logits = decoder.step(logits.argmax(-1))
    with pytest.raises(GenerationLimitError, match="KV cache of 256 tokens is full"):
        decoder.step(logits.argmax(-1))


def test_copies_generate_through_a_loop_of_their_own():
    model, reference = _pair("gpt2")
    input_ids, attention_mask = left_padded_prompts(2, 6)
    expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False),
                       expected)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert isinstance(copied.generate, FastGenerate) and copied.generate.model is copied
        assert copied.generate.decoder is None  # no caches or graphs shared with the original
        tokens = copied.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(tokens, expected)


def test_state_dict_and_class_untouched_and_generation_can_be_turned_off():
    model = causal_lm("llama")
    before = {name: value.clone() for name, value in model.state_dict().items()}
    optimized = kernel_pytorch.optimize(model)
    assert before.keys() == optimized.state_dict().keys()
    assert all(torch.equal(before[name], value) for name, value in optimized.state_dict().items())
    assert type(optimized).generate is transformers.LlamaForCausalLM.generate
    plain = kernel_pytorch.optimize(causal_lm("llama"), generation=False)
    assert "generate" not in vars(plain)


def test_models_that_cannot_take_the_loop_say_why_when_asked(monkeypatch):
    from kernel_pytorch.features.generation import model_calls

    monkeypatch.setattr(model_calls, "_static_cache_class", lambda: None)  # a transformers without StaticCache
    optimized = kernel_pytorch.optimize(causal_lm("llama"), generation=True)
    assert "generate" not in vars(optimized)
    assert any("no StaticCache" in note for note in _generation_notes(optimized))
    encoder = kernel_pytorch.optimize(torch.nn.Linear(4, 4))  # 'auto' on a model without generate(): no line
    assert not _generation_notes(encoder)
    with pytest.raises(TypeError, match="not a transformers model with generate"):
        Decoder(torch.nn.Linear(4, 4))


def test_t5_tokens_equal_the_unoptimized_model():
    model = t5_model()
    reference = copy.deepcopy(model)
    optimized = kernel_pytorch.optimize(model)
    generator = torch.Generator().manual_seed(2)
    for batch, length, extra in [(1, 5, {}), (3, 11, {}), (3, 11, {"min_new_tokens": 4}), (2, 300, {})]:
        input_ids = torch.randint(2, 64, (batch, length), generator=generator)
        attention_mask = torch.ones_like(input_ids)
        input_ids[-1, length - 3:], attention_mask[-1, length - 3:] = 0, 0  # a shorter source, padded on the right
        expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False,
                                      **extra)
        tokens = optimized.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False,
                                    **extra)
        assert torch.equal(tokens, expected), (batch, length, extra)
    lanes = optimized.generate.decoder.lanes
    assert {key[2] for key in lanes} == {256, 512}  # cross-attention caches sized to the sources
    assert not any("transformers' own loop" in note for note in _generation_notes(optimized))


def test_warm_up_compiles_every_graph_later_requests_need():
    model, reference = _pair("llama")
    seconds = model.generate.warm_up(batch_sizes=(1, 2), progress=False)
    assert seconds > 0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for batch, length in [(1, 1), (1, 30), (2, 7), (4, 12), (3, 200)]:  # other lengths, buckets and cache lengths
        input_ids, attention_mask = left_padded_prompts(batch, length)
        expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=60, do_sample=False)
        tokens = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=60, do_sample=False)
        assert torch.equal(tokens, expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled after the warm-up
    assert any("warmed up 2 lanes" in note for note in _generation_notes(model))


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 50, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.6)])
def test_warped_scores_equal_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 300) * 3
    expected = logits.clone()
    for warper in ([TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
                   + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])):
        expected = warper(None, expected)
    scores = warped_scores(logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]))
    assert torch.equal(torch.isinf(scores), torch.isinf(expected))
    torch.testing.assert_close(scores[~torch.isinf(scores)], expected[~torch.isinf(expected)])


def test_draws_follow_the_softmax():
    torch.manual_seed(0)
    scores = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    tokens = draw(scores.expand(200_000, 5))
    frequencies = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    expected = scores.double().softmax(-1)
    assert frequencies[4] == 0  # a removed token is never drawn
    assert torch.allclose(frequencies, expected, atol=4e-3), (frequencies, expected)  # ~4 standard errors


def test_sampling_requests_take_the_loop():
    model, reference = _pair("llama")
    input_ids, attention_mask = left_padded_prompts(3, 7)
    greedy = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
    torch.manual_seed(0)
    top1 = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=True, top_k=1)
    assert torch.equal(top1, greedy)  # top-k 1 leaves one token to draw: the greedy one
    torch.manual_seed(0)
    first = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=True,
                           temperature=1.5, top_p=0.9)
    second = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=True,
                            temperature=1.5, top_p=0.9)
    assert first.shape == second.shape == greedy.shape and not torch.equal(first, second)  # draws differ
    assert not any("transformers' own loop" in note for note in _generation_notes(model))


@pytest.mark.parametrize("make", [lambda: causal_lm("qwen2"), lambda: t5_model(vocab_size=128)], ids=["qwen2", "t5"])
def test_several_sampled_sequences_per_prompt_take_the_loop(make):
    model, reference = _pair_of(make())
    input_ids, attention_mask = left_padded_prompts(2, 7)
    torch.manual_seed(0)
    expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=True,
                                  top_k=1, num_return_sequences=3)
    top1 = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=True, top_k=1,
                          num_return_sequences=3)
    assert torch.equal(top1, expected)  # each prompt's rows in place, as transformers repeats them
    torch.manual_seed(0)
    drawn = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=True,
                           temperature=2.0, num_return_sequences=3)
    assert drawn.shape == expected.shape
    assert not torch.equal(drawn[0], drawn[1]) or not torch.equal(drawn[1], drawn[2])  # independent draws
    assert not any("transformers' own loop" in note for note in _generation_notes(model))


def test_several_greedy_sequences_per_prompt_get_transformers_error():
    model, _ = _pair("llama")
    input_ids, attention_mask = left_padded_prompts(2, 5)
    with pytest.raises(ValueError, match="num_return_sequences"):
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, num_return_sequences=2)


def _same_calls(ours: list[tuple], theirs: list[tuple]) -> bool:
    return len(ours) == len(theirs) and all(
        a[0] == b[0] and (len(a) == 1 or (a[1].shape == b[1].shape and torch.equal(a[1], b[1])))
        for a, b in zip(ours, theirs))


@pytest.mark.parametrize("make", [lambda: causal_lm("llama"), lambda: t5_model(vocab_size=128)], ids=["llama", "t5"])
def test_a_streamer_gets_the_calls_transformers_makes(make):
    model, reference = _pair_of(make())
    for batch, length, new_tokens, end_early in [(1, 5, 20, False), (3, 9, 40, True), (1, 7, 1, False)]:
        input_ids, attention_mask = left_padded_prompts(batch, length)
        settings = dict(attention_mask=attention_mask, max_new_tokens=new_tokens, do_sample=False)
        if end_early:  # row 0's first token is an EOS: that row ends at once, the others later
            first = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=1, do_sample=False)
            settings.update(eos_token_id=[int(first[0, -1])], pad_token_id=0)
        ours, theirs = RecordingStreamer(), RecordingStreamer()
        expected = reference.generate(input_ids, streamer=theirs, **settings)
        assert torch.equal(model.generate(input_ids, streamer=ours, **settings), expected)
        # the prompt, one put per step (one token a row) up to the step that ended the last row, then end()
        assert _same_calls(ours.calls, theirs.calls), (batch, length, len(ours.calls), len(theirs.calls))
    assert not any("transformers' own loop" in note for note in _generation_notes(model))


class _StopAtLength(transformers.StoppingCriteria):
    """Stops every row once the sequences are ``length`` tokens long."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


@pytest.mark.parametrize("make", [lambda: causal_lm("llama"), lambda: t5_model(vocab_size=128)], ids=["llama", "t5"])
@pytest.mark.parametrize("eos", [True, False], ids=["eos", "no eos"])
def test_stopping_criteria_and_max_time_end_rows_as_transformers_does(make, eos):
    model, reference = _pair_of(make())
    input_ids, attention_mask = left_padded_prompts(3, 9)
    settings = dict(attention_mask=attention_mask, max_new_tokens=30, do_sample=False)
    if not eos:  # transformers then keeps a stopped row's tokens instead of padding them
        model.generation_config.eos_token_id = reference.generation_config.eos_token_id = None
    greedy = reference.generate(input_ids, **settings)
    row_one_token = int(greedy[1, -20])  # made by row 1 mid-way: that row stops there, the others later
    head = greedy.shape[1] - 30
    for extra in [dict(stopping_criteria=transformers.StoppingCriteriaList([StopAfterToken(row_one_token)])),
                  dict(stopping_criteria=[_StopAtLength(head + 7)]), dict(max_time=0.0), dict(max_time=60.0)]:
        expected = reference.generate(input_ids, **settings, **extra)
        assert torch.equal(model.generate(input_ids, **settings, **extra), expected), extra
    assert not any("transformers' own loop" in note for note in _generation_notes(model))


def test_stop_strings_end_rows_as_transformers_does():
    tokenizer = byte_level_tokenizer()
    model, reference = _pair_of(causal_lm("llama", vocab_size=len(tokenizer)))
    input_ids, attention_mask = left_padded_prompts(3, 9)
    settings = dict(attention_mask=attention_mask, max_new_tokens=30, do_sample=False)
    greedy = reference.generate(input_ids, **settings)
    stop = tokenizer.decode([int(greedy[1, -20])])  # the text of a token row 1 makes mid-way
    expected = reference.generate(input_ids, stop_strings=[stop], tokenizer=tokenizer, **settings)
    assert not torch.equal(expected, greedy)  # the stop string cut something
    assert torch.equal(model.generate(input_ids, stop_strings=[stop], tokenizer=tokenizer, **settings), expected)
    assert not any("transformers' own loop" in note for note in _generation_notes(model))
    with pytest.raises(ValueError, match="tokenizer"):  # transformers' error, through its own loop
        model.generate(input_ids, stop_strings=[stop], **settings)


def test_a_text_generation_pipeline_takes_the_loop_with_transformers_text():
    tokenizer = byte_level_tokenizer()
    model = causal_lm("llama", vocab_size=len(tokenizer))
    for config in (model.config, model.generation_config):
        config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model, reference = _pair_of(model)
    prompts = ["hello world, the user", "said stop"]  # one request each (the pipeline's default batch of 1)
    texts = [[generated[0]["generated_text"] for generated in transformers.pipeline(
        "text-generation", model=each, tokenizer=tokenizer, device="cpu")(prompts, max_new_tokens=12, do_sample=False)]
        for each in (model, reference)]
    assert texts[0] == texts[1] and all(len(text) > len(prompt) for text, prompt in zip(texts[0], prompts))
    assert any("lane of" in note for note in _generation_notes(model))
    assert not any("transformers' own loop" in note for note in _generation_notes(model))


def test_a_cache_that_does_not_fit_is_an_error_naming_its_size(monkeypatch):
    from transformers import StaticCache

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(StaticCache, "early_initialization", out_of_memory)
    model, _ = _pair("llama")
    with pytest.raises(torch.OutOfMemoryError, match=r"static KV cache for generation \(2 sequences x 256 tokens x "
                                                     r"2 layers, 0\.00 GiB\).*generation\.max_length"):
        input_ids, attention_mask = left_padded_prompts(2, 6)
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)


def test_a_step_the_capture_refuses_runs_without_a_graph_and_says_so(monkeypatch):
    from kernel_pytorch.features.generation.lane import DecodeLane

    def refused(self, kind, saved):
        self._step_body(kind)  # the warm-up ran and advanced the buffers before the capture failed
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeLane, "_warm_up_and_capture", refused)
    model, reference = _pair("llama")
    decoder = Decoder(model)
    input_ids, attention_mask = left_padded_prompts(2, 6)
    decoder.prefill(input_ids, attention_mask, max_new_tokens=12)
    decoder.lane.cuda_graphs = True  # as on a GPU
    tokens = decoder.generate(input_ids, attention_mask, max_new_tokens=12, eos=[5], pad=0)  # the config's ids
    expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=False)
    assert torch.equal(tokens, expected)  # the buffers were put back before the step ran uncaptured
    assert not decoder.lane.cuda_graphs
    assert any("could not be captured" in note and "stream is capturing" in note for note in decoder.notes)


def test_caches_are_sized_to_the_request_and_old_lanes_are_dropped():
    from kernel_pytorch.features.generation import decoder as decoder_module

    decoder = Decoder(causal_lm("gpt2"), batch_buckets=tuple(range(1, decoder_module._MAX_LANES + 2)))
    for prompt, new in [(10, 20), (300, 100), (10, 20), (600, 3)]:
        decoder.prefill(torch.randint(6, 128, (1, prompt)), max_new_tokens=new)
    assert list(decoder.lanes) == [(1, 512, 0), (1, 256, 0), (1, 768, 0)]  # most recently used last
    for batch in range(2, decoder_module._MAX_LANES + 2):
        decoder.prefill(torch.randint(6, 128, (batch, 5)), max_new_tokens=1)
    assert len(decoder.lanes) == decoder_module._MAX_LANES and (1, 512, 0) not in decoder.lanes
    assert any("1 sequences x 512 tokens dropped" in note for note in decoder.notes)


def test_a_moved_or_replaced_parameter_rebuilds_the_lanes_and_in_place_updates_keep_them():
    model, reference = _pair("llama")
    input_ids, attention_mask = left_padded_prompts(2, 7)

    def both_generate():
        expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
        tokens = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(tokens, expected)

    both_generate()
    with torch.no_grad():  # in place: the same addresses, the captured lanes stay valid
        for twin in (model, reference):
            twin.model.norm.weight.mul_(1.5)
    both_generate()
    assert not any("lanes rebuilt" in note for note in _generation_notes(model))
    replacement = torch.randn_like(reference.lm_head.weight)
    for twin in (model, reference):  # a new tensor: a replay would read the old one
        twin.lm_head.weight = torch.nn.Parameter(replacement.clone())
    both_generate()
    assert sum("lanes rebuilt" in note for note in _generation_notes(model)) == 1


def test_a_hook_registered_after_optimize_runs_through_transformers_loop():
    model, reference = _pair("llama")
    input_ids, attention_mask = left_padded_prompts(2, 6)
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)  # lanes built
    calls = []
    handles = [twin.model.layers[0].mlp.register_forward_hook(lambda module, args, out: calls.append(out.shape))
               for twin in (model, reference)]
    expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)
    hooked_in_reference = len(calls)
    tokens = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(tokens, expected)
    assert len(calls) == 2 * hooked_in_reference  # the hook ran at every forward, as in the unoptimized model
    assert any(note.startswith("generation: generate() while a forward hook on model.layers.0.mlp is registered "
                               "runs transformers' own loop") for note in _generation_notes(model))
    with pytest.raises(RuntimeError, match="kernel_pytorch.Decoder cannot run a forward hook on model.layers.0.mlp"):
        model.generate.decoder.prefill(input_ids, attention_mask, 4)
    for handle in handles:
        handle.remove()
    lanes_before = model.generate.decoder.summary()
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)
    assert model.generate.decoder.summary() != lanes_before  # served by the static-cache loop again


def test_a_changed_train_mode_rebuilds_the_lanes():
    model, reference = _pair("llama")
    input_ids, attention_mask = left_padded_prompts(1, 5)
    for twin in (model, reference):
        twin.eval()
    for mode in ("eval", "train", "eval"):
        for twin in (model, reference):
            getattr(twin, mode)()
        expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=4,
                                          do_sample=False), expected)
    rebuilt = [note for note in model.generate.decoder.notes if "train/eval mode changed" in note]
    assert len(rebuilt) == 2, model.generate.decoder.notes  # to train, then back (the report says it once)


@pytest.mark.parametrize("option, prefill_graphs, compiled", [("auto", False, True), ("auto", True, False),
                                                               (True, True, True), (False, False, False)])
def test_compile_prefill_auto_leaves_uncompiled_only_the_prefills_replayed_from_cuda_graphs(option, prefill_graphs,
                                                                                            compiled):
    decoder = Decoder(causal_lm("llama"), compile_prefill=option, prefill_graphs=prefill_graphs)
    assert decoder.compile_prefill is compiled


@pytest.mark.parametrize("option, replayed, once", [("auto", False, False), ("auto", True, True), (True, False, True),
                                                    (False, True, False)])
def test_compile_layers_once_auto_splits_only_steps_replayed_from_cuda_graphs(monkeypatch, option, replayed, once):
    monkeypatch.setattr(Decoder, "steps_replay_cuda_graphs", property(lambda self: replayed))  # CUDA or not
    decoder = Decoder(causal_lm("llama"), compile_layers_once=option)
    assert decoder.compile_layers_once is once
