"""FP8 training for ``nn.Linear``: dynamic-scale float8 matmuls forward and backward, as a
``torch.library`` custom op with a registered autograd formula.

    y  = x @ W.T + b                      x: (M, K), W: (N, K), y: (M, N) in x's dtype
    forward         q(x, fwd) @ q(W, fwd).T              reduction over K
    grad_input      q(dy, bwd) @ q(W, fwd)               reduction over N
    grad_weight     q(dy.T, bwd) @ q(x, fwd)             reduction over M
    grad_bias       dy.sum(0)                            high precision

``q(t, dtype)`` casts ``t * scale`` to the float8 ``dtype`` (saturating at its largest finite value); the
matmul then multiplies its fp32 accumulator by ``1 / scale`` of each operand. ``fwd`` is E4M3 (more
mantissa, for values), ``bwd`` is E5M2 (more range, for gradients), the split torchao's Float8Linear uses.
Rowwise scales run along each matmul's reduction dimension, which differs between the three matmuls,
so each operand is quantized once per use (x along K and along M, W along K and along N, dy along N
and along M); tensorwise shares one scale between an operand's two uses.

Recipes (the formulas live in :mod:`kernel_pytorch.ops.float8_cast`, the only place scales are computed):

    tensorwise   scale = fp8_max / max(amax(|t|), EPS)                     one fp32 scalar per tensor
    rowwise      scale[i] = fp8_max / max(amax_j(|t[i, j]|), EPS)          one per row, j the reduction dim

``EPS`` bounds the scale so an all-zero tensor or row gives a finite scale (zeros stay zeros), and the
saturating cast means a huge outlier only shrinks everyone else's resolution, never produces inf/NaN.

Paths. ``emulate=True`` runs the same quantization (cast to the float8 dtype with the same scales), then
dequantizes to fp32 and multiplies in fp32, on any device: the CPU path and the reference for tests.
``emulate=False`` calls ``torch._scaled_mm`` and needs an FP8 GPU (NVIDIA compute capability >= 8.9, or
AMD MI300, whose float8 formats are the ``*fnuz`` dtypes: pass them as ``forward_dtype`` /
``backward_dtype`` there); anywhere else it raises, pointing at ``emulate=True``.

Quantization (:mod:`kernel_pytorch.ops.float8_cast`): one Triton pass computes the maxima, a second
scales, casts and writes each layout a matmul needs, so the backward never transposes: the forward
writes x both as (M, K) for itself and as (K, M) for the weight gradient, and saves that fp8 copy (half
of x's bytes) instead of x; likewise W as (N, K) for itself and as (K, N), scaled along N, for the input
gradient, which then reads one byte of W per element instead of casting W again (two bytes read, one
written, one launch). On other devices the same formulas run as PyTorch ops.

Layers (docs/design.md, "Kernels"): ``float8_cast`` kernels -> :func:`float8_mm_fwd` /
:func:`float8_mm_bwd` (emulated or ``_scaled_mm``) -> ``kernel_pytorch::float8_linear`` and
``kernel_pytorch::float8_linear_backward`` (``triton_op``: Inductor traces their bodies; fake implementations
are the bodies traced on fake tensors; autograd) ->
:func:`float8_linear` and :class:`Float8Linear`.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from kernel_pytorch.ops.float8_cast import EPS, FLOAT8_DTYPES, Amax, abs_max, cast
from kernel_pytorch.ops.triton_utils import eager_launches, plain_eager

__all__ = ["Float8Linear", "float8_linear", "float8_eligible", "float8_hardware_reason", "float8_dtypes_for",
           "quantize", "float8_mm_fwd", "float8_mm_bwd",
           "RECIPES", "EPS", "FP8_ALIGNMENT"]

RECIPES = ("tensorwise", "rowwise")
# _scaled_mm requires both dimensions of the second operand, i.e. in/out features, to be multiples of 16,
# and the reduction dimension of each product too (M in the weight gradient: zero-padded to it).
FP8_ALIGNMENT = 16
_HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"unknown float8 recipe {recipe!r}; expected one of {RECIPES}")


def quantize(t: Tensor, fp8_dtype: torch.dtype, recipe: str) -> tuple[Tensor, Tensor]:
    """``(t_fp8, inv_scale)`` of a 2-D ``t`` quantized along its last dimension: ``inv_scale = 1 / scale``
    (what ``_scaled_mm`` takes) is 0-dim for tensorwise, ``(rows, 1)`` for rowwise."""
    _check_recipe(recipe)
    tensorwise = recipe == "tensorwise"
    q = cast(t, abs_max(t, tensorwise, rows=True), fp8_dtype, rows=True)
    return q.rows, q.rows_inv


# ------------------------------------------------------------------------------------------- matmuls

def float8_hardware_reason(device: torch.device) -> Optional[str]:
    """None when ``device`` can run ``torch._scaled_mm``, else why not."""
    if device.type != "cuda":
        return (f"FP8 matmuls (torch._scaled_mm) need a GPU with compute capability >= 8.9 (Ada, Hopper, "
                f"Blackwell) or an AMD MI300; the model is on {device.type!r}")
    if torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if not any(a in arch for a in ("gfx94", "gfx95")):
            return f"FP8 matmuls need an AMD MI300 or newer; this GPU is {arch}"
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"FP8 matmuls need compute capability >= 8.9; this GPU is {major}.{minor}"
    return None


def float8_dtypes_for(device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(forward, backward) float8 dtypes of ``device``: E4M3/E5M2, in the ``fnuz`` variants on MI300 (gfx94x),
    whose matrix cores take only those."""
    if device.type == "cuda" and torch.version.hip is not None:
        if "gfx94" in torch.cuda.get_device_properties(device).gcnArchName:
            return torch.float8_e4m3fnuz, torch.float8_e5m2fnuz
    return torch.float8_e4m3fn, torch.float8_e5m2


