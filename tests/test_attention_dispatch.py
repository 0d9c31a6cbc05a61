"""Kernel eligibility and choice per backend (no GPU here: the unmeasured path)."""

from __future__ import annotations

import pytest
import torch

from kernel_pytorch.attention import AttentionProblem, choose_kernel, eligible_kernels
from kernel_pytorch.hardware import HardwareInfo

H100 = HardwareInfo(vendor="nvidia", device_name="sim H100", compute_capability=(9, 0), cudnn_attention=True,
                    bf16=True, fp8=True, fp8_formats=("float8_e4m3fn", "float8_e5m2"), triton_usable=True)
MI300 = HardwareInfo(vendor="amd", device_name="sim MI300X", gfx_arch="gfx942", bf16=True)
CPU = HardwareInfo(vendor="cpu", device_name="sim CPU")


def _problem(dtype=torch.bfloat16, head_dim=128, mask=None, mask_grad=False, kv_heads=16, v_dim=None):
    q = torch.empty(2, 16, 256, head_dim, dtype=dtype, device="meta")
    k = torch.empty(2, kv_heads, 256, head_dim, dtype=dtype, device="meta")
    v = torch.empty(2, kv_heads, 256, v_dim or head_dim, dtype=dtype, device="meta")
    m = None
    if mask is not None:
        m = torch.empty(2, 1, 256, 256, dtype=torch.bool if mask == "bool" else dtype, device="meta")
        m.requires_grad_(mask_grad)
    return q, k, v, m


def _choose(hardware, *tensors, training=False, causal=False):
    return choose_kernel(*tensors, is_causal=causal, dropout_p=0.0, enable_gqa=tensors[1].shape[1] != 16,
                         hardware=hardware, training=training)


@pytest.mark.parametrize("case, expected", [
    (dict(), "cudnn"),
    (dict(dtype=torch.float32), "efficient"),
    (dict(head_dim=256), "flash"),
    (dict(head_dim=100), "sdpa"),
    (dict(mask="additive"), "cudnn"),
    (dict(head_dim=256, mask="bool"), "efficient"),
    (dict(mask="additive", mask_grad=True), "efficient"),
    (dict(dtype=torch.float64), "sdpa"),
    (dict(v_dim=64, head_dim=128), "cudnn"),
])
def test_h100_first_eligible_kernel(case, expected):
    tensors = _problem(**case)
    kernel, reason = _choose(H100, *tensors, training=case.get("mask_grad", False))
    assert kernel == expected, reason
    if expected != "cudnn":
        assert "cudnn" in reason  # says why the preferred kernel was passed over


def test_unmeasured_choice_says_so():
    kernel, reason = _choose(H100, *_problem())
    assert "not measured" in reason


def test_amd_never_picks_cudnn_and_cpu_uses_pytorch_dispatch():
    assert _choose(MI300, *_problem())[0] == "flash"
    assert _choose(MI300, *_problem(mask="additive"))[0] == "efficient"
    assert _choose(CPU, *_problem())[0] == "sdpa"


def test_eligibility_reasons_name_the_limit():
    problem = AttentionProblem.from_tensors(*_problem(head_dim=100), is_causal=False, dropout_p=0.0,
                                            enable_gqa=False, training=False)
    eligible, rejected = eligible_kernels(problem, H100)
    # FlexAttention's template takes any head dim in [16, 256] (padded to a power of two, masked loads);
    # it is measured on a GPU, never the unmeasured pick (test_flex_is_never_the_unmeasured_pick).
    assert eligible == ["flex", "sdpa"]
    assert all("multiple of 8" in reason for kernel, reason in rejected.items() if kernel != "flash_attn")
    assert "not installed" in rejected["flash_attn"]


def test_an_old_gpu_gets_neither_cudnn_nor_flash():
    t4 = HardwareInfo(vendor="nvidia", device_name="sim T4", compute_capability=(7, 5))
    kernel, reason = _choose(t4, *_problem(dtype=torch.float16))
    assert kernel == "efficient" and "compute capability" in reason
