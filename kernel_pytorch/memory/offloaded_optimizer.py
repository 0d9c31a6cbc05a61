"""AdamW whose fp32 master weights and moments live in pinned CPU memory (ZeRO-Offload style).

``OffloadedOptimizer`` is a ``torch.optim.Optimizer``: LR schedulers, ``zero_grad`` and ``state_dict``
work as with ``torch.optim.AdamW``. Each parameter ("offloaded") keeps, in pinned host memory, an fp32
master copy, ``exp_avg`` and ``exp_avg_sq`` (12 bytes per element) plus a landing buffer for its
gradient in the parameter's dtype; the GPU keeps only the parameter and its gradient. Optionally a
prefix of the parameters (``gpu_fraction``) stays "resident": fp32 masters and moments on the GPU,
updated there by ``torch.optim.AdamW(fused=True)``. Both parts use the same math (fp32 masters, fp32
moments), so the split changes speed and memory, not the result.

What overlaps with what, per training step (one CUDA device; "current stream" is the user's):

1. **Backward -> gradient copies.** A ``register_post_accumulate_grad_hook`` on each offloaded parameter
   copies its gradient, as soon as autograd has accumulated it, into the pinned landing buffer on a
   side stream (D2H) that first waits for the current stream. The copies run while backward computes
   the gradients of earlier layers.
2. **Backward tail -> CPU update.** ``step()`` takes the offloaded parameters in the order their
   gradients were copied, in buckets of ``_BUCKET_NUMEL`` elements within one parameter group; for each
   bucket it waits for that bucket's copy events only, then runs the fused multi-threaded CPU AdamW
   (``torch._fused_adamw_``). The first buckets (last layers) are updated while the GPU may still be
   finishing the backward and copying the gradients of the first layers. (With ``max_grad_norm`` the
   clip coefficient needs every gradient first: the host waits for the end of backward once.)
3. **CPU update -> parameter copies.** As soon as a bucket is updated its parameters are copied back
   (H2D) on a second side stream, cast to the parameter dtype (bf16 casting is done on the CPU into the
   landing buffer, which halves the bytes sent), while the CPU updates the next bucket. The resident
   part is updated by fused AdamW on the current stream, launched before the CPU work, so it overlaps
   all of the above.
4. **Next forward.** At the end of ``step()`` the current stream waits for the last parameter copy
   (the simplest correct choice: the optimizer sees parameters, not modules, so it cannot order each
   layer's forward after just that layer's copy). The host returns from ``step()`` without waiting.

Gradient accumulation (several backwards before ``step()``): autograd accumulates into ``p.grad`` on
the GPU as usual, and every backward's hook copies the accumulated gradient again; the copy taken in
the last backward (the one ``step()`` uses) is never older than the others on the same stream, so the
earlier ones are simply overwritten. This costs PCIe bandwidth that is otherwise idle during backward,
and it is the only choice that hides the final copies behind the last backward without being told
the number of micro-batches. ``step()`` checks each gradient against its copy (same tensor, same
version counter): a gradient set by hand, changed in place after backward (``GradScaler.unscale_``,
``torch.nn.utils.clip_grad_norm_``) or never seen by the hook is copied again then, synchronously, so
the update always uses ``p.grad`` as it is when ``step()`` is called. ``self.clip_grad_norm_`` scales
the landed copies on the host instead, so it costs no copy.

Master weights follow the parameters: if a parameter is written outside the optimizer (loading a model
checkpoint after building the optimizer), its version counter changes and the next ``step()``
re-reads it into the master, unless the master already rounds to it (then the master's extra bits are
kept). ``state_dict()`` has ``torch.optim.AdamW``'s format (per parameter index ``step``,
``exp_avg``, ``exp_avg_sq``, plus ``master_param`` for non-fp32 parameters, which AdamW ignores), so a
checkpoint moves between the two either way.

This module is the optimizer itself; its parts live beside it: the pinned blocks (``pinned_host.py``, sized
against ``host_memory.py``), the copies and their ordering (``offload_transport.py``), the host update math
(``host_adamw.py``) and the per-parameter records (``optimizer_slots.py``).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from kernel_pytorch.memory.host_adamw import _clip_coefficient, _cpu_threads, _host_adamw_
# _SyncTransport: re-exported for tests/test_memory_options.py, which builds it through this module.
from kernel_pytorch.memory.offload_transport import _CudaTransport, _SyncTransport, _Transport  # noqa: F401
from kernel_pytorch.memory.optimizer_slots import (
    _buckets,
    _DeviceSlot,
    _fused_state,
    _HostSlot,
    _master_matches,
    _prefix_within,
    _resident_bytes,
    _scales_to_host,
)
from kernel_pytorch.memory.pinned_host import _HostStore, pinned_bytes_for

__all__ = ["OffloadedOptimizer", "pinned_bytes_for"]

# A bucket is the unit of "wait for its gradients, update it on the CPU, send it back": large enough that
# the fused CPU kernel's fixed cost stays under 1% of the bucket's update, small enough that the CPU starts
# long before the last gradients land (figures in docs/kernels.md, "Memory wrappers"; not yet tuned on
# a GPU machine).
_BUCKET_NUMEL = 1 << 22

# Keys torch.optim.AdamW keeps in every param group: carried with AdamW's values so that state dicts
# match key for key; only amsgrad=False and maximize=False are supported.
_ADAMW_FORMAT_KEYS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


def _validate_hyperparameters(group: dict[str, Any]) -> None:
    lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
    if not lr >= 0.0:
        raise ValueError(f"invalid learning rate {lr}: must be >= 0")
    if not (0.0 <= float(beta1) < 1.0 and 0.0 <= float(beta2) < 1.0):
        raise ValueError(f"invalid betas {group['betas']}: each must be in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"invalid eps {eps}: must be >= 0")
    if not wd >= 0.0:
        raise ValueError(f"invalid weight_decay {wd}: must be >= 0")


def _validate_options(optimizer: str, gpu_fraction: float | str, max_grad_norm: float | None,
                      num_threads: int | None) -> None:
    if not isinstance(optimizer, str) or optimizer.lower() != "adamw":
        raise ValueError(f"optimizer={optimizer!r} is not supported: OffloadedOptimizer implements 'adamw'")
    if gpu_fraction != "auto" and (
            isinstance(gpu_fraction, bool) or not isinstance(gpu_fraction, (int, float))
            or not 0.0 <= gpu_fraction <= 1.0):
        raise ValueError(f"gpu_fraction={gpu_fraction!r}: expected a number in [0, 1] or 'auto'")
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: expected None or a number > 0")
    if num_threads is not None and not (isinstance(num_threads, int) and num_threads >= 1):
        raise ValueError(f"num_threads={num_threads!r}: expected None or an integer >= 1")


# ----------------------------------------------------------------------------------------------------
# The optimizer
# ----------------------------------------------------------------------------------------------------


class OffloadedOptimizer(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments in pinned CPU memory, updated on the CPU while the GPU
    finishes backward; equal to ``torch.optim.AdamW`` (fp32 parameters) within fp32 rounding.

    Args:
        params: parameters or param groups, all on one CUDA device (fp32, bf16 or fp16).
        optimizer: ``"adamw"`` (the only update implemented).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        gpu_fraction: fraction of the parameters, by bytes, whose states stay on the GPU and are updated
            there by ``torch.optim.AdamW(fused=True)``: the longest prefix, in parameter order, whose
            bytes are at most ``gpu_fraction`` of the total. The first parameters are chosen because
            backward produces their gradients last, so their copies would have the least backward to
            hide behind. ``"auto"``: the first step runs fully offloaded; then the prefix whose GPU
            states (8 bytes per element, 16 for non-fp32 parameters) fit in the GPU memory that step
            never needed (free memory minus the step's peak above what is reserved now, minus 10% of
            the GPU) moves to the GPU, and the host blocks shrink to the rest.
        max_grad_norm: clip the global 2-norm of all gradients (GPU and host parts) to this value
            before each update, as ``torch.nn.utils.clip_grad_norm_`` would. The norm is computed on
            the GPU, where every gradient is; resident gradients are scaled there, the copies of
            offloaded ones on the host (their ``p.grad`` is left unscaled: it is about to be zeroed).
        num_threads: intra-op CPU threads for the update (``None``: ``torch.get_num_threads()``).

    Raises:
        RuntimeError (``HardwareUnavailableError``): no CUDA GPU, or parameters not on one CUDA device.
        MemoryError: the pinned blocks would not fit in the available host memory.

    Example::

        model = Model().cuda()
        opt = OffloadedOptimizer(model.parameters(), lr=3e-4, weight_decay=0.1, max_grad_norm=1.0)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        for x, y in loader:
            loss_fn(model(x), y).backward()   # gradients stream to the host as they are produced
            opt.step()                        # CPU AdamW, parameters stream back to the GPU
            opt.zero_grad()
            sched.step()
        torch.save(opt.state_dict(), "opt.pt")   # loads into torch.optim.AdamW too
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer: str = "adamw",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        gpu_fraction: float | str = 0.0,
        max_grad_norm: float | None = None,
        num_threads: int | None = None,
        *,
        _transport: _Transport | None = None,
    ):
        _validate_options(optimizer, gpu_fraction, max_grad_norm, num_threads)
        self._ready = False
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    **_ADAMW_FORMAT_KEYS}
        super().__init__(params, defaults)
        for group in self.param_groups:
            _validate_hyperparameters(group)
        self._params: list[Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._group_of: list[int] = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        for p in self._params:
            if not p.is_floating_point() or p.is_complex():
                raise ValueError(f"OffloadedOptimizer updates floating-point parameters, got {p.dtype}")
        self._transport = _transport if _transport is not None else _CudaTransport.for_params(self._params)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.num_threads = num_threads
        self.gpu_fraction = gpu_fraction
        self._auto_pending = gpu_fraction == "auto"
        self._closed = False

        sizes = [p.numel() * p.element_size() for p in self._params]
        n_resident = 0 if gpu_fraction == "auto" else _prefix_within(sizes, float(gpu_fraction) * sum(sizes))
        self._device_slots: dict[int, _DeviceSlot] = {}
        self._inner: torch.optim.AdamW | None = None
        self._add_device_slots(range(n_resident), {})
        self._host_store: _HostStore | None = None
        self._host_slots: dict[int, _HostSlot] = {}
        self._build_host_slots(range(n_resident, len(self._params)), carry={})
        # Offloaded gradients in the order their copies were issued (re-issued ones move to the end).
        self._landed: dict[int, _HostSlot] = {}
        self_ref = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(_grad_ready_hook(self_ref, i))
            for i, p in enumerate(self._params) if p.requires_grad]
        self._ready = True

    # --- construction helpers ------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_ready", False):
            raise NotImplementedError(
                "OffloadedOptimizer lays out its pinned memory at construction: pass every param group "
                "to the constructor")
        super().add_param_group(param_group)

    def _add_device_slots(self, indices: Iterable[int], carry: dict[int, dict[str, Tensor]]) -> None:
        """Make ``indices`` resident (with their states from ``carry`` where given) and rebuild the
        inner fused AdamW over every resident master."""
        for i in indices:
            p = self._params[i]
            master = p if p.dtype == torch.float32 else p.detach().float()
            self._device_slots[i] = _DeviceSlot(i, self._group_of[i], p, master, p._version)
        old_state = self._inner.state if self._inner is not None else {}
        if not self._device_slots:
            return
        groups = []
        for gi, group in enumerate(self.param_groups):
            masters = [s.master for s in self._device_slots.values() if s.group == gi]
            if masters:
                groups.append({"params": masters, "_group": gi, **self._hyper(group)})
        self._inner = torch.optim.AdamW(groups, fused=True)
        for slot in self._device_slots.values():
            if slot.master in old_state:
                self._inner.state[slot.master] = old_state[slot.master]
            elif slot.index in carry:
                c = carry[slot.index]
                self._inner.state[slot.master] = _fused_state(
                    float(c["step"]), c["exp_avg"], c["exp_avg_sq"], slot.master.device)
                if slot.master is not slot.param:
                    slot.master.copy_(c["master"])
                self._publish_device(slot)

    def _build_host_slots(self, indices: Iterable[int], carry: dict[int, _HostSlot]) -> None:
        """Lay out one pinned store for ``indices`` and fill each slot: from ``carry`` (an older slot of
        the same parameter) where given, else master = the parameter, moments = 0."""
        indices = list(indices)
        old_store = self._host_store
        self._host_store = _HostStore([self._params[i] for i in indices], self._transport)
        self._host_slots = {}
        for i, views in zip(indices, self._host_store.views):
            p = self._params[i]
            slot = _HostSlot(i, self._group_of[i], p, views["master"], views["exp_avg"], views["exp_avg_sq"],
                             views["grad"])
            old = carry.get(i)
            if old is not None:
                for kind in ("master", "exp_avg", "exp_avg_sq"):
                    getattr(slot, kind).copy_(getattr(old, kind))
                slot.step.copy_(old.step)
                slot.stepped, slot.param_version = old.stepped, old.param_version
            else:
                self._master_from_param(slot)
            self._host_slots[i] = slot
            if slot.stepped:
                self.state[p] = slot.state()
        if old_store is not None:
            old_store.release()

    def _master_from_param(self, slot: _HostSlot) -> None:
        # Cast on the CPU (no fp32 temporary on the GPU), and not through the landing buffer, which may
        # hold this step's gradient.
        slot.master.copy_(slot.param.detach().to("cpu"))
        slot.param_version = slot.param._version

    @staticmethod
    def _hyper(group: dict[str, Any]) -> dict[str, Any]:
        return {"lr": group["lr"], "betas": tuple(group["betas"]), "eps": group["eps"],
                "weight_decay": group["weight_decay"]}

    # --- introspection -------------------------------------------------------------------------------

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory held (states, masters and gradient landing buffers)."""
        return 0 if self._host_store is None else self._host_store.nbytes

    @property
    def resident_fraction(self) -> float:
        """Fraction of the parameter bytes whose states are on the GPU now."""
        total = sum(p.numel() * p.element_size() for p in self._params)
        resident = sum(s.param.numel() * s.param.element_size() for s in self._device_slots.values())
        return resident / total if total else 0.0

    # --- gradients -----------------------------------------------------------------------------------

    def _on_grad_ready(self, index: int, param: Tensor) -> None:
        slot = self._host_slots.get(index)
        grad = param.grad
        if self._closed or slot is None or grad is None or grad.is_sparse:
            return
        self._issue_copy(slot, grad)

    def _issue_copy(self, slot: _HostSlot, grad: Tensor) -> None:
        slot.handle = self._transport.to_host(grad, slot.grad)
        slot.copied = (weakref.ref(grad), grad._version)
        slot.scales.clear()
        self._landed.pop(slot.index, None)
        self._landed[slot.index] = slot

    def _grads(self) -> list[Tensor]:
        grads = [p.grad for p in self._params if p.grad is not None]
        for g in grads:
            if g.is_sparse:
                raise RuntimeError("OffloadedOptimizer does not support sparse gradients")
        return grads

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale all gradients so that their global 2-norm is at most ``max_norm``, exactly as
        ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` does (``p.grad`` is scaled in place), and
        return the total norm before clipping (a tensor on the parameters' device). Host copies already
        taken are scaled on the host at ``step()`` instead of being copied again.

        Example::

            loss.backward()
            norm = opt.clip_grad_norm_(1.0)
            opt.step()
        """
        self._check_open()
        grads = self._grads()
        if not grads:
            return torch.tensor(0.0)
        total = torch.nn.utils.get_total_norm(grads)
        coef = _clip_coefficient(total, float(max_norm))
        current = [s for s in self._landed.values() if s.copy_is_current()]
        for slot in current:
            # Scaling p.grad in place must not race the side-stream copy still reading it.
            self._transport.device_waits(slot.handle)
        torch.nn.utils.clip_grads_with_norm_(self._params, float(max_norm), total)
        for slot in current:
            slot.scales.append(coef)
            slot.copied = (slot.copied[0], slot.param.grad._version)
        return total

    # --- the step ------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW update of every parameter that has a gradient; see the module docstring for what
        overlaps. Returns ``closure()``'s loss when a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        transport = self._transport
        transport.begin_step()
        self._refresh_masters()
        self._grads()  # rejects sparse gradients before anything is updated
        pending = self._host_order()
        host_coef = None
        if self.max_grad_norm is not None:
            host_coef = self._clip_for_step(self.max_grad_norm)
        self._step_resident()
        if host_coef is not None:
            # The only host-device synchronization the clipping needs: all gradients are in the norm.
            host_coef = host_coef.to("cpu")
        _scales_to_host(pending)
        with _cpu_threads(self.num_threads):
            for bucket in _buckets(pending, _BUCKET_NUMEL):
                self._step_bucket(bucket, host_coef)
        transport.end_step()
        for slot in self._host_slots.values():
            slot.forget_copy()
        self._landed.clear()
        if self._auto_pending:
            self._auto_pending = False
            self._apply_auto_fraction()
        return loss

    def _host_order(self) -> list[_HostSlot]:
        """Offloaded parameters with a gradient, in landing order; gradients with no current copy (set
        by hand, changed after backward, never hooked) are copied now and go last."""
        landed = [s for s in self._landed.values() if s.param.grad is not None and s.copy_is_current()]
        seen = {s.index for s in landed}
        late = [s for s in self._host_slots.values() if s.param.grad is not None and s.index not in seen]
        for slot in late:
            self._issue_copy(slot, slot.param.grad)
        return landed + late

    def _clip_for_step(self, max_norm: float) -> Tensor:
        """Clip coefficient of the global norm (on the GPU); scales the resident gradients there and
        returns the coefficient for the host copies."""
        grads = self._grads()
        total = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
        resident = [s.param for s in self._device_slots.values()]
        torch.nn.utils.clip_grads_with_norm_(resident, max_norm, total)
        return _clip_coefficient(total, max_norm)

    def _step_resident(self) -> None:
        """Launch the fused AdamW of the resident part on the current stream (asynchronous)."""
        if self._inner is None:
            return
        for inner_group in self._inner.param_groups:
            inner_group.update(self._hyper(self.param_groups[inner_group["_group"]]))
        stepped = [s for s in self._device_slots.values() if s.param.grad is not None]
        for slot in stepped:
            if slot.master is not slot.param:
                slot.master.grad = slot.param.grad.float()
        self._inner.step()
        for slot in stepped:
            if slot.master is not slot.param:
                slot.param.detach().copy_(slot.master)
                slot.master.grad = None
                slot.param_version = slot.param._version
            self._publish_device(slot)

    def _step_bucket(self, bucket: list[_HostSlot], host_coef: Tensor | None) -> None:
        """Wait for the bucket's gradient copies, update it on the CPU, send the parameters back."""
        group = self.param_groups[bucket[0].group]
        grads = []
        for slot in bucket:
            self._transport.wait_host(slot.handle)
            # Scale in the gradient's dtype, as the same multiplication on the GPU would round.
            for coef in slot.scales:
                slot.grad.mul_(coef)
            if host_coef is not None:
                slot.grad.mul_(host_coef)
            grads.append(slot.grad if slot.grad.dtype == torch.float32 else slot.grad.float())
        beta1, beta2 = group["betas"]
        _host_adamw_(
            [s.master for s in bucket], grads, [s.exp_avg for s in bucket], [s.exp_avg_sq for s in bucket],
            [s.step for s in bucket], lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
            eps=float(group["eps"]), weight_decay=float(group["weight_decay"]))
        for slot in bucket:
            if slot.grad.dtype == torch.float32:
                source = slot.master
            else:
                # The landing buffer is free again: the cast parameter goes back through it, half the
                # bytes of the fp32 master for bf16.
                slot.grad.copy_(slot.master)
                source = slot.grad
            self._transport.to_device(slot.param, source)
            slot.param_version = slot.param._version
            if not slot.stepped:
                slot.stepped = True
                self.state[slot.param] = slot.state()

    def _refresh_masters(self) -> None:
        """Re-read the masters of parameters written outside the optimizer since its last write."""
        for slot in self._host_slots.values():
            if slot.param._version != slot.param_version:
                if not _master_matches(slot.master, slot.param):
                    self._master_from_param(slot)
                slot.param_version = slot.param._version
        for slot in self._device_slots.values():
            if slot.master is not slot.param and slot.param._version != slot.param_version:
                if not _master_matches(slot.master, slot.param):
                    slot.master.copy_(slot.param.detach())
                slot.param_version = slot.param._version

    def _publish_device(self, slot: _DeviceSlot) -> None:
        inner = self._inner.state.get(slot.master) if self._inner is not None else None
        if not inner:
            return
        state = {"step": inner["step"], "exp_avg": inner["exp_avg"], "exp_avg_sq": inner["exp_avg_sq"]}
        if slot.master is not slot.param:
            state["master_param"] = slot.master
        self.state[slot.param] = state

    # --- gpu_fraction="auto" -------------------------------------------------------------------------

    def _apply_auto_fraction(self) -> None:
        """After the first step: move the longest prefix of offloaded parameters whose GPU states fit in
        the measured headroom to the GPU, and shrink the pinned blocks to the rest."""
        self._transport.synchronize()
        offloaded = sorted(self._host_slots)
        count = _prefix_within([_resident_bytes(self._params[i]) for i in offloaded],
                               self._transport.headroom_bytes())
        if count == 0:
            return
        moving, staying = offloaded[:count], offloaded[count:]
        carry = {}
        for i in moving:
            s = self._host_slots[i]
            if s.stepped:
                carry[i] = {"step": s.step, "exp_avg": s.exp_avg, "exp_avg_sq": s.exp_avg_sq, "master": s.master}
        old_slots = dict(self._host_slots)
        self._add_device_slots(moving, carry)
        for i in moving:
            if i not in carry:
                self.state.pop(self._params[i], None)
        try:
            self._build_host_slots(staying, carry=old_slots)
        except MemoryError as err:
            # Shrinking needs the new blocks before the old ones go; without room, keep the old blocks
            # (the moved parameters' views there just stay unused).
            warnings.warn(f"gpu_fraction='auto': pinned blocks not shrunk ({err})", stacklevel=3)
            self._host_slots = {i: old_slots[i] for i in staying}

    # --- state dict ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.AdamW``'s format: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"
        [, "master_param"]}}, "param_groups": [...]}``, with ``step`` a CPU fp32 scalar. The moments
        are fp32 tensors that alias the optimizer's memory (CPU for offloaded parameters, GPU for
        resident ones); like AdamW's, they are references: copy them to keep a snapshot.

        Example::

            adamw = torch.optim.AdamW(model.parameters())
            adamw.load_state_dict(opt.state_dict())
        """
        self._check_open()
        state = super().state_dict()
        # In parameter order, as AdamW lists it (ours fills in landing order); "step" on the CPU for every
        # parameter, as AdamW without fused/capturable keeps it (the resident part's fused AdamW keeps it
        # on the GPU; a mix would load into AdamW's foreach path with steps on two devices).
        state["state"] = {i: {**s, "step": s["step"].to("cpu")} for i, s in sorted(state["state"].items())}
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim.AdamW`` (same parameters, same groups).
        Moments are stored in fp32 whatever their saved dtype; a saved ``master_param`` is kept if, at
        the next ``step()``, it rounds to the parameter (load the model before or after), else the
        parameter becomes the master (a stale master, e.g. after AdamW trained on).

        Example::

            opt.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
        """
        self._check_open()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, "
                             f"this optimizer {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size "
                                 "of optimizer's group")
            for key in ("amsgrad", "maximize"):
                if saved.get(key, False):
                    raise ValueError(f"loaded state dict has {key}=True, which OffloadedOptimizer does not "
                                     "implement")
        self._transport.synchronize()
        id_map = {}
        for group, saved in zip(self.param_groups, saved_groups):
            id_map.update(zip(saved["params"], range(len(id_map), len(id_map) + len(group["params"]))))
            params = group["params"]
            names = group.get("param_names")
            group.clear()
            group.update({k: v for k, v in saved.items() if k != "params"})
            group["params"] = params
            if names is not None and "param_names" not in group:
                group["param_names"] = names
            _validate_hyperparameters(group)
        saved_state = {id_map[k]: v for k, v in state_dict["state"].items() if k in id_map}
        self.state.clear()
        self._landed.clear()
        for i in range(len(self._params)):
            self._load_param_state(i, saved_state.get(i))

    def _load_param_state(self, index: int, saved: dict[str, Any] | None) -> None:
        p = self._params[index]
        if saved:
            for key in ("exp_avg", "exp_avg_sq", "master_param"):
                if key in saved and tuple(saved[key].shape) != tuple(p.shape):
                    raise ValueError(f"state of parameter {index}: {key} has shape {tuple(saved[key].shape)}, "
                                     f"the parameter {tuple(p.shape)}")
        # A saved master is taken as is and checked against the parameter at the next step() (version
        # -1 forces it), so it survives whichever of model and optimizer checkpoints is loaded first.
        master_saved = saved.get("master_param") if saved else None
        if index in self._host_slots:
            slot = self._host_slots[index]
            slot.forget_copy()
            if master_saved is not None:
                slot.master.copy_(master_saved)
                slot.param_version = -1
            else:
                self._master_from_param(slot)
            if saved:
                slot.exp_avg.copy_(saved["exp_avg"])
                slot.exp_avg_sq.copy_(saved["exp_avg_sq"])
                slot.step.fill_(float(saved["step"]))
                slot.stepped = True
                self.state[p] = slot.state()
            else:
                slot.exp_avg.zero_()
                slot.exp_avg_sq.zero_()
                slot.step.zero_()
                slot.stepped = False
            return
        slot = self._device_slots[index]
        if slot.master is not slot.param:
            slot.master.copy_(p.detach() if master_saved is None else master_saved)
            slot.param_version = p._version if master_saved is None else -1
        self._inner.state.pop(slot.master, None)
        if saved:
            device = slot.master.device
            self._inner.state[slot.master] = _fused_state(
                float(saved["step"]), saved["exp_avg"], saved["exp_avg_sq"], device)
            self._publish_device(slot)

    # --- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the gradient hooks and unpin the host memory; the optimizer cannot step afterwards."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hook_handles:
            handle.remove()
        self._transport.synchronize()
        if self._host_store is not None:
            self._host_store.release()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("OffloadedOptimizer was closed; build a new one")


def _grad_ready_hook(optimizer_ref: weakref.ref, index: int):
    """The post-accumulate-grad hook of parameter ``index``; holds the optimizer weakly, so the
    parameters do not keep it (and its pinned memory) alive."""

    def hook(param: Tensor) -> None:
        optimizer = optimizer_ref()
        if optimizer is not None:
            optimizer._on_grad_ready(index, param)

    return hook
