"""Block-structured attention masks: recognized by the attention pass (sliding windows, bands, document
masks, block-sparse masks; built in the graph or held in buffers), routed to FlexAttention with the
pattern instead of the tensor, and equal to the dense masked original, forward and gradients (fp32).

On this CPU the dispatcher keeps sparse masks dense (FlexAttention is taken only when measured fastest on
a GPU), so the flex route is forced here by standing in for the dispatcher; forward without gradients
runs FlexAttention itself (its CPU path, with the cached BlockMask), with gradients the pattern's mask_mod
evaluated densely through SDPA's math (FlexAttention has no CPU backward).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention.flex_attention import create_block_mask

import kernel_pytorch.attention.kernels.flex as flex
import kernel_pytorch.passes.attention as attention_pass
from kernel_pytorch import optimize, report_of
from kernel_pytorch.attention.kernels.band_blocks import band_block_mask
from kernel_pytorch.attention.kernels.flex import pattern_block_mask
from kernel_pytorch.passes.mask_pattern import block_density, classify_allowed

from .conftest import rel_err, twin
from .test_attention_pass import Rewritten, kwargs_of

B, H, E = 2, 2, 16
NEG = float("-inf")


def _qkv(length: int = 48, batch: int = B):
    return tuple(torch.randn(batch, H, length, E) for _ in range(3))


@pytest.fixture
def forced_flex(monkeypatch):
    """The dispatcher's choice for recognized sparse masks is flex (as a GPU measurement would make it)."""
    original = attention_pass._choose_kernel

    def choose(*args, sparsity=None, **kwargs):
        if sparsity is not None:
            return "flex", "forced by the test"
        return original(*args, sparsity=sparsity, **kwargs)

    monkeypatch.setattr(attention_pass, "_choose_kernel", choose)
    flex._BLOCK_MASKS.clear()
    yield
    flex._BLOCK_MASKS.clear()


def _check_equal(module: nn.Module, rewritten: Rewritten, inputs: tuple[torch.Tensor, ...]) -> None:
    """Forward without gradients (FlexAttention itself) and with gradients: equal to the module within 1e-5."""
    with torch.no_grad():
        assert rel_err(rewritten(*inputs), module(*inputs)) < 1e-5
    fresh = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out, expected = rewritten(*fresh), module(*ref)
    assert rel_err(out, expected) < 1e-5
    seed = torch.randn_like(expected)
    grads = torch.autograd.grad(out, [t for t in fresh if t.requires_grad], seed)
    want = torch.autograd.grad(expected, [t for t in ref if t.requires_grad], seed)
    for got, wanted in zip(grads, want):
        assert rel_err(got, wanted) < 1e-5, rel_err(got, wanted)


# --------------------------------------------------------------------------------------------------
# masks as models build them
# --------------------------------------------------------------------------------------------------


class WindowIndexArithmetic(nn.Module):
    """Causal sliding window from index arithmetic: key j is blocked when j > i or i - j >= window."""

    def __init__(self, window: int = 8):
        super().__init__()
        self.window = window

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        blocked = (i[None, :] > i[:, None]) | ((i[:, None] - i[None, :]) >= self.window)
        return torch.softmax((q @ k.mT * 0.25).masked_fill(blocked, NEG), -1) @ v


class WindowTriuTril(nn.Module):
    """Mistral's way: an additive causal triu, and the keys past the window blocked by tril with an offset."""

    def __init__(self, window: int = 8):
        super().__init__()
        self.window = window

    def forward(self, q, k, v):
        n = q.shape[-2]
        causal = torch.triu(torch.full((n, n), NEG), diagonal=1)
        outside = torch.tril(torch.full((n, n), NEG), diagonal=-self.window)
        return torch.softmax(q @ k.mT * 0.25 + (causal + outside), -1) @ v


class Banded(nn.Module):
    """Bidirectional band |i - j| <= 5 (local attention in encoders), with torch.where."""

    def forward(self, q, k, v):
        i = torch.arange(q.shape[-2])
        allowed = (i[:, None] - i[None, :]).abs() <= 5
        return torch.softmax(torch.where(allowed, q @ k.mT * 0.25, NEG), -1) @ v


