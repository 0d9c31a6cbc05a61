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
The backward requantizes x and W from the high-precision copies autograd saves (x as nn.Linear saves it,
W is the Parameter), because rowwise scales run along each matmul's reduction dimension, which differs
between the three matmuls.

Recipes (the scale functions, :func:`tensorwise_scale` and :func:`rowwise_scale`, are the only place
scales are computed):

    tensorwise   scale = fp8_max / max(amax(|t|), EPS)                     one fp32 scalar per tensor
    rowwise      scale[i] = fp8_max / max(amax_j(|t[i, j]|), EPS)          one per row, j the reduction dim

``EPS`` bounds the scale so an all-zero tensor or row gives a finite scale (zeros stay zeros), and the
saturating cast means a huge outlier only shrinks everyone else's resolution, never produces inf/NaN.

Paths. ``emulate=True`` runs the same quantization (cast to the float8 dtype with the same scales), then
dequantizes to fp32 and multiplies in fp32, on any device: the CPU path and the reference for tests.
``emulate=False`` calls ``torch._scaled_mm`` and needs an FP8 GPU (NVIDIA compute capability >= 8.9, or
AMD MI300, whose float8 formats are the ``*fnuz`` dtypes: pass them as ``forward_dtype`` /
``backward_dtype`` there); anywhere else it raises, pointing at ``emulate=True``.

Not fused (future work, stated plainly): the amax reduction and the cast are separate PyTorch ops here,
two reads of each tensor. The issue asks for amax computed in the same kernel that casts (one Triton
kernel per operand, as torchao's fused cast does); that kernel does not exist yet. Under
``torch.compile`` Inductor may fuse the reduction and the cast on its own, but nothing here relies on it.

Layers (DESIGN.md "Kernels"): scale functions + :func:`quantize` -> :func:`float8_mm_fwd` /
:func:`float8_mm_bwd` (emulated or ``_scaled_mm``) -> ``kernel_pytorch::float8_linear`` and
``kernel_pytorch::float8_linear_backward`` (custom ops, fake implementations, autograd) ->
:func:`float8_linear` and :class:`Float8Linear`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Float8Linear", "float8_linear", "float8_eligible", "tensorwise_scale", "rowwise_scale",
           "quantize", "float8_mm_fwd", "float8_mm_bwd", "RECIPES", "EPS", "FP8_ALIGNMENT"]

