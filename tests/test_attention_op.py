"""kernel_pytorch.ops.attention: every kernel against a float64 softmax(q kᵀ · scale + mask) v.

The CPU part runs in CI ("cpu_flash", "sdpa", "flex" forward, and "flash_attn"'s adapter around a
stand-in flash_attn module); the ``gpu``-marked part (``pytest -m gpu``) checks the CUDA kernels and
fails, not skips, when selected without CUDA.
"""

from __future__ import annotations

import math
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from kernel_pytorch.ops import ATTENTION_KERNELS, attention, kernel_device

from .conftest import rel_err

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(q, k, v, mask=None, is_causal=False, scale=None):
    """SDPA's definition in float64: GQA by repeat_interleave on dim -3, causal top-left aligned, a bool
    mask selects (True = attend), a float mask is added to the scores."""
    q, k, v = q.double(), k.double(), v.double()
    if q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return scores.softmax(-1) @ v


def _qkv(shape_q, shape_kv, dtype=torch.float32, device="cpu", value_dim=None, requires_grad=False):
    value_shape = (*shape_kv[:-1], value_dim or shape_kv[-1])
    return tuple(torch.randn(s, dtype=dtype, device=device, requires_grad=requires_grad)
                 for s in (shape_q, shape_kv, value_shape))


def _bool_mask(shape, device="cpu"):
    mask = torch.rand(shape, device=device) > 0.4
    mask[..., 0] = True  # no fully masked row: SDPA's convention for those differs between backends
    return mask


B, H, LQ, LK, E = 2, 3, 13, 29, 40

# name -> (q shape, k/v shape, mask shape or None, mask kind, is_causal, scale, enable_gqa)
CASES = {
    "plain": ((B, H, LQ, E), (B, H, LK, E), None, None, False, None, False),
    "causal_square": ((B, H, LK, E), (B, H, LK, E), None, None, True, None, False),
    "causal_lq_lt_lk": ((B, H, LQ, E), (B, H, LK, E), None, None, True, None, False),
    "causal_lq_gt_lk": ((B, H, LK, E), (B, H, LQ, E), None, None, True, None, False),
    "bool_mask_2d": ((B, H, LQ, E), (B, H, LK, E), (LQ, LK), "bool", False, None, False),
    "bool_mask_4d": ((B, H, LQ, E), (B, H, LK, E), (B, 1, LQ, LK), "bool", False, None, False),
    "float_mask_b11k": ((B, H, LQ, E), (B, H, LK, E), (B, 1, 1, LK), "float", False, None, False),
    "float_mask_qk": ((B, H, LQ, E), (B, H, LK, E), (LQ, LK), "float", False, None, False),
    "float_mask_hqk": ((B, H, LQ, E), (B, H, LK, E), (H, LQ, LK), "float", False, None, False),
    "float_mask_causal": ((B, H, LK, E), (B, H, LK, E), (B, 1, 1, LK), "float", True, None, False),
    "gqa": ((B, 8, LQ, E), (B, 2, LK, E), None, None, False, None, True),
    "gqa_causal_mask": ((B, 8, LK, E), (B, 2, LK, E), (B, 1, LK, LK), "float", True, None, True),
    "3d": ((5, LQ, E), (5, LK, E), (LQ, LK), "float", False, None, False),
    "5d": ((2, B, H, LQ, E), (2, B, H, LK, E), (B, 1, 1, LK), "float", False, None, False),
    "scale": ((B, H, LQ, E), (B, H, LK, E), None, None, False, 0.3, False),
    "scale_causal_bool": ((B, H, LK, E), (B, H, LK, E), (LK, LK), "bool", True, 0.05, False),
}


def _case_inputs(name, dtype, device="cpu", requires_grad=False):
    shape_q, shape_kv, mask_shape, mask_kind, is_causal, scale, gqa = CASES[name]
    q, k, v = _qkv(shape_q, shape_kv, dtype, device, requires_grad=requires_grad)
    mask = None
    if mask_kind == "bool":
        mask = _bool_mask(mask_shape, device)
    elif mask_kind == "float":
        mask = torch.randn(mask_shape, dtype=dtype, device=device)
    return q, k, v, dict(attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)


# ---------------------------------------------------------------------------------------------------------
# CPU: "cpu_flash" and "sdpa"
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", ["cpu_flash", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_float64_reference(case, kernel, dtype):
    torch.manual_seed(hash(case) % 1000)
    q, k, v, kwargs = _case_inputs(case, dtype)
    out = attention(q, k, v, **kwargs, kernel=kernel)
    expected = reference(q, k, v, kwargs["attn_mask"], kwargs["is_causal"], kwargs["scale"])
    assert out.shape == expected.shape and out.dtype == dtype, (out.shape, out.dtype)
    err = rel_err(out, expected)
    assert err < TOLERANCE[dtype], f"{case}/{kernel}/{dtype}: relative error {err:.2e}"


