"""The ``"flash_attn"`` attention kernel: ``flash_attn.flash_attn_func`` from the flash-attn package.

flash-attn takes (B, L, H, E) tensors; SDPA's are (B, H, L, E), so q, k, v are transposed in (views:
flash-attn only needs the last dim contiguous) and the output back. It takes K/V with fewer heads
natively (Hq % Hk == 0, query head h served by K/V head h // (Hq / Hk), SDPA's GQA grouping), ``softmax_scale``
(``None``: 1/sqrt(E), SDPA's default), dropout (its own Philox stream, like the aten fused kernels),
fp16/bf16 only, and head dims up to 256 (padded to a multiple of 8 inside ``flash_attn_func``).

Not SDPA-compatible, so refused (by :func:`kernel_pytorch.ops.attention.attention` and the dispatcher):
an attention-mask tensor (it has none), and ``is_causal`` with Lq != Lk, which flash-attn >= 2.1 aligns to
the bottom right and SDPA to the top left (with Lq == Lk both are the same lower triangle).

flash-attn >= 2.7 registers its kernels as ``torch.library`` custom ops with fake implementations
(Dao-AILab/flash-attention PR #1139), so a graph calling ``flash_attn_func`` traces under
``torch.compile(fullgraph=True)``; its autograd is its own. The package is imported on first use only:
it is optional, heavy, and initializes CUDA.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor

__all__ = ["flash_attn_forward", "load_flash_attn_func"]


def load_flash_attn_func() -> Callable[..., Any]:
    """``flash_attn.flash_attn_func``, imported now; ``ImportError`` names the package when it is missing."""
    try:
        import flash_attn  # an import statement, not importlib: Dynamo traces this one (module in sys.modules)
    except ImportError as error:
        raise ImportError("attention kernel 'flash_attn' needs the flash-attn package (>= 2.7: "
                          "pip install flash-attn --no-build-isolation)") from error
    return flash_attn.flash_attn_func


def flash_attn_forward(q: Tensor, k: Tensor, v: Tensor, *, dropout_p: float, is_causal: bool,
                       scale: Optional[float]) -> Tensor:
    """flash-attn on 4-D (B, H, L, E) inputs; returns (B, Hq, Lq, E) (a transposed view of its output)."""
    out = load_flash_attn_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 dropout_p=dropout_p, softmax_scale=scale, causal=is_causal)
    return out.transpose(1, 2)
