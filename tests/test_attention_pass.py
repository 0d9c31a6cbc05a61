"""The attention pass: a zoo of hand-written attention spellings, each captured by TorchDynamo,
normalized, rewritten to one fused call, and compared with the original module (values and gradients);
Hugging Face eager attention end to end; and what must not match.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
import transformers

from .hf_models import bert as _bert, gpt2 as _gpt2, llama as _llama, vit as _vit

import kernel_pytorch.passes.attention as attention_pass  # noqa: F401  (registers "attention")
from kernel_pytorch import optimize, report_of
from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.attention.dispatch import choose_kernel
from kernel_pytorch.capture import CompilerChoice
from kernel_pytorch.compile_skip import attention_only
from kernel_pytorch.hardware import HardwareInfo, detect_hardware
from kernel_pytorch.passes.attention import AttentionPass, _attention_op
from kernel_pytorch.passes.base import PassContext
from kernel_pytorch.passes.normalize import Normalize
from kernel_pytorch.ops.attention import attention

from .conftest import capture_graph, rel_err, twin

B, H, L, E = 2, 4, 6, 8


def _ctx(training: bool = False, gm: torch.fx.GraphModule | None = None, inputs: list[Any] = ()) -> PassContext:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"] if gm is not None else []
    return PassContext(hardware=detect_hardware("cpu"), config=OptimizeConfig(), training=training,
                       example_inputs=dict(zip(names, inputs)))


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


class Rewritten:
    """A module captured by dynamo, normalized and passed through the attention pass."""

    def __init__(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], dynamic: bool = False,
                 training: bool = False):
        self.gm, self.example_inputs = capture_graph(module, inputs, dynamic)
        self.user_inputs = inputs
        Normalize().run(self.gm, _ctx(training))
        self.result = AttentionPass().run(self.gm, _ctx(training, self.gm, self.example_inputs))
        self.gm.graph.lint()
        self.gm.recompile()

    def __call__(self, *fresh: torch.Tensor) -> Any:
        """The rewritten graph on fresh inputs of the captured shapes (symbolic sizes take their hints)."""
        replacements = {id(old): new for old, new in zip(self.user_inputs, fresh)}
        args = [replacements.get(id(arg), arg) for arg in self.example_inputs]
        args = [a.node.hint if isinstance(a, torch.SymInt) else a for a in args]
        out = self.gm(*args)
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out

    def runtime_args(self, *fresh: torch.Tensor) -> list[Any]:
        """The graph's arguments for a call with ``fresh`` inputs of any size: each symbolic size is read
        from the fresh input that has it in its shape (as Dynamo does)."""
        replacements = {id(old): new for old, new in zip(self.user_inputs, fresh)}
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        symbols: dict[str, int] = {}
        for node, arg in zip(placeholders, self.example_inputs):
            fake = node.meta.get("example_value")
            if isinstance(fake, torch.Tensor) and id(arg) in replacements:
                symbols.update({str(size): new for size, new in zip(fake.shape, replacements[id(arg)].shape)})
        args = []
        for node, arg in zip(placeholders, self.example_inputs):
            fake = node.meta.get("example_value")
            args.append(symbols[str(fake)] if isinstance(fake, torch.SymInt) else replacements.get(id(arg), arg))
        return args

    @property
    def calls(self) -> list[torch.fx.Node]:
        op = _attention_op()
        return [n for n in self.gm.graph.nodes if n.op == "call_function" and n.target is op]

    @property
    def descriptions(self) -> list[str]:
        return [r.replacement for r in self.result.rewrites]

    @property
    def reasons(self) -> list[str]:
        return [s.reason for s in self.result.skipped]


def _qkv(lq: int = L, lk: int = L, heads: int = H, kv_heads: int = H, e: int = E):
    return (torch.randn(B, heads, lq, e), torch.randn(B, kv_heads, lk, e), torch.randn(B, kv_heads, lk, e))


def _grads(out: torch.Tensor, wrt: list[torch.Tensor], seed: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, wrt, seed, allow_unused=True))


def check(module: nn.Module, make_inputs: Callable[[], tuple[torch.Tensor, ...]], *, count: int = 1,
          contains: tuple[str, ...] = (), absent: tuple[str, ...] = (), training: bool = False,
          dynamic: bool = False, grads: bool = True, tol: float = 1e-5) -> Rewritten:
    """Rewrite ``module``; check the rewrite count and descriptions, then values and gradients on fresh inputs."""
    torch.manual_seed(0)
    module.train(training)
    rewritten = Rewritten(module, make_inputs(), dynamic=dynamic, training=training)
    assert len(rewritten.result.rewrites) == count, (rewritten.descriptions, rewritten.reasons)
    assert len(rewritten.calls) == count
    assert not [n for n in rewritten.gm.graph.nodes if n.target is torch.softmax], rewritten.gm.code
    for text in contains:
        assert all(text in d for d in rewritten.descriptions), (text, rewritten.descriptions)
    for text in absent:
        assert all(text not in d for d in rewritten.descriptions), (text, rewritten.descriptions)
    fresh = tuple(t.clone().requires_grad_(t.is_floating_point() and grads) for t in make_inputs())
    expected, actual = module(*fresh), rewritten(*fresh)
    assert rel_err(actual, expected) < tol, rel_err(actual, expected)
    if grads:
        wrt = [t for t in fresh if t.requires_grad] + [p for p in module.parameters() if p.requires_grad]
        seed = torch.randn_like(expected)
        for got, want in zip(_grads(actual, wrt, seed), _grads(expected, wrt, seed)):
            if want is not None:
                assert got is not None and rel_err(got, want) < 1e-4, rel_err(got, want)
    return rewritten


def kwargs_of(rewritten: Rewritten, index: int = 0) -> dict:
    node = rewritten.calls[index]
    return {"mask": node.args[3], **node.kwargs}


# --------------------------------------------------------------------------------------------------
# the zoo
# --------------------------------------------------------------------------------------------------


class MatmulSqrt(nn.Module):
    def forward(self, q, k, v):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        return scores.softmax(dim=-1) @ v


class TorchMatmulPow(nn.Module):
    def forward(self, q, k, v):
        d = q.shape[-1]
        scores = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5
        return torch.matmul(F.softmax(scores, dim=3), v)


class PreScaledQ(nn.Module):
    def forward(self, q, k, v):
        q = q * (q.shape[-1] ** -0.5)
        return torch.softmax(q @ k.mT, -1) @ v


class BothScaled(nn.Module):
    """Whisper-style: q and k each scaled by d ** -0.25."""

    def forward(self, q, k, v):
        s = q.shape[-1] ** -0.25
        return torch.softmax((q * s) @ (k * s).transpose(-1, -2), -1) @ v


class T5Like(nn.Module):
    """No scale; a learned relative position bias (one per head) added to the scores."""

    def __init__(self, buckets: int = 16):
        super().__init__()
        self.bias = nn.Embedding(2 * buckets, H)
        self.buckets = buckets

    def position_bias(self, q, k):
        relative = torch.arange(k.shape[-2])[None, :] - torch.arange(q.shape[-2])[:, None]
        return self.bias(relative.clamp(-self.buckets, self.buckets - 1) + self.buckets).permute(2, 0, 1)[None]

    def forward(self, q, k, v):
        scores = torch.matmul(q, k.transpose(3, 2)) + self.position_bias(q, k)
        return torch.matmul(scores.softmax(-1), v)


class Bmm3D(nn.Module):
    def forward(self, q, k, v):
        b, h, l, e = q.shape
        q, k, v = (t.reshape(b * h, l, e) for t in (q, k, v))
        probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.3, dim=2)  # positive index of the key axis
        return torch.bmm(probs, v).view(b, h, l, e)


class Einsum(nn.Module):
    def forward(self, q, k, v):
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / 4.0
        return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)


class EinsumSeqFirst(nn.Module):
    """Heads after the sequence axis (b, l, h, d) in and out: operands and the output are permuted."""

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, l, h, d)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.2
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
        return out.transpose(1, 2)


class PermuteKT(nn.Module):
    """K kept as (b, l, h, d); Kᵀ by one permute."""

    def forward(self, q, k, v):
        k = k.transpose(1, 2)
        scores = q @ k.permute(0, 2, 3, 1) * 0.5
        return scores.softmax(-1) @ v


class AdditivePadding(nn.Module):
    def forward(self, q, k, v, keep):
        additive = (1.0 - keep[:, None, None, :]) * -10000.0
        scores = q @ k.mT * 0.25 + additive
        return scores.softmax(-1) @ v


class MaskedFillInf(nn.Module):
    def forward(self, q, k, v, keep):
        scores = (q @ k.mT) * 0.25
        scores = scores.masked_fill(keep[:, None, None, :] == 0, float("-inf"))
        return scores.softmax(-1) @ v


class MaskedFillFinfo(nn.Module):
    def forward(self, q, k, v, keep):
        scores = (q @ k.mT) * 0.25
        scores = scores.masked_fill(~keep.bool()[:, None, None, :], torch.finfo(scores.dtype).min)
        return scores.softmax(-1) @ v


class WhereMask(nn.Module):
    def forward(self, q, k, v, keep):
        scores = (q @ k.mT) * 0.25
        scores = torch.where(keep.bool()[:, None, None, :], scores, float("-inf"))
        return scores.softmax(-1) @ v


class CausalTriuFull(nn.Module):
    def forward(self, q, k, v):
        n = q.shape[-2]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        return torch.softmax(q @ k.mT * 0.125 + mask, -1) @ v


class CausalTrilOnes(nn.Module):
    def forward(self, q, k, v):
        n = q.shape[-2]
        allowed = torch.tril(torch.ones(n, n))
        scores = (q @ k.mT * 0.125).masked_fill(allowed == 0, float("-inf"))
        return scores.softmax(-1) @ v


class CausalArange(nn.Module):
    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])[:, None]
        j = torch.arange(k.shape[-2])[None, :]
        scores = (q @ k.mT * 0.125).masked_fill(j > i, torch.finfo(q.dtype).min)
        return scores.softmax(-1) @ v


class Float32Softmax(nn.Module):
    def forward(self, q, k, v):
        scores = q @ k.mT * 0.125
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return probs @ v


class SoftmaxDtypeTypeAs(nn.Module):
    def forward(self, q, k, v):
        probs = F.softmax(q @ k.mT * 0.125, dim=-1, dtype=torch.float32).type_as(v)
        return probs @ v


class WithDropout(nn.Module):
    def __init__(self, p: float = 0.3):
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, q, k, v):
        return self.drop((q @ k.mT * 0.125).softmax(-1)) @ v


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    b, h, l, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, l, d).reshape(b, h * n_rep, l, d)


class GQA(nn.Module):
    def __init__(self, how: str, dim: int = 32, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.how, self.heads, self.kv_heads, self.d = how, heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.d)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d)
        self.o = nn.Linear(heads * self.d, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2 * self.kv_heads, self.d).transpose(1, 2).chunk(2, dim=1)
        rep = self.heads // self.kv_heads
        if self.how == "repeat_kv":
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        else:
            k, v = k.repeat_interleave(rep, dim=1), torch.repeat_interleave(v, rep, dim=-3)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.d)
        out = torch.matmul(scores.softmax(-1), v)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


class CrossAttention(nn.Module):
    def forward(self, q, k, v):
        return (q @ k.mT * 0.125).softmax(-1) @ v


class BufferCausal(nn.Module):
    def __init__(self, n: int = L):
        super().__init__()
        self.register_buffer("allowed", torch.tril(torch.ones(n, n, dtype=torch.bool)))

    def forward(self, q, k, v):
        n = q.shape[-2]
        scores = (q @ k.mT * 0.125).masked_fill(~self.allowed[:n, :n], float("-inf"))
        return scores.softmax(-1) @ v


class Alibi(nn.Module):
    """ALiBi as a subtraction of slope * distance."""

    def forward(self, q, k, v):
        n = q.shape[-2]
        slopes = torch.tensor([2.0 ** -(i + 1) for i in range(q.shape[1])])
        distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().float()
        scores = q @ k.mT * 0.125 - slopes[:, None, None] * distance
        return scores.softmax(-1) @ v


def _with_keep():
    q, k, v = _qkv()
    keep = torch.ones(B, L)
    keep[1, 4:] = 0  # a padded second sequence; every query still sees a key
    return q, k, v, keep


ZOO = {
    "matmul_div_sqrt": (MatmulSqrt, _qkv, ("scale 0.353553390593273", "no mask"), 1 / math.sqrt(E)),
    "torch_matmul_pow": (TorchMatmulPow, _qkv, ("scale 0.353553390593273",), E ** -0.5),
    "prescaled_q": (PreScaledQ, _qkv, ("scale 0.353553390593273",), E ** -0.5),
    "q_and_k_scaled": (BothScaled, _qkv, ("scale",), (E ** -0.25) ** 2),
    "t5_no_scale_bias": (T5Like, _qkv, ("scale 1.0", "mask additive"), 1.0),
    "bmm_3d": (Bmm3D, _qkv, ("scale 0.3",), 0.3),
    "einsum": (Einsum, _qkv, ("scale 0.25",), 0.25),
    "einsum_seq_first": (EinsumSeqFirst, _qkv, ("scale 0.2",), 0.2),
    "permute_kt": (PermuteKT, _qkv, ("scale 0.5",), 0.5),
    "mT": (CrossAttention, _qkv, ("scale 0.125",), 0.125),
    "additive_padding": (AdditivePadding, _with_keep, ("mask additive",), 0.25),
    "masked_fill_inf": (MaskedFillInf, _with_keep, ("mask bool",), 0.25),
    "masked_fill_finfo": (MaskedFillFinfo, _with_keep, ("mask additive",), 0.25),
    "where": (WhereMask, _with_keep, ("mask bool",), 0.25),
    "causal_triu_full": (CausalTriuFull, _qkv, ("causal", "no mask"), 0.125),
    "causal_tril_ones": (CausalTrilOnes, _qkv, ("causal", "no mask"), 0.125),
    "causal_arange": (CausalArange, _qkv, ("causal", "no mask"), 0.125),
    "softmax_fp32_cast_back": (Float32Softmax, _qkv, ("scale 0.125",), 0.125),
    "softmax_dtype_type_as": (SoftmaxDtypeTypeAs, _qkv, ("scale 0.125",), 0.125),
    "cross_attention": (CrossAttention, lambda: _qkv(lq=5, lk=9), ("scale 0.125",), 0.125),
    "alibi_subtracted": (Alibi, _qkv, ("mask additive",), 0.125),
}


@pytest.mark.parametrize("name", ZOO)
def test_zoo_spelling_is_rewritten_with_equal_values_and_gradients(name):
    cls, make_inputs, contains, scale = ZOO[name]
    rewritten = check(cls(), make_inputs, contains=contains,
                      absent=() if "causal" in contains else ("causal",))
    kwargs = kwargs_of(rewritten)
    assert kwargs["scale"] == pytest.approx(scale, rel=1e-12)
    assert kwargs["is_causal"] is ("causal" in contains)
    assert (kwargs["mask"] is None) is ("no mask" in contains or "causal" in contains or not any(
        "mask" in c for c in contains))
    assert kwargs["dropout_p"] == 0.0 and kwargs["enable_gqa"] is False
    assert not [n for n in rewritten.gm.graph.nodes if n.op != "output" and not n.users
                and n.op in ("call_function", "call_method")], "dead nodes left behind:\n" + rewritten.gm.code


def test_causal_mask_subgraph_is_removed():
    rewritten = check(CausalTriuFull(), _qkv, contains=("causal",))
    assert not [n for n in rewritten.gm.graph.nodes if n.target in (torch.triu, torch.full)], rewritten.gm.code


@pytest.mark.parametrize("how", ["repeat_kv", "repeat_interleave"])
def test_gqa_repeats_are_removed_and_run_natively(how):
    rewritten = check(GQA(how), lambda: (torch.randn(B, 7, 32),), contains=("gqa 4/2", "scale 0.353553390593273"))
    node = rewritten.calls[0]
    assert node.kwargs["enable_gqa"] is True
    assert tuple(node.args[1].meta["example_value"].shape) == (B, 2, 7, 8)
    leftovers = [n for n in rewritten.gm.graph.nodes if n.target in ("expand", torch.repeat_interleave)]
    assert not leftovers, rewritten.gm.code


@pytest.mark.parametrize("training", [True, False])
def test_dropout_probability_is_passed_in_training_and_zero_in_eval(training):
    torch.manual_seed(0)
    module = WithDropout(0.3).train(training)
    rewritten = Rewritten(module, _qkv(), training=training)
    (node,) = rewritten.calls
    assert node.kwargs["dropout_p"] == (0.3 if training else 0.0)
    assert ("dropout 0.3" in rewritten.descriptions[0]) is training
    # Deterministic comparison: dropout off on both sides (the lead's verification zeroes dropout_p too).
    node.kwargs = {**node.kwargs, "dropout_p": 0.0}
    rewritten.gm.recompile()
    module.drop.p = 0.0
    fresh = _qkv()
    assert rel_err(rewritten(*fresh), module(*fresh)) < 1e-5


def test_bfloat16_softmax_in_float32_cast_back():
    torch.manual_seed(0)
    make = lambda: tuple(t.bfloat16() for t in _qkv())  # noqa: E731
    rewritten = Rewritten(Float32Softmax(), make())
    assert len(rewritten.calls) == 1
    fresh = make()
    assert rel_err(rewritten(*fresh), Float32Softmax()(*fresh)) < 2e-2


def test_causal_mask_with_unequal_lengths_is_passed_as_a_tensor():
    class Shifted(nn.Module):  # triu on an Lq x Lk grid: bottom-right aligned would differ from SDPA's is_causal
        def forward(self, q, k, v):
            mask = torch.triu(torch.full((q.shape[-2], k.shape[-2]), float("-inf")), diagonal=1)
            return torch.softmax(q @ k.mT * 0.125 + mask, -1) @ v

    rewritten = check(Shifted(), lambda: _qkv(lq=4, lk=7), contains=("mask additive",), absent=("causal",))
    assert kwargs_of(rewritten)["is_causal"] is False and kwargs_of(rewritten)["mask"] is not None


def test_buffer_causal_mask_is_causal_with_a_runtime_guard():
    module = BufferCausal()
    rewritten = check(module, _qkv, contains=("causal", "no mask"))
    assert kwargs_of(rewritten)["mask"] is None and kwargs_of(rewritten)["is_causal"] is True
    assert any("buffer" in r and "re-checked at run time" in r for r in rewritten.reasons), rewritten.reasons
    [guard] = rewritten.result.guards
    guard.bind(rewritten.gm.graph)
    args = rewritten.runtime_args(*_qkv())
    assert guard.holds(args)
    module.allowed[0, 1] = True  # an in-place edit (bumps _version): no longer causal
    assert not guard.holds(args)
    module.allowed[0, 1] = False  # causal again: re-checked, not remembered as broken
    assert guard.holds(args)


def test_buffer_mask_that_is_not_causal_stays_a_tensor():
    module = BufferCausal()
    module.allowed[3, 5] = True
    rewritten = check(module, _qkv, contains=("mask bool", "from a buffer"), absent=("causal",))
    assert kwargs_of(rewritten)["mask"] is not None and not rewritten.result.guards


def test_symbolic_sizes_causal_mask_is_causal_with_a_runtime_guard():
    rewritten = check(CausalTriuFull(), _qkv, dynamic=True, contains=("causal", "no mask"))
    assert kwargs_of(rewritten)["is_causal"] is True and kwargs_of(rewritten)["mask"] is None
    sizes = [n for n in rewritten.gm.graph.nodes if n.op == "placeholder" and not isinstance(
        n.meta.get("example_value"), torch.Tensor)]
    assert sizes, "the capture was expected to have symbolic sizes"
    [guard] = rewritten.result.guards
    guard.bind(rewritten.gm.graph)
    for length in (1, 5, 33):  # other lengths than the captured one: checked and causal
        assert guard.holds(rewritten.runtime_args(*_qkv(lq=length, lk=length)))


class SizeDependentMask(nn.Module):
    """Causal up to 8 positions; past that every query also sees key 1: a rule a guard must catch."""

    def forward(self, q, k, v):
        n = q.shape[-2]
        i = torch.arange(n)
        short = i[None, :] * 0 + n <= 8  # a tensor comparison, so Dynamo keeps n symbolic (no recompile)
        blocked = (i[None, :] > i[:, None]) & ((i[None, :] != 1) | short)
        return torch.softmax((q @ k.mT * 0.125).masked_fill(blocked, float("-inf")), -1) @ v


def test_runtime_guard_failure_runs_the_unrewritten_graph():
    torch.manual_seed(0)
    module = SizeDependentMask()
    model = optimize(twin(module), example_inputs=_qkv(), compile=False, dynamic=True)
    assert "causal" in report_of(model).rewrites[0].replacement
    for length in (6, 7, 12, 5):  # at 12 the mask is not causal: that call must run the original graph
        inputs = _qkv(lq=length, lk=length)
        assert rel_err(model(*inputs), module(*inputs)) < 1e-5, length
    notes = report_of(model).notes
    assert sum("did not hold" in note for note in notes) == 1, notes


def test_two_layers_share_one_causal_mask():
    class TwoLayers(nn.Module):
        def forward(self, q, k, v):
            n = q.shape[-2]
            mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
            first = torch.softmax(q @ k.mT * 0.125 + mask, -1) @ v
            return torch.softmax(first @ k.mT * 0.125 + mask, -1) @ v

    rewritten = check(TwoLayers(), _qkv, count=2, contains=("causal",))
    assert not [n for n in rewritten.gm.graph.nodes if n.target is torch.triu]


# --------------------------------------------------------------------------------------------------
# what must not match
# --------------------------------------------------------------------------------------------------


class SoftmaxDim(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, q, k, v):
        return (q @ k.mT * 0.125).softmax(self.dim) @ v


class ReluAttention(nn.Module):
    def forward(self, q, k, v):
        return torch.relu(q @ k.mT * 0.125) @ v


class ModifiedProbs(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_mask = nn.Parameter(torch.rand(1, H, 1, 1))

    def forward(self, q, k, v):
        return ((q @ k.mT * 0.125).softmax(-1) * self.head_mask) @ v


class ReturnsWeights(nn.Module):
    def forward(self, q, k, v):
        probs = (q @ k.mT * 0.125).softmax(-1)
        return probs @ v, probs


class LearnedTemperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(0.3))

    def forward(self, q, k, v):
        return (q @ k.mT * self.temperature).softmax(-1) @ v


class FillMinusBillion(nn.Module):
    def forward(self, q, k, v):
        n = q.shape[-2]
        allowed = torch.tril(torch.ones(n, n))
        return (q @ k.mT * 0.125).masked_fill(allowed == 0, -1e9).softmax(-1) @ v


class MaskInsideSoftCap(nn.Module):
    """A soft cap applied after the mask (Gemma 2 caps before it): no kernel computes that."""

    def forward(self, q, k, v, bias):
        scores = torch.tanh((q @ k.mT * 0.125 + bias) / 50.0) * 50.0
        return scores.softmax(-1) @ v


NEGATIVES = {
    "softmax_dim_1": (lambda: SoftmaxDim(1), "softmax over dim 1"),
    "softmax_dim_-2": (lambda: SoftmaxDim(-2), "softmax over dim -2"),
    "relu_instead_of_softmax": (ReluAttention, None),
    "probabilities_modified": (ModifiedProbs, "modified before ·V"),
    "weights_returned": (ReturnsWeights, "also used elsewhere"),
    "learned_temperature": (LearnedTemperature, "scale cannot be determined"),
    "fill_minus_1e9": (FillMinusBillion, "neither -inf nor finfo"),
    "mask_inside_soft_cap": (MaskInsideSoftCap, "inside the soft cap"),
}


@pytest.mark.parametrize("name", NEGATIVES)
def test_not_attention_is_left_alone_with_a_reason(name):
    make_module, reason = NEGATIVES[name]
    torch.manual_seed(0)
    module = make_module()
    inputs = (*_qkv(), torch.randn(L, L)) if name == "mask_inside_soft_cap" else _qkv()
    rewritten = Rewritten(module, inputs)
    assert rewritten.result.rewrites == [] and rewritten.calls == []
    if reason is None:
        assert rewritten.result.skipped == []
    else:
        assert len(rewritten.reasons) == 1 and reason in rewritten.reasons[0], rewritten.reasons
    expected, actual = module(*inputs), rewritten(*inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for e, a in zip(expected, actual if isinstance(actual, (tuple, list)) else (actual,)):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# Hugging Face eager attention, end to end through optimize()
# --------------------------------------------------------------------------------------------------


def _t5():
    config = transformers.T5Config(vocab_size=101, d_model=48, d_kv=12, d_ff=80, num_layers=2, num_decoder_layers=2,
                                   num_heads=4)
    config._attn_implementation = "eager"
    inputs = {"input_ids": torch.randint(0, 101, (2, 9)), "decoder_input_ids": torch.randint(0, 101, (2, 7))}
    return transformers.T5Model(config), inputs, "last_hidden_state"


HF = {
    # name: (factory, rewrites, substrings every description has, substrings none has)
    "llama": (_llama, 2, ("causal", "gqa 4/2", "scale 0.25", "no mask"), ()),
    "gpt2": (_gpt2, 2, ("causal", "scale 0.28867513459481287", "no mask"), ()),
    "bert": (_bert, 2, ("scale 0.28867513459481287", "mask additive"), ("causal",)),
    "t5": (_t5, 6, ("scale 1.0", "mask additive"), ("causal",)),
    "vit": (_vit, 2, ("scale 0.28867513459481287", "no mask"), ("causal",)),
}


@pytest.mark.parametrize("name", HF)
def test_hugging_face_eager_attention_end_to_end(name):
    factory, count, contains, absent = HF[name]
    torch.manual_seed(0)
    model, inputs, key = factory()
    model.eval()
    reference = twin(model)
    optimize(model, example_inputs=inputs, extra_passes=("attention",))
    report = report_of(model)
    rewrites = [r for r in report.rewrites if r.pass_name == "attention"]
    assert len(rewrites) == count, [(r.location, r.replacement) for r in rewrites]
    for text in contains:
        assert all(text in r.replacement for r in rewrites), (text, [r.replacement for r in rewrites])
    for text in absent:
        assert all(text not in r.replacement for r in rewrites), (text, [r.replacement for r in rewrites])
    assert not [s for s in report.skipped if s.pass_name == "attention"]
    assert report.rollbacks == [] and report.verification.passed, report.verification
    with torch.no_grad():
        assert rel_err(getattr(model(**inputs), key), getattr(reference(**inputs), key)) < 1e-5


def test_hugging_face_llama_training_gradients_through_the_rewrite():
    torch.manual_seed(0)
    model, inputs, _ = _llama()
    model.train()
    reference = twin(model)
    optimize(model, example_inputs=inputs, extra_passes=("attention",))
    report = report_of(model)
    assert len([r for r in report.rewrites if r.pass_name == "attention"]) == 2
    assert report.rollbacks == [] and report.verification.compared_gradients
    labels = torch.randint(0, 101, inputs["input_ids"].shape)
    model(**inputs, labels=labels).loss.backward()
    reference(**inputs, labels=labels).loss.backward()
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p.grad, p_ref.grad) < 1e-4, name


def test_zoo_module_end_to_end_through_optimize():
    torch.manual_seed(0)
    model = GQA("repeat_kv")
    reference = twin(model)
    x = torch.randn(B, 7, 32)
    optimize(model, example_inputs=(x,), extra_passes=("attention",))
    rewrites = [r for r in report_of(model).rewrites if r.pass_name == "attention"]
    assert len(rewrites) == 1 and "gqa 4/2" in rewrites[0].replacement
    fresh = torch.randn(B, 7, 32)
    assert rel_err(model(fresh), reference(fresh)) < 1e-5


def test_hugging_face_bert_training_passes_its_attention_dropout():
    torch.manual_seed(0)
    model, inputs, _ = _bert()
    model.train()
    captured = twin(model)
    optimize(model, example_inputs=inputs, extra_passes=("attention",))
    report = report_of(model)
    rewrites = [r.replacement for r in report.rewrites if r.pass_name == "attention"]
    assert len(rewrites) == 2 and all("dropout 0.1" in r for r in rewrites), rewrites
    assert report.rollbacks == []
    rewritten = Rewritten(captured, (inputs["input_ids"], inputs["attention_mask"]), training=True)
    assert [n.kwargs["dropout_p"] for n in rewritten.calls] == [0.1, 0.1]


def test_graph_without_shape_metadata_is_skipped_with_a_reason():
    gm = torch.fx.symbolic_trace(MatmulSqrt())
    Normalize().run(gm, _ctx())
    result = AttentionPass().run(gm, _ctx())
    assert result.rewrites == [] and [s.reason for s in result.skipped] == ["no shape metadata"]


# --------------------------------------------------------------------------------------------------
# The dispatch choice per backend, for every zoo spelling (bf16 on each simulated device, unmeasured)
# --------------------------------------------------------------------------------------------------

_HARDWARE = {
    "nvidia-h100": HardwareInfo(vendor="nvidia", device_name="sim H100", compute_capability=(9, 0),
                                cudnn_attention=True, bf16=True, triton_usable=True),
    "amd-mi300": HardwareInfo(vendor="amd", device_name="sim MI300X", gfx_arch="gfx942", bf16=True),
    "cpu": HardwareInfo(vendor="cpu", device_name="sim CPU"),
}


def _on_device(value):
    if not isinstance(value, torch.Tensor):
        return value
    dtype = torch.bfloat16 if value.is_floating_point() else value.dtype
    return torch.empty(tuple(int(s) for s in value.shape), dtype=dtype, device="meta")


@pytest.mark.parametrize("name", ZOO)
def test_zoo_dispatch_choice_per_backend(name):
    cls, make_inputs, _, _ = ZOO[name]
    torch.manual_seed(0)
    rewritten = Rewritten(cls(), make_inputs())
    [call] = rewritten.calls
    assert call.kwargs["kernel"] == "sdpa"  # on this CPU: PyTorch's own SDPA dispatch
    q, k, v, mask = (_on_device(a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a)
                     for a in call.args[:4])
    chosen = {hw: choose_kernel(q, k, v, mask, is_causal=call.kwargs["is_causal"], dropout_p=0.0,
                                enable_gqa=call.kwargs["enable_gqa"], hardware=info, training=False)[0]
              for hw, info in _HARDWARE.items()}
    assert chosen == {"nvidia-h100": "cudnn", "amd-mi300": "flash" if mask is None else "efficient", "cpu": "sdpa"}, \
        chosen


class CausalTriuFullThenTanh(CausalTriuFull):
    """Attention and one op Inductor compiles, so that the graph goes to Inductor (see compile_skip)."""

    def forward(self, q, k, v):
        return torch.tanh(super().forward(q, k, v))


def _inductor_calls(monkeypatch) -> list:
    from torch._inductor import compile_fx

    calls = []
    original = compile_fx.compile_fx
    monkeypatch.setattr(compile_fx, "compile_fx", lambda gm, *a, **kw: calls.append(gm) or original(gm, *a, **kw))
    return calls


@pytest.mark.parametrize("module_class, through_inductor", [(CausalTriuFullThenTanh, True), (CausalTriuFull, False)],
                         ids=["attention and more", "attention only"])
def test_runtime_guard_and_new_lengths_with_inductor(monkeypatch, module_class, through_inductor):
    # The guard wrapper sits between Dynamo and Inductor's compiled function (found on the H100). A graph whose
    # only compute is the fused attention runs eagerly instead: Inductor would call the same kernel and add its
    # wrapper's host time (H100: 0.81 vs 0.96 of cuDNN per call at hd64 L=1024 causal fwd+bwd).
    torch.manual_seed(0)
    module = module_class()
    inductor = _inductor_calls(monkeypatch)
    model = optimize(twin(module), example_inputs=_qkv(), compile=True, dynamic=True)
    report = report_of(model)
    assert report.compiler.startswith("inductor") and "causal" in report.rewrites[0].replacement, report.rewrites
    run_eagerly = any("run eagerly, not by Inductor: its only compute is fused attention" in n for n in report.notes)
    assert bool(inductor) is through_inductor and run_eagerly is not through_inductor, report.notes
    for length in (6, 9, 4):
        inputs = [t.requires_grad_() for t in _qkv(lq=length, lk=length)]
        seed = torch.randn(B, H, length, E)
        ours, reference = model(*inputs), module(*inputs)
        assert rel_err(ours, reference) < 1e-5, length
        for got, want in zip(_grads(ours, inputs, seed), _grads(reference, inputs, seed)):
            assert rel_err(got, want) < 1e-5, length
    assert not any("did not hold" in note for note in report_of(model).notes)


@pytest.mark.parametrize("extra, expected", [
    (lambda g, out: out, True),
    (lambda g, out: g.call_method("transpose", (out, 1, 2)), True),
    (lambda g, out: g.call_function(torch.add, (out, 1.0)), False),
])
def test_attention_only_allows_views_but_no_other_compute(extra, expected):
    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    out = graph.call_function(attention, (q, k, v, None), {"is_causal": True, "kernel": "sdpa"})
    graph.output(extra(graph, out))
    assert attention_only(torch.fx.GraphModule({}, graph)) is expected


def test_attention_only_leaves_flex_and_cuda_graph_modes_to_inductor():
    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(name) for name in "qkv")
    graph.output(graph.call_function(attention, (q, k, v, None), {"kernel": "flex"}))
    assert not attention_only(torch.fx.GraphModule({}, graph))  # Inductor generates FlexAttention's kernel
    assert CompilerChoice("inductor", "reduce-overhead").uses_cuda_graphs  # no wrapper host time left to save
    assert not CompilerChoice("inductor", "max-autotune-no-cudagraphs").uses_cuda_graphs
