"""The fused LM head + cross-entropy (kernel_pytorch/ops/linear_cross_entropy.py) and its pass
(kernel_pytorch/passes/linear_cross_entropy.py): loss and every gradient equal to the unfused loss in float32,
fewer bytes kept for backward, the rewrite counted on transformers causal LMs and hand-written models; the
Triton kernels under Triton's interpreter (a child pytest, as in tests/test_rope_op.py) and, with -m gpu,
against PyTorch in bf16.
"""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

from kernel_pytorch import OptimizeConfig, optimize, report_of
from kernel_pytorch.ops.linear_cross_entropy import (linear_cross_entropy, linear_logits_cross_entropy,
                                                     logits_cross_entropy)

from .conftest import rel_err
from .triton_interpreter import EAGER_OPCHECKS, INTERPRETED, cuda_device, interp, run_interpreted_tests

LCE = importlib.import_module("kernel_pytorch.ops.linear_cross_entropy")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")
LCE_PASS = importlib.import_module("kernel_pytorch.passes.linear_cross_entropy")

N, D, V = 23, 16, 97  # tokens, hidden, vocabulary: odd sizes, several chunks with chunk=7 / 32


def _inputs(dtype=torch.float32, bias=False, device="cpu"):
    hidden = torch.randn(N, D, dtype=dtype, device=device, requires_grad=True)
    weight = (torch.randn(V, D, dtype=dtype, device=device) / D ** 0.5).requires_grad_()
    b = torch.randn(V, dtype=dtype, device=device, requires_grad=True) if bias else None
    labels = torch.randint(0, V, (N,), device=device)
    labels[torch.randperm(N, device=device)[:5]] = -100  # ignored tokens
    return hidden, weight, b, labels


def _unfused(hidden, weight, bias, labels, softcap=None, **options):
    logits = F.linear(hidden, weight, bias)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float().view(-1, V), labels.view(-1), **options), logits


def _fused(kind, hidden, weight, bias, labels, softcap=None, **options):
    if kind == "from_hidden":
        return linear_cross_entropy(hidden, weight, bias, labels, softcap=softcap, chunk=7, **options), None
    if kind == "with_logits":
        return linear_logits_cross_entropy(hidden, weight, bias, labels, softcap=softcap, chunk=32, **options)
    logits = F.linear(hidden, weight, bias)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    if kind == "from_logits":
        return logits_cross_entropy(hidden, weight, bias, logits, labels, softcap=softcap, chunk=32, **options), logits
    return logits_cross_entropy(None, None, None, logits, labels, **options), logits  # "logits_only"


def _grads(loss, tensors, retain_graph=False):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None], retain_graph=retain_graph)


def _check_against_unfused(kind, dtype=torch.float32, device="cpu", tolerance=(1e-6, 1e-5), bias=False,
                           softcap=None, **options):
    torch.manual_seed(0)
    hidden, weight, b, labels = _inputs(dtype, bias, device)
    expected, _ = _unfused(hidden, weight, b, labels, softcap, **options)
    expected_grads = _grads(expected, (hidden, weight, b))
    loss, _ = _fused(kind, hidden, weight, b, labels, softcap, **options)
    assert loss.dtype == torch.float32
    assert rel_err(loss, expected) < tolerance[0], (float(loss), float(expected))
    for name, grad, grad_expected in zip(("hidden", "weight", "bias"), _grads(loss, (hidden, weight, b)),
                                         expected_grads):
        assert grad.dtype == grad_expected.dtype and rel_err(grad, grad_expected) < tolerance[1], name


# -------------------------------------------------------------------------------------- the ops, on CPU