class DocumentCausal(nn.Module):
    """Packed sequences: a query sees the earlier keys of its own document (doc ids are a model input)."""

    def forward(self, q, k, v, doc):
        n = q.shape[-2]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        same = doc[:, None, :, None] == doc[:, None, None, :]
        return torch.softmax(torch.where(same & causal, q @ k.mT * 0.25, NEG), -1) @ v


class BufferWindow(nn.Module):
    """A causal sliding window held in a registered bool buffer, sliced to the length."""

    def __init__(self, n: int = 48, window: int = 8):
        super().__init__()
        i = torch.arange(n)
        self.register_buffer("allowed", (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window))

    def forward(self, q, k, v):
        n = q.shape[-2]
        return torch.softmax((q @ k.mT * 0.25).masked_fill(~self.allowed[:n, :n], NEG), -1) @ v


class BlockDiagonal(nn.Module):
    """Fixed 128-token blocks (block-diagonal, not a band): a general block-sparse mask."""

    def forward(self, q, k, v):
        block = torch.arange(q.shape[-2]) // 128
        allowed = block[:, None] == block[None, :]
        return torch.softmax((q @ k.mT * 0.25).masked_fill(~allowed, NEG), -1) @ v


class RandomDense(nn.Module):
    """A random mask (diagonal kept) in a buffer: no block structure."""

    def __init__(self, n: int = 48):
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.register_buffer("allowed", (torch.rand(n, n, generator=generator) < 0.5) | torch.eye(n, dtype=torch.bool))

    def forward(self, q, k, v):
        return torch.softmax((q @ k.mT * 0.25).masked_fill(~self.allowed, NEG), -1) @ v


# --------------------------------------------------------------------------------------------------
# recognized and routed to flex, equal values and gradients
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module, pattern, text", [
    (WindowIndexArithmetic(), ("band", 0, 7), "causal sliding window 8"),
    (WindowTriuTril(), ("band", 0, 7), "causal sliding window 8"),
    (Banded(), ("band", -5, 5), "band -5 <= i-j <= 5"),
], ids=["index-arithmetic", "triu-tril", "banded"])
def test_band_masks_go_to_flex_with_equal_values_and_gradients(forced_flex, module, pattern, text):
    torch.manual_seed(0)
    rewritten = Rewritten(module, _qkv())
    [description] = rewritten.descriptions
    assert description.startswith("attention[flex]") and text in description, description
    kwargs = kwargs_of(rewritten)
    assert kwargs["pattern"] == pattern and kwargs["mask"] is None and kwargs["pattern_tensor"] is None
    assert not rewritten.result.guards  # static sizes, built from constants: proven
    assert not [n for n in rewritten.gm.graph.nodes if n.target in (torch.triu, torch.tril, torch.arange)]
    _check_equal(module, rewritten, _qkv())


def test_document_mask_reads_the_ids_with_equal_values_and_gradients(forced_flex):
    torch.manual_seed(0)
    doc = torch.tensor([[0] * 20 + [1] * 13 + [2] * 15, [5] * 7 + [3] * 41])
    module = DocumentCausal()
    rewritten = Rewritten(module, (*_qkv(), doc))
    [description] = rewritten.descriptions
    assert "attention[flex]" in description and "document mask & causal" in description, description
    kwargs = kwargs_of(rewritten)
    assert kwargs["pattern"] == ("document", 0, None) and kwargs["pattern_tensor"] is not None
    other = torch.tensor([[4] * 30 + [9] * 18, [1] * 48])  # other documents, same graph: read at run time
    _check_equal(module, rewritten, (*_qkv(), other))


def test_buffer_window_is_guarded_and_an_in_place_edit_falls_back(forced_flex):
    torch.manual_seed(0)
    module = BufferWindow()
    rewritten = Rewritten(module, _qkv())
    [description] = rewritten.descriptions
    assert "attention[flex]" in description and "causal sliding window 8" in description, description
    assert any("from a buffer" in r and "re-checked at run time" in r for r in rewritten.reasons), rewritten.reasons
    _check_equal(module, rewritten, _qkv())
    [guard] = rewritten.result.guards
    guard.bind(rewritten.gm.graph)
    args = rewritten.runtime_args(*_qkv())
    assert guard.holds(args)
    module.allowed[20, 5] = True  # in place: no longer a window
    assert not guard.holds(args)
    module.allowed[20, 5] = False
    assert guard.holds(args)


