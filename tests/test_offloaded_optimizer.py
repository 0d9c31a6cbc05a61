"""OffloadedOptimizer: the CPU AdamW math against torch.optim.AdamW, the optimizer's bookkeeping (hooks,
accumulation, clipping, partial offload, state dicts, schedulers) on CPU tensors through the synchronous
stand-in transport, and the CUDA path (streams, pinned memory, memory saved) under ``-m gpu``.

The CPU tests drive the same ``OffloadedOptimizer`` code as the GPU, with ``_SyncTransport`` doing the
copies synchronously between CPU tensors; the GPU tests repeat the equality checks with real streams.
"""

from __future__ import annotations

import copy
import ctypes
import mmap

import pytest
import torch
from torch import nn

from kernel_pytorch.memory import host_adamw, host_memory, optimizer_slots, pinned_host
from kernel_pytorch.memory import offloaded_optimizer as oo
from kernel_pytorch.memory.offloaded_optimizer import OffloadedOptimizer, _SyncTransport
from tests.triton_interpreter import cuda_device

# fp32 tolerance: the fused CPU kernel and AdamW's single-tensor / foreach paths round the same math in
# a different order (a few ulps per step).
FP32 = {"rtol": 1e-5, "atol": 1e-6}
STEPS = 5


@pytest.fixture
def cuda() -> torch.device:
    return cuda_device()


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def make_model(device="cpu", dtype=torch.float32, seed=0) -> nn.Module:
    """Odd shapes; parameters: weight 33x7, bias 33, weight 13x33, bias 13, norm weight and bias 13,
    weight 5x13, bias 5."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 33), nn.GELU(), nn.Linear(33, 13), nn.LayerNorm(13), nn.Linear(13, 5))
    return model.to(device=device, dtype=dtype)


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups with different lr and weight decay (matrices / vectors, the usual split)."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices, "lr": 2e-2, "weight_decay": 0.1},
            {"params": vectors, "lr": 5e-3, "weight_decay": 0.0}]


def offloaded(params, device, **kwargs) -> OffloadedOptimizer:
    """The optimizer under test: the real CUDA transport on a GPU, the synchronous stand-in on the CPU."""
    if torch.device(device).type == "cpu":
        kwargs["_transport"] = _SyncTransport(headroom=kwargs.pop("headroom", 0))
    return OffloadedOptimizer(params, **kwargs)


def batches(device, steps=STEPS, micro=2, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(9, 7, generator=gen).to(device=device, dtype=dtype) for _ in range(micro)]
            for _ in range(steps)]


def backward(model: nn.Module, micro_batches) -> None:
    for x in micro_batches:
        (model(x).float().pow(2).mean() * 10).backward()


def train_reference(model, opt, data, max_norm=None, scheduler=None) -> list[float]:
    """torch's recipe: accumulate, clip_grad_norm_, AdamW.step; returns the norms clip saw."""
    norms = []
    for micro in data:
        backward(model, micro)
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return norms


def train_offloaded(model, opt, data, scheduler=None) -> None:
    for micro in data:
        backward(model, micro)
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def assert_params_close(model, reference, **tol) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **(tol or FP32), msg=lambda m, name=name: f"{name}: {m}")


def assert_moved(model, initial) -> None:
    """Training did something (so an equality check is not vacuous)."""
    for p, p0 in zip(model.parameters(), initial.parameters()):
        assert (p.detach().float() - p0.detach().float()).abs().max() > 1e-4


# --------------------------------------------------------------------------------------------------
# the update math
# --------------------------------------------------------------------------------------------------


def test_host_adamw_matches_torch_adamw_over_steps():
    torch.manual_seed(0)
    shapes = [(17, 5), (3,), (1,), (4, 4, 3)]
    hypers = [{"lr": 3e-2, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8},
              {"lr": 1e-3, "weight_decay": 0.0, "beta1": 0.8, "beta2": 0.999, "eps": 1e-6}]
    ref = [nn.Parameter(torch.randn(s)) for s in shapes]
    masters = [p.detach().clone() for p in ref]
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    steps = [torch.zeros(()) for _ in masters]
    split = [slice(0, 2), slice(2, 4)]
    torch_opt = torch.optim.AdamW(
        [{"params": ref[s], "lr": h["lr"], "weight_decay": h["weight_decay"], "betas": (h["beta1"], h["beta2"]),
          "eps": h["eps"]} for s, h in zip(split, hypers)])
    for _ in range(STEPS):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(ref, grads):
            p.grad = g.clone()
        torch_opt.step()
        for s, h in zip(split, hypers):
            host_adamw._host_adamw_(masters[s], grads[s], exp_avgs[s], exp_avg_sqs[s], steps[s], **h)
    for i, p in enumerate(ref):
        torch.testing.assert_close(masters[i], p.detach(), **FP32)
        torch.testing.assert_close(exp_avgs[i], torch_opt.state[p]["exp_avg"], **FP32)
        torch.testing.assert_close(exp_avg_sqs[i], torch_opt.state[p]["exp_avg_sq"], **FP32)
        assert float(steps[i]) == float(torch_opt.state[p]["step"]) == STEPS


