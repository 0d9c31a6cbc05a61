"""Choose the attention kernel for one attention problem: by eligibility rules, then by measurement.

On a GPU the choice is measured, not guessed: every eligible kernel runs the problem's exact shapes
(forward, and backward when training), is checked against PyTorch's math kernel, and the fastest
correct one wins. The result is cached per problem, so the twelve identical layers of a model cost one
measurement. Without a GPU at rewrite time (simulated hardware, CPU) the first eligible kernel in the
backend's preference order is taken, and the reason says so.

DESIGN.md's H100 figures motivate the preference order: forward hd128 L=8192 bf16, cuDNN 613 TFLOP/s,
flash 349, memory-efficient below both; but cuDNN is not always fastest (and has had correctness bugs),
hence the measurement and the numerics check.

Besides PyTorch's own kernels, NVIDIA and AMD GPUs consider FlexAttention (``"flex"``, when Triton is
usable) and the flash-attn package (``"flash_attn"``, when installed). A problem one kernel cannot run as
SDPA would (a mask tensor, dropout, a head dim, a dtype, a causal alignment) is simply not eligible for it,
and the next eligible kernel in the order is used; ``"sdpa"`` is always eligible, so the fallback is never a
wrong result. FlexAttention is fused only when compiled, so it is measured compiled and picked only by a
measurement, never as an unmeasured guess.

A block-structured mask the attention pass recognized (a sliding window, a band, documents, a block-sparse
mask: ``sparsity``) makes FlexAttention eligible with that pattern in place of the mask tensor; the dense
kernels still get the tensor. Sparse masks are where FlexAttention wins (DESIGN.md: sliding window 1024 at
L=16384, 6.66x dense causal flash), so there it is measured against the fused kernels, from
:data:`SPARSE_MIN_LENGTH` on; below it, the dense kernels are kept unmeasured against it. A causal sliding
window also makes ``"cudnn_band"`` eligible where the cuDNN frontend is installed
(:mod:`kernel_pytorch.attention.kernels.cudnn_band`: cuDNN's own banded kernel, 1.8x FlexAttention's speed at
L=16384 on the H100), measured at every length.
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.nn.attention.flex_attention import create_mask

from kernel_pytorch.attention.kernels.cudnn_band import band_window
from kernel_pytorch.attention.kernels.flex import FLEX_MAX_HEAD_DIM, FLEX_MIN_HEAD_DIM, pattern_mask_mod
from kernel_pytorch.hardware import HardwareInfo
from kernel_pytorch.ops.attention import PATTERN_KERNELS, attention
from kernel_pytorch.timing import fastest_cuda_ms

__all__ = ["AttentionProblem", "choose_kernel", "eligible_kernels", "PREFERENCE", "MEASURED_ONLY",
           "SPARSE_MIN_LENGTH"]

# Kernels each vendor may use, fastest-first as measured or documented; "sdpa" (PyTorch's own
# dispatch) is always last, the universal fallback.
#
# nvidia: cuDNN first (DESIGN.md's H100 figures); flash-attn before aten's flash: the same FlashAttention-2
# algorithm, but the package is usually a newer release than the copy built into PyTorch. FlexAttention
# after both flash kernels (PyTorch's FlexAttention paper and blog report ~85-90% of FlashAttention-2's
# forward speed) and before the memory-efficient kernel, which both flash kernels beat. flex's place only
# orders the measured candidates' listing: it is never the unmeasured pick (MEASURED_ONLY).
# amd: no cuDNN; flash-attn's ROCm build (CK or Triton backend) and FlexAttention (Triton runs on ROCm)
# in the same order as on NVIDIA. cudnn_band (a causal sliding window only) before flex: both are measured.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "nvidia": ("cudnn", "flash_attn", "flash", "cudnn_band", "flex", "efficient", "sdpa"),
    "amd": ("flash_attn", "flash", "flex", "efficient", "sdpa"),
    # PyTorch's CPU dispatch already picks its flash kernel where eligible; going through it keeps
    # mask gradients and dropout available.
    "cpu": ("sdpa",),
    "intel": ("sdpa",),
    "tpu": ("sdpa",),  # XLA lowers SDPA itself
}

# Kernels taken only when a measurement on the GPU found them fastest, never as the unmeasured first
# eligible kernel: FlexAttention is fused only inside a compiled graph, and whether it beats the
# hand-written kernels depends on the shapes (and, eagerly, it is the unfused reference).
# cudnn_band computes only the windows the pass recognized, whose dense kernels it must beat by measurement.
MEASURED_ONLY = frozenset({"flex", "cudnn_band"})
# Fused kernels that make measuring FlexAttention not worth it. Its measurement compiles it, and inside
# optimize's own compile that took over 3 minutes per problem on an H100 (a 2-layer Llama-style model
# never finished optimizing); on dense and causal masks it was also the slower kernel (DESIGN.md, hd128
# L=8192 forward: 407 TFLOP/s vs cuDNN 613). Block-sparse masks, where it wins, are its job (issue 7).
_SDPA_FUSED = ("cudnn", "flash_attn", "flash", "efficient")
_FLEX_NOT_MEASURED = ("an SDPA fused kernel is eligible, and compiling FlexAttention to time it costs minutes "
                      "for a dense or causal mask it does not win")

# Key length below which a recognized sparse mask stays on the dense kernels without timing FlexAttention
# (each timing compiles it: seconds to minutes inside optimize). Measured on the H100 (bf16, hd128, 16 heads,
# batch x L = 16384, benchmarks/sparse_attention.py): with a causal 1024 window at L=2048 FlexAttention took
# 0.43 ms forward and 2.04 ms forward+backward against 0.82 and 3.51 for the dense kernels given the mask
# tensor (the ones it competes with: a mask tensor costs them 2-3x their causal time), and 0.27 / 1.56
# against 0.43 / 2.07 at L=1024. It was 4096 on a guess that FlexAttention cannot win below; shorter
# masks than 1024 keys are not measured.
SPARSE_MIN_LENGTH = 1024
_FLEX_SHORT = (f"flex: not measured: a sparse mask with fewer than {SPARSE_MIN_LENGTH} keys, where block-sparse "
               "kernels lose to the dense fused kernels")

_HALF = (torch.float16, torch.bfloat16)
# flash-attn 2.7.0 is the first release whose kernels are torch.library custom ops with fake implementations
# (Dao-AILab/flash-attention PR #1139, merged after 2.6.3): older ones call their CUDA extension directly,
# which torch.compile cannot trace (a graph break; an error with fullgraph=True or under AOTAutograd).
_FLASH_ATTN_MIN_VERSION = (2, 7)
# nvidia-cudnn-frontend 1.32: the release cudnn_band's graphs are built and tested with (pygraph.sdpa's diagonal
# band bounds, execute with ordered tensor_uids).
_CUDNN_FRONTEND_MIN_VERSION = (1, 32)
# The head dims cuDNN's fused attention takes here (sm80/sm90), through SDPA ("cudnn") and the band graphs.
_CUDNN_MAX_HEAD_DIM = 128
# flash-attn's README: head dim > 192 backward with dropout needs A100/H100-class shared memory (sm80/sm90).
_FLASH_ATTN_BIG_HEAD_BWD_CC = ((8, 0), (9, 0))
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
    # Whether the rewritten graph will be compiled (Inductor): FlexAttention is fused only then.
    compiled: bool = True
    # Whether that compiled graph runs as CUDA graphs (compile="reduce-overhead"): cudnn_band trains without them.
    cuda_graphs: bool = False
    # A block-structured mask the pass recognized: MaskPattern.sparsity, e.g. ("band", 0, 1023, 0.12) (the
    # pattern of kernel_pytorch.attention.kernels.flex and the 128x128 tile density, None when data-dependent).
    sparsity: Optional[tuple] = None

    @classmethod
    def from_tensors(cls, q, k, v, attn_mask, *, is_causal, dropout_p, enable_gqa, training,
                     compiled: bool = True, sparsity: Optional[tuple] = None,
                     cuda_graphs: bool = False) -> AttentionProblem:
        mask_kind = None if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "additive")
        return cls(tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device.type, mask_kind,
                   None if attn_mask is None else tuple(attn_mask.shape),
                   bool(attn_mask is not None and attn_mask.requires_grad and training), bool(is_causal),
                   bool(dropout_p > 0), bool(enable_gqa), bool(training), bool(compiled), bool(cuda_graphs),
                   None if sparsity is None else tuple(sparsity))

    @property
    def head_dim(self) -> int:
        return self.q_shape[-1]

    @property
    def value_dim(self) -> int:
        return self.v_shape[-1]


def _why_not(kernel: str, p: AttentionProblem, hardware: HardwareInfo) -> str | None:
    """Why ``kernel`` cannot run ``p`` (``None``: it can), mirroring the kernels' documented limits."""
    cc = hardware.compute_capability
    if kernel == "sdpa":
        return None
    if kernel == "flex":
        return _why_not_flex(p, hardware)
    if kernel == "flash_attn":
        return _why_not_flash_attn(p, hardware)
    if kernel == "cudnn_band":
        return _why_not_cudnn_band(p, hardware)
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
        if p.head_dim > _CUDNN_MAX_HEAD_DIM:
            return f"cuDNN attention here is limited to head dim {_CUDNN_MAX_HEAD_DIM} (got {p.head_dim})"
        if p.mask_requires_grad:
            return "cuDNN attention returns no gradient for the mask"
    if kernel in ("cudnn", "flash") and hardware.vendor == "nvidia" and (cc is None or cc < (8, 0)):
        return f"{kernel} needs compute capability >= 8.0"
    if p.mask_requires_grad and kernel != "efficient":
        return f"{kernel} returns no gradient for the mask"
    return None