# Every FP8 forward and backward asks; the answer for a device never changes within a process.
_cached_hardware_reason = functools.lru_cache(maxsize=None)(float8_hardware_reason)


def _check_fp8_device(device: torch.device) -> None:
    """Raise unless ``device`` can run ``torch._scaled_mm``."""
    reason = _cached_hardware_reason(device)
    if reason is not None:
        raise RuntimeError(f"Float8Linear with emulate=False: {reason}; use Float8Linear.from_linear(..., "
                           f"emulate=True) to run the same numerics in fp32")


def _mm(a: Tensor, a_inv: Tensor, b: Tensor, b_inv: Tensor, out_dtype: torch.dtype, emulate: bool,
        bias: Optional[Tensor] = None, fast_accum: bool = False) -> Tensor:
    """``(a_fp8 * a_inv) @ (b_fp8 * b_inv).T + bias`` in ``out_dtype``.

    ``a``: (M, R) float8, ``a_inv``: 0-dim or (M, 1); ``b``: (P, R) float8, ``b_inv``: 0-dim or (P, 1);
    R is the reduction dimension. The emulated path dequantizes and multiplies in fp32, matching
    ``_scaled_mm``'s fp32 accumulation and its epilogue (scales, then bias, then one rounding).
    ``fast_accum``: Hopper's faster FP8 accumulation (fewer fp32 promotions), for the forward only, as
    torchao does (faster: benchmarks/results/fp8.json, "ceilings"), while the gradients, summed over long
    reductions, keep the exact accumulation.
    """
    if emulate:
        out = (a.float() * a_inv) @ (b.float() * b_inv).t()
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
    # Rowwise _scaled_mm (CUTLASS f8f8bf16_rowwise) writes bf16 only and takes a bf16 bias; tensorwise
    # (cuBLASLt) writes any of bf16/fp16/fp32 but takes a bias only in a 16-bit output dtype. Anything
    # else gets its bias added afterwards.
    rowwise = a_inv.dim() > 0
    mm_dtype = torch.bfloat16 if rowwise else out_dtype
    fuse_bias = bias is not None and mm_dtype in (torch.bfloat16, torch.float16) and bias.dtype == mm_dtype
    # The second operand must be column-major: b is row-major (P, R), so b.t() is column-major (R, P).
    out = torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv.t() if rowwise else b_inv,
                           bias=bias if fuse_bias else None, out_dtype=mm_dtype, use_fast_accum=fast_accum)
    if bias is not None and not fuse_bias:
        out = out.float() + bias.float()
    return out.to(out_dtype)