KINDS = ["from_hidden", "with_logits", "from_logits", "logits_only"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_loss_and_gradients_equal_unfused(kind, reduction, label_smoothing):
    _check_against_unfused(kind, reduction=reduction, label_smoothing=label_smoothing)


@pytest.mark.parametrize("kind", ["from_hidden", "with_logits", "from_logits"])
def test_bias_soft_cap_and_another_ignore_index(kind):
    _check_against_unfused(kind, bias=True, softcap=2.0, ignore_index=-100, label_smoothing=0.05)
    torch.manual_seed(1)
    hidden, weight, _, labels = _inputs()
    labels[labels == -100] = 3  # class 3 ignored instead
    expected, _ = _unfused(hidden, weight, None, labels, ignore_index=3)
    loss, _ = _fused(kind, hidden, weight, None, labels, ignore_index=3)
    assert rel_err(loss, expected) < 1e-6
    for grad, grad_expected in zip(_grads(loss, (hidden, weight)), _grads(expected, (hidden, weight))):
        assert rel_err(grad, grad_expected) < 1e-5


def test_gradcheck_float64():
    torch.manual_seed(0)
    hidden = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([1, -100, 8, 0, 4])
    assert torch.autograd.gradcheck(lambda h, w, b: linear_cross_entropy(h, w, b, labels, label_smoothing=0.1,
                                                                         softcap=3.0, chunk=2), (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda h, w, b: logits_cross_entropy(
        h, w, b, torch.tanh(F.linear(h, w, b).detach() / 3.0) * 3.0, labels, softcap=3.0, chunk=4), (hidden, weight, bias))
    assert torch.autograd.gradcheck(lambda h, w, b: linear_logits_cross_entropy(h, w, b, labels, softcap=3.0, chunk=4),
                                    (hidden, weight, bias))
    logits = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: logits_cross_entropy(None, None, None, x, labels, reduction="sum"),
                                    (logits,))


def test_opcheck_and_compile():
    torch.manual_seed(0)
    hidden, weight, bias, labels = _inputs(bias=True)
    logits = F.linear(hidden, weight, bias).detach()
    torch.library.opcheck(torch.ops.kernel_pytorch.logits_cross_entropy.default,
                          (hidden, weight, bias, logits, labels, -100, 0.1, 0.0, "mean", 16))
    torch.library.opcheck(torch.ops.kernel_pytorch.linear_cross_entropy.default,
                          (hidden, weight, bias, labels, -100, 0.0, 2.0, "sum", 5, True, True))
    torch.library.opcheck(torch.ops.kernel_pytorch.linear_logits_cross_entropy.default,
                          (hidden, weight, bias, labels, -100, 0.1, 2.0, "mean", 8))

    def step(h, w, b, y):
        loss, _ = _fused("from_logits", h, w, b, y)
        loss_2, logits = _fused("with_logits", h, w, b, y)
        return loss + loss_2 + linear_cross_entropy(h, w, b, y) + logits.sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    expected = step(hidden, weight, bias, labels)
    assert rel_err(compiled(hidden, weight, bias, labels), expected) < 1e-6


def test_gradient_of_the_returned_logits_joins_the_loss():
    torch.manual_seed(0)
    hidden, weight, bias, labels = _inputs(bias=True)
    upstream = torch.randn(N, V)
    results = []
    for loss_fn in (lambda: _unfused(hidden, weight, bias, labels, 2.0), lambda: linear_logits_cross_entropy(
            hidden, weight, bias, labels, softcap=2.0, chunk=40)):
        loss, logits = loss_fn()
        results.append(_grads(2 * loss + (logits * upstream).sum(), (hidden, weight, bias), retain_graph=True))
        results.append(_grads((logits * upstream).sum(), (hidden, weight, bias)))  # the loss unused
    for grad, grad_expected in zip(results[2] + results[3], results[0] + results[1]):
        assert rel_err(grad, grad_expected) < 1e-5


def test_inference_computes_no_gradients():
    torch.manual_seed(0)
    hidden, weight, _, labels = _inputs()
    with torch.no_grad():
        expected, _ = _unfused(hidden, weight, None, labels)
        loss = linear_cross_entropy(hidden, weight, None, labels, need_hidden=False, need_weight=False, chunk=5)
    assert rel_err(loss, expected) < 1e-6
    with pytest.raises(RuntimeError, match="need_hidden / need_weight"):
        linear_cross_entropy(hidden, weight, None, labels, need_hidden=False, need_weight=False).backward()


# ------------------------------------------------------------------------------ bytes kept for backward

def _bytes_saved(fn) -> int:
    """Bytes of the tensors autograd saves while ``fn`` runs, not counting storages ``fn``'s leaves or outputs
    hold anyway (what is kept alive for backward only)."""
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        kept = fn()
    for tensor in kept:
        saved.pop(tensor.untyped_storage().data_ptr(), None)
    return sum(saved.values())


@pytest.mark.parametrize("kind", KINDS)
def test_fewer_bytes_saved_for_backward(kind):
    torch.manual_seed(0)
    hidden, weight, _, labels = _inputs()

    def run(loss_fn):
        def call():
            loss, logits = loss_fn(kind, hidden, weight, None, labels) if loss_fn is _fused else \
                loss_fn(hidden, weight, None, labels)
            return [hidden, weight, loss] + ([logits] if logits is not None and kind != "from_hidden" else [])
        return _bytes_saved(call)

    unfused, fused = run(_unfused), run(_fused)
    assert unfused >= N * V * 4  # the float32 log-softmax
    # what the fused op keeps: the row statistics, or dh and dW computed in the forward
    assert fused < unfused and fused <= (N * D + V * D + 2 * N) * 4, (fused, unfused)


# --------------------------------------------------------------------------------- the pass, on models

def _config(name):
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_embd=32, n_layer=1, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
    if name == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, head_dim=8, final_logit_softcapping=3.0))  # a low cap, so soft-capping shows in the loss
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[name]
    return model_class(config_class(**common))


