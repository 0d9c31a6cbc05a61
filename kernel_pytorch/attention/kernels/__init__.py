"""The attention kernels, below :mod:`kernel_pytorch.ops.attention`: nothing here imports the op or the
dispatcher above it.

* :mod:`~kernel_pytorch.attention.kernels.registry`: one record per kernel (what it computes, its limits,
  its entry points), the vendors' preference orders, and which kernels can run a problem.
* :mod:`~kernel_pytorch.attention.kernels.record` and :mod:`~kernel_pytorch.attention.kernels.problem`: the
  record's and the problem's types; :mod:`~kernel_pytorch.attention.kernels.eligibility`: each kernel's limits.
* :mod:`~kernel_pytorch.attention.kernels.aten_sdpa`: PyTorch's private fused SDPA kernels, forward and backward.
* :mod:`~kernel_pytorch.attention.kernels.flex`: FlexAttention with a causal or block-sparse ``BlockMask``.
* :mod:`~kernel_pytorch.attention.kernels.topk_sparse`: content-aware top-k block-sparse attention.
* :mod:`~kernel_pytorch.attention.kernels.cudnn_band`: cuDNN's causal sliding window (cuDNN frontend graphs).
* :mod:`~kernel_pytorch.attention.kernels.flash_attn`: the flash-attn package's ``flash_attn_func``.
"""

from __future__ import annotations

__all__: list[str] = []