@pytest.mark.parametrize("kernel", ["cpu_flash", "sdpa"])
def test_causal_is_top_left_aligned(kernel):
    # With Lq < Lk, query 0 sees key 0 alone (top left); bottom-right alignment would let it see
    # keys 0..Lk-Lq. Checked without the reference, which encodes the same convention.
    q, k, v = _qkv((1, 2, LQ, E), (1, 2, LK, E))
    out = attention(q, k, v, is_causal=True, kernel=kernel)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0])
    assert not torch.allclose(out[:, :, 1], v[:, :, 1], atol=1e-3)


def test_fp32_gradients_match_reference():
    torch.manual_seed(1)
    for case in ("plain", "causal_lq_lt_lk", "gqa_causal_mask", "bool_mask_2d", "3d", "5d"):
        q, k, v, kwargs = _case_inputs(case, torch.float32, requires_grad=True)
        grad = torch.randn(*q.shape[:-1], v.shape[-1])
        got = torch.autograd.grad(attention(q, k, v, **kwargs, kernel="cpu_flash"), (q, k, v), grad)
        expected = torch.autograd.grad(
            reference(q, k, v, kwargs["attn_mask"], kwargs["is_causal"], kwargs["scale"]), (q, k, v), grad.double())
        for name, g, e in zip("qkv", got, expected):
            assert g.shape == e.shape, (case, name, g.shape, e.shape)
            assert rel_err(g, e) < 1e-4, f"{case}: d{name} relative error {rel_err(g, e):.2e}"


# The CPU flash kernel runs in float64, so gradcheck can check its backward kernel directly.
@pytest.mark.parametrize("gqa, masked, is_causal", [(False, False, False), (True, True, False), (True, True, True),
                                                    (False, True, True)])
def test_gradcheck_cpu_flash(gqa, masked, is_causal):
    torch.manual_seed(2)
    q, k, v = _qkv((1, 4, 5, 8), (1, 2 if gqa else 4, 7 if not is_causal else 5, 8), torch.float64,
                   requires_grad=True)
    mask = torch.randn(1, 1, 5, k.shape[-2], dtype=torch.float64) if masked else None  # no grad: not supported

    def fn(q, k, v):
        return attention(q, k, v, mask, is_causal=is_causal, enable_gqa=gqa, kernel="cpu_flash")

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_sdpa_with_mask_gradient():
    torch.manual_seed(3)
    q, k, v = _qkv((2, 4, 5, 8), (2, 2, 7, 8), torch.float64, requires_grad=True)
    mask = torch.randn(2, 1, 5, 7, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, mask):
        return attention(q, k, v, mask, enable_gqa=True, kernel="sdpa")

    assert torch.autograd.gradcheck(fn, (q, k, v, mask))


def _op_samples():
    torch.manual_seed(4)
    q, k, v = _qkv((2, 4, 6, 16), (2, 2, 9, 16), requires_grad=True)
    mask = torch.randn(2, 1, 6, 9)
    # (q, k, v, attn_mask, dropout_p, is_causal, scale, kernel, compute_log_sumexp)
    return [(q, k, v, None, 0.0, False, None, "cpu_flash", True),
            (q, k, v, mask, 0.0, True, 0.2, "cpu_flash", True),
            (q.detach(), k.detach(), v.detach(), mask[0, 0], 0.0, False, None, "cpu_flash", False)]


@pytest.mark.parametrize("sample", range(3))
def test_opcheck_forward(sample):
    torch.library.opcheck(torch.ops.kernel_pytorch.attention_fwd.default, _op_samples()[sample])


def test_opcheck_backward():
    q, k, v, mask, dropout_p, is_causal, scale, kernel, _ = _op_samples()[1]
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse, rng_a, rng_b = torch.ops.kernel_pytorch.attention_fwd(q, k, v, mask, dropout_p, is_causal, scale,
                                                                     kernel, True)
    args = (torch.randn_like(out), q, k, v, mask, out, lse, rng_a, rng_b, dropout_p, is_causal, scale, kernel,
            False)
    torch.library.opcheck(torch.ops.kernel_pytorch.attention_bwd.default, args)
    dq, dk, dv, dmask = torch.ops.kernel_pytorch.attention_bwd(*args)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape and dmask.numel() == 0


class _RecordGraphs:
    """A torch.compile backend that keeps Dynamo's graphs and runs them with backend ``inner``."""

    def __init__(self, inner):
        self.inner, self.graphs = inner, []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend(self.inner)(gm, example_inputs)


