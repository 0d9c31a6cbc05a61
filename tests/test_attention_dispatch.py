"""Kernel eligibility and choice per backend (no GPU here: the unmeasured path; the measured one is
checked by the ``gpu``-marked test at the end, and its mechanics on the CPU)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from kernel_pytorch.attention import dispatch
from kernel_pytorch.attention.dispatch import AttentionProblem, choose_kernel, eligible_kernels
from kernel_pytorch.hardware import HardwareInfo
from kernel_pytorch.timing import measurement_compiles

H100 = HardwareInfo(vendor="nvidia", device_name="sim H100", compute_capability=(9, 0), cudnn_attention=True,
                    bf16=True, fp8=True, fp8_formats=("float8_e4m3fn", "float8_e5m2"), triton_usable=True)
MI300 = HardwareInfo(vendor="amd", device_name="sim MI300X", gfx_arch="gfx942", bf16=True)
CPU = HardwareInfo(vendor="cpu", device_name="sim CPU")


def _problem(dtype=torch.bfloat16, head_dim=128, mask=None, mask_grad=False, kv_heads=16, v_dim=None, kv_len=256):
    q = torch.empty(2, 16, 256, head_dim, dtype=dtype, device="meta")
    k = torch.empty(2, kv_heads, kv_len, head_dim, dtype=dtype, device="meta")
    v = torch.empty(2, kv_heads, kv_len, v_dim or head_dim, dtype=dtype, device="meta")
    m = None
    if mask is not None:
        m = torch.empty(2, 1, 256, kv_len, dtype=torch.bool if mask == "bool" else dtype, device="meta")
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
    assert all("multiple of 8" in reason for kernel, reason in rejected.items()
               if kernel not in ("flash_attn", "cudnn_band"))
    assert "not installed" in rejected["flash_attn"]
    assert "causal sliding window" in rejected["cudnn_band"]  # no recognized window: not its problem


def test_an_old_gpu_gets_neither_cudnn_nor_flash():
    t4 = HardwareInfo(vendor="nvidia", device_name="sim T4", compute_capability=(7, 5))
    kernel, reason = _choose(t4, *_problem(dtype=torch.float16))
    assert kernel == "efficient" and "compute capability" in reason


# ---------------------------------------------------------------------------------------------------------
# FlexAttention ("flex") and the flash-attn package ("flash_attn")
# ---------------------------------------------------------------------------------------------------------

H100_FA = H100.model_copy(update={"flash_attn_version": "2.8.3", "device_name": "sim H100 + flash-attn"})
MI300_FA = MI300.model_copy(update={"flash_attn_version": "2.8.3", "triton_usable": True})


def _rejections(hardware, *tensors, causal=False, dropout_p=0.0, training=False, compiled=True):
    problem = AttentionProblem.from_tensors(*tensors, is_causal=causal, dropout_p=dropout_p,
                                            enable_gqa=tensors[1].shape[1] != 16, training=training,
                                            compiled=compiled)
    return eligible_kernels(problem, hardware)


def test_preference_order_per_vendor():
    assert dispatch.PREFERENCE["nvidia"] == ("cudnn", "flash_attn", "flash", "cudnn_band", "flex", "efficient",
                                             "sdpa")
    assert dispatch.PREFERENCE["amd"] == ("flash_attn", "flash", "flex", "efficient", "sdpa")
    assert "cudnn" not in dispatch.PREFERENCE["amd"]
    for vendor in ("cpu", "intel", "tpu"):
        assert dispatch.PREFERENCE[vendor] == ("sdpa",)
    # Eligible kernels come out in that order.
    assert eligible_kernels(AttentionProblem.from_tensors(*_problem(head_dim=64), is_causal=False, dropout_p=0.0,
                                                          enable_gqa=False, training=False), H100_FA)[0] == \
        ["cudnn", "flash_attn", "flash", "flex", "efficient", "sdpa"]
    assert _rejections(MI300_FA, *_problem())[0] == ["flash_attn", "flash", "flex", "efficient", "sdpa"]


@pytest.mark.parametrize("case, kwargs, limit", [
    (dict(mask="bool"), {}, "score_mod"),
    (dict(mask="additive"), {}, "slower than the fused SDPA kernels that take a bias"),
    (dict(), dict(dropout_p=0.1), "no dropout"),
    (dict(head_dim=8), {}, "head dims in [16, 256]"),
    (dict(head_dim=512), {}, "head dims in [16, 256]"),
    (dict(v_dim=8), {}, "8 for v"),
    (dict(dtype=torch.float64), {}, "fp16/bf16/fp32"),
    (dict(), dict(compiled=False), "compiled"),
])
def test_flex_rejections_name_the_limit(case, kwargs, limit):
    eligible, rejected = _rejections(H100, *_problem(**case), **kwargs)
    assert "flex" not in eligible and limit in rejected["flex"], rejected.get("flex")


def test_flex_needs_triton_and_a_recent_gpu():
    no_triton = H100.model_copy(update={"triton_usable": False})
    assert "Triton" in _rejections(no_triton, *_problem())[1]["flex"]
    v100 = HardwareInfo(vendor="nvidia", device_name="sim V100", compute_capability=(7, 0), triton_usable=True)
    assert "flex" in _rejections(v100, *_problem(dtype=torch.float16))[0]
    assert "bf16" in _rejections(v100, *_problem())[1]["flex"]


def test_flex_is_eligible_without_mask_or_dropout_in_every_float_dtype():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for head_dim in (16, 64, 80, 128, 256):  # 80: not a power of two (padded, masked loads)
            assert "flex" in _rejections(H100, *_problem(dtype=dtype, head_dim=head_dim), causal=True)[0]
    assert "flex" in _rejections(H100, *_problem(kv_heads=4, kv_len=100), causal=True)[0]  # GQA, Lq != Lk
    assert "flex" in _rejections(H100, *_problem(), training=True)[0]


def test_flex_is_never_the_unmeasured_pick():
    # fp32: flex and efficient are eligible; without a GPU to measure on, efficient is taken.
    kernel, reason = _choose(H100, *_problem(dtype=torch.float32))
    assert kernel == "efficient", reason
    assert "flex: eligible, but taken only when measured fastest" in reason
    # head dim 100: only flex and sdpa are eligible; sdpa (PyTorch pads it for its flash kernel).
    kernel, reason = _choose(H100, *_problem(head_dim=100))
    assert kernel == "sdpa" and "flex: eligible" in reason, reason


@pytest.mark.parametrize("hardware, case, kwargs, limit", [
    (H100, dict(), {}, "not installed"),
    (H100.model_copy(update={"flash_attn_version": "2.6.3"}), dict(), {}, "older than 2.7"),
    (H100_FA, dict(mask="bool"), {}, "no mask tensor"),
    (H100_FA, dict(dtype=torch.float32), {}, "fp16/bf16"),
    (H100_FA, dict(head_dim=288), {}, "head dim <= 256"),
    (H100_FA, dict(v_dim=64), {}, "equal for q/k and v"),
    (H100_FA, dict(kv_len=100), dict(causal=True), "bottom-right"),
    (HardwareInfo(vendor="nvidia", device_name="sim T4", compute_capability=(7, 5), flash_attn_version="2.8.3"),
     dict(dtype=torch.float16), {}, "compute capability >= 8.0"),
    (HardwareInfo(vendor="nvidia", device_name="sim L4", compute_capability=(8, 9), flash_attn_version="2.8.3"),
     dict(head_dim=256), dict(training=True, dropout_p=0.1), "head dim > 192 with dropout"),
])
def test_flash_attn_rejections_name_the_limit(hardware, case, kwargs, limit):
    eligible, rejected = _rejections(hardware, *_problem(**case), **kwargs)
    assert "flash_attn" not in eligible and limit in rejected["flash_attn"], rejected.get("flash_attn")


def test_flash_attn_eligible_when_installed():
    for case, kwargs in [(dict(), {}), (dict(kv_heads=4), dict(causal=True)), (dict(head_dim=256), {}),
                         (dict(dtype=torch.float16, head_dim=100), {}), (dict(kv_len=100), {}),
                         (dict(), dict(training=True, dropout_p=0.1))]:
        assert "flash_attn" in _rejections(H100_FA, *_problem(**case), **kwargs)[0], (case, kwargs)
    # An L4 (sm89) trains head dim 256 without dropout.
    l4 = HardwareInfo(vendor="nvidia", device_name="sim L4", compute_capability=(8, 9), flash_attn_version="2.8.3")
    assert "flash_attn" in _rejections(l4, *_problem(head_dim=256), training=True)[0]


@pytest.mark.parametrize("hardware, case, kwargs, expected", [
    (H100_FA, dict(), {}, "cudnn"),  # cuDNN stays first where it is eligible
    (H100_FA, dict(head_dim=256), {}, "flash_attn"),  # cuDNN limited to 128 here; flash-attn before aten flash
    (H100_FA, dict(kv_len=100), dict(causal=True), "cudnn"),
    (H100_FA, dict(head_dim=256, kv_len=100), dict(causal=True), "efficient"),  # both flashes: bottom-right
    (H100_FA, dict(head_dim=256, mask="bool"), {}, "efficient"),  # a mask no flash kernel takes: the next
    (H100_FA, dict(head_dim=256, mask="additive", mask_grad=True), dict(training=True), "efficient"),
    (H100_FA, dict(dtype=torch.float64), {}, "sdpa"),
    (MI300_FA, dict(), {}, "flash_attn"),
    (MI300_FA, dict(mask="additive"), {}, "efficient"),
])
def test_unmeasured_choice_with_the_new_kernels(hardware, case, kwargs, expected):
    kwargs = dict(kwargs)
    causal, training = kwargs.pop("causal", False), kwargs.pop("training", False)
    kernel, reason = choose_kernel(*_problem(**case), is_causal=causal, dropout_p=0.0,
                                   enable_gqa=False, hardware=hardware, training=training)
    assert kernel == expected, reason


# ---------------------------------------------------------------------------------------------------------
# The measurement: its mechanics on the CPU (flex compiled by Inductor's CPU backend), then on a GPU
# ---------------------------------------------------------------------------------------------------------


def _cpu_problem(**kwargs):
    q, k, v = torch.empty(2, 8, 64, 32), torch.empty(2, 2, 64, 32), torch.empty(2, 2, 64, 32)
    return AttentionProblem.from_tensors(q, k, v, None, is_causal=True, dropout_p=0.0, enable_gqa=True,
                                         training=False, **kwargs)


def test_a_training_problem_is_measured_with_gradients_even_when_they_are_off(monkeypatch):
    monkeypatch.setattr(dispatch, "fastest_cuda_ms", lambda fns: {k: (fn(), 1.0)[1] for k, fn in fns.items()})
    problem = AttentionProblem.from_tensors(torch.empty(2, 8, 64, 32), torch.empty(2, 2, 64, 32),
                                            torch.empty(2, 2, 64, 32), None, is_causal=True, dropout_p=0.0,
                                            enable_gqa=True, training=True)
    with torch.no_grad():
        timings, failures = dispatch._measure(problem, ["cpu_flash", "sdpa"])
    assert not failures and set(timings) == {"cpu_flash", "sdpa"}, failures


def test_measurement_compiles_flex_and_times_it(monkeypatch):
    timed = []
    monkeypatch.setattr(dispatch, "fastest_cuda_ms", lambda fns: {k: (fn(), timed.append(1), float(len(timed)))[2]
                                                                  for k, fn in fns.items()})
    timings, failures = dispatch._measure(_cpu_problem(), ["cpu_flash", "flex", "sdpa"])
    assert not failures and set(timings) == {"cpu_flash", "flex", "sdpa"}, failures


def test_a_measurement_inside_a_capture_compiles_its_backward_up_front():
    """optimize measures flex inside the model's capture, which holds Dynamo's compile lock; on CUDA autograd
    runs the backward on a device thread, which waited for that lock forever when it compiled the backward
    lazily (H100, a sliding window in training). The thread here stands in for the device thread."""
    from torch._dynamo.convert_frame import compile_lock

    compiled = torch.compile(lambda x: (x.sin() * 2).sum(), backend="inductor", dynamic=False)
    x = torch.randn(8, requires_grad=True)
    with compile_lock, measurement_compiles():
        loss = compiled(x)
        backward = threading.Thread(target=loss.backward, daemon=True)
        backward.start()
        backward.join(timeout=60)
    assert not backward.is_alive(), "the backward waited for the compile lock"
    assert torch.allclose(x.grad, 2 * x.detach().cos())


def _padded_training_problem():
    q, kv = torch.empty(2, 4, 64, 32), torch.empty(2, 2, 64, 32)
    mask = torch.empty(2, 1, 64, 64, dtype=torch.bool)
    return AttentionProblem.from_tensors(q, kv, kv, mask, is_causal=False, dropout_p=0.0, enable_gqa=True,
                                         training=True)


def test_a_kernel_with_wrong_gradients_under_a_padding_mask_is_passed_over(monkeypatch):
    """As cuDNN's backward with a padding mask on torch 2.11 (H100): right outputs, wrong gradients, and
    only where the mask hides keys. PyTorch's own dispatch ("sdpa") is judged too: it may pick that kernel."""
    monkeypatch.setattr(dispatch, "fastest_cuda_ms", lambda fns: {k: (fn(), 1.0)[1] for k, fn in fns.items()})
    real = dispatch._attention_fn

    class WrongWhereMasked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, mask):
            ctx.hides = bool((~mask).any())
            return out.clone()

        @staticmethod
        def backward(ctx, grad):
            return (grad * 3 if ctx.hides else grad), None

    def wrong_backward(kernel):
        def run(q, k, v, attn_mask, **kwargs):
            return WrongWhereMasked.apply(real(kernel)(q, k, v, attn_mask, **kwargs), attn_mask)
        return run if kernel == "sdpa" else real(kernel)

    monkeypatch.setattr(dispatch, "_attention_fn", wrong_backward)
    timings, failures = dispatch._measure(_padded_training_problem(), ["cpu_flash", "sdpa"])
    assert set(timings) == {"cpu_flash"}, failures
    assert len(failures) == 1 and failures[0].startswith("sdpa: differs from float32 by"), failures
    assert "(gradients included)" in failures[0]