def test_buffer_window_edited_after_optimize_runs_unrewritten_with_equal_values(forced_flex):
    torch.manual_seed(0)
    module = BufferWindow()
    model = optimize(twin(module), example_inputs=_qkv(), compile=False)
    assert "attention[flex]" in report_of(model).rewrites[0].replacement, report_of(model).rewrites
    inputs = _qkv()
    assert rel_err(model(*inputs), module(*inputs)) < 1e-5
    for m in (model, module):  # the same in-place edit on both: the rewrite's window no longer holds
        m.allowed[30, 2] = True
    assert rel_err(model(*inputs), module(*inputs)) < 1e-5
    assert sum("did not hold" in note for note in report_of(model).notes) == 1, report_of(model).notes


def test_block_diagonal_mask_is_block_sparse_with_its_density(forced_flex):
    torch.manual_seed(0)
    module = BlockDiagonal()
    rewritten = Rewritten(module, _qkv(512, batch=1))
    [description] = rewritten.descriptions
    assert "attention[flex]" in description and "block-sparse mask, block density 0.25" in description, description
    assert kwargs_of(rewritten)["pattern"] == ("blocks",)
    _check_equal(module, rewritten, _qkv(512, batch=1))


class BlockDiagonalBuffer(nn.Module):
    """A document (block-diagonal) mask held in a buffer, as models that pack sequences keep it."""

    def __init__(self, sdpa: bool, n: int = 512):
        super().__init__()
        block = torch.arange(n) // 128
        self.register_buffer("allowed", block[:, None] == block[None, :])
        self.sdpa = sdpa

    def forward(self, q, k, v):
        if self.sdpa:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.allowed, scale=0.25)
        return torch.softmax((q @ k.mT * 0.25).masked_fill(~self.allowed, NEG), -1) @ v


@pytest.mark.parametrize("sdpa", [False, True], ids=["hand-written", "sdpa-call"])
def test_block_mask_in_a_buffer_edited_after_optimize_is_honoured(forced_flex, sdpa):
    torch.manual_seed(0)
    module = BlockDiagonalBuffer(sdpa)
    inputs = _qkv(512, batch=1)
    model = optimize(twin(module), example_inputs=inputs, compile=False)
    [line] = [r.replacement for r in report_of(model).rewrites if r.pass_name == "attention"]
    assert "block-sparse mask" in line and ("SDPA call" in line) == sdpa, line
    assert rel_err(model(*inputs), module(*inputs)) < 1e-5
    for m in (model, module):  # the same in-place edit on both: another block now attended
        m.allowed[256:384, :128] = True
    assert rel_err(model(*inputs), module(*inputs)) < 1e-5  # a stale plan would miss 128 keys in 128 rows


# --------------------------------------------------------------------------------------------------
# what stays dense
# --------------------------------------------------------------------------------------------------


def test_random_dense_mask_stays_a_dense_tensor(forced_flex):
    torch.manual_seed(0)
    rewritten = Rewritten(RandomDense(), _qkv())
    [description] = rewritten.descriptions
    assert "attention[sdpa]" in description and "recognized" not in description, description
    assert kwargs_of(rewritten)["mask"] is not None and "pattern" not in kwargs_of(rewritten)


def test_on_this_cpu_a_window_is_recognized_and_run_dense():
    torch.manual_seed(0)
    module = WindowIndexArithmetic()
    rewritten = Rewritten(module, _qkv())
    [description] = rewritten.descriptions
    assert "attention[sdpa]" in description and "(causal sliding window 8, block density 1.00: recognized, run dense)" \
        in description, description
    assert kwargs_of(rewritten)["mask"] is not None and not rewritten.result.guards
    _check_equal(module, rewritten, _qkv())


# --------------------------------------------------------------------------------------------------
# classification and the BlockMask cache
# --------------------------------------------------------------------------------------------------