def _batch(seq=9):
    ids = torch.randint(0, V, (2, seq))
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt not trained on
    return {"input_ids": ids, "labels": labels}


def _optimized_with_logits(name, training_logits):
    torch.manual_seed(0)
    model = _config(name).train()
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config and loss_type warnings
        optimize(model, example_inputs=_batch(), training_logits=training_logits)
    return model, reference


def _rewrites(model) -> list[str]:
    return [r.replacement for r in report_of(model).rewrites if r.pass_name == "linear_cross_entropy"]


def _assert_same_loss_and_gradients(model, reference, batch, **kwargs):
    out, expected = model(**batch, **kwargs), reference(**batch, **kwargs)
    assert rel_err(out.loss, expected.loss) < 1e-5 and rel_err(out.logits, expected.logits) < 1e-5
    out.loss.backward()
    expected.loss.backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, p_ref.grad) < 1e-4, name


@pytest.mark.parametrize("name, fused", [("llama", "-> linear_logits"), ("qwen3", "-> linear_logits"),
                                         ("qwen2", "-> linear_logits"), ("mistral", "-> linear_logits"),
                                         ("gemma2", "soft-capped at 3 -> linear_logits"),
                                         ("gpt2", "no LM head right before the loss")])
def test_transformers_causal_lms_with_labels(name, fused):
    model, reference = _optimized_with_logits(name, "keep")
    rewrites = _rewrites(model)
    assert len(rewrites) == 1 and fused in rewrites[0], report_of(model)
    assert not report_of(model).rollbacks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' loss_type warnings
        _assert_same_loss_and_gradients(model, reference, _batch())


def test_num_items_in_batch_divides_a_sum():
    torch.manual_seed(0)
    model = _config("llama").train()
    reference = copy.deepcopy(model)
    batch = _batch()
    items = torch.tensor(11)
    optimize(model, example_inputs=dict(batch, num_items_in_batch=items))
    assert len(_rewrites(model)) == 1, report_of(model)
    _assert_same_loss_and_gradients(model, reference, _batch(), num_items_in_batch=torch.tensor(13))


class HandWrittenLM(nn.Module):
    """An LM head and its loss the plain way; ``return_logits`` decides which fused op the pass picks."""

    def __init__(self, return_logits: bool, label_smoothing: float = 0.0):
        super().__init__()
        self.embed, self.norm = nn.Embedding(V, D), nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=True)
        self.return_logits, self.label_smoothing = return_logits, label_smoothing

    def forward(self, ids, labels):
        logits = self.lm_head(self.norm(self.embed(ids)))
        loss = F.cross_entropy(logits.float().view(-1, V), labels.view(-1), label_smoothing=self.label_smoothing)
        return (loss, logits) if self.return_logits else loss


@pytest.mark.parametrize("return_logits, fused", [(False, "linear_cross_entropy"),
                                                   (True, "linear_logits_cross_entropy")])
