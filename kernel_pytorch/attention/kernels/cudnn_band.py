"""The ``"cudnn_band"`` attention kernel: cuDNN's fused attention with a causal sliding window (a diagonal
band), built as a cuDNN graph through the cuDNN frontend's Python API (the ``nvidia-cudnn-frontend``
package, >= 1.32; extra ``cudnn``).

PyTorch's own cuDNN SDPA takes a causal flag or a mask tensor, not a window: a sliding window there is a
dense masked attention. cuDNN skips the tiles outside the band itself, which made it faster than cuDNN's
dense causal kernel and than FlexAttention with the window's BlockMask, forward and backward
(``benchmarks/results/sparse_attention.json``; the figures in ``docs/attention.md``, "cuDNN's sliding window").

What it computes is SDPA's with the mask ``0 <= i - j < window`` (query i sees itself and the
``window - 1`` keys before it): the graph's ``diagonal_band_left_bound`` is the band's length, checked
against a masked float32 SDPA (a bound of ``w`` matched the band ``0 <= i - j <= w - 1`` to bf16 rounding,
``w - 1`` did not). Only that band, with equal query and key lengths: the mask pattern ``("band", 0, hi)``
of :mod:`kernel_pytorch.attention.kernels.flex` with ``window = hi + 1``. The dispatcher sends nothing else here.

Why our own graphs rather than the frontend's ``torch.ops.cudnn.sdpa_fwd``: that op covers every SDPA
variant (sinks, padding, varlen) and checks and normalizes its arguments on each call, which cost about
twice our host time per call (docs/attention.md, "cuDNN's sliding window"). This module builds one forward and one
backward graph per (shapes, strides, dtype, window, scale), keeps them, and each call only allocates the
outputs and executes (``_execute``). Two ops in PyTorch's dispatcher make it traceable by torch.compile;
the autograd formula is SDPA's (forward saves the log-sum-exp, backward is cuDNN's). The frontend is
imported on first use only: it is optional and loads cuDNN.
"""

from __future__ import annotations

import atexit
import math
import threading
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["cudnn_band_forward", "band_window", "check_band_call", "load_cudnn_frontend"]

# Operand ids inside our graphs, by operand name (any distinct integers; one numbering for both directions).
# The names, of the operands and of the two nodes ("sdpa_fwd", "sdpa_bwd"), and the explicit no-padding
# arguments in ``_build`` are those of the frontend's own torch ops: with others ("do", "band_bwd", the
# padding arguments left to their defaults), a forward + backward warmed up eagerly and then captured into
# a CUDA graph failed the capture, with these it captured (docs/attention.md, "cuDNN's sliding window and
# CUDA graphs"). Once another band problem has run in the process, the backward's capture fails with
# either (the dispatcher's rule: its record's trains_in_cuda_graphs).
_UIDS = {name: uid for uid, name in enumerate(("q", "k", "v", "o", "stats", "dO", "dq", "dk", "dv"), start=1)}
_MAX_GRAPHS = 256  # built graphs kept; one per distinct problem, oldest dropped past this


class _Graph(NamedTuple):
    graph: Any  # cudnn.pygraph, built
    workspace_bytes: int


_graphs: dict[tuple, _Graph] = {}
_graphs_lock = threading.Lock()  # builds are serialized; execution of a built graph is not
_local = threading.local()  # cuDNN handles are not thread-safe: one per thread and device


@atexit.register
def _release_graphs() -> None:
    """Drop the built graphs before the interpreter tears the frontend's bindings down: alive then, each
    makes nanobind print a leak report at exit."""
    _graphs.clear()
    getattr(_local, "handles", {}).clear()


def load_cudnn_frontend() -> Any:
    """The cuDNN frontend's Python module; ``ImportError`` names the package when it is missing."""
    try:
        import cudnn  # an import statement: Dynamo traces it, the module is cached after the first call
    except ImportError as error:
        raise ImportError("attention kernel 'cudnn_band' needs the cuDNN frontend: "
                          "pip install 'nvidia-cudnn-frontend>=1.32' (extra 'cudnn')") from error
    return cudnn


def band_window(pattern: Optional[tuple], lq: int, lk: int) -> Optional[int]:
    """The window length cuDNN's band takes for mask ``pattern`` on ``lq`` x ``lk`` scores, or None when the
    pattern is not a causal sliding window this kernel computes exactly."""
    if pattern is None or pattern[0] != "band" or lq != lk:
        return None
    lo, hi = pattern[1], pattern[2]
    if lo != 0 or hi is None or hi < 0:
        return None
    return hi + 1



