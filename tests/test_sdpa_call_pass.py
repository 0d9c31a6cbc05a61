"""The attention pass on existing ``F.scaled_dot_product_attention`` calls: every spelling of the call is
matched, its mask decided as a hand-written one's would be (causal -> is_causal, windows recognized, padding
kept as a tensor), repeated K/V used with ``enable_gqa``, and the call handed to the dispatcher; the
rewritten graph equals the original (values and gradients). Then transformers models with their default
(SDPA) attention end to end, training and inference, with and without padding.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

from kernel_pytorch import optimize, report_of
from kernel_pytorch.attention.dispatch import choose_kernel
from kernel_pytorch.hardware import HardwareInfo

from . import sdpa_models
from .conftest import rel_err, twin
from .test_attention_pass import B, E, L, Rewritten, T5Like, _qkv, _with_keep, check, kwargs_of, repeat_kv
from .test_attention_pass import BufferCausal as HandWrittenBufferCausal

# --------------------------------------------------------------------------------------------------
# spellings of the call
# --------------------------------------------------------------------------------------------------


class Positional(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, None, 0.0, True)


class Keywords(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=False, scale=0.3, dropout_p=0.0)


class DefaultScale(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class NativeGQA(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class RepeatKV(nn.Module):
    def __init__(self, how: str = "repeat_kv"):
        super().__init__()
        self.how = how

    def forward(self, q, k, v):
        rep = q.shape[1] // k.shape[1]
        if self.how == "repeat_kv":
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        else:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, scale=0.25)


class BoolCausalMask(nn.Module):
    def forward(self, q, k, v):
        n = q.shape[-2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(n, n, dtype=torch.bool).tril())


class AdditiveCausalMask(nn.Module):
    def forward(self, q, k, v):
        n = q.shape[-2]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        return F.scaled_dot_product_attention(q, k, v, mask, scale=0.125)


class SlidingWindow(nn.Module):
    """Mistral's causal window of 3, as transformers' sdpa_mask builds it from index comparisons."""

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])[None, None, :, None]
        j = torch.arange(k.shape[-2])[None, None, None, :]
        allowed = (j > i - 3) & (j <= i)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.expand(q.shape[0], -1, -1, -1))


class PaddingBool(nn.Module):
    def forward(self, q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep.bool()[:, None, None, :], scale=0.25)


class PaddingAdditive(nn.Module):
    def forward(self, q, k, v, keep):
        additive = (1.0 - keep[:, None, None, :]) * torch.finfo(q.dtype).min
        return F.scaled_dot_product_attention(q, k, v, additive)


class BufferCausal(HandWrittenBufferCausal):
    def forward(self, q, k, v):
        n = q.shape[-2]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed[:n, :n])


class WithDropout(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.2 if self.training else 0.0, is_causal=True)


class CrossAttention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=0.5)


class PositionBias(T5Like):
    """T5 through SDPA: unscaled, a trainable relative position bias (one per head) as the additive mask."""

    def __init__(self, buckets: int = 8):
        super().__init__(buckets)

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.position_bias(q, k), scale=1.0)


def _gqa_inputs():
    return _qkv(heads=4, kv_heads=2)


def _with_token_keep():
    """q, k, v and an integer keep mask (no gradient: its finfo.min multiple would make one of infs)."""
    *qkv, keep = _with_keep()
    return (*qkv, keep.long())


SPELLINGS = {
    # name: (module, inputs, substrings of the report line, the call's expected keyword arguments)
    "positional": (Positional, _qkv, ("causal", "no mask"), {"is_causal": True, "mask": None}),
    "keywords": (Keywords, _qkv, ("scale 0.3", "no mask"), {"is_causal": False, "scale": 0.3}),
    "default_scale": (DefaultScale, _qkv, (f"scale {E ** -0.5!r} (SDPA's default)",), {"scale": None}),
    "native_gqa": (NativeGQA, _gqa_inputs, ("causal", "gqa 4/2"), {"enable_gqa": True, "is_causal": True}),
    "repeat_kv": (RepeatKV, _gqa_inputs, ("gqa 4/2", "scale 0.25"), {"enable_gqa": True}),
    "repeat_interleave": (lambda: RepeatKV("interleave"), _gqa_inputs, ("gqa 4/2",), {"enable_gqa": True}),
    "bool_causal_mask": (BoolCausalMask, _qkv, ("causal", "no mask"), {"is_causal": True, "mask": None}),
    "additive_causal_mask": (AdditiveCausalMask, _qkv, ("causal", "no mask"), {"is_causal": True, "mask": None}),
    "sliding_window": (SlidingWindow, _qkv, ("causal sliding window 3",), {"is_causal": False}),
    "padding_bool": (PaddingBool, _with_token_keep, ("mask bool",), {"is_causal": False}),
    "padding_additive": (PaddingAdditive, _with_token_keep, ("mask additive",), {"is_causal": False}),
    "cross_attention": (CrossAttention, lambda: _qkv(lq=5, lk=9), ("scale 0.5", "no mask"), {"scale": 0.5}),
    "position_bias": (PositionBias, _qkv, ("scale 1.0", "mask additive"), {"scale": 1.0}),
}


@pytest.mark.parametrize("name", SPELLINGS)
def test_sdpa_spelling_is_rewritten_with_equal_values_and_gradients(name):
    factory, make_inputs, contains, expected = SPELLINGS[name]
    rewritten = check(factory(), make_inputs, contains=("SDPA call", *contains), training=True)
    call = kwargs_of(rewritten)
    for key, value in expected.items():
        assert call[key] == value if value is not None else call[key] is None, (key, call)
    assert not [n for n in rewritten.gm.graph.nodes if n.target is F.scaled_dot_product_attention]


def test_repeated_kv_are_removed_and_the_sources_passed():
    rewritten = check(RepeatKV(), _gqa_inputs)
    [call] = rewritten.calls
    assert [tuple(a.meta["example_value"].shape) for a in call.args[1:3]] == [(B, 2, L, E)] * 2
    assert not [n for n in rewritten.gm.graph.nodes if n.op == "call_method" and n.target == "expand"]


def test_constant_causal_mask_subgraph_is_erased():
    rewritten = check(BoolCausalMask(), _qkv)
    assert not [n for n in rewritten.gm.graph.nodes if n.op == "call_method" and n.target == "tril"]


def test_buffer_causal_mask_is_causal_behind_a_runtime_guard():
    module = BufferCausal()
    rewritten = check(module, _qkv, contains=("causal", "no mask"))
    assert kwargs_of(rewritten)["is_causal"] and kwargs_of(rewritten)["mask"] is None
    assert any("from a buffer" in r for r in rewritten.reasons), rewritten.reasons
    [guard] = rewritten.result.guards
    guard.bind(rewritten.gm.graph)
    args = rewritten.runtime_args(*_qkv())
    assert guard.holds(args)
    module.allowed[0, 1] = True  # an in-place edit: no longer causal, the graph runs unrewritten
    assert not guard.holds(args)


def test_symbolic_sizes_sliding_window_is_recognized_behind_a_runtime_guard():
    rewritten = check(SlidingWindow(), _qkv, dynamic=True, contains=("causal sliding window 3",))
    assert kwargs_of(rewritten)["mask"] is not None  # on the CPU the dense kernel keeps the tensor


@pytest.mark.parametrize("training", [True, False])
def test_dropout_probability_is_kept_as_the_call_gave_it(training):
    torch.manual_seed(0)
    module = WithDropout().train(training)
    rewritten = Rewritten(module, _qkv(), training=training)
    assert kwargs_of(rewritten)["dropout_p"] == (0.2 if training else 0.0)
    assert ("dropout 0.2" in rewritten.descriptions[0]) == training


_NVIDIA = HardwareInfo(vendor="nvidia", device_name="sim H100", compute_capability=(9, 0), cudnn_attention=True,
                       bf16=True, triton_usable=True)


def _kernel_for(call: torch.fx.Node, training: bool) -> str:
    """The kernel an H100 would get (unmeasured: first eligible) for this call's shapes in bf16."""
    def on_meta(node):
        value = node.meta["example_value"] if isinstance(node, torch.fx.Node) else None
        if value is None:
            return None
        dtype = torch.bfloat16 if value.is_floating_point() else value.dtype
        return torch.empty(tuple(value.shape), dtype=dtype, device="meta").requires_grad_(value.requires_grad)

    q, k, v, mask = (on_meta(a) for a in call.args[:4])
    return choose_kernel(q, k, v, mask, is_causal=call.kwargs["is_causal"], dropout_p=0.0,
                         enable_gqa=call.kwargs["enable_gqa"], hardware=_NVIDIA, training=training)[0]