def float8_mm_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: str, emulate: bool,
                  forward_dtype: torch.dtype, weight_grad: bool = True, x_amax: Optional[Tensor] = None,
                  input_grad: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``x @ weight.T + bias`` with both operands in ``forward_dtype``; x (M, K), weight (N, K).

    ``x_amax``: max |x| (shape (1,), fp32), tensorwise only, when the kernel that produced x computed it
    (``rms_norm`` / ``gated_activation*`` with ``fp8_amax=True``): x's cast then skips its own reduction.

    Returns ``(out, x_t, x_t_inv, w_t, w_t_inv)``: what the backward needs, written by the same cast passes
    as the forward's operands: x transposed to (K, M padded to 16) in float8, scaled along M (for the
    weight gradient; empty without ``weight_grad``: inference and frozen weights skip that write), and W
    transposed to (K, N), scaled along N (for the input gradient; empty without ``input_grad``). Saving
    W.T costs N * K bytes until the backward, which otherwise cast W again: at 8192^3 that is 64 MB kept
    against a 128 MB read, a 64 MB write and a launch saved."""
    if not emulate:
        _check_fp8_device(x.device)
    tensorwise = recipe == "tensorwise"
    if x_amax is not None and not tensorwise:
        raise ValueError("x_amax (the input's maximum, computed by its producer) is for the tensorwise recipe: "
                         "rowwise scales need the maxima of x's rows and columns")
    x_max = Amax(tensor=x_amax) if x_amax is not None else abs_max(x, tensorwise, rows=True, cols=weight_grad)
    # scales along K for the forward, along M for grad_weight
    x_q = cast(x, x_max, forward_dtype, rows=True, cols=weight_grad, cols_multiple=FP8_ALIGNMENT)
    # scales along K for the forward, along N for grad_input (N is a multiple of 16: float8_eligible)
    w_q = cast(weight, abs_max(weight, tensorwise, rows=True, cols=input_grad), forward_dtype, rows=True,
               cols=input_grad)
    out = _mm(x_q.rows, x_q.rows_inv, w_q.rows, w_q.rows_inv, x.dtype, emulate, bias, fast_accum=True)
    x_t, x_t_inv = (x_q.cols, x_q.cols_inv) if weight_grad else _nothing_saved(x, forward_dtype)
    w_t, w_t_inv = (w_q.cols, w_q.cols_inv) if input_grad else _nothing_saved(x, forward_dtype)
    return out, x_t, x_t_inv, w_t, w_t_inv


def _nothing_saved(like: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return like.new_empty(0, dtype=fp8_dtype), like.new_empty(0, dtype=torch.float32)


def float8_mm_bwd(grad_out: Tensor, x_t: Tensor, x_t_inv: Tensor, w_t: Tensor, w_t_inv: Tensor,
                  weight_dtype: torch.dtype, recipe: str, emulate: bool, backward_dtype: torch.dtype,
                  input_grad: bool = True, weight_grad: bool = True,
                  grad_out_amax: Optional[Tensor] = None) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(grad_input, grad_weight)``: ``dy @ W`` and ``dy.T @ x`` with dy in ``backward_dtype``, from what
    :func:`float8_mm_fwd` returned; scales along each product's reduction dimension. ``grad_out_amax``:
    max |dy| (tensorwise) from the kernel that computed dy, which dy's cast then does not look for."""
    if not emulate:
        _check_fp8_device(grad_out.device)
    tensorwise = recipe == "tensorwise"
    dy_max = Amax(tensor=grad_out_amax) if grad_out_amax is not None and tensorwise else abs_max(
        grad_out, tensorwise, rows=input_grad, cols=weight_grad)
    dy_q = cast(grad_out, dy_max, backward_dtype, rows=input_grad, cols=weight_grad, cols_multiple=FP8_ALIGNMENT)
    grad_input = grad_weight = None
    if input_grad:  # reduce over N: dy (M, N) per row, W.T (K, N) per row
        grad_input = _mm(dy_q.rows, dy_q.rows_inv, w_t, w_t_inv, grad_out.dtype, emulate)
    if weight_grad:  # reduce over M: dy.T (N, M) per row, x.T (K, M) per row
        grad_weight = _mm(dy_q.cols, dy_q.cols_inv, x_t, x_t_inv, weight_dtype, emulate)
    return grad_input, grad_weight