RECIPES = ("tensorwise", "rowwise")
# Lower bound on amax, so scale = fp8_max / amax stays finite for all-zero tensors/rows (the value
# torchao and PyTorch's own _scaled_mm tests use: fp8_max / 1e-12 ~ 4.5e14 is far inside fp32's range).
EPS = 1e-12
# _scaled_mm requires both dimensions of the second operand, i.e. in/out features, to be multiples of 16.
FP8_ALIGNMENT = 16
_HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)
_FP8_DTYPES = tuple(getattr(torch, n) for n in
                    ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


# ---------------------------------------------------------------------------------------------- scales

def tensorwise_scale(t: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """``fp8_max / max(amax(|t|), EPS)`` as a 0-dim fp32 tensor: one scale for the whole tensor."""
    amax = t.detach().abs().amax().float()
    return torch.finfo(fp8_dtype).max / amax.clamp(min=EPS)


def rowwise_scale(t: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """``fp8_max / max(amax_j(|t[i, j]|), EPS)`` per row of the 2-D ``t``, shape ``(rows, 1)`` fp32.

    The caller lays ``t`` out so that its last dimension is the matmul's reduction dimension: each scale
    then multiplies a whole row or column of the product, which is what lets the matmul apply it to its
    accumulator instead of inside the reduction.
    """
    amax = t.detach().abs().amax(dim=-1, keepdim=True).float()
    return torch.finfo(fp8_dtype).max / amax.clamp(min=EPS)


def quantize(t: Tensor, fp8_dtype: torch.dtype, recipe: str) -> tuple[Tensor, Tensor]:
    """``(t_fp8, inv_scale)`` of a 2-D ``t`` quantized along its last dimension.

    ``inv_scale = 1 / scale`` (what ``_scaled_mm`` takes) is 0-dim for tensorwise, ``(rows, 1)`` for
    rowwise. The clamp makes the cast saturate: ``to(float8_e4m3fn)`` of a value past 448 would be NaN.
    """
    if recipe == "tensorwise":
        scale = tensorwise_scale(t, fp8_dtype)
    elif recipe == "rowwise":
        scale = rowwise_scale(t, fp8_dtype)
    else:
        raise ValueError(f"unknown float8 recipe {recipe!r}; expected one of {RECIPES}")
    fp8_max = torch.finfo(fp8_dtype).max
    t_fp8 = (t.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return t_fp8, scale.reciprocal()


# ------------------------------------------------------------------------------------------- matmuls

def _check_fp8_device(device: torch.device) -> None:
    """Raise unless ``device`` can run ``torch._scaled_mm``."""
    hint = "use Float8Linear.from_linear(..., emulate=True) to run the same numerics in fp32"
    if device.type != "cuda":
        raise RuntimeError(
            f"Float8Linear with emulate=False needs FP8 matmuls (torch._scaled_mm), which need a GPU with "
            f"compute capability >= 8.9 (Ada, Hopper, Blackwell) or an AMD MI300; got device "
            f"{device.type!r}: {hint}")
    if torch.version.hip is not None:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if not any(a in arch for a in ("gfx94", "gfx95")):
            raise RuntimeError(f"Float8Linear with emulate=False needs an MI300 or newer for FP8 matmuls; "
                               f"got {arch}: {hint}")
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise RuntimeError(f"Float8Linear with emulate=False needs compute capability >= 8.9 for FP8 "
                           f"matmuls; this GPU is {major}.{minor}: {hint}")


def _mm(a: Tensor, a_inv: Tensor, b: Tensor, b_inv: Tensor, out_dtype: torch.dtype, emulate: bool,
        bias: Optional[Tensor] = None) -> Tensor:
    """``(a_fp8 * a_inv) @ (b_fp8 * b_inv).T + bias`` in ``out_dtype``.

    ``a``: (M, R) float8, ``a_inv``: 0-dim or (M, 1); ``b``: (P, R) float8, ``b_inv``: 0-dim or (P, 1);
    R is the reduction dimension. The emulated path dequantizes and multiplies in fp32, matching
    ``_scaled_mm``'s fp32 accumulation and its epilogue (scales, then bias, then one rounding).
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
    out = torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv.t().contiguous() if rowwise else b_inv,
                           bias=bias if fuse_bias else None, out_dtype=mm_dtype)
    if bias is not None and not fuse_bias:
        out = out.float() + bias.float()
    return out.to(out_dtype)


def _pad_rows(t: Tensor, multiple: int) -> Tensor:
    """Zero-pad the first dimension of ``t`` to a multiple: padding rows add nothing to a reduction over
    them and do not change any amax."""
    pad = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def float8_mm_fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: str, emulate: bool,
                  forward_dtype: torch.dtype) -> Tensor:
    """``x @ weight.T + bias`` with both operands quantized to ``forward_dtype``; x (M, K), weight (N, K)."""
    if not emulate:
        _check_fp8_device(x.device)
    x_fp8, x_inv = quantize(x, forward_dtype, recipe)  # scales along K: per row of x
    w_fp8, w_inv = quantize(weight, forward_dtype, recipe)  # along K: per output row of W
    return _mm(x_fp8, x_inv, w_fp8, w_inv, x.dtype, emulate, bias)


def float8_mm_bwd(grad_out: Tensor, x: Tensor, weight: Tensor, recipe: str, emulate: bool,
                  forward_dtype: torch.dtype, backward_dtype: torch.dtype, input_grad: bool = True,
                  weight_grad: bool = True) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(grad_input, grad_weight)``: ``dy @ W`` and ``dy.T @ x`` with dy in ``backward_dtype`` and the
    other operand requantized in ``forward_dtype``, scales along each product's reduction dimension."""
    if not emulate:
        _check_fp8_device(grad_out.device)
    grad_input = grad_weight = None
    if input_grad:  # reduce over N: dy (M, N) rows, W.T (K, N) rows
        g_fp8, g_inv = quantize(grad_out, backward_dtype, recipe)
        w_fp8, w_inv = quantize(weight.t().contiguous(), forward_dtype, recipe)
        grad_input = _mm(g_fp8, g_inv, w_fp8, w_inv, x.dtype, emulate)
    if weight_grad:  # reduce over M: dy.T (N, M) rows, x.T (K, M) rows
        g, xx = grad_out, x
        if not emulate:  # _scaled_mm needs the reduction dimension (M here) to be a multiple of 16
            g, xx = _pad_rows(g, FP8_ALIGNMENT), _pad_rows(xx, FP8_ALIGNMENT)
        g_fp8, g_inv = quantize(g.t().contiguous(), backward_dtype, recipe)
        x_fp8, x_inv = quantize(xx.t().contiguous(), forward_dtype, recipe)
        grad_weight = _mm(g_fp8, g_inv, x_fp8, x_inv, weight.dtype, emulate)
    return grad_input, grad_weight


# ------------------------------------------------------------------------------------------ custom ops

@torch.library.custom_op("kernel_pytorch::float8_linear", mutates_args=())
def _float8_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], recipe: str, emulate: bool,
                      forward_dtype: torch.dtype, backward_dtype: torch.dtype) -> Tensor:
    return float8_mm_fwd(x, weight, bias, recipe, emulate, forward_dtype)


@_float8_linear_op.register_fake
def _(x, weight, bias, recipe, emulate, forward_dtype, backward_dtype):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("kernel_pytorch::float8_linear_backward", mutates_args=())
def _float8_linear_backward_op(grad_out: Tensor, x: Tensor, weight: Tensor, recipe: str, emulate: bool,
                               forward_dtype: torch.dtype, backward_dtype: torch.dtype, input_grad: bool,
                               weight_grad: bool) -> list[Tensor]:
    gi, gw = float8_mm_bwd(grad_out, x, weight, recipe, emulate, forward_dtype, backward_dtype,
                           input_grad, weight_grad)
    # A custom op cannot return None: an unneeded gradient comes back as an empty tensor.
    return [gi if gi is not None else x.new_empty(0), gw if gw is not None else weight.new_empty(0)]


@_float8_linear_backward_op.register_fake
def _(grad_out, x, weight, recipe, emulate, forward_dtype, backward_dtype, input_grad, weight_grad):
    return [x.new_empty(x.shape if input_grad else (0,)), weight.new_empty(weight.shape if weight_grad else (0,))]


def _setup_context(ctx, inputs, output):
    x, weight, bias, recipe, emulate, forward_dtype, backward_dtype = inputs
    ctx.save_for_backward(x, weight)
    ctx.config = (recipe, emulate, forward_dtype, backward_dtype)
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    recipe, emulate, forward_dtype, backward_dtype = ctx.config
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_out = grad_out.contiguous()
    gi = gw = gb = None
    if need_x or need_w:
        gi, gw = _float8_linear_backward_op(grad_out, x, weight, recipe, emulate, forward_dtype,
                                            backward_dtype, need_x, need_w)
        gi, gw = (gi if need_x else None), (gw if need_w else None)
    if need_b:
        gb = grad_out.float().sum(0).to(ctx.bias_dtype)
    return gi, gw, gb, None, None, None, None


_float8_linear_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------- functional/module

def float8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, recipe: str = "tensorwise",
                  emulate: bool = False, forward_dtype: torch.dtype = torch.float8_e4m3fn,
                  backward_dtype: torch.dtype = torch.float8_e5m2) -> Tensor:
    """``F.linear(x, weight, bias)`` with float8 matmuls forward and backward; x of shape (..., K)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown float8 recipe {recipe!r}; expected one of {RECIPES}")
    for name, dt in (("forward_dtype", forward_dtype), ("backward_dtype", backward_dtype)):
        if dt not in _FP8_DTYPES:
            raise ValueError(f"{name} must be a float8 dtype, got {dt}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = _float8_linear_op(x2, weight, bias, recipe, emulate, forward_dtype, backward_dtype)
    return out.reshape(*lead, weight.shape[0])


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
        if recipe not in RECIPES:
            raise ValueError(f"unknown float8 recipe {recipe!r}; expected one of {RECIPES}")
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
        if recipe not in RECIPES:
            raise ValueError(f"unknown float8 recipe {recipe!r}; expected one of {RECIPES}")
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