@pytest.mark.parametrize("training, kernel", [(True, "efficient"), (False, "cudnn")])
def test_trainable_position_bias_gets_a_kernel_with_a_mask_gradient(training, kernel):
    torch.manual_seed(0)
    module = PositionBias().train(training)
    rewritten = Rewritten(module, _qkv(), training=training)
    [call] = rewritten.calls
    assert call.args[3].meta["example_value"].requires_grad  # captured with gradients on
    assert _kernel_for(call, training) == kernel  # cuDNN returns no mask gradient: the efficient kernel does


class ScaleFromSizes(nn.Module):
    """A scale computed from a symbolic head size: a SymFloat, not a constant."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=1.0 / q.shape[-1])


def test_non_constant_scale_is_skipped_with_a_reason():
    torch.manual_seed(0)
    rewritten = Rewritten(ScaleFromSizes(), _qkv(), dynamic=True)
    if rewritten.result.rewrites:  # Dynamo specialized the head size: a constant after all
        assert "scale 0.125" in rewritten.descriptions[0]
    else:
        assert rewritten.reasons and "scale that is not a constant" in rewritten.reasons[0], rewritten.reasons


# --------------------------------------------------------------------------------------------------
# transformers models with their default attention, end to end through optimize()
# --------------------------------------------------------------------------------------------------

CASES = [  # (family, training, padded): each family trains (all gradients); the decoders also run inference
    ("llama", True, True), ("llama", False, False),
    ("qwen2", True, False), ("qwen2", False, True),
    ("qwen3", True, True), ("qwen3", False, False),
    ("mistral", True, False), ("mistral", False, True),
    ("gpt2", True, True), ("gpt2", False, False),
    ("bert", True, True),
    ("t5", True, True),  # its inference SDPA call is the same (dropout 0 here), and the slowest capture
]


def _first_output(model: nn.Module, inputs: dict) -> torch.Tensor:
    return model(**inputs)[0]  # logits or last_hidden_state


def _gradient_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Every parameter's gradient error against the reference's (inf where one of them has none)."""
    errors = {}
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        if p.grad is None or p_ref.grad is None:
            errors[name] = 0.0 if p.grad is None and p_ref.grad is None else float("inf")
        else:
            errors[name] = rel_err(p.grad, p_ref.grad) if p_ref.grad.norm() > 0 else float(p.grad.norm())
    return errors


