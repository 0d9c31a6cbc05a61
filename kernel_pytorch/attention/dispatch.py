"""Choose the attention kernel for one attention problem: by eligibility rules, then by measurement.

On a GPU the choice is measured, not guessed: every eligible kernel runs the problem's exact shapes
(forward, and backward when training), is checked against PyTorch's math kernel, and the fastest
correct one wins. The result is cached per problem, so the twelve identical layers of a model cost one
measurement. Without a GPU at rewrite time (simulated hardware, CPU) the first eligible kernel in the
backend's preference order is taken, and the reason says so.

DESIGN.md's H100 figures motivate the preference order: forward hd128 L=8192 bf16, cuDNN 613 TFLOP/s,
flash 349, memory-efficient below both; but cuDNN is not always fastest (and has had correctness bugs),
hence the measurement and the numerics check.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional

import torch

from kernel_pytorch.hardware import HardwareInfo

__all__ = ["AttentionProblem", "choose_kernel", "eligible_kernels", "PREFERENCE"]

# Kernels each vendor may use, fastest-first as measured or documented; "sdpa" (PyTorch's own
# dispatch) is always last, the universal fallback.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "nvidia": ("cudnn", "flash", "efficient", "sdpa"),
    "amd": ("flash", "efficient", "sdpa"),
    # PyTorch's CPU dispatch already picks its flash kernel where eligible; going through it keeps
    # mask gradients and dropout available.
    "cpu": ("sdpa",),
    "intel": ("sdpa",),
    "tpu": ("sdpa",),  # XLA lowers SDPA itself
}

_HALF = (torch.float16, torch.bfloat16)
# Relative error (norm) a fused kernel may show against the math kernel on the same bf16/fp16 inputs;
# measured fused-vs-math differences are ~3e-3; a wrong kernel is off by O(1).
_NUMERICS_LIMIT = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}


@dataclass(frozen=True)
class AttentionProblem:
    """Shapes and options of one attention call; hashable, so choices are cached per problem."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    mask: Optional[str]  # None | "bool" | "additive"
    mask_shape: Optional[tuple[int, ...]]
    mask_requires_grad: bool
    is_causal: bool
    dropout: bool
    enable_gqa: bool
    training: bool

    @classmethod
    def from_tensors(cls, q, k, v, attn_mask, *, is_causal, dropout_p, enable_gqa, training) -> AttentionProblem:
        mask_kind = None if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "additive")
        return cls(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device.type, mask_kind,
                   None if attn_mask is None else tuple(attn_mask.shape),
                   bool(attn_mask is not None and attn_mask.requires_grad and training), bool(is_causal),
                   bool(dropout_p > 0), bool(enable_gqa), bool(training))

    @property
    def head_dim(self) -> int:
        return self.q_shape[-1]


def _why_not(kernel: str, p: AttentionProblem, hardware: HardwareInfo) -> str | None:
    """Why ``kernel`` cannot run ``p`` (``None``: it can), mirroring the kernels' documented limits."""
    cc = hardware.compute_capability
    if kernel == "sdpa":
        return None
    if kernel in ("cudnn", "flash") and p.dtype not in _HALF:
        return f"{kernel} needs fp16/bf16, not {p.dtype}"
    if kernel == "efficient" and p.dtype not in (*_HALF, torch.float32):
        return f"efficient needs fp16/bf16/fp32, not {p.dtype}"
    if p.head_dim % 8 or p.v_shape[-1] % 8:
        return f"head dim {p.head_dim} is not a multiple of 8"
    if kernel == "flash":
        if p.mask is not None:
            return "flash takes no mask"
        if p.head_dim > 256 or p.v_shape[-1] != p.head_dim:
            return "flash needs head dim <= 256 and equal for q/k and v"
        if p.is_causal and p.q_shape[-2] != p.k_shape[-2]:
            # measured on H100: flash aligns causal bottom-right when Lq != Lk, SDPA top-left
            return "flash's causal mask is bottom-right aligned when query and key lengths differ"
    if kernel == "cudnn":
        if not hardware.cudnn_attention:
            return "cuDNN attention unavailable on this GPU"
        if p.head_dim > 128:
            return f"cuDNN attention here is limited to head dim 128 (got {p.head_dim})"
        if p.mask_requires_grad:
            return "cuDNN attention returns no gradient for the mask"
    if kernel in ("cudnn", "flash") and hardware.vendor == "nvidia" and (cc is None or cc < (8, 0)):
        return f"{kernel} needs compute capability >= 8.0"
    if p.mask_requires_grad and kernel != "efficient":
        return f"{kernel} returns no gradient for the mask"
    return None


