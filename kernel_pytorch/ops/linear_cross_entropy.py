"""The LM head and its cross-entropy loss, fused: the float32 logits are never kept, nor their gradient.

What transformers' causal LMs compute with ``labels=`` (``ForCausalLMLoss``)::

    logits = F.linear(hidden, weight, bias)                          # (N, V) in the model's dtype: an output
    loss = F.cross_entropy(logits.float().view(-1, V), labels, ignore_index=-100, reduction="mean")

Unfused, autograd keeps the float32 log-softmax (``N * V * 4`` bytes: 8.4 GB at vocab 128256 and 8 x 2048
tokens) and the backward materializes the float32 gradient of the logits, then its copy in the model's dtype.
Three ops replace the loss, by what the graph holds:

* :func:`linear_logits_cross_entropy` (the logits are an output, as in every transformers model): the
  logits the model returns are kept anyway, so it computes them (the head's matmul, soft-capped if asked) and
  the loss from *them* (per row: logsumexp and loss in float32, one read), returning both; it saves only the
  ``N`` float32 log-sum-exps beyond the logits. The backward computes the logits' gradient slice by slice
  over the vocabulary, ``g = scale * (softmax - target)`` from the saved log-sum-exps, plus the gradient
  that reaches the logits as an output, and turns each slice into its share at once: ``dW[v0:v1] = g.T @ h``
  (one whole matmul per slice, float32 accumulation inside it) and ``dh += g @ W[v0:v1]``. Neither the
  float32 logits nor the full gradient of the logits exists, and no matmul is added. Why one op for the head
  and the loss: in a compiled graph the logits' gradient as an output arrives as zeros even when unused
  (AOTAutograd materializes it), and a separate ``F.linear`` would run its two backward matmuls on them;
  inside the op it is one more read per slice. Recomputing the logits from the hidden states instead would
  add a matmul to keep nothing the model does not keep already.
* :func:`linear_cross_entropy` (the logits feed only the loss: a hand-written model returning the loss):
  the logits are computed chunk by chunk over tokens and dropped, Liger-Kernel's scheme: each chunk's
  loss, and, when training, its gradient written over the chunk's logits and turned at once into ``dh`` for
  those tokens and its share of ``dW`` (float32 accumulator), so the backward only scales them by the
  loss's gradient. Nothing of size ``N * V`` is ever kept; between forward and backward it holds ``dh`` and
  ``dW`` (the sizes of the hidden states and the weight) instead of the logits.
* :func:`logits_cross_entropy` with no head (the head is in another graph: a graph break before the loss):
  the loss from the given logits, saving the log-sum-exps instead of a float32 log-softmax; the backward
  writes the logits' gradient once, in their dtype.

Numerics: logits rounded to the model's dtype by the matmul, as the model rounds them; the softmax, the loss,
its reduction and the logits' gradient in float32; that gradient rounded to the model's dtype before the
matmuls, as the unfused backward rounds it. ``ignore_index`` rows give 0 loss and 0 gradient; ``"mean"``
divides by the number of other rows, as PyTorch does; ``label_smoothing`` is PyTorch's
(``(1 - e) * nll + e * mean_j(-log p_j)``). ``softcap`` (Gemma-2's final ``tanh(x / c) * c``) is applied
before the loss by :func:`linear_cross_entropy`; :func:`logits_cross_entropy` takes the capped logits (the
model's output) and applies the cap's derivative ``1 - (x / c)**2`` in the backward.

Layers: ``_loss_rows_kernel`` / ``_grad_kernel`` (Triton: per row, log-sum-exp and loss in one read; the
gradient from the saved log-sum-exp) with their native PyTorch twins (CPU, other devices, machines without
Triton) -> ``kernel_pytorch::linear_logits_cross_entropy``, ``kernel_pytorch::linear_cross_entropy`` and
``kernel_pytorch::logits_cross_entropy`` (+ ``_backward``, shared) (``custom_op``: the bodies loop over chunks
with matmuls, opaque to Inductor so it neither unrolls the loops nor plans their buffers) -> the functionals.

Example::

    loss, logits = linear_logits_cross_entropy(hidden, lm_head.weight, None, labels)
    loss = linear_cross_entropy(hidden, lm_head.weight, None, labels, label_smoothing=0.1)
    loss = logits_cross_entropy(None, None, None, logits, labels)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from kernel_pytorch.ops import triton_utils as tu
from kernel_pytorch.ops.triton_utils import jit, tl

__all__ = ["linear_cross_entropy", "linear_logits_cross_entropy", "logits_cross_entropy", "CHUNK_ELEMENTS"]

# Elements of one chunk of logits (or of their gradient) in the model's dtype: 2**28 is 512 MB in bf16, the
# most either op holds beyond its inputs; 8 chunks at 8 x 2048 tokens and vocab 128256. Fewer, larger chunks
# mean fewer partial sums (dh per vocabulary slice, dW per token chunk: each a read-add-write of that size).
CHUNK_ELEMENTS = 1 << 28
# A vocabulary slice narrower than this makes dh = g @ W[v0:v1] a matmul with a short inner dim.
_MIN_VOCAB_SLICE = 4096
_REDUCTIONS = ("mean", "sum")

# Tiles: one program per row for the loss (a row of 32k-256k logits, read in blocks of _LOSS_BLOCK);
# _GRAD_BLOCK columns of one row per program for the elementwise gradient. Not swept yet.
_LOSS_BLOCK, _LOSS_WARPS = 4096, 8
_GRAD_BLOCK, _GRAD_WARPS = 2048, 8


# --------------------------------------------------------------------------------------------- kernels

@jit
def _soft_capped(x, softcap):
    """``softcap * tanh(x / softcap)`` in fp32 (tanh as 2 * sigmoid(2y) - 1: the interpreter has no tanh)."""
    return softcap * (2.0 * tl.sigmoid(2.0 * x / softcap) - 1.0)


@jit
def _loss_rows_kernel(
    X,  # (n_rows, n_cols) logits, row stride stride_x, unit column stride
    LABELS,  # (n_rows,) int64 class of each row
    LOSS,  # (n_rows,) fp32 output: the row's loss, 0 where its label is ignore_index
    LSE,  # (n_rows,) fp32 output: logsumexp of the (capped) row
    stride_x, n_cols, ignore_index, smoothing, softcap,
    APPLY_CAP: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(LABELS + row)
    running_max = float("-inf")
    running_sum = 0.0
    total = 0.0
    target = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if APPLY_CAP:
            x = _soft_capped(x, softcap)
        x = tl.where(mask, x, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(x, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
        total += tl.sum(tl.where(mask, x, 0.0), 0)
        target += tl.sum(tl.where(cols == label, x, 0.0), 0)
    lse = running_max + tl.log(running_sum)
    loss = (1.0 - smoothing) * (lse - target) + smoothing * (lse - total / n_cols)
    tl.store(LOSS + row, tl.where(label != ignore_index, loss, 0.0))
    tl.store(LSE + row, lse)


@jit
def _grad_kernel(
    X,  # (n_rows, n_cols) logits (a vocabulary slice starting at column col_offset), row stride stride_x
    LABELS,  # (n_rows,) int64
    LSE,  # (n_rows,) fp32 logsumexp of each whole (capped) row
    SCALE,  # () fp32: the loss's gradient, divided by the count of counted rows for "mean"
    T,  # (n_rows, n_cols) gradient of X as an output too (row stride stride_t), added; read only if HAS_TANGENT
    G,  # (n_rows, n_cols) output, row stride stride_g: the gradient of the loss w.r.t. X (may be X itself)
    stride_x, stride_t, stride_g, n_cols, col_offset, vocab, ignore_index, smoothing, softcap,
    APPLY_CAP: tl.constexpr, CHAIN_CAP: tl.constexpr, HAS_TANGENT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    label = tl.load(LABELS + row)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if APPLY_CAP:
        x = _soft_capped(x, softcap)
    g = tl.exp(x - tl.load(LSE + row)) - smoothing / vocab
    g -= tl.where(cols + col_offset == label, 1.0 - smoothing, 0.0)
    g = tl.where(label != ignore_index, g * tl.load(SCALE), 0.0)
    if HAS_TANGENT:
        g += tl.load(T + row * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
    if CHAIN_CAP:  # through the soft cap: d(c * tanh(r / c)) / dr = 1 - (x / c)**2
        g *= 1.0 - (x / softcap) * (x / softcap)
    tl.store(G + row * stride_g + cols, g.to(G.dtype.element_ty), mask=mask)


def _loss_rows_triton(x: Tensor, labels: Tensor, ignore_index: int, smoothing: float, softcap: float,
                      apply_cap: bool) -> tuple[Tensor, Tensor]:
    n_rows, n_cols = x.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    lse = torch.empty_like(loss)
    with tu.device_guard(x), tu.eager_launches():
        tu.launch(_loss_rows_kernel)[(n_rows,)](
            x, labels, loss, lse, x.stride(0), n_cols, ignore_index, smoothing, softcap or 1.0,
            APPLY_CAP=apply_cap, BLOCK=min(_LOSS_BLOCK, tu.next_power_of_2(n_cols)), num_warps=_LOSS_WARPS)
    return loss, lse


def _grad_triton(x: Tensor, labels: Tensor, lse: Tensor, scale: Tensor, out: Tensor, col_offset: int, vocab: int,
                 ignore_index: int, smoothing: float, softcap: float, apply_cap: bool,
                 tangent: Optional[Tensor] = None) -> None:
    n_rows, n_cols = x.shape
    block = min(_GRAD_BLOCK, tu.next_power_of_2(n_cols))
    t = tu.unused_pointer(x) if tangent is None else tangent
    with tu.device_guard(x), tu.eager_launches():
        tu.launch(_grad_kernel)[(n_rows, tu.cdiv(n_cols, block))](
            x, labels, lse, scale, t, out, x.stride(0), t.stride(0) if tangent is not None else 0, out.stride(0),
            n_cols, col_offset, vocab, ignore_index, smoothing, softcap or 1.0, APPLY_CAP=apply_cap,
            CHAIN_CAP=softcap > 0, HAS_TANGENT=tangent is not None, BLOCK=block, num_warps=_GRAD_WARPS)


# ------------------------------------------------------------------------------ the same, in PyTorch

def _capped(x: Tensor, softcap: float, apply_cap: bool) -> Tensor:
    x = x.to(tu.acc_dtype(x.dtype))
    return torch.tanh(x / softcap) * softcap if apply_cap else x


def _loss_rows_torch(x: Tensor, labels: Tensor, ignore_index: int, smoothing: float, softcap: float,
                     apply_cap: bool) -> tuple[Tensor, Tensor]:
    x = _capped(x, softcap, apply_cap)
    lse = torch.logsumexp(x, -1)
    counted = labels != ignore_index
    target = x.gather(1, labels.where(counted, 0)[:, None]).squeeze(1)
    loss = lse - target
    if smoothing:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - x.mean(-1))
    return loss.where(counted, 0.0), lse


def _grad_torch(x: Tensor, labels: Tensor, lse: Tensor, scale: Tensor, out: Tensor, col_offset: int, vocab: int,
                ignore_index: int, smoothing: float, softcap: float, apply_cap: bool,
                tangent: Optional[Tensor] = None) -> None:
    x = _capped(x, softcap, apply_cap)
    g = torch.exp(x - lse[:, None])
    if smoothing:
        g -= smoothing / vocab
    column = labels - col_offset
    hit = (labels != ignore_index) & (column >= 0) & (column < x.shape[1])
    g.scatter_add_(1, column.clamp(0, x.shape[1] - 1)[:, None], -(1.0 - smoothing) * hit.to(g.dtype)[:, None])
    g = torch.where((labels != ignore_index)[:, None], g * scale, 0.0)
    if tangent is not None:
        g += tangent
    if softcap > 0:  # through the soft cap: d(c * tanh(r / c)) / dr = 1 - (x / c)**2
        g *= 1.0 - (x / softcap).square()
    out.copy_(g)


def _loss_rows(x: Tensor, *args) -> tuple[Tensor, Tensor]:
    """Per row of logits ``x``: (loss, logsumexp), fp32."""
    return (_loss_rows_triton if tu.use_triton(x) else _loss_rows_torch)(x, *args)


def _write_grad(x: Tensor, *args) -> None:
    """The loss's gradient w.r.t. the logits ``x`` into ``out`` (``args``: as ``_grad_torch``)."""
    (_grad_triton if tu.use_triton(x) else _grad_torch)(x, *args)