# --------------------------------------------------------------------------------------------------
# the optimizer on CPU tensors (synchronous transport), and the same checks on a GPU
# --------------------------------------------------------------------------------------------------


def check_matches_adamw(device, gpu_fraction, max_norm=0.05):
    model = make_model(device)
    initial, reference = copy.deepcopy(model), copy.deepcopy(model)
    opt = offloaded(param_groups(model), device, gpu_fraction=gpu_fraction, max_grad_norm=max_norm)
    ref_opt = torch.optim.AdamW(param_groups(reference))
    data = batches(device)
    norms = train_reference(reference, ref_opt, data, max_norm=max_norm)
    assert min(norms) > max_norm, "the clip must be active for the test to check it"
    train_offloaded(model, opt, data)
    assert_moved(model, initial)
    assert_params_close(model, reference)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(opt.state[p]["exp_avg"].to(device), ref_opt.state[q]["exp_avg"], **FP32)
    return opt


@pytest.mark.parametrize("gpu_fraction", [0.0, 0.5, 1.0])
def test_matches_adamw_with_clipping_and_accumulation(gpu_fraction):
    opt = check_matches_adamw("cpu", gpu_fraction)
    offloaded_count = len(opt._host_slots)
    assert offloaded_count == {0.0: 8, 0.5: offloaded_count, 1.0: 0}[gpu_fraction]
    assert 0 < offloaded_count < 8 or gpu_fraction != 0.5, "0.5 must exercise both parts"
    # Every backward's hook copied its gradient (2 micro-batches x 5 steps) and step() copied none again.
    assert opt._transport.copies_to_host == offloaded_count * 2 * STEPS
    assert opt._transport.copies_to_device == offloaded_count * STEPS