def eligible_kernels(problem: AttentionProblem, hardware: HardwareInfo) -> tuple[list[str], dict[str, str]]:
    """The kernels that can run ``problem`` in preference order, and why each other one cannot."""
    eligible, rejected = [], {}
    for kernel in PREFERENCE[hardware.vendor]:
        reason = _why_not(kernel, problem, hardware)
        if reason is None:
            eligible.append(kernel)
        else:
            rejected[kernel] = reason
    return eligible, rejected


def choose_kernel(q, k, v, attn_mask, *, is_causal: bool, dropout_p: float, enable_gqa: bool,
                  hardware: HardwareInfo, training: bool) -> tuple[str, str]:
    """The kernel for this call and the reason, from example tensors (real or fake) of its inputs."""
    problem = AttentionProblem.from_tensors(q, k, v, attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                                            enable_gqa=enable_gqa, training=training)
    key = (problem, hardware.model_dump_json())
    if key not in _CHOICES:
        _CHOICES[key] = _choose(problem, hardware)
    return _CHOICES[key]


_CHOICES: dict[tuple[AttentionProblem, str], tuple[str, str]] = {}


def _choose(problem: AttentionProblem, hardware: HardwareInfo) -> tuple[str, str]:
    eligible, rejected = eligible_kernels(problem, hardware)
    passed_over = "; ".join(f"{k}: {why}" for k, why in rejected.items())
    if len(eligible) == 1:
        reason = "only eligible kernel"
    elif problem.device_type != "cuda" or not torch.cuda.is_available():
        reason = "first eligible in preference order, not measured (no GPU at rewrite time)"
    else:
        timings, failures = _measure(problem, eligible)
        passed_over = "; ".join(filter(None, [passed_over, *failures]))
        if not timings:
            return "sdpa", f"no fused kernel ran correctly ({passed_over})"
        measured = ", ".join(f"{k} {t:.3f} ms" for k, t in sorted(timings.items(), key=lambda kv: kv[1]))
        eligible, reason = [min(timings, key=timings.get)], f"fastest measured ({measured})"
    return eligible[0], reason + (f"; passed over: {passed_over}" if passed_over else "")


def _measure(problem: AttentionProblem, kernels: list[str]) -> tuple[dict[str, float], list[str]]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from kernel_pytorch.ops.attention import attention

    with unset_fake_temporarily(), torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        inputs = _random_inputs(problem)
        reference = _run(attention, inputs, "sdpa", problem, with_dropout=False)
        timings, failures = {}, []
        for kernel in kernels:
            try:
                result = _run(attention, inputs, kernel, problem, with_dropout=False)
                error = _relative_error(result, reference)
                if not error <= _NUMERICS_LIMIT.get(problem.dtype, 1e-4):
                    failures.append(f"{kernel}: differs from math by {error:.1e}")
                    continue
                timings[kernel] = _median_ms(lambda: _run(attention, inputs, kernel, problem, with_dropout=True))
            except (RuntimeError, ValueError) as error:  # a limit not modelled above: not eligible here
                failures.append(f"{kernel}: {str(error).splitlines()[0][:120]}")
    return timings, failures


def _random_inputs(p: AttentionProblem) -> dict:
    def make(shape):
        return torch.randn(shape, device="cuda", dtype=p.dtype, requires_grad=p.training)

    mask = None
    if p.mask == "bool":
        mask = torch.ones(p.mask_shape, device="cuda", dtype=torch.bool)
    elif p.mask == "additive":
        mask = torch.randn(p.mask_shape, device="cuda", dtype=p.dtype, requires_grad=p.mask_requires_grad)
    return {"q": make(p.q_shape), "k": make(p.k_shape), "v": make(p.v_shape), "mask": mask}


def _run(attention, inputs, kernel: str, p: AttentionProblem, *, with_dropout: bool) -> torch.Tensor:
    out = attention(inputs["q"], inputs["k"], inputs["v"], inputs["mask"],
                    dropout_p=0.1 if (p.dropout and with_dropout) else 0.0, is_causal=p.is_causal,
                    enable_gqa=p.enable_gqa, kernel=kernel)
    if p.training:
        grads = torch.autograd.grad(out, [inputs["q"], inputs["k"], inputs["v"]], torch.ones_like(out))
        return torch.cat([out.detach().flatten(), *(g.flatten() for g in grads)])
    return out.detach()


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _median_ms(fn, warmup: int = 2, runs: int = 7) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