def _why_not_flex(p: AttentionProblem, hardware: HardwareInfo) -> str | None:
    """FlexAttention's limits (see :mod:`kernel_pytorch.attention.kernels.flex` for where each was found)."""
    cc = hardware.compute_capability
    if p.mask is not None and p.sparsity is None:
        return ("flex takes no mask tensor here: FlexAttention could read it in a score_mod, but that is slower "
                "than the fused SDPA kernels that take a bias")
    if p.dropout:
        return "flex has no dropout"
    if p.dtype not in (*_HALF, torch.float32):
        return f"flex needs fp16/bf16/fp32, not {p.dtype}"
    if not (FLEX_MIN_HEAD_DIM <= p.head_dim <= FLEX_MAX_HEAD_DIM
            and FLEX_MIN_HEAD_DIM <= p.value_dim <= FLEX_MAX_HEAD_DIM):
        return (f"flex needs head dims in [{FLEX_MIN_HEAD_DIM}, {FLEX_MAX_HEAD_DIM}] "
                f"(got {p.head_dim} for q/k, {p.value_dim} for v)")
    if not hardware.triton_usable:
        return "flex needs Triton (its fused kernel is an Inductor Triton template); Triton is not usable here"
    if not p.compiled:
        return "flex is fused only in a compiled graph; eagerly it is the unfused reference (scores materialized)"
    if hardware.vendor == "nvidia" and (cc is None or cc < (7, 0)):
        return "flex needs compute capability >= 7.0 (Triton)"
    if hardware.vendor == "nvidia" and p.dtype == torch.bfloat16 and cc < (8, 0):
        return "flex in bf16 needs compute capability >= 8.0 (Triton's bf16 dot)"
    return None