@pytest.mark.parametrize("backend, dynamic", [("eager", False), ("aot_eager", False), ("aot_eager", True)])
def test_compiles_without_graph_break(backend, dynamic):
    torch.manual_seed(5)
    q, k, v = _qkv((2, 8, LK, E), (2, 2, LK, E), requires_grad=True)
    mask = _bool_mask((LK, LK))

    def step(q, k, v):
        out = attention(q, k, v, mask, is_causal=True, enable_gqa=True, kernel="cpu_flash")
        return out, out.square().sum()

    # Dynamo does not trace .backward(); the backward of the compiled graph runs from outside it.
    recorder = _RecordGraphs(backend)
    compiled_out, loss = torch.compile(step, backend=recorder, fullgraph=True, dynamic=dynamic)(q, k, v)
    loss.backward()
    compiled_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager_out, loss = step(q, k, v)
    loss.backward()
    # fullgraph=True already fails on a graph break; dynamic=True adds an empty graph of Dynamo's own.
    graphs = [gm for gm in recorder.graphs if any(node.op == "call_function" for node in gm.graph.nodes)]
    assert len(graphs) == 1, [gm.code for gm in graphs]
    targets = {node.target for node in graphs[0].graph.nodes}
    assert torch.ops.kernel_pytorch.attention_fwd.default in targets, targets
    torch.testing.assert_close(compiled_out, eager_out, rtol=1e-6, atol=1e-6)
    for compiled, t in zip(compiled_grads, (q, k, v)):
        torch.testing.assert_close(compiled, t.grad, rtol=1e-6, atol=1e-6)


def test_unknown_kernel_names_the_valid_ones():
    q, k, v = _qkv((1, 1, 4, 8), (1, 1, 4, 8))
    with pytest.raises(ValueError, match="unknown attention kernel 'triton'.*" + ".*".join(ATTENTION_KERNELS)):
        attention(q, k, v, kernel="triton")
    with pytest.raises(ValueError, match="unknown attention kernel"):
        kernel_device("triton")


def test_kernel_device():
    assert {name: kernel_device(name) for name in ATTENTION_KERNELS} == {
        "sdpa": "any", "cudnn": "cuda", "flash": "cuda", "efficient": "cuda", "cpu_flash": "cpu", "flex": "any",
        "flash_attn": "cuda", "cudnn_band": "cuda"}


def test_mask_requiring_grad_is_refused_by_kernels_without_a_mask_gradient():
    q, k, v = _qkv((1, 2, 4, 8), (1, 2, 4, 8))
    mask = torch.zeros(4, 4, requires_grad=True)
    for kernel in ("cpu_flash", "cudnn"):
        with pytest.raises(ValueError, match=f"{kernel}.*cannot return a gradient for attn_mask"):
            attention(q, k, v, mask, kernel=kernel)
    with torch.no_grad():  # nothing to differentiate: fine
        torch.testing.assert_close(attention(q, k, v, mask, kernel="cpu_flash"),
                                   reference(q, k, v, mask).float(), rtol=1e-5, atol=1e-6)
    assert attention(q, k, v, mask, kernel="sdpa").requires_grad


def test_refusals_that_would_otherwise_compute_something_else():
    q, k, v = _qkv((1, 2, 4, 8), (1, 2, 6, 8), torch.bfloat16)
    with pytest.raises(ValueError, match="'flash' takes no attn_mask"):
        attention(q, k, v, torch.zeros(4, 6, dtype=torch.bfloat16), kernel="flash")
    with pytest.raises(ValueError, match="'flash' aligns is_causal to the bottom right"):
        attention(q, k, v, is_causal=True, kernel="flash")
    with pytest.raises(ValueError, match="'cudnn' supports float16 and bfloat16"):
        attention(q.float(), k.float(), v.float(), kernel="cudnn")
    with pytest.raises(ValueError, match="runs on cuda tensors, got cpu"):
        attention(q, k, v, kernel="efficient")
    with pytest.raises(ValueError, match="needs enable_gqa=True"):
        attention(q, k[:, :1], v[:, :1], kernel="cpu_flash")
    with pytest.raises(ValueError, match="does not broadcast"):
        attention(q, k, v, torch.zeros(3, 4, 6, dtype=torch.bfloat16), kernel="cpu_flash")


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 29), (13, 29), (2, 3, 13, 29), (2, 3, 13, 1), (1, 1, 1, 32)])
def test_efficient_bias_is_expanded_and_row_aligned(mask_shape):
    # The CUDA efficient kernel raises unless the bias is (B, H, Lq, Lk) with every stride but the last a
    # multiple of 8; this layout step is plain tensor code, so it is checked here, on the CPU.
    from kernel_pytorch.attention.kernels.aten_sdpa import efficient_bias

    seq_k = mask_shape[-1] if mask_shape[-1] != 1 else 29
    q, k = torch.empty(2, 3, 13, 8), torch.empty(2, 3, seq_k, 8)
    mask = torch.randn(mask_shape)
    mask = mask[(None,) * (4 - mask.dim())]
    bias = efficient_bias(mask, q, k)
    assert bias.shape == (2, 3, 13, seq_k)
    assert bias.stride(-1) == 1 and all(s % 8 == 0 for s in bias.stride()[:-1]), bias.stride()
    assert torch.equal(bias, mask.expand(2, 3, 13, seq_k))
    materialized = bias.untyped_storage().nbytes() // bias.element_size()
    assert materialized <= math.prod(mask.shape[:-1]) * 32, "broadcast dims were materialized"