def test_classification_of_evaluated_masks():
    i = torch.arange(300)
    distance = i[:, None] - i[None, :]
    window = (distance >= 0) & (distance < 64)
    assert classify_allowed(window, 300, 300).spec == ("band", 0, 63)
    assert classify_allowed(distance >= 0, 300, 300) is None  # causal: decided before, by the causal rules
    assert classify_allowed(torch.ones(300, 300, dtype=torch.bool), 300, 300) is None  # no mask at all
    shifted = (distance >= 1)  # row 0 fully masked: eager gives NaN there, FlexAttention 0
    assert classify_allowed(shifted, 300, 300) is None
    assert block_density(window) == pytest.approx(5 / 9)  # 3x3 tiles: the diagonal and the one below


def test_block_mask_is_built_once_per_pattern_and_shape():
    flex._BLOCK_MASKS.clear()
    first = pattern_block_mask(("band", 0, 63), None, 256, 256, torch.device("cpu"))
    assert pattern_block_mask(("band", 0, 63), None, 256, 256, torch.device("cpu")) is first
    assert pattern_block_mask(("band", 0, 63), None, 384, 384, torch.device("cpu")) is not first
    ids = torch.zeros(1, 256, dtype=torch.long)
    doc_mask = pattern_block_mask(("document", None, None), ids, 256, 256, torch.device("cpu"))
    assert pattern_block_mask(("document", None, None), ids, 256, 256, torch.device("cpu")) is doc_mask
    ids[0, 128:] = 1  # an in-place edit: the ids' version changes, so the mask is rebuilt
    assert pattern_block_mask(("document", None, None), ids, 256, 256, torch.device("cpu")) is not doc_mask
    flex._BLOCK_MASKS.clear()


@pytest.mark.parametrize("lo,hi", [(0, None), (0, 63), (0, 127), (-100, 300), (3, 1000), (None, 0), (None, None)])
@pytest.mark.parametrize("lq,lk", [(1, 130), (5, 5), (128, 256), (200, 640), (384, 384), (1000, 1000)])
def test_band_block_mask_from_tile_corners_equals_create_block_mask(lo, hi, lq, lk):
    """Every tensor of the BlockMask (partial and full tiles, their order, the transposed q-side tables)."""
    mask_mod = flex.pattern_mask_mod(("band", lo, hi), None)
    expected = create_block_mask(mask_mod, None, None, lq, lk, device="cpu").as_tuple()
    built = band_block_mask(lo, hi, lq, lk, "cpu", mask_mod).as_tuple()
    assert len(built) == len(expected)
    for ours, theirs in zip(built, expected):
        if isinstance(theirs, torch.Tensor):
            assert ours.shape == theirs.shape and torch.equal(ours, theirs)
        elif not callable(theirs):
            assert ours == theirs


def test_is_causal_is_the_causal_band_cached_and_differentiable_on_the_cpu():
    """``is_causal`` goes the band's way: its BlockMask cached per lengths, and on the CPU with gradients SDPA's math
    on the evaluated mask (FlexAttention has no CPU backward)."""
    flex._BLOCK_MASKS.clear()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 16, requires_grad=True) for _ in range(3))
    out = flex.flex_attention_forward(q, k, v, is_causal=True, scale=None)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(out, expected) < 1e-5
    seed = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), seed), torch.autograd.grad(expected, (q, k, v), seed)):
        assert rel_err(got, want) < 1e-5
    flex.flex_attention_forward(q.detach(), k.detach(), v.detach(), is_causal=True, scale=None)  # FlexAttention
    assert [key[:3] for key in flex._BLOCK_MASKS] == [(flex.CAUSAL_PATTERN, 200, 200)]
    flex._BLOCK_MASKS.clear()


