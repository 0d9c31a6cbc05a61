"""The attention kernels below :mod:`kernel_pytorch.ops.attention`: what ``attention(..., kernel=...)`` calls
beyond PyTorch's own SDPA kernels. Nothing here imports the op or the dispatcher above it.

* :mod:`~kernel_pytorch.attention.kernels.flex`: FlexAttention with a causal or block-sparse ``BlockMask``.
* :mod:`~kernel_pytorch.attention.kernels.topk_sparse`: content-aware top-k block-sparse attention.
* :mod:`~kernel_pytorch.attention.kernels.cudnn_band`: cuDNN's causal sliding window (cuDNN frontend graphs).
* :mod:`~kernel_pytorch.attention.kernels.flash_attn`: the flash-attn package's ``flash_attn_func``.
"""

from __future__ import annotations

__all__: list[str] = []