def test_cpu_flash_refuses_dropout():
    # The CPU flash kernel has no dropout; aten raises and we let it (SDPA uses its math path then).
    q, k, v = _qkv((1, 2, 4, 8), (1, 2, 4, 8))
    with pytest.raises(RuntimeError, match="dropout"):
        attention(q, k, v, dropout_p=0.1, kernel="cpu_flash")


# ---------------------------------------------------------------------------------------------------------
# CPU: "flex" (FlexAttention runs forward on the CPU, eagerly as its unfused reference) and "flash_attn"
# (a stand-in module: flash-attn itself needs a CUDA GPU and is not installed here)
# ---------------------------------------------------------------------------------------------------------

# CASES without a mask tensor: what "flex" and "flash_attn" take.
MASKLESS_CASES = [name for name, case in CASES.items() if case[2] is None]


@pytest.fixture
def quiet_flex():
    # Eager flex_attention warns (once per process) that it is the unfused implementation; expected here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


@pytest.mark.usefixtures("quiet_flex")
@pytest.mark.parametrize("case", MASKLESS_CASES + ["3d_maskless", "5d_maskless", "2d"])
def test_flex_forward_matches_sdpa_on_cpu(case):
    torch.manual_seed(12)
    extra = {"3d_maskless": ((5, LQ, E), (5, LK, E), False, None, False),
             "5d_maskless": ((2, B, H, LQ, E), (2, B, H, LK, E), True, 0.2, False),
             "2d": ((LK, E), (LK, E), True, None, False)}
    if case in extra:
        shape_q, shape_kv, is_causal, scale, gqa = extra[case]
        q, k, v = _qkv(shape_q, shape_kv)
        kwargs = dict(is_causal=is_causal, scale=scale, enable_gqa=gqa)
    else:
        q, k, v, kwargs = _case_inputs(case, torch.float32)
        kwargs.pop("attn_mask")
    out = attention(q, k, v, **kwargs, kernel="flex")
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert out.shape == expected.shape and out.dtype == torch.float32, (out.shape, out.dtype)
    assert rel_err(out, expected) < 1e-5, f"{case}: relative error {rel_err(out, expected):.2e}"
    float64 = reference(q, k, v, None, kwargs["is_causal"], kwargs["scale"])
    assert rel_err(out, float64) < 1e-5


@pytest.mark.usefixtures("quiet_flex")
def test_flex_value_dim_may_differ_and_causal_is_top_left():
    q, k, v = _qkv((1, 2, LQ, 32), (1, 2, LK, 32), value_dim=24)
    out = attention(q, k, v, is_causal=True, kernel="flex")
    assert out.shape == (1, 2, LQ, 24)
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0])  # query 0 sees key 0 alone: top-left aligned
    assert rel_err(out, F.scaled_dot_product_attention(q, k, v, is_causal=True)) < 1e-5


@pytest.mark.usefixtures("quiet_flex")
def test_flex_backward_on_cpu_is_pytorchs_limit():
    # FlexAttention has no CPU backward (flex_attention raises, not us); the dispatcher never picks flex
    # for the CPU, and the GPU tests below check the gradients.
    q, k, v = _qkv((1, 2, 8, 16), (1, 2, 8, 16), requires_grad=True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        attention(q, k, v, kernel="flex")


@pytest.mark.usefixtures("quiet_flex")
@pytest.mark.parametrize("case", ["plain", "causal_square", "causal_lq_lt_lk", "causal_lq_gt_lk", "gqa", "scale"])
def test_flex_gradients_match_sdpa_through_the_eager_reference(case, monkeypatch):
    """Our adapter (block mask, GQA, scale, layouts) differentiated through FlexAttention's own autograd.

    PyTorch refuses CPU inputs that require grad in flex_attention's argument check only; with that check
    lifted, the eager higher-order op differentiates with its dense reference backward, the same code as
    eager flex on a GPU. (The fused GPU backward is test_gpu_flex_matches_float64_under_inductor's.)"""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)
    torch.manual_seed(13)
    q, k, v, kwargs = _case_inputs(case, torch.float32, requires_grad=True)
    kwargs.pop("attn_mask")
    out = attention(q, k, v, **kwargs, kernel="flex")
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert rel_err(out, expected) < 1e-5
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape, (case, name, g.shape, w.shape)
        assert rel_err(g, w) < 1e-4, f"{case}: d{name} relative error {rel_err(g, w):.2e}"


