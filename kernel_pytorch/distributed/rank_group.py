"""This process's place in a process group, and the two kinds of communication the sequence-parallel code
does: passing a tensor one step around the ring, and checking that every rank was called with the same
shapes before any other communication (mismatched shapes would otherwise hang or corrupt a collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["PendingReceive", "RankGroup", "require_same_on_all_ranks"]

# Shapes are sent as a fixed number of ints so every rank's metadata row has the same length.
_MAX_DIMS = 8
# Every torch dtype, in one order all processes of one torch version agree on: a dtype is sent as its index.
_DTYPES = tuple(sorted({value for value in vars(torch).values() if isinstance(value, torch.dtype)}, key=str))


@dataclass(frozen=True)
class PendingReceive:
    """A tensor arriving from the previous rank; ``wait()`` returns it once the exchange completes."""

    received: Tensor
    sent: Tensor  # kept alive until the send completes: the backend reads it asynchronously
    requests: tuple

    def wait(self) -> Tensor:
        for request in self.requests:
            request.wait()
        return self.received


@dataclass(frozen=True)
class RankGroup:
    """``group`` (``None``: the default group) with this process's rank and the group's size. Without an
    initialized ``torch.distributed`` it is a group of one, so single-process code needs no setup."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> RankGroup:
        if not (dist.is_available() and dist.is_initialized()):
            if group is not None:
                raise ValueError("a process group was given but torch.distributed is not initialized")
            return cls(None, 0, 1)
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the given process group")
        return cls(group, rank, dist.get_world_size(group))

    @classmethod
    def named(cls, name: str) -> RankGroup:
        """The group whose :attr:`name` is ``name``. Custom ops take groups by name: their schema has no
        ProcessGroup type, and a string is a constant that traces into a graph. torch 2.13 has no public
        resolver (functional collectives use this private one too)."""
        return cls.of(_resolve_process_group(name) if name else None)

    @property
    def name(self) -> str:
        """The group's registered name (``group.group_name``; the default group's for ``None``), or ``""``
        for the group of one without ``torch.distributed``: what :meth:`named` takes back."""
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        return (self.group if self.group is not None else dist.group.WORLD).group_name

    def pass_to_next(self, tensor: Tensor, tag: int) -> PendingReceive:
        """Send ``tensor`` to the next rank and receive the previous rank's into a new buffer, both posted
        now and completed by ``wait()``, so the caller computes while the transfer runs."""
        received = torch.empty_like(tensor)
        operations = [
            dist.P2POp(dist.isend, tensor, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag),
        ]
        return PendingReceive(received, tensor, tuple(dist.batch_isend_irecv(operations)))

    def all_gather_ints(self, values: Sequence[int], device: torch.device) -> list[tuple[int, ...]]:
        """Every rank's ``values`` (equal lengths), in rank order."""
        local = torch.tensor(list(values), dtype=torch.int64, device=self._collective_device(device))
        gathered = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(gathered, local, group=self.group)
        return [tuple(row.tolist()) for row in gathered]

    def _collective_device(self, device: torch.device) -> torch.device:
        # gloo and MPI collectives take CPU tensors; NCCL (and mixed "cpu:gloo,cuda:nccl") the data's device.
        return torch.device("cpu") if dist.get_backend(self.group) in ("gloo", "mpi") else device


def _tensor_metadata(tensor: Tensor) -> list[int]:
    """[ndim, shape padded with -1 to _MAX_DIMS entries, dtype index]."""
    shape = list(tensor.shape[:_MAX_DIMS])
    return [tensor.dim(), *shape, *[-1] * (_MAX_DIMS - len(shape)), _DTYPES.index(tensor.dtype)]


def _describe(row: Sequence[int], tensor_names: Sequence[str], option_names: Sequence[str]) -> str:
    width = _MAX_DIMS + 2
    parts = []
    for index, name in enumerate(tensor_names):
        ndim, *shape, dtype = row[index * width:(index + 1) * width]
        parts.append(f"{name} {tuple(shape[:ndim])} {str(_DTYPES[dtype]).removeprefix('torch.')}")
    options = row[len(tensor_names) * width:]
    parts += [f"{name}={value}" for name, value in zip(option_names, options)]
    return ", ".join(parts)


def require_same_on_all_ranks(rank_group: RankGroup, tensors: dict[str, Tensor], options: dict[str, int],
                              caller: str) -> None:
    """Raise the same ``ValueError`` on every rank unless all ranks passed tensors of equal shapes and
    dtypes and equal integer ``options``. One small all_gather; nothing when the group has one rank."""
    if rank_group.size == 1:
        return
    local = [value for tensor in tensors.values() for value in _tensor_metadata(tensor)] + list(options.values())
    rows = rank_group.all_gather_ints(local, next(iter(tensors.values())).device)
    if all(row == rows[0] for row in rows):
        return
    listing = "\n".join(f"  rank {rank}: {_describe(row, list(tensors), list(options))}"
                        for rank, row in enumerate(rows))
    raise ValueError(f"{caller}: every rank must pass the same shapes, dtypes and options, got\n{listing}")