def _version_tuple(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as ``"2.8.3"`` or ``"2.7.0.post2"``; () if unparsable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else ()


def _why_not_flash_attn(p: AttentionProblem, hardware: HardwareInfo) -> str | None:
    """flash-attn 2's limits (its README and ``flash_attn_interface.py``)."""
    cc = hardware.compute_capability
    if hardware.flash_attn_version is None:
        return "flash_attn: the flash-attn package is not installed"
    if _version_tuple(hardware.flash_attn_version) < _FLASH_ATTN_MIN_VERSION:
        return (f"flash_attn: flash-attn {hardware.flash_attn_version} is older than 2.7, whose kernels are the first "
                "that torch.compile can trace")
    if p.mask is not None:
        return "flash_attn takes no mask tensor"
    if p.dtype not in _HALF:
        return f"flash_attn needs fp16/bf16, not {p.dtype}"
    if p.head_dim > 256 or p.value_dim != p.head_dim:
        return f"flash_attn needs head dim <= 256 and equal for q/k and v (got {p.head_dim} and {p.value_dim})"
    if p.is_causal and p.q_shape[-2] != p.k_shape[-2]:
        # flash-attn >= 2.1 aligns causal to the bottom right; SDPA to the top left (equal when Lq == Lk)
        return "flash_attn's causal mask is bottom-right aligned when query and key lengths differ"
    if hardware.vendor == "nvidia":
        if cc is None or cc < (8, 0):
            return "flash_attn needs compute capability >= 8.0 (FlashAttention-2)"
        if p.training and p.dropout and p.head_dim > 192 and cc not in _FLASH_ATTN_BIG_HEAD_BWD_CC:
            return "flash_attn's backward for head dim > 192 with dropout needs an sm80/sm90 GPU"
    return None


def _why_not_cudnn_band(p: AttentionProblem, hardware: HardwareInfo) -> str | None:
    """The cuDNN frontend's banded attention: a causal sliding window with equal lengths, then the limits of
    cuDNN's fused attention itself (dtypes, head dims, GPU), which are the ``"cudnn"`` kernel's."""
    pattern = None if p.sparsity is None else p.sparsity[:3]
    if band_window(pattern, p.q_shape[-2], p.k_shape[-2]) is None:
        return "cudnn_band computes a causal sliding window (a recognized band 0 <= i - j <= w, Lq == Lk) only"
    if hardware.cudnn_frontend_version is None:
        return "cudnn_band: the nvidia-cudnn-frontend package is not installed (extra 'cudnn')"
    if _version_tuple(hardware.cudnn_frontend_version) < _CUDNN_FRONTEND_MIN_VERSION:
        minimum = ".".join(map(str, _CUDNN_FRONTEND_MIN_VERSION))
        return (f"cudnn_band: nvidia-cudnn-frontend {hardware.cudnn_frontend_version} is older than {minimum}, the "
                "release its cuDNN graphs are built and tested with")
    if p.dropout:
        return "cudnn_band has no dropout"
    if p.training and p.cuda_graphs:
        # H100: its backward, warmed up and then captured, fails the capture ("operation would make the
        # legacy stream depend on a capturing blocking stream") once another band problem has run in the
        # process, and so does the cuDNN frontend's own torch.ops.cudnn.sdpa_bwd; alone, both capture. The
        # forward captured every time.
        return "cudnn_band trains without CUDA graphs only (its backward failed CUDA-graph capture on the H100)"
    if p.value_dim != p.head_dim:
        return f"cudnn_band needs equal q/k and v head dims (got {p.head_dim} and {p.value_dim})"
    reason = _why_not("cudnn", p, hardware)
    return None if reason is None else f"cudnn_band runs cuDNN's fused attention: {reason}"


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
                  hardware: HardwareInfo, training: bool, compiled: bool = True,
                  sparsity: Optional[tuple] = None, cuda_graphs: bool = False) -> tuple[str, str]:
    """The kernel for this call and the reason, from example tensors (real or fake) of its inputs.

    ``compiled``: whether the graph the call lands in will be compiled (Inductor); ``False`` rules out
    ``"flex"``, which is fused only when compiled. ``sparsity``: the block structure of ``attn_mask`` the
    pass recognized (``MaskPattern.sparsity``); ``"flex"`` then computes the pattern, not the tensor.
    ``cuda_graphs``: whether that compiled graph runs as CUDA graphs (``compile="reduce-overhead"``)."""
    problem = AttentionProblem.from_tensors(q, k, v, attn_mask, is_causal=is_causal, dropout_p=dropout_p,
                                            enable_gqa=enable_gqa, training=training, compiled=compiled,
                                            sparsity=sparsity, cuda_graphs=cuda_graphs)
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
            return "sdpa", f"no fused kernel ran correctly ({passed_over})"
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
        reference = _run(_attention_fn("sdpa"), inputs, "sdpa", problem, with_dropout=False)
        runnable, failures = {}, []
        for kernel in kernels:
            try:
                # The numerics run comes first, so a compiled kernel is compiled (once) before the timing;
                # then one run as timed (with dropout, where the problem has it), so the timing cannot fail.
                fn = _attention_fn(kernel)
                timed = functools.partial(_run, fn, inputs, kernel, problem, with_dropout=True)
                with _measurement_compiles():
                    result = _run(fn, inputs, kernel, problem, with_dropout=False)
                    timed()
                error = _relative_error(result, reference)
                if not error <= _NUMERICS_LIMIT.get(problem.dtype, 1e-4):
                    failures.append(f"{kernel}: differs from math by {error:.1e}")
                    continue
                runnable[kernel] = timed
            except Exception as error:  # noqa: BLE001 - a limit not modelled above, a failed compile, a
                # missing package: the kernel is passed over with the error, the choice goes on.
                first_line = (str(error).strip().splitlines() or [""])[0][:160]
                failures.append(f"{kernel}: {type(error).__name__}: {first_line}")
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