@pytest.mark.parametrize("dynamic", [False, True])
def test_flex_compiles_without_graph_break(dynamic):
    torch.manual_seed(14)
    q, k, v = _qkv((2, 8, LK, 32), (2, 2, LK, 32))  # no grad: FlexAttention has no CPU backward

    def step(q, k, v):
        return attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True, kernel="flex")

    recorder = _RecordGraphs("aot_eager")
    out = torch.compile(step, backend=recorder, fullgraph=True, dynamic=dynamic)(q, k, v)
    graphs = [gm for gm in recorder.graphs if any(node.op == "call_function" for node in gm.graph.nodes)]
    assert len(graphs) == 1, [gm.code for gm in graphs]
    # The higher-order op is in the graph, for Inductor to lower into its fused kernel.
    assert any(node.op == "call_function" and "flex_attention" in str(node.target) for node in graphs[0].graph.nodes)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True)
    assert rel_err(out, expected) < 1e-5


def test_flex_under_inductor_on_a_graph_as_optimize_hands_it_over():
    # optimize() gives Inductor an FX graph that calls attention() (no Dynamo trace of it): AOTAutograd
    # traces flex_attention into its higher-order op, which Inductor lowers (its CPU template here).
    from torch._inductor.compile_fx import compile_fx

    torch.manual_seed(15)
    q, k, v = _qkv((2, 8, 64, 32), (2, 2, 64, 32))
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(name) for name in "qkv"]
    graph.output((graph.call_function(attention, (*inputs, None),
                                      {"is_causal": True, "enable_gqa": True, "kernel": "flex"}),))
    compiled = compile_fx(torch.fx.GraphModule(torch.nn.Module(), graph), [q, k, v])
    [out] = compiled(q, k, v)
    assert rel_err(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) < 1e-5


def test_flex_and_flash_attn_refusals():
    q, k, v = _qkv((1, 2, 4, 16), (1, 2, 6, 16), torch.bfloat16)
    for kernel in ("flex", "flash_attn"):
        with pytest.raises(ValueError, match=f"'{kernel}' takes no attn_mask"):
            attention(q, k, v, torch.zeros(4, 6, dtype=torch.bool), kernel=kernel)
    with pytest.raises(ValueError, match="'flex' has no dropout"):
        attention(q, k, v, dropout_p=0.1, kernel="flex")
    with pytest.raises(ValueError, match="'flash_attn' aligns is_causal to the bottom right"):
        attention(q, k, v, is_causal=True, kernel="flash_attn")
    with pytest.raises(ValueError, match="'flash_attn' supports float16 and bfloat16"):
        attention(q.float(), k.float(), v.float(), kernel="flash_attn")
    big = torch.zeros(1, 2, 4, 288, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'flash_attn' needs head dims <= 256"):
        attention(big, big, big, kernel="flash_attn")
    with pytest.raises(ValueError, match="does not go through the custom ops"):
        torch.ops.kernel_pytorch.attention_fwd(q, k, v, None, 0.0, False, None, "flex", False)


def _stand_in_flash_attn(calls):
    """A ``flash_attn`` module whose ``flash_attn_func`` takes flash-attn's (B, L, H, E) layout and
    computes with SDPA, recording what it was given."""

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), v=tuple(v.shape), dropout_p=dropout_p,
                          softmax_scale=softmax_scale, causal=causal))
        # flash-attn's GQA: query head h reads K/V head h // (Hq / Hk), which is SDPA's enable_gqa grouping.
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             dropout_p=dropout_p, is_causal=causal, scale=softmax_scale,
                                             enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    module = types.ModuleType("flash_attn")
    module.flash_attn_func = flash_attn_func
    return module


@pytest.mark.parametrize("case", ["plain", "causal_square", "gqa", "scale", "5d_gqa_causal"])
def test_flash_attn_adapter_layout_and_values(case, monkeypatch):
    """Our adapter around flash-attn (transposes to (B, L, H, E) and back, GQA heads, scale, causal) against
    the float64 reference, with a stand-in ``flash_attn`` module computing SDPA on flash-attn's layout.
    This checks the adapter, not flash-attn: the package is not installed here and needs a CUDA GPU."""
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", _stand_in_flash_attn(calls))
    torch.manual_seed(16)
    if case == "5d_gqa_causal":
        q, k, v = _qkv((2, B, 8, LK, E), (2, B, 2, LK, E), torch.bfloat16, requires_grad=True)
        kwargs = dict(is_causal=True, scale=None, enable_gqa=True)
    else:
        q, k, v, kwargs = _case_inputs(case, torch.bfloat16, requires_grad=True)
        kwargs.pop("attn_mask")
    out = attention(q, k, v, **kwargs, kernel="flash_attn")
    expected = reference(q, k, v, None, kwargs["is_causal"], kwargs["scale"])
    assert out.shape == expected.shape and out.dtype == torch.bfloat16, (out.shape, out.dtype)
    assert rel_err(out, expected) < TOLERANCE[torch.bfloat16], f"relative error {rel_err(out, expected):.2e}"
    [call] = calls
    heads_q, heads_k, seq_q, seq_k = q.shape[-3], k.shape[-3], q.shape[-2], k.shape[-2]
    assert call["q"][1:] == (seq_q, heads_q, E) and call["k"][1:] == (seq_k, heads_k, E), call  # (B, L, H, E)
    assert call["softmax_scale"] == kwargs["scale"] and call["causal"] == kwargs["is_causal"]
    assert call["dropout_p"] == 0.0
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad.double())
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and rel_err(g, w) < 5e-2, f"d{name} relative error {rel_err(g, w):.2e}"