def test_hand_written_model(return_logits, fused):
    torch.manual_seed(0)
    model = HandWrittenLM(return_logits, label_smoothing=0.1)
    reference = copy.deepcopy(model)
    batch = _batch()
    optimize(model, example_inputs=(batch["input_ids"], batch["labels"]))
    rewrites = _rewrites(model)
    assert len(rewrites) == 1 and f"-> {fused}" in rewrites[0], report_of(model)
    batch = _batch(seq=9)
    out, expected = model(batch["input_ids"], batch["labels"]), reference(batch["input_ids"], batch["labels"])
    loss, expected_loss = (out[0], expected[0]) if return_logits else (out, expected)
    assert rel_err(loss, expected_loss) < 1e-5
    loss.backward()
    expected_loss.backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, p_ref.grad) < 1e-4, name


def test_model_keeps_fewer_bytes_for_backward():
    torch.manual_seed(0)
    batch = _batch(seq=16)
    kept = {}
    for label, disabled in (("fused", ()), ("unfused", ("linear_cross_entropy",))):
        torch.manual_seed(0)
        model = HandWrittenLM(return_logits=False)
        optimize(model, OptimizeConfig(disable_passes=disabled), example_inputs=(batch["input_ids"], batch["labels"]))
        kept[label] = _bytes_saved(lambda: [model(batch["input_ids"], batch["labels"]), *model.parameters()])
    assert kept["unfused"] - kept["fused"] >= 32 * V * 4 - (32 * D + V * D + V) * 4, kept


# ------------------------------------------------------------------- training_logits="drop" (Liger's contract)

@pytest.mark.parametrize("name, capped", [("llama", ""), ("qwen3", ""), ("gemma2", "soft-capped at 3 ")])
def test_dropped_training_logits_are_none_and_the_loss_and_gradients_stay(name, capped):
    model, reference = _optimized_with_logits(name, "drop")
    report = report_of(model)
    assert any("training_logits='drop': 1 LM head's logits read by the loss returned as None" in n
               for n in report.notes), report.notes
    rewrites = _rewrites(model)
    assert rewrites and f"{capped}-> linear_cross_entropy (the logits never materialized)" in rewrites[0], rewrites
    assert report.verification.passed and not report.rollbacks, report.verification
    assert any("['logits'] not compared" in n for n in report.notes), report.notes
    batch = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, expected = model(**batch), reference(**batch)
    assert out.logits is None and expected.logits is not None
    assert rel_err(out.loss, expected.loss) < 1e-5
    out.loss.backward()
    expected.loss.backward()
    pairs = list(zip(model.parameters(), reference.parameters()))
    every = rel_err(torch.cat([p.grad.flatten() for p, _ in pairs]), torch.cat([r.grad.flatten() for _, r in pairs]))
    assert every < 1e-5, every


@pytest.mark.parametrize("training_logits, taken", [("keep", False), ("drop", True)])
def test_a_measured_slower_fused_loss_is_taken_only_where_the_logits_are_dropped(monkeypatch, training_logits, taken):
    """As on a GPU that timed the fused loss 30% slower than the unfused one: over TIME_MARGIN, within
    DROPPED_LOGITS_MARGIN, which applies where training_logits='drop' gave the logits up for memory."""
    measured = []

    def timings(steps):
        measured.append(sorted(steps))
        return {"fused": 1.3, "unfused": 1.0}

    monkeypatch.setattr(LCE_PASS, "_decision", LCE_PASS._measured_choice)  # the GPU's path, on the CPU
    monkeypatch.setattr(LCE_PASS, "fastest_cuda_ms", timings)
    monkeypatch.setattr(LCE_PASS, "_MEASURED", {})
    model, _ = _optimized_with_logits("llama", training_logits)
    assert measured == [["fused", "unfused"]]
    skips = [s.reason for s in report_of(model).skipped if s.pass_name == "linear_cross_entropy"]
    if taken:
        assert len(_rewrites(model)) == 1 and not skips
        assert "fused 1.300 ms, unfused 1.000 ms, margin 50% (training_logits='drop')" in _rewrites(model)[0]
    else:
        assert not _rewrites(model) and len(skips) == 1, skips
        assert "fused op slower" in skips[0] and "margin 5%)" in skips[0], skips