def check_band_call(q: Tensor, k: Tensor, is_causal: bool, pattern: Optional[tuple],
                    pattern_tensor: Optional[Tensor]) -> None:
    """Refuse a call this kernel would not compute as SDPA: only the pattern ``("band", 0, w - 1)``, with
    Lq == Lk and no ``is_causal`` (the band is causal) and no pattern tensor."""
    if band_window(pattern, q.shape[-2], k.shape[-2]) is None or is_causal or pattern_tensor is not None:
        raise ValueError("attention kernel 'cudnn_band' computes a causal sliding window given as the pattern "
                         f"('band', 0, w - 1) with Lq == Lk and no is_causal (got pattern={pattern!r}, "
                         f"is_causal={is_causal}, Lq={q.shape[-2]}, Lk={k.shape[-2]})")

# ----------------------------------------------------------------------------------- graphs and handles


def _handle(cudnn: Any, device: torch.device) -> Any:
    """This thread's cuDNN handle for ``device``, on torch's current stream (``set_stream`` is a no-op when
    the stream is the one the handle already has)."""
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    handle = handles.get(device)
    if handle is None:
        with torch.cuda.device(device):  # a handle binds to the current device
            handle = handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch._C._cuda_getCurrentRawStream(device.index))
    return handle


def _declare(g: Any, name: str, t: Tensor, data_type: Any) -> Any:
    return g.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=data_type, uid=_UIDS[name])


def _set_output(cudnn_tensor: Any, name: str, t: Tensor, data_type: Any) -> None:
    cudnn_tensor.set_uid(_UIDS[name]).set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride()))
    cudnn_tensor.set_data_type(data_type)


def _build(cudnn: Any, handle: Any, backward: bool, tensors: dict[str, Tensor], window: int, scale: float,
           deterministic: bool) -> _Graph:
    """A built cuDNN graph: the band's forward (q, k, v -> o, stats) or backward (q, k, v, o, do, stats ->
    dq, dk, dv), for the shapes and strides of ``tensors`` (the outputs included)."""
    io_type = {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[tensors["q"].dtype]
    fp32 = cudnn.data_type.FLOAT
    g = cudnn.pygraph(handle=handle, io_data_type=io_type, intermediate_data_type=fp32, compute_data_type=fp32)
    q, k, v = (_declare(g, name, tensors[name], io_type) for name in ("q", "k", "v"))
    # No padding and no sequence lengths, said explicitly (see _UIDS: CUDA-graph capture).
    band = dict(attn_scale=scale, use_padding_mask=False, seq_len_q=None, seq_len_kv=None,
                diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_left_bound=window,
                diagonal_band_right_bound=0)
    if backward:
        o, do = (_declare(g, name, tensors[name], io_type) for name in ("o", "dO"))
        stats = _declare(g, "stats", tensors["stats"], fp32)
        dq, dk, dv = g.sdpa_backward(name="sdpa_bwd", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                     use_deterministic_algorithm=deterministic, **band)
        for out, name in ((dq, "dq"), (dk, "dk"), (dv, "dv")):
            _set_output(out, name, tensors[name], io_type)
    else:
        o, stats = g.sdpa(name="sdpa_fwd", q=q, k=k, v=v, generate_stats=True, sink_token=None, **band)
        _set_output(o, "o", tensors["o"], io_type)
        _set_output(stats, "stats", tensors["stats"], fp32)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return _Graph(g, g.get_workspace_size())


def _execute(backward: bool, tensors: dict[str, Tensor], window: int, scale: float) -> None:
    """Run the band graph on ``tensors``, operand name -> tensor (outputs written in place), building it on
    the first call for this problem."""
    cudnn = load_cudnn_frontend()
    q = tensors["q"]
    deterministic = backward and torch.are_deterministic_algorithms_enabled()
    key = (backward, q.dtype, q.device, window, scale, deterministic,
           *((t.shape, t.stride()) for t in tensors.values()))
    handle = _handle(cudnn, q.device)
    built = _graphs.get(key)
    if built is None:
        with _graphs_lock:
            built = _graphs.get(key) or _build(cudnn, handle, backward, tensors, window, scale, deterministic)
            _graphs[key] = built
            while len(_graphs) > _MAX_GRAPHS:
                _graphs.pop(next(iter(_graphs)))
    workspace = torch.empty(max(built.workspace_bytes, 1), dtype=torch.uint8, device=q.device)
    built.graph.execute(list(tensors.values()), workspace, handle=handle,
                        tensor_uids=tuple(_UIDS[name] for name in tensors))


def _descriptor_ready(t: Tensor) -> Tensor:
    """cuDNN's descriptors need a unit innermost stride and a 16-byte aligned base (an odd storage offset
    faults the kernel); a tensor without them is copied. ``clone``, as ``contiguous`` returns an already
    contiguous but misaligned tensor unchanged."""
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return t.clone(memory_format=torch.contiguous_format)
    return t


# -------------------------------------------------------------------------------------- the two ops
#
# Two ops in the dispatcher (so torch.compile traces them, with the fake implementations below) and an
# autograd.Function over them, not ``torch.library.custom_op``, whose Python layers cost several times the
# host time per call of an op registered with ``Library.impl`` (docs/attention.md), which the compiled
# module pays on every call.

_lib = torch.library.Library("kernel_pytorch", "FRAGMENT")
_lib.define("cudnn_band_fwd(Tensor q, Tensor k, Tensor v, int window, float scale) -> (Tensor, Tensor)")
_lib.define("cudnn_band_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, int window, "
            "float scale) -> (Tensor, Tensor, Tensor)")


def _band_fwd_fake(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float) -> tuple[Tensor, Tensor]:
    # The output takes q's memory layout (empty_like), so a (B, L, H, E) projection viewed as (B, H, L, E)
    # gets an output whose transpose back is free. Stats: (B, H, L, 1) float32, as cuDNN writes them.
    batch, heads, length, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads, length, 1), dtype=torch.float32)


