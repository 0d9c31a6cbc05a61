"""The fused RoPE op (kernel_pytorch/ops/rope.py): the Triton kernel under Triton's interpreter, the native
path, autograd (q, k, and cos/sin when they need it), Hugging Face's Llama and GPT-J formulas, custom-op
registration and torch.compile; GPU numerics with -m gpu.

As in tests/test_norm_ops.py (whose module docstring says why), the ``test_interp_*`` tests run in a
child pytest started with ``TRITON_INTERPRET=1`` (``test_triton_kernels_in_a_subprocess``) and are
deselected in a process without it; run them directly with
``TRITON_INTERPRET=1 pytest tests/test_rope_op.py -k interp``. Under the interpreter fp32 -> bf16 casts
truncate, so bf16 results there are within the tolerances below but not PyTorch's rounding.

cos and sin are random in most tests, not real tables: a kernel that assumed their two halves repeat (as
Llama's do) or that read only half of them would fail.
"""

from __future__ import annotations

import functools
import importlib
import math

import pytest
import torch
import torch._dynamo.testing
from transformers import LlamaConfig
from transformers.models.gptj import modeling_gptj as gptj
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from .triton_interpreter import EAGER_OPCHECKS, INTERPRETED, cuda_device, interp, route_to_triton, run_interpreted_tests

RP = importlib.import_module("kernel_pytorch.ops.rope")
tu = importlib.import_module("kernel_pytorch.ops.triton_utils")


DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Relative-norm error allowed against a float64 reference, per input dtype (one rounding of the output;
# bf16 under the interpreter truncates: ~2x).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / max(float(expected.norm()), 1e-12))


# ------------------------------------------------------------------------------------- the reference

def rot_reference(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """rot(x), written out: rotate-half cat(-x2, x1), or interleaved rot[2i] = -x[2i+1], rot[2i+1] = x[2i]."""
    if interleaved:
        out = torch.empty_like(x)
        out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
        return out
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(x, cos, sin, interleaved):
    """The model's formula (in whatever dtype it is given: the tests give float64), features past the
    rotary dim passed through."""
    r = cos.shape[-1]
    rotated = x[..., :r] * cos + rot_reference(x[..., :r], interleaved) * sin
    return torch.cat((rotated, x[..., r:]), dim=-1)


# ------------------------------------------------------------------------------------------- inputs

# name: (layout, B, Hq, Hkv, L, D, R, cos/sin shape). Odd sequence lengths, GQA head counts; layouts:
#   bhld      q (B, Hq, L, D) contiguous
#   blhd-t    (B, L, H, D) projections viewed as (B, H, L, D): transpose(1, 2), non-contiguous
#   qkv-t     q and k sliced out of one fused qkv projection, then transposed (row gaps, non-contiguous)
#   blhd      q (B, L, Hq, D) itself, cos (B, L, 1, R)
#   strided   feature stride 2 (the launcher copies), sin with other strides than cos
#   lhd       3-D q (L, H, D), cos (L, 1, R)
#   5d        q (2, B, H, L, D), cos (1, B, 1, L, R)
CASES = {
    "d8-bhld-B1LR": ("bhld", 2, 4, 2, 5, 8, 8, "B1LR"),
    "d64-blhd-t-11LR": ("blhd-t", 2, 4, 1, 7, 64, 64, "11LR"),
    "d80-partial32-qkv-t-LR": ("qkv-t", 2, 3, 1, 9, 80, 32, "LR"),
    "d128-blhd-BL1R": ("blhd", 2, 4, 2, 3, 128, 128, "BL1R"),
    "d64-partial16-strided-B1LR": ("strided", 1, 2, 2, 5, 64, 16, "B1LR"),
    "d128-lhd-L1R": ("lhd", 1, 4, 2, 7, 128, 128, "L1R"),
    "d8-5d": ("5d", 2, 4, 2, 3, 8, 8, "5d"),
}


def make_case(name, dtype, device="cpu"):
    """(q, k, cos, sin) for CASES[name]; q and k are leaves (views are detached), so they can require grad."""
    layout, b, hq, hkv, seq, d, r, table = CASES[name]
    def make(*shape):
        return torch.randn(*shape, dtype=dtype, device=device)

    if layout == "bhld":
        q, k = make(b, hq, seq, d), make(b, hkv, seq, d)
    elif layout == "blhd-t":
        q, k = make(b, seq, hq, d).transpose(1, 2), make(b, seq, hkv, d).transpose(1, 2)
    elif layout == "qkv-t":
        qkv = make(b, seq, (hq + 2 * hkv) * d)
        q = qkv[..., :hq * d].view(b, seq, hq, d).transpose(1, 2)
        k = qkv[..., hq * d:(hq + hkv) * d].view(b, seq, hkv, d).transpose(1, 2)
    elif layout == "blhd":
        q, k = make(b, seq, hq, d), make(b, seq, hkv, d)
    elif layout == "strided":
        q, k = make(b, hq, seq, d, 2)[..., 0], make(b, hkv, seq, d, 2)[..., 0]
    elif layout == "lhd":
        q, k = make(seq, hq, d), make(seq, hkv, d)
    else:
        q, k = make(2, b, hq, seq, d), make(2, b, hkv, seq, d)
    shape = {"B1LR": (b, 1, seq, r), "11LR": (1, 1, seq, r), "LR": (seq, r), "BL1R": (b, seq, 1, r),
             "L1R": (seq, 1, r), "5d": (1, b, 1, seq, r)}[table]
    cos, sin = make(*shape), make(*shape)
    if layout == "strided":
        sin = make(*reversed(shape)).permute(*reversed(range(len(shape))))  # other strides than cos
    return q.detach(), k.detach(), cos, sin


def check_kernels(q, k, cos, sin, interleaved):
    """The launchers against the float64 reference, forward and backward (arbitrary-strided cotangents)."""
    tol, r = TOL[q.dtype], cos.shape[-1]
    q_out, k_out = RP.rope_fwd(q, k, cos, sin, interleaved)
    leaves = [t.detach().double().requires_grad_() for t in (q, k)]
    c64, s64 = cos.double(), sin.double()
    refs = [rope_reference(x, c64, s64, interleaved) for x in leaves]
    for x, out, ref in zip((q, k), (q_out, k_out), refs):
        assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
        assert rel(out, ref) < tol
        assert torch.equal(out[..., r:], x[..., r:])  # pass-through features: copied exactly
    # Cotangents in another layout than the outputs (the kernel reads them through their strides).
    dq, dk = (torch.randn(*reversed(t.shape), dtype=t.dtype, device=t.device).permute(
        *reversed(range(t.dim()))) for t in (q, k))
    dq_in, dk_in = RP.rope_bwd(dq, dk, cos, sin, interleaved)
    want = torch.autograd.grad(refs, leaves, (dq.double(), dk.double()))
    for x, got, ref in zip((q, k), (dq_in, dk_in), want):
        assert got.dtype == x.dtype and got.shape == x.shape and got.is_contiguous()
        assert rel(got, ref) < tol
        assert torch.equal(got[..., r:], (dq if x is q else dk)[..., r:])


def check_op(q, k, cos, sin, interleaved, table_grads=True):
    """apply_rope, forward and backward (cos and sin too when ``table_grads``), against float64 autograd."""
    tol = TOL[q.dtype]
    ours = [q.detach().requires_grad_(), k.detach().requires_grad_(), cos.detach().requires_grad_(table_grads),
            sin.detach().requires_grad_(table_grads)]
    ref = [t.detach().double().requires_grad_(t.requires_grad) for t in ours]
    outs = RP.apply_rope(*ours, interleaved=interleaved)
    ref_outs = [rope_reference(x, ref[2], ref[3], interleaved) for x in ref[:2]]
    for out, ref_out, x in zip(outs, ref_outs, ours):
        assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
        assert rel(out, ref_out) < tol
    cot = [torch.randn_like(o) for o in outs]
    wanted = [t for t in ours if t.requires_grad]
    got = torch.autograd.grad(outs, wanted, cot)
    want = torch.autograd.grad(ref_outs, [t for t in ref if t.requires_grad], [c.double() for c in cot])
    assert len(got) == (4 if table_grads else 2)
    for g, w, leaf in zip(got, want, wanted):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
        assert rel(g, w) < tol


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Route the op's CPU tensors to the Triton kernel (interpreted); counts launcher calls."""
    return route_to_triton(monkeypatch, RP, ("rope_fwd", "rope_bwd"), ("TRITON_MIN_ELEMENTS",))


@pytest.fixture
def launches(monkeypatch):
    """The grids of the kernel launches the op makes (tu.launch, wrapped)."""
    grids = []
    real = tu.launch

    class Recorded:
        def __init__(self, kernel):
            self.launcher = real(kernel)

        def __getitem__(self, grid):
            grids.append(grid)
            return self.launcher[grid]

    monkeypatch.setattr(tu, "launch", Recorded)
    return grids


# ---------------------------------------------------------------------- Triton kernel, interpreter

@interp
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_kernels_match_float64(dtype, case, interleaved, launches):
    torch.manual_seed(len(case))
    q, k, cos, sin = make_case(case, dtype)
    check_kernels(q, k, cos, sin, interleaved)
    # One launch each for the forward and the backward, q's and k's row tiles in one grid.
    tile = RP._rope_tile(q.shape[-1], cos.shape[-1], max(q.numel(), k.numel()) // q.shape[-1])
    programs = sum(math.ceil(t.numel() // t.shape[-1] / tile.rows) for t in (q, k))
    assert launches == [(programs,), (programs,)]


@interp
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", ["d80-partial32-qkv-t-LR", "d128-blhd-BL1R", "d8-5d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_op_matches_float64_with_table_grads(triton_on_cpu, dtype, case, interleaved):
    torch.manual_seed(1)
    check_op(*make_case(case, dtype), interleaved)
    assert triton_on_cpu == {"rope_fwd": 1, "rope_bwd": 1}


@interp
def test_interp_row_tiles_straddle_q_and_k():
    # Programs with partial last tiles: 3 * 11 = 33 rows of q in tiles of 32 rows (at D = 64) and 7 rows
    # of k; and 1-row tiles at a wide head (3 programs for q, 5 for k).
    torch.manual_seed(0)
    for shape_q, shape_k in [((3, 11, 64), (7, 64)), ((3, 2048), (5, 2048))]:
        q, k = torch.randn(*shape_q), torch.randn(*shape_k)
        cos, sin = torch.randn(shape_q[-1]), torch.randn(shape_q[-1])
        check_kernels(q, k, cos, sin, False)
        check_kernels(q, k, cos, sin, True)
    assert RP._rope_tile(2048, 2048, 5).rows == 1


@interp
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_interp_gradcheck_float64_triton_path(triton_on_cpu, interleaved):
    # The kernel's ACC follows the input (fp64 here), so gradcheck checks the Triton forward and backward.
    torch.manual_seed(0)
    q = torch.randn(1, 3, 2, 6, dtype=torch.float64).transpose(1, 2).requires_grad_()  # non-contiguous
    k = torch.randn(1, 1, 3, 6, dtype=torch.float64, requires_grad=True)
    cos, sin = (torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))  # partial: 4 of 6
    fn = functools.partial(RP.apply_rope, interleaved=interleaved)
    assert torch.autograd.gradcheck(fn, (q, k, cos, sin), eps=1e-6, atol=1e-8)
    assert set(triton_on_cpu) == {"rope_fwd", "rope_bwd"}


@interp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_triton_path_matches_native_path(triton_on_cpu, dtype, monkeypatch):
    torch.manual_seed(0)
    base = make_case("d80-partial32-qkv-t-LR", dtype)

    def run(interleaved):
        leaves = [t.detach().clone().requires_grad_() for t in base]
        q_out, k_out = RP.apply_rope(*leaves, interleaved=interleaved)
        (q_out.float().square().sum() + (k_out.float() * 3).sum()).backward()
        return [q_out, k_out] + [t.grad for t in leaves]

    triton_results = [run(False), run(True)]
    assert triton_on_cpu == {"rope_fwd": 2, "rope_bwd": 2}
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset({"cuda"}))
    native_results = [run(False), run(True)]
    assert triton_on_cpu == {"rope_fwd": 2, "rope_bwd": 2}  # the second run took the native path
    for got_all, want_all in zip(triton_results, native_results):
        for got, want in zip(got_all, want_all):
            assert rel(got, want) < TOL[dtype]


@interp
@pytest.mark.parametrize("case", ["llama-bhld", "llama-blhd", "phi-partial"])
def test_interp_matches_hf_llama_triton_path(triton_on_cpu, case):
    check_against_hf_llama(case)
    assert triton_on_cpu == {"rope_fwd": 1, "rope_bwd": 1}


@interp
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_interp_matches_gptj_triton_path(triton_on_cpu, rotary_dim):
    check_against_gptj(rotary_dim)
    assert triton_on_cpu == {"rope_fwd": 1, "rope_bwd": 1}


@interp
def test_interp_rounds_once_triton_path(triton_on_cpu):
    # fp16: the interpreter rounds fp32 -> fp16 to nearest even, as the GPU does.
    check_rounds_once(torch.float16)
    assert triton_on_cpu.get("rope_fwd")


@interp
def test_interp_zero_rows(triton_on_cpu, launches):
    q, k, cos, sin = torch.randn(0, 4, 8), torch.randn(0, 2, 8), torch.randn(4, 8), torch.randn(4, 8)
    q_out, k_out = RP.rope_fwd(q, k, cos[:1], sin[:1], False)
    assert q_out.shape == (0, 4, 8) and k_out.shape == (0, 2, 8)
    q = q.requires_grad_()
    q_out, k_out = RP.apply_rope(q, k, cos[:1], sin[:1])
    q_out.sum().backward()
    assert q.grad.shape == (0, 4, 8) and launches == []  # nothing to launch


@interp
def test_interp_wider_table_dtype(triton_on_cpu):
    check_wider_table_dtype()
    assert triton_on_cpu.get("rope_fwd")




@interp
def test_interp_opcheck_triton_path(triton_on_cpu):
    torch.manual_seed(0)
    q, k, cos, sin = make_case("d80-partial32-qkv-t-LR", torch.float32)
    q.requires_grad_(), cos.requires_grad_()
    for interleaved in (False, True):
        torch.library.opcheck(torch.ops.kernel_pytorch.rope.default, (q, k, cos, sin, interleaved),
                              test_utils=EAGER_OPCHECKS)
        torch.library.opcheck(torch.ops.kernel_pytorch.rope_backward.default,
                              (q.detach(), k, cos.detach(), sin, interleaved), test_utils=EAGER_OPCHECKS)
    assert triton_on_cpu.get("rope_fwd") and triton_on_cpu.get("rope_bwd")


# ----------------------------------------------------------------------------- run the above, on CPU

@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_* tests itself")
@pytest.mark.skipif(not tu.HAS_TRITON, reason="Triton is not installed: no kernels to interpret")
def test_triton_kernels_in_a_subprocess(interpreted_tests):
    run_interpreted_tests(__file__, interpreted_tests)


# --------------------------------------------------------------- shared by both paths (native, Triton)

def _llama_tables(head_dim, batch, seq, device="cpu"):
    """HF LlamaRotaryEmbedding's cos and sin, (batch, seq, head_dim) fp32, for random positions."""
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=256)
    positions = torch.randint(0, 256, (batch, seq), device=device)
    x = torch.empty(1, device=device)
    return LlamaRotaryEmbedding(config=config).to(device)(x, positions)


def check_against_hf_llama(case, device="cpu"):
    """HF's apply_rotary_pos_emb (fp32): outputs to 1e-5, gradients of q, k, cos and sin to 1e-4."""
    torch.manual_seed(0)
    b, hq, hkv, seq = 2, 4, 2, 9
    d, r = (80, 32) if case == "phi-partial" else (64, 64)
    cos, sin = _llama_tables(r, b, seq, device)
    dim = 2 if case == "llama-blhd" else 1  # HF's unsqueeze_dim: the heads axis
    shape = (lambda h: (b, seq, h, d)) if case == "llama-blhd" else (lambda h: (b, h, seq, d))
    base = [torch.randn(*shape(hq), device=device), torch.randn(*shape(hkv), device=device), cos, sin]

    def hf(q, k, cos, sin):
        if r == d:
            return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=dim)
        # Phi / GPT-NeoX partial rotary: rotate the first r features, pass the rest.
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=dim)
        return torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)

    def ours(q, k, cos, sin):
        return RP.apply_rope(q, k, cos.unsqueeze(dim), sin.unsqueeze(dim))

    results = []
    for fn in (hf, ours):
        leaves = [t.detach().clone().requires_grad_() for t in base]
        outs = fn(*leaves)
        loss = outs[0].square().sum() + (outs[1] * torch.linspace(-1, 1, d, device=device)).sum()
        results.append((outs, torch.autograd.grad(loss, leaves)))
    (hf_outs, hf_grads), (our_outs, our_grads) = results
    for got, want in zip(our_outs, hf_outs):
        assert rel(got, want) < 1e-5
    for got, want in zip(our_grads, hf_grads):
        assert rel(got, want) < 1e-4


