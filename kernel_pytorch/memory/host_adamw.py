"""The offloaded optimizer's update math on the host: pure CPU, tested against ``torch.optim.AdamW``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

__all__: list[str] = []  # package-private: offloaded_optimizer.py imports these by name

# torch.nn.utils.clip_grad_norm_ divides by (total_norm + 1e-6); the same constant gives the same
# coefficient bit for bit.
_CLIP_EPS = 1e-6


def _host_adamw_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step in place on CPU fp32 tensors (the math of ``torch.optim.AdamW``): increments each
    ``steps`` counter (0-d fp32 tensors), then runs ATen's fused CPU kernel, which splits each tensor
    over the intra-op threads (``torch.get_num_threads()``). ``grads`` must be fp32 like ``params``
    (the kernel refuses mixed dtypes)."""
    if not params:
        return
    # AdamW(fused=True) counts the step before calling the kernel, which reads the new count.
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
        amsgrad=False, maximize=False,
    )


def _clip_coefficient(total_norm: Tensor, max_norm: float) -> Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` computed as ``torch.nn.utils`` does."""
    return torch.clamp(max_norm / (total_norm + _CLIP_EPS), max=1.0)


@contextlib.contextmanager
def _cpu_threads(num_threads: int | None) -> Iterator[None]:
    """Run the block with ``num_threads`` intra-op threads (restored after); ``None`` keeps torch's."""
    if num_threads is None or num_threads == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