def _band_bwd_fake(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor, window: int,
                   scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _band_fwd(q: Tensor, k: Tensor, v: Tensor, window: int, scale: float) -> tuple[Tensor, Tensor]:
    out, stats = _band_fwd_fake(q, k, v, window, scale)  # the layouts the fake promises, from the inputs as given
    q, k, v = _descriptor_ready(q), _descriptor_ready(k), _descriptor_ready(v)
    _execute(False, {"q": q, "k": k, "v": v, "o": out, "stats": stats}, window, scale)
    return out, stats


def _band_bwd(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor, window: int,
              scale: float) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _band_bwd_fake(grad_out, q, k, v, out, stats, window, scale)
    q, k, v, out = (_descriptor_ready(t) for t in (q, k, v, out))
    if grad_out.stride() != out.stride() or grad_out.data_ptr() % 16:  # the graph reads dO in O's layout
        grad_out = torch.empty_like(out).copy_(grad_out)
    _execute(True, {"q": q, "k": k, "v": v, "o": out, "dO": grad_out, "stats": stats, "dq": dq, "dk": dk,
                    "dv": dv}, window, scale)
    return dq, dk, dv


for _name, _impl, _fake in (("cudnn_band_fwd", _band_fwd, _band_fwd_fake),
                            ("cudnn_band_bwd", _band_bwd, _band_bwd_fake)):
    _lib.impl(_name, _impl, "CUDA")
    torch.library.register_fake(f"kernel_pytorch::{_name}", _fake, lib=_lib)


class _CudnnBandAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, window: int, scale: float) -> Tensor:
        out, stats = torch.ops.kernel_pytorch.cudnn_band_fwd(q, k, v, window, scale)
        ctx.save_for_backward(q, k, v, out, stats)
        ctx.window, ctx.scale = window, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, stats = ctx.saved_tensors
        dq, dk, dv = torch.ops.kernel_pytorch.cudnn_band_bwd(grad_out, q, k, v, out, stats, ctx.window, ctx.scale)
        return dq, dk, dv, None, None


def cudnn_band_forward(q: Tensor, k: Tensor, v: Tensor, *, window: int, scale: Optional[float]) -> Tensor:
    """Causal sliding-window attention of 4-D (B, H, L, E) inputs: query i sees keys ``i - window + 1 .. i``.
    K/V may have fewer heads (Hq % Hk == 0); ``scale=None`` is 1/sqrt(E). The forward captures into CUDA
    graphs; the backward's capture fails once another band problem has run in the process (see ``_UIDS``),
    so the dispatcher does not offer this kernel for training through CUDA graphs."""
    if window < 1:
        raise ValueError(f"the sliding window must hold at least one key, got {window}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _CudnnBandAttention.apply(q, k, v, int(window), scale)