def test_dropped_training_logits_hold_less_after_the_forward_and_inference_keeps_them():
    """What a training step holds between forward and backward: the tensors saved for backward and the logits
    returned. Dropped, the logits are never made; the fused loss saves dh and dW instead (Liger's scheme)."""
    held = {}
    batch = _batch(seq=64)
    for option in ("keep", "drop"):
        model, _ = _optimized_with_logits("llama", option)
        outputs = []
        saved = _bytes_saved(lambda: [outputs.append(model(**batch)) or outputs[0].loss, *model.parameters()])
        logits = outputs[0].logits
        held[option] = saved + (0 if logits is None else logits.untyped_storage().nbytes())
        if option == "drop":
            assert logits is None
            model.eval()
            with torch.no_grad():
                assert model(input_ids=batch["input_ids"]).logits.shape == (2, 64, V)  # inference: returned
    assert held["drop"] < held["keep"], held


def test_training_logits_is_keep_or_drop():
    with pytest.raises(ValueError, match="training_logits"):
        OptimizeConfig(training_logits="skip")


@pytest.mark.parametrize("call, reason", [
    (lambda x, y: F.cross_entropy(x, y, reduction="none"), "per-token losses"),
    (lambda x, y: F.cross_entropy(x, y, weight=torch.ones(V)), "class weights"),
    (lambda x, y: F.cross_entropy(x, F.one_hot(y.clamp(min=0), V).float()), "class probabilities"),
])
def test_skips_say_why(call, reason):
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(D, V)

        def forward(self, h, y):
            return call(self.head(h).float().view(-1, V), y.view(-1))

    model = Loss()
    optimize(model, example_inputs=(torch.randn(N, D), torch.randint(0, V, (N,))))
    skips = [s.reason for s in report_of(model).skipped if s.pass_name == "linear_cross_entropy"]
    assert _rewrites(model) == [] and len(skips) == 1 and reason in skips[0], report_of(model)


# ------------------------------------------------------------------- the Triton kernels, interpreted

@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"}))


@interp
@pytest.mark.parametrize("kind", KINDS)
def test_interp_kernels_equal_unfused(triton_on_cpu, kind):
    assert tu.use_triton(torch.empty(1))
    _check_against_unfused(kind, label_smoothing=0.1, tolerance=(1e-5, 1e-4))
    if kind != "logits_only":
        _check_against_unfused(kind, bias=True, softcap=2.0, reduction="sum", tolerance=(1e-5, 1e-4))


@interp
def test_interp_opcheck(triton_on_cpu):
    torch.manual_seed(0)
    hidden, weight, _, labels = _inputs()
    torch.library.opcheck(torch.ops.kernel_pytorch.linear_cross_entropy.default,
                          (hidden, weight, None, labels, -100, 0.1, 0.0, "mean", 8, True, True),
                          test_utils=EAGER_OPCHECKS)


@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_* tests itself")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to interpret")
def test_triton_kernels_in_a_subprocess(interpreted_tests):
    run_interpreted_tests(__file__, interpreted_tests)


# ----------------------------------------------------------------------------------- on a GPU (-m gpu)

@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_gpu_kernels_against_pytorch_in_bf16(kind, softcap):
    device = cuda_device()
    # bf16 logits and gradients, rounded once each; the unfused reference rounds the same way
    _check_against_unfused(kind, torch.bfloat16, device, tolerance=(5e-3, 2e-2), label_smoothing=0.1,
                           softcap=None if kind == "logits_only" else softcap)


@pytest.mark.gpu
def test_gpu_large_vocabulary_chunks():
    device = cuda_device()
    torch.manual_seed(0)
    hidden = torch.randn(4096, 1024, dtype=torch.bfloat16, device=device, requires_grad=True)
    weight = (torch.randn(50257, 1024, dtype=torch.bfloat16, device=device) / 32).requires_grad_()
    labels = torch.randint(0, 50257, (4096,), device=device)
    labels[:100] = -100
    logits = F.linear(hidden, weight)
    expected = F.cross_entropy(logits.float(), labels)
    expected_grads = torch.autograd.grad(expected, (hidden, weight), retain_graph=True)
    for loss in (logits_cross_entropy(hidden, weight, None, logits, labels, chunk=8192),
                 linear_logits_cross_entropy(hidden, weight, None, labels, chunk=8192)[0],
                 linear_cross_entropy(hidden, weight, None, labels, chunk=1000)):
        assert rel_err(loss, expected) < 1e-3
        for grad, grad_expected in zip(torch.autograd.grad(loss, (hidden, weight)), expected_grads):
            assert rel_err(grad, grad_expected) < 2e-2
