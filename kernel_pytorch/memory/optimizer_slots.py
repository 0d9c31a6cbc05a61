"""The offloaded optimizer's per-parameter records: an offloaded parameter's pinned views and gradient copy
(``_HostSlot``), a resident one's fp32 master (``_DeviceSlot``), and the helpers that move, size and bucket
them."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []  # package-private: offloaded_optimizer.py imports these by name


@dataclass(eq=False)
class _HostSlot:
    """An offloaded parameter: its pinned views, step counter and the state of its gradient copy."""

    index: int
    group: int
    param: Tensor
    master: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    grad: Tensor
    step: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))
    stepped: bool = False
    param_version: int = -1
    # (weak reference to the gradient tensor copied, its version then) and the copy's handle.
    copied: tuple[weakref.ref, int] | None = None
    handle: Any = None
    # Clip coefficients applied to p.grad by clip_grad_norm_ after the copy was taken.
    scales: list[Tensor] = field(default_factory=list)

    def copy_is_current(self) -> bool:
        grad = self.param.grad
        return (grad is not None and self.copied is not None and self.copied[0]() is grad
                and grad._version == self.copied[1])

    def forget_copy(self) -> None:
        self.copied, self.handle = None, None
        self.scales.clear()

    def state(self) -> dict[str, Tensor]:
        state = {"step": self.step, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.param.dtype != torch.float32:
            state["master_param"] = self.master
        return state


@dataclass(eq=False)
class _DeviceSlot:
    """A resident parameter; ``master`` is what the inner fused AdamW updates: the parameter itself
    when it is fp32, else an fp32 copy on its device."""

    index: int
    group: int
    param: Tensor
    master: Tensor
    param_version: int = -1


def _master_matches(master: Tensor, param: Tensor) -> bool:
    """Whether ``master`` rounds to ``param`` (then it holds the same weights with more bits); compared
    on the master's device, so a host master costs no GPU memory."""
    return master.shape == param.shape and torch.equal(
        master.to(param.dtype), param.detach().to(master.device))


def _device_copy(t: Tensor, device: torch.device) -> Tensor:
    """A new fp32 tensor on ``device`` with ``t``'s values (never an alias, unlike ``Tensor.to``)."""
    out = torch.empty(t.shape, dtype=torch.float32, device=device)
    out.copy_(t)
    return out


def _fused_state(step: float, exp_avg: Tensor, exp_avg_sq: Tensor, device: torch.device) -> dict[str, Tensor]:
    """A parameter's state as ``torch.optim.AdamW(fused=True)`` keeps it: fp32 moments and an fp32 step
    counter, all on the parameter's device."""
    return {"step": torch.tensor(step, dtype=torch.float32, device=device),
            "exp_avg": _device_copy(exp_avg, device), "exp_avg_sq": _device_copy(exp_avg_sq, device)}


def _prefix_within(sizes: Sequence[int], budget: float) -> int:
    """How many leading ``sizes`` fit in ``budget`` together."""
    total = 0
    for count, size in enumerate(sizes):
        if total + size > budget:
            return count
        total += size
    return len(sizes)


def _resident_bytes(p: Tensor) -> int:
    """GPU bytes that making ``p`` resident costs: fp32 moments, and for non-fp32 parameters an fp32
    master and the fp32 gradient the fused kernel reads."""
    return p.numel() * (8 if p.dtype == torch.float32 else 16)


def _scales_to_host(slots: Sequence[_HostSlot]) -> None:
    """Bring the clip coefficients pending on ``slots`` to the CPU, one transfer per coefficient."""
    on_host: dict[int, Tensor] = {}
    for slot in slots:
        for c in slot.scales:
            if id(c) not in on_host:
                on_host[id(c)] = c.to("cpu")
        slot.scales = [on_host[id(c)] for c in slot.scales]


def _buckets(slots: Sequence[_HostSlot], max_numel: int) -> Iterator[list[_HostSlot]]:
    """Consecutive runs of ``slots`` within one parameter group, of at most ``max_numel`` elements
    (or one parameter, if larger)."""
    bucket: list[_HostSlot] = []
    numel = 0
    for slot in slots:
        if bucket and (slot.group != bucket[0].group or numel + slot.param.numel() > max_numel):
            yield bucket
            bucket, numel = [], 0
        bucket.append(slot)
        numel += slot.param.numel()
    if bucket:
        yield bucket