def test_the_measurement_mask_hides_padding_but_never_a_whole_row():
    inputs = dispatch._random_inputs(_padded_training_problem())
    mask = inputs["mask"]
    assert mask.shape == (2, 1, 64, 64) and mask[..., 0].all()
    assert not mask[-1, ..., 32:].any() and mask[0, 0, -1].all()  # the last row: padding; the first: causal
    assert inputs["grad_out"].shape == (2, 4, 64, 32)


def test_a_kernel_that_fails_to_compile_is_passed_over_with_the_error(monkeypatch):
    monkeypatch.setattr(dispatch, "fastest_cuda_ms", lambda fns: {k: (fn(), 1.0)[1] for k, fn in fns.items()})
    real = dispatch._attention_fn

    class TritonCompileError(Exception):  # neither RuntimeError nor ValueError: any error is caught
        pass

    def failing(kernel):
        if kernel != "flex":
            return real(kernel)

        def compile_error(*args, **kwargs):
            raise TritonCompileError("out of shared memory: required 262144\nHardware limit: 232448")
        return compile_error

    monkeypatch.setattr(dispatch, "_attention_fn", failing)
    timings, failures = dispatch._measure(_cpu_problem(), ["flex", "sdpa"])
    assert set(timings) == {"sdpa"}
    assert failures == ["flex: TritonCompileError: out of shared memory: required 262144"], failures


