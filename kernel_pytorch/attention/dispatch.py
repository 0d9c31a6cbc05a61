"""Choose the attention kernel for one attention problem: by eligibility rules, then by measurement.

On a GPU the choice is measured, not guessed: every eligible kernel runs the problem's exact shapes
(forward, and backward when training), is checked against PyTorch's math kernel, and the fastest
correct one wins. The result is cached per problem, so the twelve identical layers of a model cost one
measurement. Without a GPU at rewrite time (simulated hardware, CPU) the first eligible kernel in the
backend's preference order is taken, and the reason says so.

What each kernel computes, its limits and the vendors' preference orders are the kernels' records
(:mod:`kernel_pytorch.attention.kernels.registry`). cuDNN leads NVIDIA's order, fastest in the forward
measurements (``benchmarks/results/attention.json``), but it is not always fastest (and has had correctness
bugs), hence the measurement and the numerics check.

Besides PyTorch's own kernels, NVIDIA and AMD GPUs consider FlexAttention (``"flex"``, when Triton is
usable) and the flash-attn package (``"flash_attn"``, when installed). A problem one kernel cannot run as
SDPA would (a mask tensor, dropout, a head dim, a dtype, a causal alignment) is simply not eligible for it,
and the next eligible kernel in the order is used; ``"sdpa"`` is always eligible, so the fallback is never a
wrong result. FlexAttention is fused only when compiled, so it is measured compiled and picked only by a
measurement, never as an unmeasured guess.

A block-structured mask the attention pass recognized (a sliding window, a band, documents, a block-sparse
mask: ``sparsity``) makes FlexAttention eligible with that pattern in place of the mask tensor; the dense
kernels still get the tensor. Sparse masks are where FlexAttention wins against the dense kernels
(``benchmarks/results/sparse_attention.json``), so there it is measured against the fused kernels, from
:data:`SPARSE_MIN_LENGTH` on; below it, the dense kernels are kept unmeasured against it. A causal sliding
window also makes ``"cudnn_band"`` eligible where the cuDNN frontend is installed
(:mod:`kernel_pytorch.attention.kernels.cudnn_band`: cuDNN's own banded kernel, faster than FlexAttention on
such windows in the same results), measured at every length. The figures: ``docs/attention.md``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch.nn.attention.flex_attention import create_mask

from kernel_pytorch.attention.kernels.flex import pattern_mask_mod
from kernel_pytorch.attention.kernels.problem import AttentionProblem
from kernel_pytorch.attention.kernels.registry import (
    KERNELS,
    MEASURED_ONLY,
    PATTERN_KERNELS,
    PREFERENCE,
    eligible_kernels,
)
from kernel_pytorch.errors import first_line
from kernel_pytorch.hardware import HardwareInfo
from kernel_pytorch.ops.attention import attention
from kernel_pytorch.timing import fastest_cuda_ms, measurement_compiles

__all__ = ["AttentionProblem", "choose_kernel", "eligible_kernels", "PREFERENCE", "MEASURED_ONLY",
           "SPARSE_MIN_LENGTH"]

# The fused kernels that make measuring FlexAttention not worth it (all but "sdpa" and the measured-only ones).
# Its measurement compiles it, which inside optimize's own compile took minutes per problem, and on dense and
# causal masks it was the slower kernel (docs/attention.md, "FlexAttention on dense masks").
# Block-sparse masks, where it wins, are its job.
_SDPA_FUSED = tuple(name for name, kernel in KERNELS.items() if name != "sdpa" and not kernel.measured_only)
_FLEX_NOT_MEASURED = ("an SDPA fused kernel is eligible, and compiling FlexAttention to time it costs minutes "
                      "for a dense or causal mask it does not win")

# Key length below which a recognized sparse mask stays on the dense kernels without timing FlexAttention
# (each timing compiles it: seconds to minutes inside optimize). FlexAttention beat the dense kernels given
# the mask tensor from a causal 1024 window at L=1024 on (benchmarks/sparse_attention.py; the figures in
# docs/attention.md, "Sparse masks: SPARSE_MIN_LENGTH"); shorter masks than 1024 keys are not measured.
SPARSE_MIN_LENGTH = 1024
_FLEX_SHORT = (f"flex: not measured: a sparse mask with fewer than {SPARSE_MIN_LENGTH} keys, where block-sparse "
               "kernels lose to the dense fused kernels")

# Relative error (norm) a fused kernel may show against the math kernel on the same bf16/fp16 inputs;
# measured fused-vs-math differences are ~3e-3; a wrong kernel is off by O(1).
_NUMERICS_LIMIT = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def choose_kernel(q, k, v, attn_mask, *, is_causal: bool, dropout_p: float, enable_gqa: bool,
                  hardware: HardwareInfo, training: bool, compiled: bool = True,
                  sparsity: Optional[tuple] = None, cuda_graphs: bool = False,
                  softcap: Optional[float] = None) -> tuple[str, str]:
    """The kernel for this call and the reason, from example tensors (real or fake) of its inputs.

    ``compiled``: whether the graph the call lands in will be compiled (Inductor); ``False`` rules out
    ``"flex"``, which is fused only when compiled. ``sparsity``: the block structure of ``attn_mask`` the
    pass recognized (``MaskPattern.sparsity``); ``"flex"`` then computes the pattern, not the tensor.
    ``cuda_graphs``: whether that compiled graph runs as CUDA graphs (``compile="reduce-overhead"``).
    ``softcap``: the scores' soft cap (Gemma-2), which only ``"flex"`` and ``"sdpa"`` (PyTorch's ops) compute."""
    problem = AttentionProblem.from_tensors(q, k, v, attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                                            enable_gqa=enable_gqa, training=training, compiled=compiled,
                                            sparsity=sparsity, cuda_graphs=cuda_graphs, softcap=softcap)
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
        unmeasured = [k for k in eligible if k in MEASURED_ONLY]
        eligible = [k for k in eligible if k not in MEASURED_ONLY]  # never empty: "sdpa" is always eligible
        reason = "first eligible in preference order, not measured (no GPU at rewrite time)"
        passed_over = "; ".join(filter(None, [passed_over, *(
            f"{k}: eligible, but taken only when measured fastest on a GPU" for k in unmeasured)]))
    else:
        skip_flex = _flex_not_measured(problem, eligible)
        if skip_flex:
            eligible = [k for k in eligible if k != "flex"]
            passed_over = "; ".join(filter(None, [passed_over, skip_flex]))
        timings, failures = _measure(problem, eligible)
        passed_over = "; ".join(filter(None, [passed_over, *failures]))
        if not timings:
            return "sdpa", f"no kernel, PyTorch's dispatch included, matched float32 ({passed_over})"
        measured = ", ".join(f"{k} {t:.3f} ms" for k, t in sorted(timings.items(), key=lambda kv: kv[1]))
        eligible, reason = [min(timings, key=timings.get)], f"fastest measured ({measured})"
    return eligible[0], reason + (f"; passed over: {passed_over}" if passed_over else "")


def _flex_not_measured(problem: AttentionProblem, eligible: list[str]) -> str:
    """Why FlexAttention is left out of the measurement ("" when it is timed): with a dense or causal
    mask whenever an SDPA fused kernel is eligible; with a sparse mask below SPARSE_MIN_LENGTH keys."""
    if "flex" not in eligible or not any(k in eligible for k in _SDPA_FUSED):
        return ""
    if problem.sparsity is None:
        return f"flex: not measured: {_FLEX_NOT_MEASURED}"
    return _FLEX_SHORT if problem.k_shape[-2] < SPARSE_MIN_LENGTH else ""


def _measure(problem: AttentionProblem, kernels: list[str]) -> tuple[dict[str, float], list[str]]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # The problem's device is "cuda" whenever this runs from _choose; tests run it on the CPU.
    rng_devices = [torch.cuda.current_device()] if problem.device_type == "cuda" else []
    # A training problem is timed forward + backward, also when the capture runs with gradients off (a
    # module in train mode given inputs that need none): every kernel failed there with "element 0 of
    # tensors does not require grad", and the pass fell back to SDPA's dispatch.
    with unset_fake_temporarily(), torch.random.fork_rng(devices=rng_devices), \
            torch.set_grad_enabled(problem.training):
        inputs = _random_inputs(problem)
        reference = _float32_reference(inputs, problem)
        runnable, failures = {}, []
        for kernel in kernels:
            try:
                # The numerics run comes first, so a compiled kernel is compiled (once) before the timing;
                # then one run as timed (with dropout, where the problem has it), so the timing cannot fail.
                fn = _attention_fn(kernel)
                timed = functools.partial(_run, fn, inputs, kernel, problem, with_dropout=True)
                with measurement_compiles():
                    result = _run(fn, inputs, kernel, problem, with_dropout=False)
                    timed()
                error = _relative_error(result, reference)
                if not error <= _NUMERICS_LIMIT.get(problem.dtype, 1e-4):
                    failures.append(f"{kernel}: differs from float32 by {error:.1e}"
                                    + (" (gradients included)" if problem.training else ""))
                    continue
                runnable[kernel] = timed
            except Exception as error:  # noqa: BLE001 - a limit not modelled above, a failed compile, a
                # missing package: the kernel is passed over with the error, the choice goes on.
                failures.append(f"{kernel}: {first_line(error)[:200]}")
        timings = fastest_cuda_ms(runnable) if runnable else {}
    return timings, failures


def _attention_fn(kernel: str) -> Callable[..., torch.Tensor]:
    """What runs ``kernel`` as a rewritten graph would: ``attention`` itself, or for ``"flex"`` a fresh
    Inductor compile of it (static shapes), which lowers FlexAttention into its fused Triton kernel;
    eagerly FlexAttention is the unfused reference, whose timing would say nothing."""
    if kernel != "flex":
        return attention
    return torch.compile(_flex_for_measurement, fullgraph=True, dynamic=False)


def _flex_for_measurement(q, k, v, attn_mask, **kwargs) -> torch.Tensor:
    """``attention`` under another code object: Dynamo keeps compiled entries per code object, so the
    measurement's compiles stay off ``attention``'s own."""
    return attention(q, k, v, attn_mask, **kwargs)


def _random_inputs(p: AttentionProblem) -> dict:
    def make(shape):
        return torch.randn(shape, device=p.device_type, dtype=p.dtype, requires_grad=p.training)

    # A random gradient of the output: ones made every kernel's dq small and alike.
    grad_out = torch.randn(*p.q_shape[:-1], p.v_shape[-1], device=p.device_type, dtype=p.dtype)
    tensors = {"q": make(p.q_shape), "k": make(p.k_shape), "v": make(p.v_shape), "grad_out": grad_out}
    if p.sparsity is not None:
        return {**tensors, **_sparse_mask(p)}
    mask = None
    if p.mask == "bool":
        mask = _padding_mask(p)
    elif p.mask == "additive":
        mask = torch.randn(p.mask_shape, device=p.device_type, dtype=p.dtype, requires_grad=p.mask_requires_grad)
    return {**tensors, "mask": mask}


def _padding_mask(p: AttentionProblem) -> torch.Tensor:
    """A bool mask of the problem's shape that hides keys as real ones do: causal (bottom-right aligned), and
    in the last batch row the second half of the keys (padding); every query keeps key 0. An all-True mask
    hid a kernel's wrong gradients (cuDNN's backward with a padding mask, torch 2.11 on an H100)."""
    lq, lk = p.mask_shape[-2], p.mask_shape[-1]
    rows = torch.arange(lq, device=p.device_type)[:, None] + (lk - lq)
    keys = torch.arange(lk, device=p.device_type)[None, :]
    allowed = (keys <= rows).expand(p.mask_shape).clone()
    if len(p.mask_shape) == 4 and p.mask_shape[0] > 1:
        allowed[-1, ..., max(1, lk // 2):] = False
    return allowed


def _float32_reference(inputs: dict, p: AttentionProblem) -> torch.Tensor:
    """What :func:`_run` returns, computed from float32 copies of the inputs by PyTorch's memory-efficient or
    math kernel: the fused kernels in the problem's dtype are judged against it, PyTorch's own dispatch
    ("sdpa") included, since that may pick a kernel whose gradients are wrong (cuDNN's backward with a
    padding mask, torch 2.11 on an H100). K/V heads are repeated for GQA, which the efficient kernel lacks
    (the math kernel would hold float32 scores per head: 17 GB at 16 heads and 16384 tokens)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (inputs[name].detach().float().requires_grad_(p.training) for name in ("q", "k", "v"))
    mask = inputs["mask"]
    if mask is not None and mask.is_floating_point():
        mask = mask.detach().float().requires_grad_(mask.requires_grad)
    groups = q.shape[-3] // k.shape[-3]
    softcap = {} if p.softcap is None else {"softcap": p.softcap}
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        out = attention(q, k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3), mask,
                        is_causal=p.is_causal, kernel="sdpa", **softcap)
        if not p.training:
            return out.detach()
        grads = torch.autograd.grad(out, [q, k, v], inputs["grad_out"].float())
    return _output_and_gradients(out, grads)