def test_flash_attn_adapter_traces_without_graph_break(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", _stand_in_flash_attn([]))
    q, k, v = _qkv((2, 8, LK, E), (2, 2, LK, E), torch.bfloat16)

    def step(q, k, v):
        return attention(q, k, v, is_causal=True, enable_gqa=True, kernel="flash_attn")

    out = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v)
    assert rel_err(out, reference(q, k, v, None, True)) < TOLERANCE[torch.bfloat16]


def test_flash_attn_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # None in sys.modules: "import flash_attn" fails
    q, k, v = _qkv((1, 2, 4, 16), (1, 2, 4, 16), torch.bfloat16)
    with pytest.raises(ImportError, match="needs the flash-attn package"):
        attention(q, k, v, kernel="flash_attn")


# ---------------------------------------------------------------------------------------------------------
# GPU (pytest -m gpu): the CUDA kernels
# ---------------------------------------------------------------------------------------------------------

CUDA_KERNELS = {  # kernel -> dtypes
    "cudnn": (torch.bfloat16, torch.float16),
    "flash": (torch.bfloat16, torch.float16),
    "efficient": (torch.bfloat16, torch.float16, torch.float32),
}
GPU_TOLERANCE = {  # (output, gradients)
    torch.bfloat16: (2e-2, 5e-2), torch.float16: (5e-3, 1e-2), torch.float32: (1e-4, 1e-4)}
GPU_CASES = {  # name -> (q shape, k/v shape, mask shape or None, is_causal, enable_gqa)
    "plain": ((2, 16, 77, 64), (2, 16, 77, 64), None, False, False),
    "causal": ((2, 16, 77, 64), (2, 16, 77, 64), None, True, False),
    "causal_lq_lt_lk": ((2, 16, 40, 64), (2, 16, 77, 64), None, True, False),
    "gqa": ((2, 16, 77, 128), (2, 4, 77, 128), None, False, True),
    "gqa_causal": ((2, 16, 77, 64), (2, 4, 77, 64), None, True, True),
    "mask": ((2, 16, 40, 64), (2, 16, 77, 64), (2, 1, 40, 77), False, False),
    "mask_b11k_gqa_causal": ((2, 16, 77, 64), (2, 4, 77, 64), (2, 1, 1, 77), True, True),
    "bool_mask": ((2, 16, 40, 64), (2, 16, 77, 64), (40, 77), False, False),
    # E % 8 != 0: flash pads it (as SDPA does); efficient takes it in fp32 only; the others raise.
    "head_dim_36": ((2, 4, 77, 36), (2, 4, 77, 36), None, True, False),
}
GPU_CASE_ONLY = {"head_dim_36": {("flash", torch.bfloat16), ("flash", torch.float16), ("efficient", torch.float32)}}


def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("gpu tests were selected (-m gpu) but torch.cuda.is_available() is False")


def _gpu_params():
    for kernel, dtypes in CUDA_KERNELS.items():
        for dtype in dtypes:
            for case, (_, shape_kv, mask_shape, is_causal, _) in GPU_CASES.items():
                query_len = GPU_CASES[case][0][-2]
                if kernel == "flash" and (mask_shape or (is_causal and query_len != shape_kv[-2])):
                    continue  # refused by design: test_refusals_that_would_otherwise_compute_something_else
                if case in GPU_CASE_ONLY and (kernel, dtype) not in GPU_CASE_ONLY[case]:
                    continue
                yield pytest.param(kernel, dtype, case, id=f"{kernel}-{str(dtype)[6:]}-{case}")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, dtype, case", list(_gpu_params()))
