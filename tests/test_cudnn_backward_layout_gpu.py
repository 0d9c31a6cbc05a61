"""On an NVIDIA GPU (``pytest -m gpu``): PyTorch's cuDNN attention caches its backward plan by q/k/v's strides
alone, the plan also fixing the output gradient's strides (torch 2.11; docs/attention.md, "cuDNN's backward
plan cache"). Attention through kernel_pytorch passes that gradient in the output's layout always, so its
calls neither read nor leave a plan for another layout. Each test uses its own sequence length: a plan
cached by one test is never looked up by another."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernel_pytorch.ops.attention import _trains_on_pytorch_cudnn, attention

from .conftest import rel_err

pytestmark = pytest.mark.gpu

_BATCH, _HEADS, _HEAD_DIM = 2, 4, 128


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("gpu tests were selected (-m gpu) but torch.cuda.is_available() is False")


def _problem(length):
    """bf16 q, k, v (B, H, L, E) requiring grad and a causal mask with the last sequence half padded."""
    q, k, v = (torch.randn(_BATCH, _HEADS, length, _HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    position = torch.arange(length, device="cuda")
    keep = torch.ones(_BATCH, length, dtype=torch.bool, device="cuda")
    keep[-1, length // 2:] = False
    mask = ((position[:, None] >= position[None, :])[None] & keep[:, None, :])[:, None]
    return q, k, v, mask


def _output_gradient(like, transposed):
    """A random output gradient, laid out as the output (contiguous here) or (B, L, H, E) viewed as
    (B, H, L, E), as a following ``transpose(1, 2)`` hands it back."""
    if not transposed:
        return torch.randn_like(like)
    return torch.randn(like.shape[0], like.shape[2], like.shape[1], like.shape[3], device="cuda",
                       dtype=like.dtype).transpose(1, 2)


def _errors(call, length, transposed):
    """Relative errors of ``call``'s output and q/k/v gradients against float32 math."""
    q, k, v, mask = _problem(length)
    seed = _output_gradient(q, transposed)
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        expected = F.scaled_dot_product_attention(*exact, attn_mask=mask)
        expected_grads = torch.autograd.grad(expected, exact, seed.float())
    out = call(q, k, v, mask)
    grads = torch.autograd.grad(out, (q, k, v), seed)
    return [rel_err(a, b) for a, b in zip((out, *grads), (expected, *expected_grads))]


def _pytorch(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _ours(q, k, v, mask):
    return attention(q, k, v, attn_mask=mask, kernel="sdpa")


def _require_pytorch_picks_cudnn(length):
    q, k, v, mask = _problem(length)
    if not _trains_on_pytorch_cudnn(q, k, v, mask, 0.0, False, None, False, None):
        pytest.fail("the premise does not hold here: PyTorch's SDPA does not train this call on cuDNN")


def test_a_transposed_gradient_through_kernel_pytorch_leaves_pytorchs_next_call_right():
    length = 384
    _require_pytorch_picks_cudnn(length)
    first = _errors(_ours, length, transposed=True)
    assert max(first) < 2e-2, first
    after = _errors(_pytorch, length, transposed=False)
    assert max(after) < 2e-2, after  # a plan built for the transposed gradient would be off by ~1.4


def test_kernel_pytorch_is_right_for_either_gradient_layout_in_turn():
    length = 512
    _require_pytorch_picks_cudnn(length)
    for transposed in (False, True, False):
        errors = _errors(_ours, length, transposed)
        assert max(errors) < 2e-2, (transposed, errors)


def test_the_sdpa_kernel_traced_by_aotautograd_also_passes_the_gradient_in_one_layout():
    """As in an optimized model's compiled graph: AOTAutograd traces ``attention(kernel="sdpa")`` on fake
    tensors, where PyTorch's choice of cuDNN must still send the call through the "cudnn" kernel."""
    from functorch.compile import aot_function, nop

    length = 768
    _require_pytorch_picks_cudnn(length)
    traced = aot_function(_ours, fw_compiler=nop, bw_compiler=nop)
    first = _errors(traced, length, transposed=True)
    assert max(first) < 2e-2, first
    after = _errors(_pytorch, length, transposed=False)
    assert max(after) < 2e-2, after