# ------------------------------------------------------------------------------------------ custom ops
# ``triton_op`` rather than ``custom_op``: under torch.compile (how ``optimize`` runs models) Inductor traces
# these bodies and calls the cast kernels and ``torch._scaled_mm`` from its generated code, instead of calling
# back into this Python per layer and step. As custom_ops their host time per forward + backward was many
# times their GPU time at small shapes, which made an FP8 model host-bound (docs/kernels.md, "FP8 linear").
# Fake tensors: the same bodies, traced (no launch, nothing read).

def _float8_linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], x_amax: Optional[Tensor], recipe: str,
                           emulate: bool, forward_dtype: torch.dtype, backward_dtype: torch.dtype, input_grad: bool,
                           weight_grad: bool, grad_amax_slot: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                             Tensor]:
    out, x_t, x_t_inv, w_t, w_t_inv = float8_mm_fwd(x, weight, bias, recipe, emulate, forward_dtype, weight_grad,
                                                    x_amax, input_grad)
    # The slot: a (1,) fp32 output whose value nothing reads and whose gradient, from the consumer the slot
    # is handed to, is max |grad_out| (see float8_linear); empty without grad_amax_slot.
    slot = torch.zeros(1 if grad_amax_slot else 0, dtype=torch.float32, device=x.device)
    # The fp8 bytes leave the op as uint8: integer outputs are data to autograd and to the op checkers
    # (which would otherwise try to sum and multiply float8 tensors); the backward views them back.
    return out, x_t.view(torch.uint8), x_t_inv, w_t.view(torch.uint8), w_t_inv, slot


def _float8_linear_backward(grad_out: Tensor, x_t: Tensor, x_t_inv: Tensor, w_t: Tensor, w_t_inv: Tensor,
                            weight: Tensor, recipe: str, emulate: bool, forward_dtype: torch.dtype,
                            backward_dtype: torch.dtype, input_grad: bool, weight_grad: bool,
                            grad_out_amax: Optional[Tensor]) -> list[Tensor]:
    """``weight``: only its dtype is used (the weight gradient's); the Parameter is passed, not a copy."""
    gi, gw = float8_mm_bwd(grad_out, x_t.view(forward_dtype), x_t_inv, w_t.view(forward_dtype), w_t_inv,
                           weight.dtype, recipe, emulate, backward_dtype, input_grad, weight_grad, grad_out_amax)
    # An op cannot return None: an unneeded gradient comes back as an empty tensor.
    return [gi if gi is not None else grad_out.new_empty(0), gw if gw is not None else weight.new_empty(0)]


_float8_linear_op = torch.library.triton_op("kernel_pytorch::float8_linear", _float8_linear_forward,
                                            mutates_args=())
_float8_linear_backward_op = torch.library.triton_op("kernel_pytorch::float8_linear_backward",
                                                     _float8_linear_backward, mutates_args=())


