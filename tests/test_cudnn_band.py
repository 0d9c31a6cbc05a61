"""The ``"cudnn_band"`` attention kernel (cuDNN's causal sliding window, a graph built with the cuDNN
frontend): which problems the dispatcher sends it, what ``attention`` refuses, and on a GPU with the
package, forward and gradients against the masked float64 reference, the custom ops under opcheck and
Inductor, and the attention pass choosing it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernel_pytorch.attention import dispatch
from kernel_pytorch.attention.dispatch import AttentionProblem, choose_kernel, eligible_kernels
from kernel_pytorch.attention.kernels.cudnn_band import band_window
from kernel_pytorch.hardware import HardwareInfo
from kernel_pytorch.ops import attention
from kernel_pytorch.ops.attention import PATTERN_KERNELS

H100 = HardwareInfo(vendor="nvidia", device_name="sim H100", compute_capability=(9, 0), cudnn_attention=True,
                    bf16=True, triton_usable=True, cudnn_frontend_version="1.32.0")
WINDOW = ("band", 0, 255, 0.3)  # MaskPattern.sparsity of a causal sliding window of 256


def _problem(sparsity=WINDOW, dtype=torch.bfloat16, head_dim=128, kv_heads=16, kv_len=1024, dropout=0.0,
             training=False, cuda_graphs=False):
    q = torch.empty(1, 16, 1024, head_dim, dtype=dtype, device="meta")
    k = v = torch.empty(1, kv_heads, kv_len, head_dim, dtype=dtype, device="meta")
    mask = torch.empty(1024, kv_len, dtype=torch.bool, device="meta")
    return AttentionProblem.from_tensors(q, k, v, mask, is_causal=False, dropout_p=dropout, enable_gqa=kv_heads != 16,
                                         training=training, sparsity=sparsity, cuda_graphs=cuda_graphs)


def test_band_window_takes_causal_windows_with_equal_lengths_only():
    assert band_window(("band", 0, 1023), 4096, 4096) == 1024
    assert band_window(("band", 0, 0), 8, 8) == 1  # the diagonal alone
    for pattern, lq, lk in ((("band", 1, 1023), 64, 64), (("band", -4, 3), 64, 64), (("band", 0, None), 64, 64),
                            (("band", 0, 15), 64, 32), (("document", 0, 15), 64, 64), (None, 64, 64)):
        assert band_window(pattern, lq, lk) is None, pattern


def test_a_causal_window_makes_it_eligible_beside_flex_and_the_dense_kernels():
    eligible, rejected = eligible_kernels(_problem(), H100)
    # flash takes no mask tensor; the dense kernels that take one keep it
    assert eligible == ["cudnn", "cudnn_band", "flex", "efficient", "sdpa"], rejected
    eligible, _ = eligible_kernels(_problem(kv_heads=4, training=True), H100)  # GQA, training
    assert "cudnn_band" in eligible
    eligible, _ = eligible_kernels(_problem(cuda_graphs=True), H100)  # inference through CUDA graphs
    assert "cudnn_band" in eligible


@pytest.mark.parametrize("case, hardware, limit", [
    (dict(sparsity=None), H100, "causal sliding window"),
    (dict(sparsity=("band", 2, 255, 0.3)), H100, "causal sliding window"),
    (dict(sparsity=("document", 0, None, 0.3)), H100, "causal sliding window"),
    (dict(kv_len=512), H100, "causal sliding window"),  # Lq != Lk
    (dict(), H100.model_copy(update={"cudnn_frontend_version": None}), "not installed"),
    (dict(), H100.model_copy(update={"cudnn_frontend_version": "1.16.0"}), "older than 1.32"),
    (dict(dropout=0.1), H100, "no dropout"),
    (dict(training=True, cuda_graphs=True), H100, "without CUDA graphs"),
    (dict(dtype=torch.float32), H100, "fp16/bf16"),
    (dict(head_dim=256), H100, "limited to head dim 128"),
    (dict(), H100.model_copy(update={"compute_capability": (7, 5), "cudnn_attention": False}),
     "cuDNN attention unavailable"),
    (dict(), H100.model_copy(update={"compute_capability": (7, 5)}), "compute capability >= 8.0"),
])
def test_rejections_name_the_limit(case, hardware, limit):
    eligible, rejected = eligible_kernels(_problem(**case), hardware)
    assert "cudnn_band" not in eligible and limit in rejected["cudnn_band"], rejected.get("cudnn_band")


def test_never_the_unmeasured_pick():
    q = torch.empty(1, 16, 1024, 128, dtype=torch.bfloat16, device="meta")
    mask = torch.empty(1024, 1024, dtype=torch.bool, device="meta")
    kernel, reason = choose_kernel(q, q, q, mask, is_causal=False, dropout_p=0.0, enable_gqa=False, hardware=H100,
                                   training=False, sparsity=WINDOW)
    assert kernel == "cudnn" and "cudnn_band: eligible, but taken only when measured fastest" in reason, reason
    assert "cudnn_band" in dispatch.MEASURED_ONLY and "cudnn_band" in PATTERN_KERNELS


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "causal sliding window given as the pattern"),
    (dict(pattern=("band", 0, 7), is_causal=True), "no is_causal"),
    (dict(pattern=("band", 1, 7)), "causal sliding window given as the pattern"),
    (dict(pattern=("band", 0, 7), dropout_p=0.1), "has no dropout"),
    (dict(pattern=("band", 0, 7), attn_mask=torch.ones(16, 16, dtype=torch.bool)), "takes no attn_mask"),
    (dict(pattern=("band", 0, 7)), "float16 and bfloat16"),  # fp32 inputs
])
def test_attention_refuses_what_the_band_kernel_does_not_compute(kwargs, message):
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match=message):
        attention(q, q, q, kernel="cudnn_band", **kwargs)


def test_attention_refuses_cpu_tensors():
    q = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="runs on cuda tensors"):
        attention(q, q, q, kernel="cudnn_band", pattern=("band", 0, 7))


class _CausalAttention(nn.Module):
    def forward(self, q, k, v):
        n = q.shape[-2]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=q.device), diagonal=1)
        return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask, -1) @ v


def test_the_pass_tells_the_dispatcher_whether_the_graph_runs_as_cuda_graphs(monkeypatch):
    """``compile="reduce-overhead"`` reaches the kernel choice (where cudnn_band is refused for training)."""
    import kernel_pytorch.passes.attention as attention_pass
    from kernel_pytorch import optimize

    seen = []
    choose = attention_pass._choose_kernel

    def spy(*args, ctx, **kwargs):
        seen.append(ctx.cuda_graphs)
        return choose(*args, ctx=ctx, **kwargs)

    monkeypatch.setattr(attention_pass, "_choose_kernel", spy)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    for mode in ("reduce-overhead", "default"):
        optimize(_CausalAttention().train(), example_inputs=(q, q, q), compile=mode)(q, q, q)
    assert seen == [True, False]


# ----------------------------------------------------------------------------------------------- GPU

def _needs_cuda_and_frontend():
    if not torch.cuda.is_available():
        pytest.fail("gpu tests were selected (-m gpu) but torch.cuda.is_available() is False")
    if importlib.util.find_spec("cudnn") is None:
        pytest.skip("nvidia-cudnn-frontend is not installed (extra 'cudnn'): the kernel is optional")


def _band_mask(length: int, window: int) -> torch.Tensor:
    i = torch.arange(length, device="cuda")
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv_heads, transposed", [(8, False), (2, True)], ids=["mha", "gqa-strided"])
@pytest.mark.parametrize("window", [1, 200, 4096], ids=lambda w: f"window{w}")
def test_gpu_forward_and_gradients_match_the_masked_reference(dtype, kv_heads, transposed, window):
    """Against float64 masked SDPA, no further from it than PyTorch's own masked SDPA in the same dtype (plus
    a 10% margin): a wrong band is off by O(1)."""
    _needs_cuda_and_frontend()
    torch.manual_seed(0)
    b, length, d = 2, 1024, 128

    def make(heads):
        if transposed:  # (B, L, H, E) projections viewed as (B, H, L, E), as models hand them over
            return torch.randn(b, length, heads, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
        return torch.randn(b, heads, length, d, device="cuda", dtype=dtype, requires_grad=True)

    q, k, v = make(8), make(kv_heads), make(kv_heads)
    grad = torch.randn(b, 8, length, d, device="cuda", dtype=dtype)
    gqa = kv_heads != 8
    out = attention(q, k, v, enable_gqa=gqa, kernel="cudnn_band", pattern=("band", 0, window - 1))
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    mask = _band_mask(length, window)
    exact_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = F.scaled_dot_product_attention(*exact_inputs, attn_mask=mask, enable_gqa=gqa)
    want = (exact, *torch.autograd.grad(exact, exact_inputs, grad.double()))
    same_dtype = [t.detach().requires_grad_() for t in (q, k, v)]
    sdpa = F.scaled_dot_product_attention(*same_dtype, attn_mask=mask, enable_gqa=gqa)
    baseline = (sdpa, *torch.autograd.grad(sdpa, same_dtype, grad))
    scale = want[-1].double().norm()  # dv's: never zero
    for name, g, w, base in zip(("out", "dq", "dk", "dv"), got, want, baseline):
        # Absolute norms, so window 1 (softmax over one key: dq = dk = 0 exactly, rounding residue ~1e-6 in
        # both kernels) is judged on the same footing.
        error, base_error = (g.double() - w).norm(), (base.double() - w).norm()
        assert error <= 1.1 * base_error + 1e-4 * scale, (name, float(error), float(base_error))


class _SlidingWindowAttention(nn.Module):
    """Mistral's mask: a causal triu and the keys past the window blocked by a tril with an offset."""

    def __init__(self, window: int):
        super().__init__()
        self.window = window

    def forward(self, q, k, v):
        n = q.shape[-2]
        causal = torch.triu(torch.full((n, n), float("-inf"), device=q.device), diagonal=1)
        outside = torch.tril(torch.full((n, n), float("-inf"), device=q.device), diagonal=-self.window)
        scores = (q @ k.mT) * q.shape[-1] ** -0.5 + (causal + outside).to(q.dtype)
        return torch.softmax(scores.float(), -1).to(q.dtype) @ v