def _sparse_mask(p: AttentionProblem) -> dict:
    """A mask with the problem's structure, as the dense kernels' tensor and as flex's pattern: a band
    exactly; documents and general block masks as equal-length documents covering the recorded tile
    density (the real ones depend on data or a buffer this measurement does not have)."""
    lq, lk = p.q_shape[-2], p.k_shape[-2]
    kind, density = p.sparsity[0], p.sparsity[-1]
    if kind == "band":
        pattern, tensor = p.sparsity[:3], None
    else:
        span = max(1, round((density if density is not None else 0.25) * lk))
        ids = (torch.arange(lk, device=p.device_type) // span)[None]
        pattern = ("document", *(p.sparsity[1:3] if kind == "document" else (None, None)))
        tensor = ids
    allowed = create_mask(pattern_mask_mod(pattern, tensor), 1, 1, lq, lk, device=p.device_type)
    mask = allowed if p.mask == "bool" else torch.where(allowed, 0.0, float("-inf")).to(p.dtype)
    return {"mask": mask, "pattern": pattern, "pattern_tensor": tensor}


def _run(attention_fn, inputs, kernel: str, p: AttentionProblem, *, with_dropout: bool) -> torch.Tensor:
    pattern = {"pattern": inputs["pattern"], "pattern_tensor": inputs["pattern_tensor"]} \
        if kernel in PATTERN_KERNELS and "pattern" in inputs else {}
    softcap = {} if p.softcap is None else {"softcap": p.softcap}
    out = attention_fn(inputs["q"], inputs["k"], inputs["v"], None if pattern else inputs["mask"],
                    dropout_p=0.1 if (p.dropout and with_dropout) else 0.0, is_causal=p.is_causal,
                    enable_gqa=p.enable_gqa, kernel=kernel, **pattern, **softcap)
    if p.training:
        grads = torch.autograd.grad(out, [inputs["q"], inputs["k"], inputs["v"]], inputs["grad_out"].to(out.dtype))
        return _output_and_gradients(out, grads)
    return out.detach()


def _output_and_gradients(out: torch.Tensor, grads) -> torch.Tensor:
    """What a training problem's runs compare: the output and the q, k, v gradients, flattened into one."""
    return torch.cat([out.detach().flatten(), *(g.flatten() for g in grads)])


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