def check_bf16(device, gpu_fraction, max_norm=0.5):
    """bf16 parameters follow fp32 masters updated by AdamW on the bf16 gradients (clipped as torch
    would clip them), within fp32 rounding; each parameter is its master rounded to bf16."""
    model = make_model(device, torch.bfloat16)
    initial = copy.deepcopy(model)
    groups = param_groups(model)
    opt = offloaded(groups, device, gpu_fraction=gpu_fraction, max_grad_norm=max_norm)
    # The optimizer's parameter order, so the bf16 norm of norms rounds the same way.
    params = [p for g in groups for p in g["params"]]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    index = {id(p): i for i, p in enumerate(params)}
    ref_opt = torch.optim.AdamW([{**g, "params": [masters[index[id(p)]] for p in g["params"]]} for g in groups])
    clipped = 0
    for micro in batches(device, dtype=torch.bfloat16):
        backward(model, micro)
        grads = [p.grad.clone() for p in params]
        total = torch.nn.utils.get_total_norm(grads)
        clipped += int(total > max_norm)
        torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))  # torch's clip, in bf16
        for m, g in zip(masters, grads):
            m.grad = g.float()
        ref_opt.step()
        opt.step()
        opt.zero_grad()
    assert clipped > 0
    assert_moved(model, initial)
    for p, m in zip(params, masters):
        ours = opt.state[p]["master_param"]
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours.to(device), m.detach(), **FP32)
        torch.testing.assert_close(p, ours.to(device=device, dtype=torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("gpu_fraction", [0.0, 0.5])
def test_bf16_params_follow_fp32_masters(gpu_fraction):
    check_bf16("cpu", gpu_fraction)


def test_bf16_params_are_sent_back_in_bf16():
    model = make_model(dtype=torch.bfloat16)
    opt = offloaded(model.parameters(), "cpu")
    backward(model, batches("cpu", steps=1, dtype=torch.bfloat16)[0])
    opt.step()
    assert opt._transport.bytes_to_device == 2 * sum(p.numel() for p in model.parameters())


def test_gradients_changed_after_backward_are_copied_again():
    model = make_model()
    reference = copy.deepcopy(model)
    opt = offloaded(model.parameters(), "cpu", lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    data = batches("cpu", steps=1, micro=1)[0]
    for m in (model, reference):
        backward(m, data)
        params = list(m.parameters())
        params[0].grad.mul_(0.5)                       # in place after the hook's copy
        params[1].grad = torch.ones_like(params[1])    # replaced: the hook never saw it
    copies = opt._transport.copies_to_host
    assert copies == 8
    opt.step()
    ref_opt.step()
    assert opt._transport.copies_to_host == copies + 2
    assert_params_close(model, reference)


def test_gradient_set_by_hand_without_backward_is_used():
    model = make_model()
    reference = copy.deepcopy(model)
    opt = offloaded(model.parameters(), "cpu", lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for p, q in zip(model.parameters(), reference.parameters()):
        p.grad = torch.full_like(p, 0.3)
        q.grad = torch.full_like(q, 0.3)
    list(model.parameters())[2].grad = None   # no gradient: no update, like AdamW
    list(reference.parameters())[2].grad = None
    opt.step()
    ref_opt.step()
    assert_params_close(model, reference)
    assert list(model.parameters())[2] not in opt.state
    assert opt._transport.copies_to_host == 7


def test_clip_grad_norm_matches_torch_and_copies_nothing_again():
    model = make_model()
    reference = copy.deepcopy(model)
    opt = offloaded(param_groups(model), "cpu", gpu_fraction=0.3)
    ref_opt = torch.optim.AdamW(param_groups(reference))
    for step, micro in enumerate(batches("cpu", steps=3)):
        backward(model, micro)
        backward(reference, micro)
        # Bit for bit while the weights are still identical; after that, AdamW's rounding differs.
        tol = {"rtol": 0, "atol": 0} if step == 0 else FP32
        copies = opt._transport.copies_to_host
        norm = opt.clip_grad_norm_(0.05)
        # Same parameter order as the optimizer's groups: the norm of norms then rounds the same way.
        ordered = [p for g in ref_opt.param_groups for p in g["params"]]
        ref_norm = torch.nn.utils.clip_grad_norm_(ordered, 0.05)
        assert float(ref_norm) > 0.05
        torch.testing.assert_close(norm, ref_norm, **tol)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol)
        opt.step()
        ref_opt.step()
        assert opt._transport.copies_to_host == copies
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_params_close(model, reference)


def test_clip_between_micro_batches_then_more_backward():
    """A copy taken after clip_grad_norm_ reads the already-clipped gradient: the coefficient pending
    on the older copy must not be applied to it again."""
    model = make_model()
    reference = copy.deepcopy(model)
    opt = offloaded(model.parameters(), "cpu")
    ref_opt = torch.optim.AdamW(reference.parameters())
    first, second = batches("cpu", steps=1)[0]
    for m, clip in ((model, opt.clip_grad_norm_),
                    (reference, lambda n: torch.nn.utils.clip_grad_norm_(reference.parameters(), n))):
        backward(m, [first])
        assert float(clip(0.05)) > 0.05
        backward(m, [second])
    opt.step()
    ref_opt.step()
    assert_params_close(model, reference)


def test_clip_after_a_gradient_was_dropped():
    model = make_model()
    opt = offloaded(model.parameters(), "cpu")
    backward(model, batches("cpu", steps=1)[0])
    first = next(model.parameters())
    first.grad = None                         # its copy's tensor is gone
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    norm = opt.clip_grad_norm_(0.05)
    torch.testing.assert_close(norm, expected)
    opt.step()
    assert first not in opt.state


def check_state_dict_round_trip(device, gpu_fraction):
    """Ours -> AdamW and AdamW -> ours, mid-training; both continue as if nothing happened."""
    model = make_model(device)
    reference = copy.deepcopy(model)
    opt = offloaded(param_groups(model), device, gpu_fraction=gpu_fraction)
    ref_opt = torch.optim.AdamW(param_groups(reference))
    first, second = batches(device, steps=2), batches(device, steps=2, seed=7)
    train_offloaded(model, opt, first)
    train_reference(reference, ref_opt, first)

    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert list(ours["state"]) == list(theirs["state"])
    for i in theirs["state"]:
        assert set(ours["state"][i]) == set(theirs["state"][i]) == {"step", "exp_avg", "exp_avg_sq"}
        torch.testing.assert_close(ours["state"][i]["exp_avg_sq"].to(device), theirs["state"][i]["exp_avg_sq"], **FP32)

    # Swap: AdamW continues from our state, we continue from AdamW's.
    model_b, reference_b = copy.deepcopy(model), copy.deepcopy(reference)
    adamw_from_ours = torch.optim.AdamW(param_groups(model_b))
    adamw_from_ours.load_state_dict(copy.deepcopy(ours))
    ours_from_adamw = offloaded(param_groups(reference_b), device, gpu_fraction=gpu_fraction)
    ours_from_adamw.load_state_dict(copy.deepcopy(theirs))
    for m, o in ((model, opt), (reference, ref_opt), (model_b, adamw_from_ours), (reference_b, ours_from_adamw)):
        train_reference(m, o, second)
    for m in (model_b, reference_b, reference):
        assert_params_close(model, m)
    assert float(ours_from_adamw.state_dict()["state"][0]["step"]) == 4


@pytest.mark.parametrize("gpu_fraction", [0.0, 0.5])
def test_state_dict_round_trip_with_torch_adamw(gpu_fraction):
    check_state_dict_round_trip("cpu", gpu_fraction)


def bf16_checkpoint():
    """(optimizer state dict with lr and weight decay set to 0, model state dict) after 2 bf16 steps."""
    model = make_model(dtype=torch.bfloat16)
    opt = offloaded(model.parameters(), "cpu", lr=1e-3)
    for micro in batches("cpu", steps=2, dtype=torch.bfloat16):
        backward(model, micro)
        opt.step()
        opt.zero_grad()
    opt_state, model_state = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    # lr 0 and no decay: a step leaves the masters as they are, so tests can read which one was kept.
    opt_state["param_groups"][0].update(lr=0.0, weight_decay=0.0)
    master = opt_state["state"][0]["master_param"]
    assert not torch.equal(master, model_state["0.weight"].float())  # it carries bits bf16 lacks
    return opt_state, model_state


def masters_after_a_step(model, opt) -> list[torch.Tensor]:
    backward(model, batches("cpu", steps=1, dtype=torch.bfloat16)[0])
    opt.step()
    return [opt.state[p]["master_param"] for p in model.parameters()]


@pytest.mark.parametrize("gpu_fraction", [0.0, 1.0])
@pytest.mark.parametrize("model_first", [True, False])
def test_bf16_master_survives_a_checkpoint_in_either_load_order(model_first, gpu_fraction):
    opt_state, model_state = bf16_checkpoint()
    model = make_model(dtype=torch.bfloat16, seed=5)
    opt = offloaded(model.parameters(), "cpu", gpu_fraction=gpu_fraction)
    if model_first:
        model.load_state_dict(model_state)
    opt.load_state_dict(opt_state)
    if not model_first:
        model.load_state_dict(model_state)
    for i, master in enumerate(masters_after_a_step(model, opt)):
        torch.testing.assert_close(master, opt_state["state"][i]["master_param"], rtol=0, atol=0)


@pytest.mark.parametrize("gpu_fraction", [0.0, 1.0])
def test_a_stale_bf16_master_gives_way_to_the_parameter(gpu_fraction):
    opt_state, model_state = bf16_checkpoint()
    model = make_model(dtype=torch.bfloat16)
    model.load_state_dict(model_state)
    opt = offloaded(model.parameters(), "cpu", gpu_fraction=gpu_fraction)
    for s in opt_state["state"].values():
        s["master_param"] = s["master_param"] + 1.0   # e.g. left behind while AdamW trained on
    opt.load_state_dict(opt_state)
    for master, p in zip(masters_after_a_step(model, opt), model.parameters()):
        torch.testing.assert_close(master, p.detach().float(), rtol=0, atol=0)


def test_weights_loaded_after_construction_reach_the_masters():
    model = make_model()
    opt = offloaded(model.parameters(), "cpu", lr=1e-2, gpu_fraction=0.0)
    other = make_model(seed=3)
    model.load_state_dict(other.state_dict())  # e.g. a model checkpoint restored after building opt
    reference = copy.deepcopy(other)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    data = batches("cpu", steps=2)
    train_offloaded(model, opt, data)
    train_reference(reference, ref_opt, data)
    assert_params_close(model, reference)


def check_lr_scheduler(device):
    model = make_model(device)
    reference = copy.deepcopy(model)
    opt = offloaded(param_groups(model), device, gpu_fraction=0.5)
    ref_opt = torch.optim.AdamW(param_groups(reference))
    decay = lambda step: 0.5 ** step
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, decay)
    data = batches(device, steps=4)
    train_offloaded(model, opt, data, scheduler=sched)
    train_reference(reference, ref_opt, data, scheduler=ref_sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-2 * 0.5 ** 4)
    assert_params_close(model, reference)


def test_lr_scheduler_drives_both_parts():
    check_lr_scheduler("cpu")


def test_gpu_fraction_keeps_the_longest_fitting_prefix_by_bytes():
    model = make_model()
    sizes = [p.numel() * 4 for p in model.parameters()]   # 231, 33, 429, 13, 13, 13, 65, 5 elements
    opt = offloaded(model.parameters(), "cpu", gpu_fraction=0.4)
    resident = sorted(opt._device_slots)
    assert resident == list(range(len(resident))) and resident
    assert sum(sizes[i] for i in resident) <= 0.4 * sum(sizes) < sum(sizes[:len(resident) + 1])
    assert opt.resident_fraction == pytest.approx(sum(sizes[i] for i in resident) / sum(sizes))
    # Pinned blocks hold exactly the offloaded parameters: 3 fp32 kinds + the fp32 landing buffer,
    # each view padded to 64 bytes.
    padded = sum(-(-s // 64) * 64 for i, s in enumerate(sizes) if i not in resident)
    assert opt.pinned_bytes == 4 * padded


def test_auto_fraction_moves_a_prefix_after_the_first_step():
    model = make_model()
    reference = copy.deepcopy(model)
    sizes = [p.numel() for g in param_groups(model) for p in g["params"]]   # the optimizer's order
    headroom = 8 * (sizes[0] + sizes[1] + sizes[2]) + 7  # fp32: 8 bytes of moments per element
    opt = offloaded(param_groups(model), "cpu", gpu_fraction="auto", headroom=headroom)
    ref_opt = torch.optim.AdamW(param_groups(reference))
    assert opt.resident_fraction == 0.0
    pinned_before = opt.pinned_bytes
    data = batches("cpu")
    train_offloaded(model, opt, data[:1])
    assert sorted(opt._device_slots) == [0, 1, 2]
    assert opt.pinned_bytes < pinned_before
    train_offloaded(model, opt, data[1:])
    train_reference(reference, ref_opt, data)
    assert_params_close(model, reference)


def test_not_enough_host_memory_is_a_clear_memory_error(monkeypatch):
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 1000)
    with pytest.raises(MemoryError, match=r"needs \d+ bytes .* only 1000 bytes .* available"):
        offloaded(make_model().parameters(), "cpu")


def test_available_host_bytes_is_read_from_the_system():
    assert host_memory.available_host_bytes() > 0


@pytest.mark.parametrize("files, room", [
    # cgroup v2: 8 GiB limit, 7 GiB used of which 2 GiB page cache -> 3 GiB of room.
    ({"memory.max": "8589934592", "memory.current": "7516192768", "memory.stat": "anon 5368709120\nfile 2147483648"},
     3 << 30),
    ({"memory.max": "max", "memory.current": "7516192768"}, None),
    # cgroup v1: no limit is a page-rounded 2**63 - 1.
    ({"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "1"}, None),
    ({"memory/memory.limit_in_bytes": "4294967296", "memory/memory.usage_in_bytes": "4294967296",
      "memory/memory.stat": "cache 0\ntotal_cache 1073741824"}, 1 << 30),
    ({}, None),
])
def test_a_cgroup_limit_bounds_the_available_host_memory(tmp_path, monkeypatch, files, room):
    # In a container /proc/meminfo shows the whole machine; past the cgroup's limit the process is killed.
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    monkeypatch.setattr(host_memory, "_CGROUP_ROOT", str(tmp_path))
    assert host_memory._cgroup_room() == room
    if room is not None:
        assert host_memory.available_host_bytes() <= room


def test_needs_a_cuda_gpu():
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        OffloadedOptimizer(make_model().parameters())


@pytest.mark.parametrize("kwargs, message", [
    ({"optimizer": "sgd"}, "adamw"),
    ({"gpu_fraction": 1.5}, "gpu_fraction"),
    ({"gpu_fraction": "half"}, "gpu_fraction"),
    ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"num_threads": 0}, "num_threads"),
    ({"lr": -1.0}, "learning rate"),
    ({"betas": (0.9, 1.0)}, "betas"),
])
def test_invalid_arguments_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        offloaded(make_model().parameters(), "cpu", **kwargs)


def test_load_state_dict_rejects_what_it_cannot_honour():
    model = make_model()
    opt = offloaded(model.parameters(), "cpu")
    amsgrad = torch.optim.AdamW(copy.deepcopy(model).parameters(), amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(amsgrad)
    other = copy.deepcopy(model)
    backward(other, batches("cpu", steps=1)[0])
    adamw = torch.optim.AdamW(other.parameters())
    adamw.step()
    state = adamw.state_dict()
    state["state"][0]["exp_avg"] = torch.zeros(7)   # would broadcast silently in copy_ to 33x7
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(state)


def test_views_are_64_byte_aligned_and_buckets_split_at_groups():
    offsets, length = pinned_host._carve([3, 16, 17], torch.float32)
    assert offsets == [0, 16, 32] and length == 64
    offsets, length = pinned_host._carve([3, 40], torch.bfloat16)
    assert offsets == [0, 32] and length == 96

    def slot(group, numel):
        return optimizer_slots._HostSlot(0, group, torch.zeros(numel), *[torch.zeros(numel)] * 4)

    slots = [slot(0, 4), slot(0, 4), slot(0, 4), slot(1, 1), slot(0, 20)]
    sizes = [[len(s.param) for s in b] for b in optimizer_slots._buckets(slots, max_numel=8)]
    assert sizes == [[4, 4], [4], [1], [20]]


def test_num_threads_is_used_for_the_update_and_restored(monkeypatch):
    seen = []
    real = oo._host_adamw_

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        real(*args, **kwargs)

    monkeypatch.setattr(oo, "_host_adamw_", spy)
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    model = make_model()
    opt = offloaded(model.parameters(), "cpu", num_threads=wanted)
    backward(model, batches("cpu", steps=1)[0])
    opt.step()
    assert seen and set(seen) == {wanted}
    assert torch.get_num_threads() == before


def test_param_groups_are_fixed_at_construction():
    model = make_model()
    opt = offloaded(list(model.parameters())[:2], "cpu")
    with pytest.raises(NotImplementedError, match="constructor"):
        opt.add_param_group({"params": list(model.parameters())[2:]})


def test_host_blocks_are_page_aligned_allocations_of_their_own():
    """The CUDA transport registers each block from its storage's first byte, the address
    ``Tensor.is_pinned()`` asks about: a block must start its storage and a page, and outlive its own
    tensor object for as long as views of it exist."""
    block = pinned_host._host_block(1000, torch.bfloat16)
    assert block.dtype == torch.bfloat16 and block.shape == (1000,)
    assert block.untyped_storage().data_ptr() == block.data_ptr()
    assert block.data_ptr() % mmap.PAGESIZE == 0
    assert block.untyped_storage().nbytes() == 2000
    assert not block.any()
    view = block[64:128]
    view.fill_(1.5)
    del block
    assert float(view.sum()) == 96.0
    assert pinned_host._host_block(0, torch.float32).numel() == 0


def test_close_removes_hooks_and_refuses_to_step():
    model = make_model()
    opt = offloaded(model.parameters(), "cpu")
    opt.close()
    backward(model, batches("cpu", steps=1)[0])
    assert opt._transport.copies_to_host == 0
    assert opt._transport.pinned_blocks == []
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()


# --------------------------------------------------------------------------------------------------
# CUDA: streams, events, pinned memory (pytest -m gpu)
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_fraction", [0.0, 0.5])
def test_gpu_matches_adamw_with_clipping_and_accumulation(cuda, gpu_fraction):
    opt = check_matches_adamw(cuda, gpu_fraction)
    assert (len(opt._host_slots) == 8) == (gpu_fraction == 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_fraction", [0.0, 0.5])
def test_gpu_bf16_params_follow_fp32_masters(cuda, gpu_fraction):
    check_bf16(cuda, gpu_fraction)


@pytest.mark.gpu
@pytest.mark.parametrize("gpu_fraction", [0.0, 0.5])
def test_gpu_state_dict_round_trip(cuda, gpu_fraction):
    check_state_dict_round_trip(cuda, gpu_fraction)


@pytest.mark.gpu
def test_gpu_lr_scheduler(cuda):
    check_lr_scheduler(cuda)


def pinned_at(address: int) -> bool:
    """``Tensor.is_pinned()`` of one host address. PyTorch asks CUDA (``cudaPointerGetAttributes``, which
    knows ``cudaHostRegister``ed ranges) about the first byte of a tensor's *storage*, so a one-byte
    tensor wrapped around ``address`` asks about exactly that byte."""
    return torch.frombuffer((ctypes.c_char * 1).from_address(address), dtype=torch.uint8).is_pinned()


@pytest.mark.gpu
def test_gpu_pinned_blocks_are_registered_and_exactly_sized(cuda):
    model = make_model(cuda, torch.bfloat16)
    numels = [p.numel() for p in model.parameters()]

    def caching_allocator_bytes() -> int:
        return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)

    before = caching_allocator_bytes()
    opt = OffloadedOptimizer(model.parameters())
    # Not from the caching host allocator (which rounds up to powers of two).
    assert caching_allocator_bytes() == before
    blocks = list(opt._host_store._blocks)
    fp32_len, bf16_len = (pinned_host._carve(numels, dtype)[1] for dtype in (torch.float32, torch.bfloat16))
    assert sorted((str(b.dtype), b.numel()) for b in blocks) == sorted(
        [("torch.bfloat16", bf16_len)] + [("torch.float32", fp32_len)] * 3)
    assert opt.pinned_bytes == sum(b.nbytes for b in blocks) == 12 * fp32_len + 2 * bf16_len
    for b in blocks:
        # Each block is its own page-aligned allocation, registered from its first to its last byte.
        assert b.untyped_storage().data_ptr() == b.data_ptr() and b.data_ptr() % mmap.PAGESIZE == 0
        assert b.untyped_storage().nbytes() == b.nbytes
        assert b.is_pinned()
        assert pinned_at(b.data_ptr()) and pinned_at(b.data_ptr() + b.nbytes - 1)
    slot = opt._host_slots[len(numels) - 1]   # the last parameter: views at an offset in each block
    views = (slot.master, slot.exp_avg, slot.exp_avg_sq, slot.grad)
    for t in views:
        assert t.storage_offset() > 0 and t.is_pinned() and pinned_at(t.data_ptr())
    addresses = [b.data_ptr() for b in blocks]
    opt.close()
    # The views (and `blocks`) keep the memory mapped, so the addresses are still ours: unregistered.
    assert not any(pinned_at(a) for a in addresses)
    assert not any(t.is_pinned() for t in views)


@pytest.mark.gpu
def test_gpu_peak_memory_is_lower_than_fused_adamw_by_the_states(cuda):
    def peak(make_opt) -> tuple[int, int]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).to(cuda)
        opt = make_opt(model.parameters())
        x = torch.randn(64, 2048, device=cuda)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(cuda)
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        states = 8 * sum(p.numel() for p in model.parameters())
        result = torch.cuda.max_memory_allocated(cuda), states
        if isinstance(opt, OffloadedOptimizer):
            opt.close()
        del model, opt
        torch.cuda.empty_cache()
        return result

    fused_peak, states = peak(lambda ps: torch.optim.AdamW(ps, fused=True))
    offloaded_peak, _ = peak(lambda ps: OffloadedOptimizer(ps))
    assert offloaded_peak <= fused_peak - states, (offloaded_peak, fused_peak, states)


@pytest.mark.gpu
def test_gpu_auto_fraction_measures_headroom_and_stays_equal(cuda):
    model = make_model(cuda)
    reference = copy.deepcopy(model)
    opt = OffloadedOptimizer(param_groups(model), gpu_fraction="auto")
    ref_opt = torch.optim.AdamW(param_groups(reference))
    data = batches(cuda)
    train_offloaded(model, opt, data)
    train_reference(reference, ref_opt, data)
    # A tiny model fits in any GPU's headroom: everything moves after the first step.
    assert opt.resident_fraction == 1.0 and opt.pinned_bytes == 0
    assert_params_close(model, reference)