def test_real_tensors_inside_a_dynamo_backend_count_as_eager_and_use_the_cache():
    """optimize verifies rewritten graphs inside its Dynamo backend: the FlexAttention calls there run on
    real tensors, so they must take the eager path (on a GPU, FlexAttention compiled on its own), not the
    traced one, which on a GPU runs PyTorch's unfused reference."""
    flex._BLOCK_MASKS.clear()
    seen = {}

    def backend(gm, example_inputs):
        seen["real"] = flex._tracing(torch.randn(2))
        seen["mask"] = pattern_block_mask(("band", 0, 63), None, 256, 256, torch.device("cpu"))
        return gm.forward

    torch.compile(lambda x: x.sin(), backend=backend)(torch.randn(3))
    assert seen["real"] is False
    assert pattern_block_mask(("band", 0, 63), None, 256, 256, torch.device("cpu")) is seen["mask"]  # cached
    assert flex._tracing(FakeTensorMode().from_tensor(torch.randn(2))) is True  # AOTAutograd's traces
    flex._BLOCK_MASKS.clear()


# --------------------------------------------------------------------------------------------------
# the dispatcher
# --------------------------------------------------------------------------------------------------


def _problem(length: int, sparsity):
    from kernel_pytorch.attention.dispatch import AttentionProblem

    q = torch.empty(1, 16, length, 128, dtype=torch.bfloat16, device="meta")
    mask = torch.empty(length, length, dtype=torch.bool, device="meta")
    return AttentionProblem.from_tensors(q, q, q, mask, is_causal=False, dropout_p=0.0, enable_gqa=False,
                                         training=False, sparsity=sparsity)


def test_dispatch_measures_flex_only_for_sparse_masks_from_the_length_threshold():
    from kernel_pytorch.attention.dispatch import SPARSE_MIN_LENGTH, _flex_not_measured, eligible_kernels
    from kernel_pytorch.hardware import HardwareInfo

    h100 = HardwareInfo(vendor="nvidia", device_name="sim H100", compute_capability=(9, 0), cudnn_attention=True,
                        triton_usable=True)
    window = ("band", 0, 1023, 0.12)
    dense, rejected = eligible_kernels(_problem(SPARSE_MIN_LENGTH, None), h100)
    assert "flex" not in dense and "mask tensor" in rejected["flex"]  # a plain mask tensor: as before
    sparse, _ = eligible_kernels(_problem(SPARSE_MIN_LENGTH, window), h100)
    assert "flex" in sparse and "cudnn" in sparse  # the dense kernels keep the tensor
    assert _flex_not_measured(_problem(SPARSE_MIN_LENGTH, window), sparse) == ""
    assert "fewer than" in _flex_not_measured(_problem(SPARSE_MIN_LENGTH // 2, window), sparse)


@pytest.mark.parametrize("sparsity", [("band", 0, 31, 0.5), ("document", 0, None, 0.25), ("blocks", 0.25)])
def test_dispatch_measurement_inputs_pair_the_mask_with_its_pattern(sparsity):
    from kernel_pytorch.attention.dispatch import AttentionProblem, _random_inputs, _run
    from kernel_pytorch.ops.attention import attention

    q = torch.empty(1, 2, 256, 16)
    mask = torch.empty(256, 256, dtype=torch.bool)
    problem = AttentionProblem.from_tensors(q, q, q, mask, is_causal=False, dropout_p=0.0, enable_gqa=False,
                                            training=False, sparsity=sparsity)
    torch.manual_seed(0)
    inputs = _random_inputs(problem)
    assert inputs["mask"].dtype == torch.bool and not bool(inputs["mask"].all())
    dense = _run(attention, inputs, "sdpa", problem, with_dropout=False)
    assert rel_err(_run(attention, inputs, "flex", problem, with_dropout=False), dense) < 1e-5


def test_flex_route_compiles_with_inductor(forced_flex):
    # Under Inductor the BlockMask is built in the traced graph (fake tensors), not taken from the cache.
    torch.manual_seed(0)
    module = WindowIndexArithmetic()
    model = optimize(twin(module), example_inputs=_qkv(), compile=True)
    report = report_of(model)
    assert report.compiler.startswith("inductor") and "attention[flex]" in report.rewrites[0].replacement
    inputs = _qkv()
    with torch.no_grad():
        assert rel_err(model(*inputs), module(*inputs)) < 1e-5
    # Nothing cached from the trace: only the verification's eager runs (real tensors) fill the cache.
    assert all(type(mask.kv_num_blocks) is torch.Tensor for mask in flex._BLOCK_MASKS.values())