@pytest.mark.gpu
def test_gpu_choice_measures_flex(monkeypatch):
    """flex is compiled, checked and timed where no SDPA fused kernel applies (simulated by leaving only
    flex and sdpa eligible), and passed over, unmeasured, where one does."""
    if not torch.cuda.is_available():
        pytest.fail("gpu tests were selected (-m gpu) but torch.cuda.is_available() is False")
    from kernel_pytorch.hardware import detect_hardware

    hardware = detect_hardware()
    q = torch.empty(4, 16, 1024, 64, dtype=torch.bfloat16, device="cuda")
    k = v = torch.empty(4, 4, 1024, 64, dtype=torch.bfloat16, device="cuda")

    def choose(training):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return choose_kernel(q, k, v, None, is_causal=True, dropout_p=0.0, enable_gqa=True,
                                 hardware=hardware, training=training)

    kernel, reason = choose(False)
    assert "flex: not measured" in reason and "flex " not in reason.split(";")[0], reason
    real = dispatch.eligible_kernels
    monkeypatch.setattr(dispatch, "_CHOICES", {})  # choices are cached per problem
    monkeypatch.setattr(dispatch, "eligible_kernels", lambda *a, **kw: (
        ["flex", "sdpa"], real(*a, **kw)[1]))
    for training in (False, True):
        kernel, reason = choose(training)
        assert reason.startswith("fastest measured ("), reason
        measured = reason[len("fastest measured ("):].split(")")[0]
        assert "flex " in measured and "sdpa " in measured, reason  # flex was compiled, checked and timed
        assert kernel in measured.split(",")[0], reason