@pytest.mark.parametrize("family, training, padded", CASES)
def test_transformers_default_attention_is_rewritten_and_matches(family, training, padded):
    torch.manual_seed(0)
    model, inputs, calls = sdpa_models.FAMILIES[family](padded)
    model.train(training)
    reference = twin(model)
    optimize(model, example_inputs=inputs)
    report = report_of(model)
    lines = [r.replacement for r in report.rewrites if r.pass_name == "attention"]
    assert len(lines) == calls and all(line.startswith("attention[sdpa]: SDPA call") for line in lines), lines
    assert not [s for s in report.skipped if s.pass_name == "attention"]
    assert report.rollbacks == [] and report.verification.passed, report.verification
    fresh = sdpa_models.fresh_inputs(inputs)
    with torch.set_grad_enabled(training):
        out, expected = _first_output(model, fresh), _first_output(reference, fresh)
        assert rel_err(out, expected) < 1e-5
        if not training:
            return
        seed = torch.randn_like(expected)
        (out * seed).sum().backward()
        (expected * seed).sum().backward()
    errors = _gradient_errors(model, reference)
    assert errors and not {name: e for name, e in errors.items() if not e < 1e-4}, errors


# --------------------------------------------------------------------------------------------------
# use_cache=False: transformers builds the causal mask through packed-sequence ids of the position ids
# --------------------------------------------------------------------------------------------------