def check_against_gptj(rotary_dim, device="cpu"):
    """GPT-J's interleaved formula (its own apply_rotary_pos_emb and rotary_dim split, fp32), with the
    gradient of its half-width sin/cos tables through the repeat_interleave that feeds ours."""
    torch.manual_seed(0)
    b, seq, hq, hkv, d = 2, 7, 4, 2, 64
    table = gptj.create_sinusoidal_positions(128, rotary_dim).to(device)
    positions = torch.randint(0, 128, (b, seq), device=device)
    sin_half, cos_half = torch.split(table[positions], rotary_dim // 2, dim=-1)  # (B, L, R / 2), as GPT-J
    base = [torch.randn(b, seq, hq, d, device=device), torch.randn(b, seq, hkv, d, device=device),
            cos_half, sin_half]

    def reference(q, k, cos, sin):
        def one(x):
            x_rot = gptj.apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos)
            return torch.cat((x_rot, x[..., rotary_dim:]), -1)
        return one(q), one(k)

    def ours(q, k, cos, sin):
        full = [torch.repeat_interleave(t[:, :, None, :], 2, 3) for t in (cos, sin)]  # (B, L, 1, R)
        return RP.apply_rope(q, k, *full, interleaved=True)

    results = []
    for fn in (reference, ours):
        leaves = [t.detach().clone().requires_grad_() for t in base]
        outs = fn(*leaves)
        loss = outs[0].square().sum() + (outs[1] * torch.linspace(-1, 1, d, device=device)).sum()
        results.append((outs, torch.autograd.grad(loss, leaves)))
    (ref_outs, ref_grads), (our_outs, our_grads) = results
    for got, want in zip(our_outs, ref_outs):
        assert rel(got, want) < 1e-5
    for got, want in zip(our_grads, ref_grads):
        assert rel(got, want) < 1e-4