@pytest.mark.gpu
def test_gpu_the_pass_measures_it_for_a_long_window_and_the_model_matches():
    """At L=4096 with a 1024 window (H100: 0.25 ms against cuDNN's dense causal 0.46 and FlexAttention's 0.44)
    the dispatcher measures cudnn_band among the candidates; the rewritten model equals the original."""
    _needs_cuda_and_frontend()
    from kernel_pytorch import optimize, report_of

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    module = _SlidingWindowAttention(1024).cuda().eval()
    model = optimize(_SlidingWindowAttention(1024).cuda().eval(), example_inputs=(q, k, v), compile=False)
    lines = [r.replacement for r in report_of(model).rewrites if r.pass_name == "attention"]
    assert lines and lines[0].startswith("attention[cudnn_band]") and "cudnn_band " in lines[0], lines
    with torch.no_grad():
        assert _rel(model(q, k, v), module(q, k, v)) < 2e-2


def _gqa_inputs(dtype=torch.bfloat16, length=512):
    """(B, L, H, E) projections viewed as (B, H, L, E), 8 query heads over 2 K/V heads."""
    def make(heads):
        return torch.randn(2, length, heads, 64, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    return make(8), make(2), make(2)


@pytest.mark.gpu
def test_gpu_opcheck_of_the_two_ops():
    """Schema, fake tensors (shapes and strides of the real outputs) and AOTAutograd with dynamic shapes, for
    the forward and the backward op (their autograd is the autograd.Function around them)."""
    _needs_cuda_and_frontend()
    torch.manual_seed(1)
    q, k, v = (t.detach() for t in _gqa_inputs())
    checks = {"test_utils": ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")}
    torch.library.opcheck(torch.ops.kernel_pytorch.cudnn_band_fwd.default, (q, k, v, 100, 0.125), **checks)
    out, stats = torch.ops.kernel_pytorch.cudnn_band_fwd(q, k, v, 100, 0.125)
    assert out.stride() == q.stride() and stats.shape == (2, 8, 512, 1) and stats.dtype == torch.float32
    grad = torch.randn_like(out)
    torch.library.opcheck(torch.ops.kernel_pytorch.cudnn_band_bwd.default, (grad, q, k, v, out, stats, 100, 0.125),
                          **checks)


@pytest.mark.gpu
def test_gpu_inductor_fullgraph_matches_eager():
    """Compiled with fullgraph=True (the custom ops trace, no graph break), forward and gradients equal the
    eager call's: the same cuDNN graphs run in both."""
    _needs_cuda_and_frontend()
    torch.manual_seed(2)
    q, k, v = _gqa_inputs()

    def step(q, k, v):
        out = attention(q, k, v, enable_gqa=True, kernel="cudnn_band", pattern=("band", 0, 127))
        return out, out.float().square().sum()

    results = []
    for fn in (torch.compile(step, fullgraph=True), step):
        out, loss = fn(q, k, v)
        results.append((out.detach(), *torch.autograd.grad(loss, (q, k, v))))
    for name, compiled, eager in zip(("out", "dq", "dk", "dv"), *results):
        assert _rel(compiled, eager) < 1e-3, (name, _rel(compiled, eager))


@pytest.mark.gpu
def test_gpu_misaligned_and_strided_inputs_are_copied_not_misread():
    """A base pointer off the 16-byte alignment cuDNN's descriptors need (an odd storage offset) and a
    strided innermost dim are copied before the graph runs: same results as the aligned inputs."""
    _needs_cuda_and_frontend()
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    want = attention(q, k, v, kernel="cudnn_band", pattern=("band", 0, 31))
    shifted = torch.empty(q.numel() + 1, device="cuda", dtype=torch.bfloat16)[1:].view(q.shape).copy_(q)
    assert shifted.data_ptr() % 16
    wide = torch.zeros(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
    wide[..., ::2] = k
    got = attention(shifted, wide[..., ::2], v, kernel="cudnn_band", pattern=("band", 0, 31))
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_forward_captures_into_a_cuda_graph():
    """Inference under ``compile="reduce-overhead"`` replays CUDA graphs: the band's forward captures (no
    host sync, the workspace from the graph's pool) and a replay gives the eager output. (Training through
    CUDA graphs is not offered: the dispatcher refuses it, see test_rejections_name_the_limit.)"""
    _needs_cuda_and_frontend()
    torch.manual_seed(4)
    q, k, v = (t.detach() for t in _gqa_inputs())

    def step():
        return attention(q, k, v, enable_gqa=True, kernel="cudnn_band", pattern=("band", 0, 127))

    eager = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as capture requires
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    captured.zero_()
    graph.replay()
    assert torch.equal(captured, eager)