@contextlib.contextmanager
def _measurement_compiles():
    """How a measurement inside ``optimize`` compiles (FlexAttention).

    Dynamo's recompile limits (8 per code object by default) are lifted: one entry per attention problem
    would otherwise push a model's later problems back to eager. And the backward is compiled with the
    forward: the measurement runs inside the model's own capture, which holds Dynamo's compile lock, and
    on CUDA autograd runs the backward on a device thread, whose lazy backward compile waited for that
    lock forever (H100, the sliding window in training: optimize hung in ``compile_fx_backward``).
    """
    with torch._dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16), \
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        yield


def _random_inputs(p: AttentionProblem) -> dict:
    def make(shape):
        return torch.randn(shape, device=p.device_type, dtype=p.dtype, requires_grad=p.training)

    if p.sparsity is not None:
        return {"q": make(p.q_shape), "k": make(p.k_shape), "v": make(p.v_shape), **_sparse_mask(p)}
    mask = None
    if p.mask == "bool":
        mask = torch.ones(p.mask_shape, device=p.device_type, dtype=torch.bool)
    elif p.mask == "additive":
        mask = torch.randn(p.mask_shape, device=p.device_type, dtype=p.dtype, requires_grad=p.mask_requires_grad)
    return {"q": make(p.q_shape), "k": make(p.k_shape), "v": make(p.v_shape), "mask": mask}


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
    out = attention_fn(inputs["q"], inputs["k"], inputs["v"], None if pattern else inputs["mask"],
                    dropout_p=0.1 if (p.dropout and with_dropout) else 0.0, is_causal=p.is_causal,
                    enable_gqa=p.enable_gqa, kernel=kernel, **pattern)
    if p.training:
        grads = torch.autograd.grad(out, [inputs["q"], inputs["k"], inputs["v"]], torch.ones_like(out))
        return torch.cat([out.detach().flatten(), *(g.flatten() for g in grads)])
    return out.detach()


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
