"""The ``"cudnn_band"`` attention kernel: cuDNN's fused attention with a causal sliding window (a diagonal
band), through the cuDNN frontend's PyTorch ops (the ``nvidia-cudnn-frontend`` package, >= 1.32:
``torch.ops.cudnn.sdpa_fwd`` / ``sdpa_bwd``; extra ``cudnn``).

PyTorch's own cuDNN SDPA takes a causal flag or a mask tensor, not a window: a sliding window there is a
dense masked attention. cuDNN skips the tiles outside the band itself. H100, bf16, hd128, 16 heads,
batch x L = 16384, causal window 1024 (GPU time, CUDA-graph replays), against cuDNN's dense causal kernel
through SDPA and FlexAttention with the window's BlockMask:

    L        band fwd   dense causal fwd   flex fwd   |  band fwd+bwd   dense causal   flex
    2048     0.221 ms   0.256              0.396      |  0.968          1.128          1.633
    16384    0.274      1.727              0.490      |  1.154          7.026          1.984

What it computes is SDPA's with the mask ``0 <= i - j < window`` (query i sees itself and the
``window - 1`` keys before it): the frontend's ``window_left`` is the band's length, checked against a
masked float32 SDPA (a ``window_left`` of ``w`` matched the band ``0 <= i - j <= w - 1`` to bf16 rounding,
``w - 1`` did not). Only that band, with equal query and key lengths: the mask pattern ``("band", 0, hi)``
of :mod:`kernel_pytorch.attention.flex` with ``window = hi + 1``. The dispatcher sends nothing else here.

The frontend's ops are ``torch.library`` custom ops with fake implementations, so this traces under
torch.compile; the autograd formula is the one below (forward saves the log-sum-exp, backward is
``sdpa_bwd``). The package is imported on first use only: it is optional and loads cuDNN.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["cudnn_band_forward", "band_window", "load_cudnn_sdpa_ops", "CUDNN_BAND_MAX_HEAD_DIM"]

# The head dims the dispatcher sends here: what cuDNN's fused attention takes on sm80/sm90 (the limit of
# PyTorch's cuDNN SDPA, which the dispatcher applies to "cudnn" too).
CUDNN_BAND_MAX_HEAD_DIM = 128


def load_cudnn_sdpa_ops() -> None:
    """Register ``torch.ops.cudnn.sdpa_fwd`` / ``sdpa_bwd`` (importing the frontend's torch module);
    ``ImportError`` names the package when it is missing."""
    try:
        import cudnn.sdpa.fwd.torch_op  # noqa: F401  (an import statement: Dynamo traces it, module cached)
    except ImportError as error:
        raise ImportError("attention kernel 'cudnn_band' needs the cuDNN frontend's torch ops: "
                          "pip install 'nvidia-cudnn-frontend>=1.32' (extra 'cudnn')") from error


def band_window(pattern: Optional[tuple], lq: int, lk: int) -> Optional[int]:
    """The window length cuDNN's band takes for mask ``pattern`` on ``lq`` x ``lk`` scores, or None when the
    pattern is not a causal sliding window this kernel computes exactly."""
    if pattern is None or pattern[0] != "band" or lq != lk:
        return None
    lo, hi = pattern[1], pattern[2]
    if lo != 0 or hi is None or hi < 0:
        return None
    return hi + 1


class _CudnnBandAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, window: int, scale: float) -> Tensor:
        out, lse = torch.ops.cudnn.sdpa_fwd(q, k, v, scale, is_causal=True, window_left=window, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.window, ctx.scale = window, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.cudnn.sdpa_bwd(grad_out.contiguous(), q, k, v, out, lse, ctx.scale, is_causal=True,
                                              window_left=ctx.window)
        return dq, dk, dv, None, None


def cudnn_band_forward(q: Tensor, k: Tensor, v: Tensor, *, window: int, scale: Optional[float]) -> Tensor:
    """Causal sliding-window attention of 4-D (B, H, L, E) inputs: query i sees keys ``i - window + 1 .. i``.
    K/V may have fewer heads (Hq % Hk == 0); ``scale=None`` is 1/sqrt(E)."""
    if window < 1:
        raise ValueError(f"the sliding window must hold at least one key, got {window}")
    load_cudnn_sdpa_ops()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _CudnnBandAttention.apply(q, k, v, int(window), scale)