def _without_cache(family: str) -> tuple[nn.Module, dict]:
    """A decoder with use_cache=False (as for training): transformers then materializes a bool mask from
    ``find_packed_sequence_indices(position_ids)`` (``diff``, ``cumsum``) instead of passing is_causal."""
    config_class, model_class = _DECODERS[family]
    config = config_class(vocab_size=sdpa_models.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          use_cache=False, pad_token_id=0)
    return model_class(config), {"input_ids": torch.randint(0, sdpa_models.VOCAB, (2, 12))}


_DECODERS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    "starcoder2": (transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM),
}


def _assert_same_values_and_gradients(model: nn.Module, reference: nn.Module, inputs: dict) -> None:
    out, expected = _first_output(model, inputs), _first_output(reference, inputs)
    assert rel_err(out, expected) < 1e-5
    seed = torch.randn_like(expected)
    (out * seed).sum().backward()
    (expected * seed).sum().backward()
    errors = _gradient_errors(model, reference)
    assert errors and not {name: e for name, e in errors.items() if not e < 1e-4}, errors


@pytest.mark.parametrize("family", list(_DECODERS))
def test_a_mask_built_from_position_ids_without_a_cache_becomes_is_causal(family):
    """The positions are an arange inside the model: the packed-sequence ids are constants, the mask is causal
    (measured on an H100, that mask had kept every SDPA call on a dense masked kernel)."""
    torch.manual_seed(0)
    model, inputs = _without_cache(family)
    model.train()
    reference = twin(model)
    optimize(model, example_inputs=inputs)
    lines = [r.replacement for r in report_of(model).rewrites if r.pass_name == "attention"]
    assert len(lines) == 2 and all("causal" in line and "no mask" in line for line in lines), lines
    _assert_same_values_and_gradients(model, reference, sdpa_models.fresh_inputs(inputs))


def test_packed_sequences_given_as_position_ids_keep_their_mask():
    """Position ids passed in (two sequences packed in each row) are an input: the block-diagonal causal mask
    they make stays a tensor, and the packed rows match the original."""
    torch.manual_seed(0)
    model, inputs = _without_cache("llama")
    model.train()
    reference = twin(model)
    inputs["position_ids"] = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12).contiguous()
    optimize(model, example_inputs=inputs)
    lines = [r.replacement for r in report_of(model).rewrites if r.pass_name == "attention"]
    assert lines and not any("causal" in line for line in lines), lines
    fresh = {**sdpa_models.fresh_inputs({"input_ids": inputs["input_ids"]}),
             "position_ids": torch.cat([torch.arange(8), torch.arange(4)]).expand(2, 12).contiguous()}
    _assert_same_values_and_gradients(model, reference, fresh)


def test_comparison_methods_as_dynamo_records_them_are_shape_only_ops():
    """torch 2.11's Dynamo records transformers' ``ids[q] == ids[kv]`` as ``.__eq__``: a mask built so is
    still a provable constant (on an H100 it had kept the dense mask)."""
    from kernel_pytorch.passes.shape_constants import ConstantEvaluator

    graph = torch.fx.Graph()
    positions = graph.call_function(torch.arange, (6,))
    rows, cols = graph.call_method("unsqueeze", (positions, 1)), graph.call_method("unsqueeze", (positions, 0))
    causal = graph.call_method("__ge__", (rows, cols))
    row_ids, col_ids = graph.call_method("__mul__", (rows, 0)), graph.call_method("__mul__", (cols, 0))
    same = graph.call_method("__eq__", (row_ids, col_ids))
    mask = graph.call_function(operator.and_, (causal, same))
    graph.output(mask)
    evaluation = ConstantEvaluator().evaluate(mask)
    assert evaluation.value is not None, evaluation.reason
    assert torch.equal(evaluation.value, torch.ones(6, 6, dtype=torch.bool).tril())