def test_gpu_kernel_matches_reference(kernel, dtype, case):
    _needs_cuda()
    torch.manual_seed(6)
    shape_q, shape_kv, mask_shape, is_causal, gqa = GPU_CASES[case]
    q, k, v = _qkv(shape_q, shape_kv, dtype, "cuda", requires_grad=True)
    mask = None
    if case == "bool_mask":
        mask = _bool_mask(mask_shape, "cuda")
    elif mask_shape:
        mask = torch.randn(mask_shape, dtype=dtype, device="cuda")
    out = attention(q, k, v, mask, is_causal=is_causal, enable_gqa=gqa, kernel=kernel)
    expected = reference(q, k, v, mask, is_causal)
    out_tol, grad_tol = GPU_TOLERANCE[dtype]
    assert out.shape == expected.shape and out.dtype == dtype
    assert rel_err(out, expected) < out_tol, f"output relative error {rel_err(out, expected):.2e}"
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad.double())
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        assert rel_err(g, w) < grad_tol, f"d{name} relative error {rel_err(g, w):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 77), (40, 77), (2, 8, 40, 77), (8, 1, 77)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_efficient_mask_gradient(dtype, mask_shape):
    _needs_cuda()
    torch.manual_seed(7)
    q, k, v = _qkv((2, 8, 40, 64), (2, 2, 77, 64), dtype, "cuda", requires_grad=True)
    mask = torch.randn(mask_shape, dtype=dtype, device="cuda", requires_grad=True)  # rows of 77: unaligned
    out = attention(q, k, v, mask, enable_gqa=True, kernel="efficient")
    expected = reference(q, k, v, mask)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, mask), grad)
    want = torch.autograd.grad(expected, (q, k, v, mask), grad.double())
    for name, g, w in zip(("q", "k", "v", "mask"), got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert rel_err(g, w) < GPU_TOLERANCE[dtype][1], f"d{name} relative error {rel_err(g, w):.2e}"


SDPA_BACKEND = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(CUDA_KERNELS))
def test_gpu_dropout_uses_the_kernels_rng_forward_and_backward(kernel):
    # With the same seed, SDPA restricted to the same aten kernel draws the same dropout mask: equal
    # outputs, and equal gradients only if our backward got the forward's RNG state.
    _needs_cuda()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv((2, 8, 77, 64), (2, 8, 77, 64), torch.bfloat16, "cuda", requires_grad=True)
    grad = torch.randn(2, 8, 77, 64, dtype=torch.bfloat16, device="cuda")
    torch.manual_seed(8)
    out = attention(q, k, v, dropout_p=0.3, is_causal=True, kernel=kernel)
    got = torch.autograd.grad(out, (q, k, v), grad)
    torch.manual_seed(8)
    with sdpa_kernel(getattr(SDPBackend, SDPA_BACKEND[kernel])):
        native = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    want = torch.autograd.grad(native, (q, k, v), grad)
    no_dropout = attention(q, k, v, is_causal=True, kernel=kernel)
    assert out.isfinite().all() and rel_err(out, no_dropout) > 0.05, "dropout changed nothing"
    assert rel_err(out, native) < 1e-3, f"output differs from SDPA's {kernel}: {rel_err(out, native):.2e}"
    for name, g, w in zip("qkv", got, want):
        assert g.isfinite().all() and rel_err(g, w) < 2e-2, f"d{name} differs from SDPA's: {rel_err(g, w):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(CUDA_KERNELS))
def test_gpu_dropout_smoke_gqa_and_mask(kernel):
    _needs_cuda()
    q, k, v = _qkv((2, 16, 77, 64), (2, 4, 77, 64), torch.bfloat16, "cuda", requires_grad=True)
    mask = None if kernel == "flash" else torch.randn(2, 1, 77, 77, dtype=torch.bfloat16, device="cuda")
    out = attention(q, k, v, mask, dropout_p=0.2, enable_gqa=True, kernel=kernel)
    out.float().square().sum().backward()
    assert out.shape == q.shape and out.isfinite().all()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and t.grad.isfinite().all() and t.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(CUDA_KERNELS))
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_gpu_opcheck(kernel, dropout_p):
    _needs_cuda()
    torch.manual_seed(9)
    q, k, v = _qkv((2, 8, 40, 64), (2, 2, 77, 64), torch.bfloat16, "cuda", requires_grad=True)
    mask = None if kernel == "flash" else torch.randn(2, 1, 40, 77, dtype=torch.bfloat16, device="cuda")
    args = (q, k, v, mask, dropout_p, False, None, kernel, True)
    # With dropout, two runs differ: compare metadata only (the RNG-state outputs' devices included).
    tests = ("test_schema", "test_faketensor") if dropout_p else None
    torch.library.opcheck(torch.ops.kernel_pytorch.attention_fwd.default, args,
                          **({"test_utils": tests} if tests else {}))
    out, lse, rng_a, rng_b = torch.ops.kernel_pytorch.attention_fwd(*(a.detach() if isinstance(a, torch.Tensor)
                                                                      else a for a in args))
    bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), mask, out, lse, rng_a, rng_b, dropout_p,
                False, None, kernel, kernel == "efficient")
    torch.library.opcheck(torch.ops.kernel_pytorch.attention_bwd.default, bwd_args,
                          **({"test_utils": tests} if tests else {}))