# ----------------------------------------------------------------------------------- shared pieces

def _counted(labels: Tensor, ignore_index: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return (labels != ignore_index).sum().to(dtype)


def _reduced(loss_rows: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    total = loss_rows.sum()
    return total / _counted(labels, ignore_index, total.dtype) if reduction == "mean" else total


def _gradient_scale(grad_loss: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """d loss / d (a counted row's loss), as a 0-d fp32 device tensor (no host sync)."""
    grad_loss = grad_loss.to(tu.acc_dtype(grad_loss.dtype))
    return grad_loss / _counted(labels, ignore_index, grad_loss.dtype) if reduction == "mean" else grad_loss.clone()


def _add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b``, accumulated in ``acc``'s dtype (fp32 for 16-bit ``a``, ``b``)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def _accumulator(like: Tensor, *shape: int) -> Tensor:
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    return torch.zeros(shape, dtype=dtype, device=like.device)


def _check(hidden: Tensor, weight: Tensor, labels: Tensor, reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden (N, D) and weight (V, D) expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels of shape ({hidden.shape[0]},) expected, got {tuple(labels.shape)}")


# -------------------------------------------------------------------- the loss from the model's logits

def _vocab_slice(n_rows: int, vocab: int, chunk: int) -> int:
    if chunk > 0:
        return chunk
    return min(vocab, max(_MIN_VOCAB_SLICE, CHUNK_ELEMENTS // max(n_rows, 1)))


def _token_chunk(n_rows: int, vocab: int, chunk: int) -> int:
    return chunk if chunk > 0 else max(1, min(n_rows, CHUNK_ELEMENTS // vocab))


def _logits_ce(hidden: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], logits: Tensor,
               labels: Tensor, ignore_index: int, label_smoothing: float, softcap: float, reduction: str,
               chunk: int) -> tuple[Tensor, Tensor]:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if hidden is not None:
        _check(hidden, weight, labels, reduction)
    rows = _token_chunk(logits.shape[0], logits.shape[1], chunk)
    loss_rows = torch.empty(logits.shape[0], dtype=tu.acc_dtype(logits.dtype), device=logits.device)
    lse = torch.empty_like(loss_rows)
    # The Triton kernel makes one pass per row, all rows in one launch; PyTorch's path makes fp32 temporaries
    # of its chunk's size, hence the chunks.
    step = logits.shape[0] if tu.use_triton(logits) else rows
    for r0 in range(0, logits.shape[0], max(step, 1)):
        r1 = min(r0 + step, logits.shape[0])
        loss_rows[r0:r1], lse[r0:r1] = _loss_rows(logits[r0:r1], labels[r0:r1], ignore_index, label_smoothing,
                                                  softcap, False)
    return _reduced(loss_rows, labels, ignore_index, reduction), lse


def _logits_ce_fake(hidden, weight, bias, logits, labels, ignore_index, label_smoothing, softcap, reduction, chunk):
    dtype = tu.acc_dtype(logits.dtype)
    return logits.new_empty((), dtype=dtype), logits.new_empty(logits.shape[0], dtype=dtype)


def _logits_grad(logits: Tensor, labels: Tensor, lse: Tensor, scale: Tensor, params: tuple) -> Tensor:
    """The gradient w.r.t. the logits themselves, in their dtype (no LM head to send it to)."""
    ignore_index, label_smoothing, softcap = params
    d_logits = torch.empty_like(logits)
    _write_grad(logits, labels, lse, scale, d_logits, 0, logits.shape[1], ignore_index, label_smoothing, softcap,
                False)
    return d_logits


def _logits_ce_backward(grad_loss: Tensor, hidden: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
                        logits: Tensor, labels: Tensor, lse: Tensor, ignore_index: int, label_smoothing: float,
                        softcap: float, reduction: str, chunk: int, need_hidden: bool, need_weight: bool,
                        grad_logits: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n_rows, vocab = logits.shape
    scale = _gradient_scale(grad_loss, labels, ignore_index, reduction)
    if hidden is None:  # three distinct empty tensors: a custom op's outputs may not alias each other
        return (logits.new_empty(0), logits.new_empty(0), logits.new_empty(0),
                _logits_grad(logits, labels, lse, scale, (ignore_index, label_smoothing, softcap)))
    width = _vocab_slice(n_rows, vocab, chunk)
    d_hidden = _accumulator(hidden, *hidden.shape) if need_hidden else hidden.new_empty(0)
    d_weight = torch.empty_like(weight) if need_weight else weight.new_empty(0)
    d_bias = _accumulator(bias, vocab) if bias is not None and need_weight else weight.new_empty(0)
    g_buffer = torch.empty(n_rows, min(width, vocab), dtype=hidden.dtype, device=hidden.device)
    for v0 in range(0, vocab, width):
        v1 = min(v0 + width, vocab)
        g = g_buffer[:, :v1 - v0]
        _write_grad(logits[:, v0:v1], labels, lse, scale, g, v0, vocab, ignore_index, label_smoothing, softcap,
                    False, None if grad_logits is None else grad_logits[:, v0:v1])
        if need_weight:
            torch.mm(g.t(), hidden, out=d_weight[v0:v1])
            if bias is not None:
                d_bias[v0:v1] = g.sum(0, dtype=d_bias.dtype)
        if need_hidden:
            _add_product(d_hidden, g, weight[v0:v1])
    if bias is not None and need_weight:
        d_bias = d_bias.to(bias.dtype)
    return (d_hidden.to(hidden.dtype) if need_hidden else d_hidden), d_weight, d_bias, logits.new_empty(0)


def _logits_ce_backward_fake(grad_loss, hidden, weight, bias, logits, labels, lse, ignore_index, label_smoothing,
                             softcap, reduction, chunk, need_hidden, need_weight, grad_logits=None):
    def empty():
        return logits.new_empty(0)

    if hidden is None:
        return empty(), empty(), empty(), torch.empty_like(logits)
    d_bias = bias.new_empty(bias.shape) if bias is not None and need_weight else empty()
    return (torch.empty_like(hidden) if need_hidden else empty(), torch.empty_like(weight) if need_weight else empty(),
            d_bias, empty())


logits_ce_op = torch.library.custom_op("kernel_pytorch::logits_cross_entropy", _logits_ce, mutates_args=())
logits_ce_backward_op = torch.library.custom_op("kernel_pytorch::logits_cross_entropy_backward", _logits_ce_backward,
                                                mutates_args=())
logits_ce_op.register_fake(_logits_ce_fake)
logits_ce_backward_op.register_fake(_logits_ce_backward_fake)


def _logits_ce_setup(ctx, inputs, output) -> None:
    hidden, weight, bias, logits, labels, *params = inputs
    ctx.save_for_backward(hidden, weight, bias, logits, labels, output[1])
    ctx.params = params


def _logits_ce_grad(ctx, grad_loss, _grad_lse):
    hidden, weight, bias, logits, labels, lse = ctx.saved_tensors
    wanted = ctx.needs_input_grad
    d_hidden, d_weight, d_bias, d_logits = logits_ce_backward_op(
        grad_loss, hidden, weight, bias, logits, labels, lse, *ctx.params, wanted[0], wanted[1] or wanted[2])
    return (d_hidden if wanted[0] else None, d_weight if wanted[1] else None, d_bias if wanted[2] else None,
            d_logits if hidden is None and wanted[3] else None, None, None, None, None, None, None)


logits_ce_op.register_autograd(_logits_ce_grad, setup_context=_logits_ce_setup)


def logits_cross_entropy(hidden: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], logits: Tensor,
                         labels: Tensor, *, ignore_index: int = -100, label_smoothing: float = 0.0,
                         softcap: Optional[float] = None, reduction: str = "mean", chunk: int = 0) -> Tensor:
    """``F.cross_entropy(logits.float().view(-1, V), labels.view(-1), ...)`` where ``logits = F.linear(hidden,
    weight, bias)`` (soft-capped by ``softcap`` when given) is kept anyway (an output): the gradient goes to
    ``hidden``, ``weight`` and ``bias`` directly, slice by slice of the vocabulary (``chunk`` columns; 0: by
    :data:`CHUNK_ELEMENTS`), never through ``logits``. With ``hidden`` and ``weight`` None (the LM head is in
    another graph), the gradient goes to ``logits``, in their dtype; only the row statistics are saved,
    not a float32 copy. The float32 loss, a 0-d tensor.

    >>> h, w = torch.randn(6, 8), torch.randn(11, 8)
    >>> labels = torch.tensor([1, 2, -100, 4, 5, 6])
    >>> loss = logits_cross_entropy(h, w, None, h @ w.T, labels)
    """
    if (hidden is None) != (weight is None) or (hidden is None and bias is not None):
        raise ValueError("logits_cross_entropy: give hidden and weight (and maybe bias) together, or none of them")
    if hidden is not None:
        hidden = hidden.reshape(-1, hidden.shape[-1])
    loss, _ = logits_ce_op(hidden, weight, bias, logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index, float(label_smoothing), float(softcap or 0.0), reduction, chunk)
    return loss


# ---------------------------------------------------------- the LM head and its loss, the logits an output

def _linear_logits_ce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, ignore_index: int,
                      label_smoothing: float, softcap: float, reduction: str,
                      chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    _check(hidden, weight, labels, reduction)
    logits = F.linear(hidden, weight, bias)  # the model's own logits, in its dtype
    if softcap > 0:  # capped in fp32 and rounded once, a token chunk at a time (no fp32 copy of the whole)
        rows = _token_chunk(logits.shape[0], logits.shape[1], chunk)
        for r0 in range(0, logits.shape[0], rows):
            logits[r0:r0 + rows] = _capped(logits[r0:r0 + rows], softcap, True)
    loss, lse = _logits_ce(None, None, None, logits, labels, ignore_index, label_smoothing, softcap, reduction, chunk)
    return loss, logits, lse


def _linear_logits_ce_fake(hidden, weight, bias, labels, ignore_index, label_smoothing, softcap, reduction, chunk):
    dtype = tu.acc_dtype(hidden.dtype)
    return (hidden.new_empty((), dtype=dtype), hidden.new_empty(hidden.shape[0], weight.shape[0]),
            hidden.new_empty(hidden.shape[0], dtype=dtype))


linear_logits_ce_op = torch.library.custom_op("kernel_pytorch::linear_logits_cross_entropy", _linear_logits_ce,
                                              mutates_args=())
linear_logits_ce_op.register_fake(_linear_logits_ce_fake)


def _linear_logits_ce_setup(ctx, inputs, output) -> None:
    hidden, weight, bias, labels, *params = inputs
    _, logits, lse = output
    ctx.save_for_backward(hidden, weight, bias, logits, labels, lse)
    ctx.params = params
    ctx.set_materialize_grads(False)  # unused logits get None, not an (N, V) tensor of zeros (eager)


def _linear_logits_ce_grad(ctx, grad_loss, grad_logits, _grad_lse):
    hidden, weight, bias, logits, labels, lse = ctx.saved_tensors
    if grad_loss is None:  # only the logits were differentiated
        grad_loss = torch.zeros((), dtype=lse.dtype, device=lse.device)
    wanted = ctx.needs_input_grad
    d_hidden, d_weight, d_bias, _ = logits_ce_backward_op(
        grad_loss, hidden, weight, bias, logits, labels, lse, *ctx.params, wanted[0], wanted[1] or wanted[2],
        grad_logits)
    return (d_hidden if wanted[0] else None, d_weight if wanted[1] else None, d_bias if wanted[2] else None,
            None, None, None, None, None, None)


linear_logits_ce_op.register_autograd(_linear_logits_ce_grad, setup_context=_linear_logits_ce_setup)


def linear_logits_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, *,
                                ignore_index: int = -100, label_smoothing: float = 0.0,
                                softcap: Optional[float] = None, reduction: str = "mean",
                                chunk: int = 0) -> tuple[Tensor, Tensor]:
    """``(loss, logits)``: ``logits = F.linear(hidden, weight, bias)`` (Gemma-2's ``tanh(x / softcap) * softcap``
    of it when ``softcap`` is given), of shape ``hidden.shape[:-1] + (V,)`` in the model's dtype, and
    ``F.cross_entropy(logits.float().view(-1, V), labels.view(-1), ...)`` from them. One op for both, so that
    in a compiled graph the gradient reaching the logits as an output (zeros when unused) joins the loss's
    slice by slice, with no matmul of its own (module docstring).

    >>> h, w = torch.randn(2, 3, 8), torch.randn(11, 8)
    >>> loss, logits = linear_logits_cross_entropy(h, w, None, torch.tensor([[1, 2, -100], [4, 5, 6]]))
    """
    loss, logits, _ = linear_logits_ce_op(hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1),
                                          ignore_index, float(label_smoothing), float(softcap or 0.0), reduction,
                                          chunk)
    return loss, logits.view(*hidden.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------ the loss from the hidden states

def _linear_ce(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, ignore_index: int,
               label_smoothing: float, softcap: float, reduction: str, chunk: int, need_hidden: bool,
               need_weight: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check(hidden, weight, labels, reduction)
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    rows = _token_chunk(n_rows, vocab, chunk)
    scale = _gradient_scale(torch.ones((), dtype=tu.acc_dtype(hidden.dtype), device=hidden.device), labels,
                            ignore_index, reduction)
    loss_rows = torch.empty(n_rows, dtype=tu.acc_dtype(hidden.dtype), device=hidden.device)
    d_hidden = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    d_weight = _accumulator(weight, *weight.shape) if need_weight else weight.new_empty(0)
    d_bias = _accumulator(bias, vocab) if bias is not None and need_weight else weight.new_empty(0)
    for r0 in range(0, n_rows, rows):
        r1 = min(r0 + rows, n_rows)
        h, row_labels = hidden[r0:r1], labels[r0:r1]
        x = F.linear(h, weight, bias)  # the chunk's logits in the model's dtype, as the model rounds them
        loss_rows[r0:r1], lse = _loss_rows(x, row_labels, ignore_index, label_smoothing, softcap, softcap > 0)
        if not (need_hidden or need_weight):
            continue
        _write_grad(x, row_labels, lse, scale, x, 0, vocab, ignore_index, label_smoothing, softcap, softcap > 0)
        if need_hidden:
            torch.mm(x, weight, out=d_hidden[r0:r1])
        if need_weight:
            _add_product(d_weight, x.t(), h)
            if bias is not None:
                d_bias += x.sum(0, dtype=d_bias.dtype)
    if need_weight:
        d_weight = d_weight.to(weight.dtype)
        d_bias = d_bias.to(bias.dtype) if bias is not None else d_bias
    return _reduced(loss_rows, labels, ignore_index, reduction), d_hidden, d_weight, d_bias


def _linear_ce_fake(hidden, weight, bias, labels, ignore_index, label_smoothing, softcap, reduction, chunk,
                    need_hidden, need_weight):
    d_bias = bias.new_empty(bias.shape) if bias is not None and need_weight else weight.new_empty(0)
    return (hidden.new_empty((), dtype=tu.acc_dtype(hidden.dtype)),
            torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0), d_bias)


linear_ce_op = torch.library.custom_op("kernel_pytorch::linear_cross_entropy", _linear_ce, mutates_args=())
linear_ce_op.register_fake(_linear_ce_fake)


def _linear_ce_setup(ctx, inputs, output) -> None:
    ctx.bias = inputs[2] is not None
    ctx.save_for_backward(*output[1:])
    ctx.computed = inputs[-2:]


def _linear_ce_grad(ctx, grad_loss, *_grads_of_grads):
    d_hidden, d_weight, d_bias = ctx.saved_tensors
    wanted = ctx.needs_input_grad
    if (wanted[0] and not ctx.computed[0]) or ((wanted[1] or wanted[2]) and not ctx.computed[1]):
        raise RuntimeError("linear_cross_entropy: a gradient was needed that need_hidden / need_weight turned off")
    return (d_hidden * grad_loss if wanted[0] else None, d_weight * grad_loss if wanted[1] else None,
            d_bias * grad_loss if ctx.bias and wanted[2] else None, None, None, None, None, None, None, None, None)


linear_ce_op.register_autograd(_linear_ce_grad, setup_context=_linear_ce_setup)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, softcap: Optional[float] = None,
                         reduction: str = "mean", chunk: int = 0, need_hidden: bool = True,
                         need_weight: bool = True) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float().view(-1, V), labels.view(-1), ...)``, with
    Gemma-2's ``tanh(x / softcap) * softcap`` on the logits when ``softcap`` is given, without ever holding
    the logits: ``chunk`` tokens at a time (0: by :data:`CHUNK_ELEMENTS`). The gradients the backward will
    need (``need_hidden``: w.r.t. ``hidden``; ``need_weight``: ``weight`` and ``bias``) are computed in the
    forward, chunk by chunk; pass False for those no backward will ask for (both, for inference).

    >>> h, w = torch.randn(6, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    >>> linear_cross_entropy(h, w, None, torch.tensor([1, 2, -100, 4, 5, 6])).backward()
    """
    d = hidden.shape[-1]
    loss, *_ = linear_ce_op(hidden.reshape(-1, d), weight, bias, labels.reshape(-1), ignore_index,
                            float(label_smoothing), float(softcap or 0.0), reduction, chunk, need_hidden, need_weight)
    return loss
