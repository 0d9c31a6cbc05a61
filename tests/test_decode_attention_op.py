"""The decode attention op (kernel_pytorch/ops/decode_attention.py): the split-KV Triton kernels under Triton's
interpreter and on the GPU against a float64 reference, masks of every kind, GQA, mask-hidden blocks, the
native path, bad input, and torch.compile.

As in tests/test_norm_ops.py, the ``test_interp_*`` tests run in a child pytest started with
``TRITON_INTERPRET=1`` (``test_triton_kernels_in_a_subprocess``); run them directly with
``TRITON_INTERPRET=1 pytest tests/test_decode_attention_op.py -k interp``.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch._dynamo.testing

from .triton_interpreter import INTERPRETED, cuda_device, interp, route_to_triton, run_interpreted_tests

DA = importlib.import_module("kernel_pytorch.ops.decode_attention")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Relative-norm error against float64 per dtype: one rounding of the output plus the probabilities rounded to
# V's dtype (bf16 under the interpreter truncates: ~2x).
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# name: (B, Hq, Hkv, L, D, mask kind). Lengths not a multiple of the 64-position block, head dims not a power
# of two, groups of 1 (MHA) to 8.
CASES = {
    "mha-nomask": (2, 4, 4, 37, 16, None),
    "gqa4-bool-B111L": (1, 8, 2, 200, 64, "bool"),
    "gqa8-bool-BH1L": (2, 8, 1, 130, 32, "bool-per-head"),
    "gqa2-additive-min": (2, 4, 2, 150, 24, "additive"),
    "gqa2-additive-inf-2d": (1, 4, 2, 70, 16, "additive-inf-2d"),
    "gqa2-bool-hd80": (1, 4, 2, 90, 80, "bool"),  # the combine's feature blocks: 3 of 32, the last partly masked
}


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / max(float(expected.norm()), 1e-12))


def make_case(name: str, dtype: torch.dtype, device="cpu"):
    batch, q_heads, kv_heads, length, head_dim, kind = CASES[name]
    q = torch.randn(batch, q_heads, 1, head_dim, device=device, dtype=dtype)
    # The cache as a StaticCache holds it: (B, Hkv, L, D), read through strides of a wider buffer here.
    k = torch.randn(batch, kv_heads, length + 3, head_dim, device=device, dtype=dtype)[:, :, 3:]
    v = torch.randn(batch, kv_heads, length, head_dim, device=device, dtype=dtype)
    filled = torch.randint(1, length + 1, (batch,), device=device)  # tokens cached per sequence
    allowed = torch.arange(length, device=device)[None, :] < filled[:, None]  # (B, L)
    if kind is None:
        mask = None
    elif kind == "bool":
        mask = allowed[:, None, None, :]
    elif kind == "bool-per-head":
        mask = allowed[:, None, None, :] & (torch.rand(batch, q_heads, 1, length, device=device) < 0.7)
        mask[..., 0] = True  # each row sees a token
    elif kind == "additive":
        mask = torch.where(allowed, 0.0, torch.finfo(dtype).min)[:, None, None, :].to(dtype)
        mask = mask + torch.randn_like(mask) * allowed[:, None, None, :]  # a bias on the live positions too
    else:  # "additive-inf-2d": one row for the whole batch
        mask = torch.where(allowed[:1], 0.0, float("-inf")).to(dtype)
    return q, k, v, mask


def reference(q, k, v, mask, scale):
    """Attention in float64, the cache expanded to every query head."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return torch.softmax(scores, -1) @ v


def check(name: str, dtype: torch.dtype, device="cpu") -> None:
    torch.manual_seed(len(name))
    q, k, v, mask = make_case(name, dtype, device)
    scale = 0.3
    out = DA.decode_attention(q, k, v, mask, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel(out, reference(q, k, v, mask, scale)) < TOL[dtype]


@pytest.fixture
def triton_on_cpu(monkeypatch):
    return route_to_triton(monkeypatch, DA, ("decode_fwd",), ())


# ---------------------------------------------------------------------- Triton kernel, interpreter

@interp
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_kernel_matches_float64(triton_on_cpu, dtype, case):
    check(case, dtype)
    assert triton_on_cpu == {"decode_fwd": 1}


@interp
def test_interp_blocks_hidden_by_the_mask_are_not_read(triton_on_cpu):
    # NaN in the hidden part of the cache: read, it would poison the row (0 * NaN); skipped, it cannot.
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)
    k[:, :, 128:], v[:, :, 128:] = float("nan"), float("nan")
    mask = (torch.arange(256) < 100)[None, None, None, :]
    out = DA.decode_attention(q, k, v, mask, 0.25)
    assert rel(out, reference(q, k[:, :, :128], v[:, :, :128], mask[..., :128], 0.25)) < 1e-5


@interp
def test_interp_a_fully_masked_row_gives_zeros(triton_on_cpu):
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 80, 16), torch.randn(1, 1, 80, 16)
    mask = torch.zeros(1, 2, 1, 80, dtype=torch.bool)
    mask[:, 0, :, :5] = True
    out = DA.decode_attention(q, k, v, mask, 0.25)
    assert torch.equal(out[:, 1], torch.zeros_like(out[:, 1]))
    assert rel(out[:, 0], reference(q[:, :1], k, v, mask[:, :1], 0.25)[:, 0]) < 1e-5


@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_* tests itself")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to interpret")
def test_triton_kernels_in_a_subprocess(interpreted_tests):
    run_interpreted_tests(__file__, interpreted_tests)


# ------------------------------------------------------------------------------ native path, errors

@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_matches_float64(dtype, case):
    check(case, dtype)


def test_default_scale_is_one_over_root_head_dim():
    q, k, v = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 9, 16), torch.randn(1, 1, 9, 16)
    assert rel(DA.decode_attention(q, k, v), reference(q, k, v, None, 1 / math.sqrt(16))) < 1e-6


@pytest.mark.parametrize("shapes, message", [
    (((1, 4, 2, 16), (1, 2, 9, 16)), "one query token"),
    (((1, 4, 1, 16), (1, 3, 9, 16)), "not a multiple"),
    (((1, 4, 1, 16), (1, 2, 9, 8)), "must be (B, Hkv, L, D)"),
])
def test_bad_shapes_get_a_clear_error(shapes, message):
    q_shape, kv_shape = shapes
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DA.decode_attention(torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape))


def test_compiles_without_a_graph_break_and_matches():
    torch.manual_seed(0)
    q, k, v, mask = make_case("gqa4-bool-B111L", torch.float32)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    out = torch.compile(DA.decode_attention, backend=counter, fullgraph=True)(q, k, v, mask, 0.3)
    assert counter.frame_count == 1
    assert rel(out, reference(q, k, v, mask, 0.3)) < 1e-5


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_kernel_matches_float64(dtype, case):
    check(case, dtype, cuda_device())


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 1000, 4097])
def test_gpu_long_caches_and_compiled_dynamic_lengths(length):
    device = cuda_device()
    torch.manual_seed(length)
    q = torch.randn(1, 32, 1, 128, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, length, 128, device=device, dtype=torch.bfloat16) for _ in range(2))
    mask = (torch.arange(length, device=device) < max(1, length - 7))[None, None, None, :]
    compiled = torch.compile(DA.decode_attention, dynamic=True, fullgraph=True)
    assert rel(compiled(q, k, v, mask, 0.088), reference(q, k, v, mask, 0.088)) < TOL[torch.bfloat16]