@pytest.mark.gpu
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
@pytest.mark.parametrize("kernel", list(CUDA_KERNELS))
def test_gpu_inductor_fullgraph(kernel, dropout_p):
    # With dropout, the same seed gives the same mask: the kernel draws from the CUDA generator whether
    # Inductor or eager calls it.
    _needs_cuda()
    torch.manual_seed(10)
    q, k, v = _qkv((2, 16, 77, 64), (2, 4, 77, 64), torch.bfloat16, "cuda", requires_grad=True)
    mask = None if kernel == "flash" else torch.randn(1, 1, 77, 77, dtype=torch.bfloat16, device="cuda")

    def step(q, k, v):
        out = attention(q, k, v, mask, dropout_p, is_causal=True, enable_gqa=True, kernel=kernel)
        return out, out.float().square().sum()

    compiled = torch.compile(step, fullgraph=True)
    compiled(q, k, v)  # compile outside the seeded region
    torch.manual_seed(11)
    compiled_out, loss = compiled(q, k, v)
    for t in (q, k, v):
        t.grad = None
    loss.backward()
    compiled_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(11)
    eager_out, loss = step(q, k, v)
    loss.backward()
    assert rel_err(compiled_out, eager_out) < 1e-3
    for name, compiled, t in zip("qkv", compiled_grads, (q, k, v)):
        assert rel_err(compiled, t.grad) < 1e-2, f"d{name}: {rel_err(compiled, t.grad):.2e}"


# ---------------------------------------------------------------------------------------------------------
# GPU (pytest -m gpu): "flex", compiled as optimize() runs it, and eagerly (the unfused reference)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.fail("gpu tests were selected (-m gpu) but torch.cuda.is_available() is False")
    return torch.device("cuda")


FLEX_GPU_CASES = {  # name -> (q shape, k/v shape, is_causal, enable_gqa, scale)
    "plain": ((2, 16, 256, 64), (2, 16, 256, 64), False, False, None),
    "causal": ((2, 16, 256, 64), (2, 16, 256, 64), True, False, None),
    "causal_gqa": ((2, 16, 300, 128), (2, 4, 300, 128), True, True, None),  # 300: a partial last block
    "causal_lq_lt_lk": ((2, 8, 77, 64), (2, 8, 200, 64), True, False, 0.1),
    "causal_lq_gt_lk": ((2, 8, 200, 64), (2, 8, 77, 64), True, False, None),
    "head_dim_80": ((2, 8, 256, 80), (2, 8, 256, 80), True, False, None),  # padded to 128 inside the kernel
}


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [True, False], ids=["inductor", "eager"])
@pytest.mark.parametrize("case", list(FLEX_GPU_CASES))
def test_gpu_flex_matches_float64_under_inductor(cuda, case, compiled):
    torch.manual_seed(17)
    shape_q, shape_kv, is_causal, gqa, scale = FLEX_GPU_CASES[case]
    q, k, v = _qkv(shape_q, shape_kv, torch.bfloat16, cuda, requires_grad=True)

    def step(q, k, v):
        return attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa, kernel="flex")

    fn = torch.compile(step, fullgraph=True) if compiled else step
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = fn(q, k, v)
    expected = reference(q, k, v, None, is_causal, scale)
    out_tol, grad_tol = GPU_TOLERANCE[torch.bfloat16]
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    assert rel_err(out, expected) < out_tol, f"output relative error {rel_err(out, expected):.2e}"
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad.double())
    for name, g, w in zip("qkv", got, want):
        assert g.shape == w.shape and g.dtype == torch.bfloat16, (name, g.shape, g.dtype)
        assert rel_err(g, w) < grad_tol, f"d{name} relative error {rel_err(g, w):.2e}"


@pytest.mark.gpu
def test_gpu_flex_is_lowered_to_a_fused_kernel(cuda):
    # Inductor names template kernels triton_tem_*: the flex template, not an unfused decomposition.
    from torch._inductor.utils import run_and_get_code

    q, k, v = _qkv((1, 8, 1024, 64), (1, 8, 1024, 64), torch.bfloat16, cuda)
    fn = torch.compile(lambda q, k, v: attention(q, k, v, is_causal=True, kernel="flex"), fullgraph=True)
    _, codes = run_and_get_code(fn, q, k, v)
    assert any("triton_tem_" in code for code in codes), codes[0][:2000]


def test_cudnn_backward_gets_its_output_gradient_in_the_outputs_strides():
    from kernel_pytorch.attention.kernels.aten_sdpa import in_strides_of

    out = torch.randn(2, 5, 3, 8).transpose(1, 2)  # (B, L, H, E) memory viewed as (B, H, L, E)
    same = torch.empty_like(out).copy_(out)
    assert in_strides_of(same, out) is same
    contiguous = torch.randn(out.shape)
    moved = in_strides_of(contiguous, out)
    assert moved.stride() == out.stride() and torch.equal(moved, contiguous)


def test_sdpa_kernel_keeps_pytorchs_call_off_cuda(monkeypatch):
    attention_module = sys.modules["kernel_pytorch.ops.attention"]  # the package exports the function by that name
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    assert not attention_module._trains_on_pytorch_cudnn(q, q, q, None, 0.0, True, None, False, None)
    calls = []
    monkeypatch.setattr(attention_module, "attention_fwd", lambda *args: calls.append(args))
    out = attention(q, q, q, is_causal=True, kernel="sdpa")
    assert calls == [] and rel_err(out, F.scaled_dot_product_attention(q, q, q, is_causal=True)) < 1e-6