def check_rounds_once(dtype, device="cpu"):
    """In half precision the op (one rounding) is closer to the exact result than the model's eager
    formula (three roundings), and differs from it by at most about one ulp."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 33, 128, dtype=dtype, device=device)
    k = torch.randn(2, 2, 33, 128, dtype=dtype, device=device)
    cos, sin = (t.to(dtype) for t in _llama_tables(128, 2, 33, device))  # (B, L, D), as HF's model has them
    ours = RP.apply_rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
    eager = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
    c64, s64 = cos.unsqueeze(1).double(), sin.unsqueeze(1).double()
    for x, got, model in zip((q, k), ours, eager):
        assert got.shape == model.shape == x.shape
        exact = rope_reference(x.double(), c64, s64, False)
        assert rel(got, exact) < rel(model, exact)
        # Each rounding errs by at most half an ulp of what it rounds: of the products for the model.
        x64 = x.double()
        scale = (x64 * c64).abs() + (rot_reference(x64, False) * s64).abs()
        bound = 2 * torch.finfo(dtype).eps * scale + torch.finfo(dtype).smallest_normal
        assert ((got.double() - model.double()).abs() <= bound).all()


def check_wider_table_dtype(device="cpu"):
    # fp32 tables with bf16 q/k: math in fp32 from the fp32 values, outputs in q's dtype; cos/sin grads
    # in theirs.
    torch.manual_seed(0)
    q, k = (torch.randn(2, h, 5, 16, dtype=torch.bfloat16, device=device, requires_grad=True) for h in (4, 2))
    cos, sin = (torch.randn(5, 16, device=device, requires_grad=True) for _ in range(2))
    q_out, k_out = RP.apply_rope(q, k, cos, sin)
    assert q_out.dtype == k_out.dtype == torch.bfloat16
    assert rel(q_out, rope_reference(q.double(), cos.double(), sin.double(), False)) < TOL[torch.bfloat16]
    (q_out.float().sum() + k_out.float().square().sum()).backward()
    assert cos.grad.dtype == sin.grad.dtype == torch.float32 and q.grad.dtype == torch.bfloat16


def check_compile_aot_eager():
    torch.manual_seed(0)
    b, seq, hq, hkv, d = 2, 5, 4, 2, 16
    proj = torch.nn.Linear(32, (hq + 2 * hkv) * d)

    def block(x, cos, sin):
        qkv = proj(x)
        q = qkv[..., :hq * d].view(b, seq, hq, d).transpose(1, 2)
        k = qkv[..., hq * d:(hq + hkv) * d].view(b, seq, hkv, d).transpose(1, 2)
        q, k = RP.apply_rope(q, k, cos, sin)
        q2, k2 = RP.apply_rope(q, k, cos, sin, interleaved=True)
        return q2.square().sum() + (k2 * k).sum()

    args = [torch.randn(b, seq, 32, requires_grad=True), torch.randn(1, 1, seq, d, requires_grad=True),
            torch.randn(1, 1, seq, d)]
    clones = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, backend=counter)
    out = compiled(*args)
    out.backward()
    ref = block(*clones)
    ref.backward()
    assert counter.frame_count == 1  # one graph: no break
    assert rel(out, ref) < 1e-6
    for got, want in zip(args[:2], clones[:2]):
        assert rel(got.grad, want.grad) < 1e-5
    graph_ops = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("kernel_pytorch.rope" in op for op in graph_ops), graph_ops


# --------------------------------------------------------------------------------- the native path

@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_matches_float64_with_table_grads(dtype, case, interleaved):
    torch.manual_seed(len(case))
    check_op(*make_case(case, dtype), interleaved)


@pytest.mark.parametrize("case", ["llama-bhld", "llama-blhd", "phi-partial"])
def test_native_matches_hf_llama(case):
    check_against_hf_llama(case)


def test_native_fp32_is_hf_llama_bitwise():
    # In fp32 the native path is HF's formula itself (same ops, same order): bit for bit, gradients too.
    torch.manual_seed(0)
    cos, sin = _llama_tables(64, 2, 9)
    q, k = torch.randn(2, 4, 9, 64, requires_grad=True), torch.randn(2, 2, 9, 64, requires_grad=True)
    ours = RP.apply_rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))
    hf = apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(ours, hf))
    grads = [torch.autograd.grad(out[0].square().sum() + out[1].sum(), (q, k)) for out in (ours, hf)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_native_matches_gptj(rotary_dim):
    check_against_gptj(rotary_dim)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_native_rounds_once(dtype):
    check_rounds_once(dtype)


def test_native_wider_table_dtype():
    check_wider_table_dtype()


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_native_gradcheck_float64(interleaved):
    torch.manual_seed(0)
    q = torch.randn(2, 3, 2, 10, dtype=torch.float64).transpose(1, 2).requires_grad_()  # non-contiguous
    k = torch.randn(2, 1, 3, 10, dtype=torch.float64, requires_grad=True)
    fn = functools.partial(RP.apply_rope, interleaved=interleaved)
    for shape in [(2, 1, 3, 6), (3, 10)]:  # partial rotary with per-batch tables; full with a shared one
        cos, sin = (torch.randn(*shape, dtype=torch.float64, requires_grad=True) for _ in range(2))
        assert torch.autograd.gradcheck(fn, (q, k, cos, sin))
        assert torch.autograd.gradcheck(fn, (q, k.detach(), cos.detach(), sin))


def test_opcheck_native_path():
    torch.manual_seed(0)
    q, k, cos, sin = make_case("d80-partial32-qkv-t-LR", torch.float32)
    q.requires_grad_(), cos.requires_grad_()
    ops = torch.ops.kernel_pytorch
    torch.library.opcheck(ops.rope.default, (q, k, cos, sin, False))
    torch.library.opcheck(ops.rope_backward.default, (q.detach(), k, cos.detach(), sin, True))


def test_compile_fullgraph_aot_eager_with_backward_has_no_graph_break():
    check_compile_aot_eager()


def test_q_and_k_are_saved_only_for_table_gradients():
    # The backward needs only cos and sin: a model's q and k (large) are not kept alive for it.
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, requires_grad=True), torch.randn(2, 2, 5, 8, requires_grad=True)
    for table_grad, expected in [(False, [(5, 8), (5, 8)]), (True, [(5, 8), (5, 8), q.shape, k.shape])]:
        cos, sin = (torch.randn(5, 8, requires_grad=table_grad) for _ in range(2))
        saved = []

        def pack(t, saved=saved):
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            q_out, k_out = RP.apply_rope(q, k, cos, sin)
        assert sorted(saved) == sorted(tuple(s) for s in expected)
        (q_out.sum() + k_out.sum()).backward()
        assert (cos.grad is not None) == table_grad


def test_unused_output_and_partial_requires_grad():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 8, requires_grad=True), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    q64 = q.detach().double().requires_grad_()
    rope_reference(q64, cos.double(), sin.double(), False).sum().backward()
    q_out, _ = RP.apply_rope(q, k, cos, sin)  # only q requires grad
    q_out.sum().backward()
    assert rel(q.grad, q64.grad) < 1e-6 and k.grad is None
    q.grad, k = None, k.requires_grad_()
    q_out, _ = RP.apply_rope(q, k, cos, sin)  # k_out unused: its gradient comes in zero-filled
    q_out.sum().backward()
    assert rel(q.grad, q64.grad) < 1e-6 and torch.equal(k.grad, torch.zeros_like(k))


def test_cpu_tensors_take_the_native_path(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("Triton launcher called for a CPU tensor")

    monkeypatch.setattr(RP, "rope_fwd", no_triton)
    monkeypatch.setattr(RP, "rope_bwd", no_triton)
    q, k = torch.randn(2, 4, 5, 8, requires_grad=True), torch.randn(2, 2, 5, 8, requires_grad=True)
    q_out, k_out = RP.apply_rope(q, k, torch.randn(5, 8), torch.randn(5, 8))
    (q_out.sum() + k_out.sum()).backward()
    assert q.grad is not None and k.grad is not None
    assert not tu.use_triton(q)


def test_bad_arguments_are_named():
    q, k, t = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(5, 8)
    cases = [
        ((q, k, torch.randn(5, 7), torch.randn(5, 7)), "must be even"),
        ((q, k, torch.randn(5, 10), torch.randn(5, 10)), "exceeds the head dim 8"),
        ((q, k, torch.randn(3, 8), torch.randn(3, 8)), "do not broadcast to q"),
        ((q, k, torch.randn(2, 5, 8), torch.randn(2, 5, 8)), "do not broadcast to q"),  # B where Hq is
        ((q, torch.randn(2, 2, 4, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)), "do not broadcast to k"),
        ((q[0, 0], k[0, 0], torch.randn(1, 5, 8), torch.randn(1, 5, 8)), "do not broadcast to q"),  # rank
        ((q, k.half(), t, t), "one dtype"),
        ((q, torch.randn(2, 2, 5, 6), t, t), "one head dim"),
        ((q, k, t, torch.randn(1, 5, 8)), "one shape"),
        ((q.long(), k.long(), t, t), "floating"),
        ((q, k, t.long(), t.long()), "floating"),
        ((q, k, torch.randn(()), torch.randn(())), "floating tensors with a last"),
        ((q, k, t.to("meta"), t.to("meta")), "one device"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            RP.apply_rope(*args)


def test_rope_tile_table():
    tile = RP._rope_tile
    assert tile(128, 128, 10**6) == RP._Tile(block_h=64, block_p=1, rows=16, num_warps=4)
    assert tile(64, 64, 10**6) == RP._Tile(32, 1, 32, 4)
    assert tile(80, 32, 10**6) == RP._Tile(16, 64, 16, 4)  # 96-wide tile row -> 16 rows (a power of two)
    assert tile(96, 96, 10**6).rows == 16 and tile(256, 64, 10**6).rows == 4  # 32 + 256-wide tile rows
    assert tile(64, 64, 5).rows == 8  # no more rows per tile than the problem has
    assert tile(8192, 8192).num_warps == 16
    for d in (8, 80, 96, 160, 512):
        assert tile(d, d // 2).rows & (tile(d, d // 2).rows - 1) == 0
    with pytest.raises(ValueError, match="head dim 65538 exceeds 65536"):
        tile(tu.MAX_HIDDEN + 2, 64)


# ---------------------------------------------------------------------------------------------- GPU

@pytest.fixture
def cuda():
    return cuda_device()


# name: (layout, B, Hq, Hkv, L, D, R, table) at model sizes (layouts as CASES).
GPU_CASES = {
    "llama-d128-gqa": ("blhd-t", 2, 32, 8, 1023, 128, 128, "B1LR"),
    "d64-11LR": ("bhld", 4, 16, 16, 511, 64, 64, "11LR"),
    "phi-d80-partial32": ("qkv-t", 2, 32, 32, 257, 80, 32, "LR"),
    "blhd-d128": ("blhd", 2, 32, 8, 513, 128, 128, "BL1R"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_kernels_match_float64(cuda, dtype, case, interleaved, monkeypatch, launches):
    monkeypatch.setitem(CASES, case, GPU_CASES[case])
    torch.manual_seed(0)
    q, k, cos, sin = make_case(case, dtype, cuda)
    check_kernels(q, k, cos, sin, interleaved)
    check_op(q, k, cos, sin, interleaved)
    assert len(launches) == 4  # kernels: forward, backward; op: forward, backward (tables: native)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["llama-bhld", "llama-blhd", "phi-partial"])
def test_gpu_matches_hf_llama(cuda, case, launches):
    check_against_hf_llama(case, cuda)
    assert len(launches) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_gpu_matches_gptj(cuda, rotary_dim, launches):
    check_against_gptj(rotary_dim, cuda)
    assert len(launches) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_rounds_once(cuda, dtype):
    check_rounds_once(dtype, cuda)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_triton_path_matches_native_path(cuda, dtype, monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setitem(CASES, "llama-d128-gqa", GPU_CASES["llama-d128-gqa"])
    q, k, cos, sin = make_case("llama-d128-gqa", dtype, cuda)
    triton = RP.apply_rope(q, k, cos, sin)
    monkeypatch.setattr(tu, "TRITON_DEVICE_TYPES", frozenset())
    native = RP.apply_rope(q, k, cos, sin)
    for got, want in zip(triton, native):
        # fp32 FMA contraction may move the last fp32 bit; after rounding to half precision rarely any.
        assert rel(got, want) < (1e-6 if dtype == torch.float32 else TOL[dtype] / 10)
        if dtype != torch.float32:
            assert (got != want).float().mean() < 1e-3


@pytest.mark.gpu
def test_gpu_wider_table_dtype(cuda):
    check_wider_table_dtype(cuda)


@pytest.mark.gpu
def test_gpu_opcheck_triton_path(cuda, monkeypatch):
    torch.manual_seed(0)
    monkeypatch.setitem(CASES, "gpu-opcheck", ("qkv-t", 2, 4, 2, 33, 80, 32, "B1LR"))
    q, k, cos, sin = make_case("gpu-opcheck", torch.float32, cuda)
    q.requires_grad_(), cos.requires_grad_()
    for interleaved in (False, True):
        torch.library.opcheck(torch.ops.kernel_pytorch.rope.default, (q, k, cos, sin, interleaved))
        torch.library.opcheck(torch.ops.kernel_pytorch.rope_backward.default,
                              (q.detach(), k, cos.detach(), sin, interleaved))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_compile_fullgraph_inductor(cuda, dtype):
    # Inductor calls the Triton kernel from its generated code (triton_op); forward and backward.
    torch.manual_seed(0)
    b, seq, hq, hkv, d = 2, 257, 16, 4, 128
    proj = torch.nn.Linear(512, (hq + 2 * hkv) * d, device=cuda, dtype=dtype)
    cos, sin = (t.unsqueeze(1).to(dtype) for t in _llama_tables(d, b, seq, cuda))

    def block(x):
        qkv = proj(x)
        q = qkv[..., :hq * d].view(b, seq, hq, d).transpose(1, 2)
        k = qkv[..., hq * d:(hq + hkv) * d].view(b, seq, hkv, d).transpose(1, 2)
        v = qkv[..., (hq + hkv) * d:].view(b, seq, hkv, d).transpose(1, 2)
        q, k = RP.apply_rope(q, k, cos, sin)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    x = torch.randn(b, seq, 512, device=cuda, dtype=dtype, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out = torch.compile(block, fullgraph=True)(x)
    ref = block(x2)
    assert rel(out, ref) < 2 * TOL[dtype]
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    assert rel(x.grad, x2.grad) < 4 * TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_gpu_compile_dynamic_sequence_length(cuda, dynamic):
    torch.manual_seed(0)
    compiled = torch.compile(lambda q, k, c, s: RP.apply_rope(q, k, c, s, interleaved=True), fullgraph=True,
                             dynamic=dynamic)
    for seq in (7, 300, 1025):
        q = torch.randn(2, seq, 8, 64, device=cuda, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(2, 2, seq, 64, device=cuda, dtype=torch.bfloat16)
        cos, sin = (torch.randn(seq, 64, device=cuda, dtype=torch.bfloat16) for _ in range(2))
        for got, want in zip(compiled(q, k, cos, sin), RP.apply_rope(q, k, cos, sin, interleaved=True)):
            assert rel(got, want) < TOL[torch.bfloat16]