def _setup_context(ctx, inputs, output):
    x, weight, bias, _x_amax, recipe, emulate, forward_dtype, backward_dtype, input_grad, _weight_grad, \
        grad_amax_slot = inputs
    _, x_t, x_t_inv, w_t, w_t_inv, slot = output
    ctx.save_for_backward(x_t, x_t_inv, w_t, w_t_inv, weight)
    ctx.mark_non_differentiable(x_t_inv, w_t_inv, *(() if grad_amax_slot else (slot,)))
    # Only the output has a gradient; materializing zeros for the others cost a 64 MB fill per step at
    # 8192^2 (the fp8 x.T), seen in the profile.
    ctx.set_materialize_grads(False)
    ctx.config = (recipe, emulate, forward_dtype, backward_dtype, input_grad)
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, grad_out, _grad_x_t, _grad_x_t_inv, _grad_w_t, _grad_w_t_inv, grad_out_amax):
    """``grad_out_amax``: the slot's gradient (``grad_amax_slot=True``), max |grad_out| from the consumer's
    backward kernel; None when the slot had no consumer (grads are not materialized), then found here."""
    x_t, x_t_inv, w_t, w_t_inv, weight = ctx.saved_tensors
    recipe, emulate, forward_dtype, backward_dtype, input_grad = ctx.config
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    if grad_out is None:  # only the slot was used (grads are not materialized): nothing flows back
        return (None,) * 11
    if need_x and not input_grad:
        raise RuntimeError("float8_linear: the input's gradient is needed but the forward ran with input_grad=False, "
                           "so W.T was not kept")
    grad_out = grad_out.contiguous()
    gi = gw = gb = None
    if need_x or need_w:
        args = (grad_out, x_t, x_t_inv, w_t, w_t_inv, weight, recipe, emulate, forward_dtype, backward_dtype,
                need_x, need_w, grad_out_amax)
        if plain_eager(grad_out, weight):
            with eager_launches():
                gi, gw = _float8_linear_backward(*args)
        else:
            gi, gw = _float8_linear_backward_op(*args)
        gi, gw = (gi if need_x else None), (gw if need_w else None)
    if need_b:
        gb = grad_out.float().sum(0).to(ctx.bias_dtype)
    return (gi, gw, gb) + (None,) * 8


_float8_linear_op.register_autograd(_backward, setup_context=_setup_context)


class _Float8LinearFunction(torch.autograd.Function):
    """The op's body and autograd formula without its dispatch, for plain eager calls
    (:func:`~kernel_pytorch.ops.triton_utils.plain_eager`): the same kernels, numerics and saved tensors.
    The op's Python dispatch, forward and backward, was host time the GPU waited for on the per-call path,
    which this path removes (benchmarks/results/fp8.json, "linear" note; docs/kernels.md, "FP8 linear")."""

    @staticmethod
    def forward(ctx, *inputs):
        # ctx-taking forward, not a setup_context staticmethod: with one, Function.apply binds the arguments
        # through inspect.signature on every call, host time per forward (docs/kernels.md, "Host time").
        with eager_launches():
            output = _float8_linear_forward(*inputs)
        _setup_context(ctx, inputs, output)
        # Only the output and the slot leave: the fp8 copies and scales stay in ctx, which the op has to return
        # as outputs. Autograd wraps each output it is handed, host time per call.
        out, *_, slot = output
        return out, slot

    @staticmethod
    def backward(ctx, grad_out, grad_out_amax):
        return _backward(ctx, grad_out, None, None, None, None, grad_out_amax)


# ----------------------------------------------------------------------------------- functional/module

def float8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, recipe: str = "tensorwise",
                  emulate: bool = False, forward_dtype: torch.dtype = torch.float8_e4m3fn,
                  backward_dtype: torch.dtype = torch.float8_e5m2, x_amax: Optional[Tensor] = None,
                  grad_amax_slot: bool = False):
    """``F.linear(x, weight, bias)`` with float8 matmuls forward and backward; x of shape (..., K).

    ``x_amax``: ``max |x|`` as a (1,) fp32 tensor, computed by the kernel that produced x (tensorwise recipe
    only): the forward then does not read x to find it. It must be x's exact maximum (the scale, and so the
    result, is that of the unfused path); ``rms_norm`` and ``gated_activation*`` return it with
    ``fp8_amax=True``, and the FP8 pass wires them up where a norm or gated activation feeds an FP8 linear.

    ``grad_amax_slot=True`` (tensorwise) returns ``(out, slot)``: hand ``slot`` to the one consumer of
    ``out`` whose backward computes the maximum of out's gradient (``gated_activation_packed(...,
    grad_amax_slot=slot)``). The slot's gradient carries that maximum to this linear's backward, which then
    does not read the gradient to find it. The consumer must be out's only user: the maximum is that of
    its gradient, which is out's whole gradient only then."""
    _check_recipe(recipe)
    for name, dt in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype)):
        if dt not in FLOAT8_DTYPES:
            raise ValueError(f"{name} must be a float8 dtype, got {dt}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if grad_amax_slot and recipe != "tensorwise":
        raise ValueError("grad_amax_slot (the gradient's maximum from its consumer) is for the tensorwise recipe: "
                         "rowwise scales need the maxima of the gradient's rows and columns")
    input_grad = torch.is_grad_enabled() and x.requires_grad
    weight_grad = torch.is_grad_enabled() and weight.requires_grad
    args = (x2, weight, bias, x_amax, recipe, emulate, forward_dtype, backward_dtype, input_grad, weight_grad,
            bool(grad_amax_slot))
    if plain_eager(x2, weight, bias, x_amax):
        out, slot = _Float8LinearFunction.apply(*args)
    else:
        out, *_, slot = _float8_linear_op(*args)
    out = out.reshape(*lead, weight.shape[0])
    return (out, slot) if grad_amax_slot else out


def float8_eligible(linear: nn.Module) -> Optional[str]:
    """None when ``linear`` can become a :class:`Float8Linear`, else the reason it cannot."""
    if isinstance(linear, Float8Linear):
        return "already a Float8Linear"
    if not isinstance(linear, nn.Linear):
        return f"not an nn.Linear ({type(linear).__name__})"
    if linear.weight.dtype not in _HIGH_PRECISION:
        return f"weight dtype {linear.weight.dtype} is not bf16/fp16/fp32"
    if linear.bias is not None and linear.bias.dtype not in _HIGH_PRECISION:
        return f"bias dtype {linear.bias.dtype} is not bf16/fp16/fp32"
    bad = [f"{n}={v}" for n, v in (("in_features", linear.in_features), ("out_features", linear.out_features))
           if v % FP8_ALIGNMENT]
    if bad:
        return f"{', '.join(bad)} not a multiple of {FP8_ALIGNMENT} (torch._scaled_mm requires it)"
    return None


class Float8Linear(nn.Module):
    """Drop-in for an ``nn.Linear`` whose matmuls (forward and both backward ones) run in float8.

    Holds the original ``weight`` / ``bias`` Parameters (the same objects, dtype unchanged), so the
    state dict, optimizer state and weight tying are those of the ``nn.Linear`` it replaces; only the
    matmuls are quantized, on the fly, with fresh (dynamic) scales each call.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, recipe: str = "tensorwise",
                 emulate: bool = False, forward_dtype: torch.dtype = torch.float8_e4m3fn,
                 backward_dtype: torch.dtype = torch.float8_e5m2, device=None, dtype=None):
        super().__init__()
        _check_recipe(recipe)
        self.in_features, self.out_features = in_features, out_features
        self.recipe, self.emulate = recipe, emulate
        self.forward_dtype, self.backward_dtype = forward_dtype, backward_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]  # the same init as nn.Linear

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "tensorwise", emulate: bool = False,
                    forward_dtype: torch.dtype = torch.float8_e4m3fn,
                    backward_dtype: torch.dtype = torch.float8_e5m2) -> "Float8Linear":
        """Wrap ``linear``'s own Parameters (no copy); raises ValueError when it is not eligible."""
        reason = float8_eligible(linear)
        if reason is not None:
            raise ValueError(f"cannot convert {linear} to Float8Linear: {reason}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        _check_recipe(recipe)
        new.recipe, new.emulate = recipe, emulate
        new.forward_dtype, new.backward_dtype = forward_dtype, backward_dtype
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def forward(self, x: Tensor) -> Tensor:
        return float8_linear(x, self.weight, self.bias, self.recipe, self.emulate, self.forward_dtype,
                             self.backward_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe}, emulate={self.emulate}, "
                f"forward_dtype={self.forward_dtype}, backward_dtype={self.backward_dtype}")
