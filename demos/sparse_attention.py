"""Demo: sparse attention, the two kinds ``optimize`` offers.

1. Sliding-window attention (exact). Causal attention masked to the last ``window`` keys the way
   Mistral's reference code writes it (``triu`` for the future, ``tril`` with an offset for the keys past the
   window): the attention rewrite recognizes the window. On a GPU the dispatcher measures the kernels that
   skip the blocks outside the window (FlexAttention with the window's block mask; cuDNN's banded kernel with
   the ``cudnn`` extra) against the dense ones; on a CPU the window is recognized and run dense. Outputs, and
   gradients in training, match the unoptimized model within the project's per-dtype tolerances; the speedup
   over it is measured at a long length (on a CPU at small shapes, where the window itself saves nothing).
2. Top-k sparse attention (an approximation, inference only, opt-in:
   ``optimize(model.eval(), sparse_attention=SparseAttentionConfig(...))``). Each 128-token query block
   attends to the first block, its own, and the ``topk`` key blocks whose mean-pooled keys score highest
   against its mean-pooled queries. The report gives the relative error against dense attention measured on
   the example inputs; on tokens whose attention falls on a few passages (as in trained LLMs) it must be below
   bf16's output tolerance, the same holds on fresh inputs, calls shorter than ``min_length`` run dense
   (within the dtype's tolerance), and the error on random tokens, whose attention is spread over every key,
   is shown beside it.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from dataclasses import dataclass, field

import torch
from _common import DemoResult, default_device, demo_main, rel_err
from rich.console import Console
from rich.markup import escape

from benchmarks.harness import measure
from kernel_pytorch import SparseAttentionConfig, optimize, report_of
from kernel_pytorch.config import DEFAULT_TOLERANCES

BLOCK = 128  # SparseAttentionConfig's default block: the unit top-k chooses, and the subject passages' length
# The bound on top-k's relative error on the subject tokens: bf16's output tolerance, the error the project
# accepts from an exact bf16 rewrite. There ~99.9% of each query's attention falls on its own subject's
# passages (measured with dense attention at the CPU sizes), which the budget covers, so what top-k drops is
# small: ~2e-3 at the CPU sizes. On random tokens, where no block stands out, the same setting is off by ~0.1.
TOPK_BOUND = DEFAULT_TOLERANCES["bfloat16"].outputs
# Why the sliding window brings no speedup of its own on a CPU (the speedup there, if any, is SDPA's fused
# CPU kernel against eager's op chain, with the same masked work).
WINDOW_ON_CPU = ("expected on a CPU: the window is recognized but runs on the dense kernel (the kernels that "
                 "skip the blocks outside it, FlexAttention fused by Inductor and cuDNN's banded kernel, need a "
                 "GPU, and compile='auto' leaves Inductor off on a CPU), so no masked block is skipped; the "
                 "window's speedups are measured on GPUs")


@dataclass(frozen=True)
class Sizes:
    dim: int
    heads: int
    dtype: torch.dtype
    length: int  # sliding window: the timed inference length
    train_length: int  # sliding window: the gradient check's length
    window: int
    topk_length: int  # top-k: the example length, also min_length (so the example runs the sparse path)
    topk: int
    runs: int


def _sizes(quick: bool, cuda: bool) -> Sizes:
    if cuda:  # a long context: the window skips 7/8 of the score matrix eager computes at 8192, 15/16 at 16384
        return Sizes(dim=1024, heads=8, dtype=torch.bfloat16, length=8192 if quick else 16384, train_length=4096,
                     window=1024, topk_length=8192 if quick else 16384, topk=16, runs=5 if quick else 20)
    # fp32, and lengths at which eager FlexAttention (top-k on a CPU runs unfused) takes about a second
    return Sizes(dim=256, heads=8, dtype=torch.float32, length=512, train_length=256, window=64, topk_length=2048,
                 topk=3, runs=5)


@dataclass
class Part:
    """What one half of the demo found: a failed check (``problem``), or its notes and speedup."""

    problem: str | None = None
    notes: list[str] = field(default_factory=list)
    speedup: float | None = None


class Attention(torch.nn.Module):
    """Multi-head causal self-attention written out by hand; with ``window``, each query sees only the
    ``window`` most recent keys, itself included."""

    def __init__(self, dim: int, heads: int, window: int | None = None):
        super().__init__()
        self.heads, self.window = heads, window
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        batch, n, _ = x.shape
        q, k, v = (p(x).view(batch, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        blocked = torch.full((n, n), float("-inf"), device=x.device, dtype=x.dtype)
        mask = blocked.triu(1)  # no key after the query
        if self.window is not None:
            mask = mask + blocked.tril(-self.window)  # and none `window` or more positions before it
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(batch, n, -1))


def _tolerance(dtype: torch.dtype):
    return DEFAULT_TOLERANCES[str(dtype).removeprefix("torch.")]


def _attention_line(model) -> str:
    """The report's attention rewrite (the first: later captures of new lengths repeat it)."""
    lines = [r.replacement for r in report_of(model).rewrites if r.pass_name == "attention"]
    return lines[0] if lines else "no attention rewrite"


def _kernel(line: str) -> str:
    found = re.match(r"attention\[(\w+)\]", line)
    return found.group(1) if found else "?"


def _training_errors(model, reference, x: torch.Tensor) -> tuple[float, str, float]:
    """One forward + backward of each on ``x``: the output's relative error, and the worst of the input and
    parameter gradients' (its name and error)."""
    x1, x2 = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    out, expected = model(x1), reference(x2)
    seed = torch.randn_like(expected)
    out.backward(seed)
    expected.backward(seed)
    errors = {"input gradient": rel_err(x1.grad, x2.grad)}
    errors.update({f"{name} gradient": rel_err(p.grad, q.grad)
                   for (name, p), q in zip(model.named_parameters(), reference.parameters())})
    worst = max(errors, key=errors.get)
    return rel_err(out, expected), worst, errors[worst]


def _optimized_window(model: Attention, x: torch.Tensor, window: int, mode: str, console: Console):
    """A copy of ``model`` optimized on ``x``, and its attention rewrite line (printed)."""
    optimized = optimize(copy.deepcopy(model), example_inputs=(x,))
    line = _attention_line(optimized)
    console.print(f"sliding window {window}, {mode} at {x.shape[1]} tokens: {escape(line)}")
    return optimized, line


def _sliding_window(s: Sizes, device: str, console: Console) -> Part:
    """Part 1: the window recognized, the same outputs and gradients, timed against eager."""
    torch.manual_seed(0)
    eager = Attention(s.dim, s.heads, s.window).to(device=device, dtype=s.dtype).eval()
    x = torch.randn(1, s.length, s.dim, device=device, dtype=s.dtype)
    model, line = _optimized_window(eager, x, s.window, "inference", console)
    if f"causal sliding window {s.window}" not in line:
        return Part(f"the window was not recognized: {line}")
    x = torch.randn_like(x)
    with torch.no_grad():
        error = rel_err(model(x), eager(x))
    if not error < _tolerance(s.dtype).outputs:
        return Part(f"sliding window: outputs differ: relative error {error:.1e}")

    # Training: a copy optimized in train mode (the kernel is chosen for forward + backward there).
    trained = copy.deepcopy(eager).train()
    x = torch.randn(1, s.train_length, s.dim, device=device, dtype=s.dtype)
    model_train, train_line = _optimized_window(trained, x, s.window, "training", console)
    if f"causal sliding window {s.window}" not in train_line:
        return Part(f"the window was not recognized in training: {train_line}")
    train_error, worst, grad_error = _training_errors(model_train, trained, torch.randn_like(x))
    tolerance = _tolerance(s.dtype)
    if not (train_error < tolerance.outputs and grad_error < tolerance.gradients):
        return Part(f"sliding window, training: output error {train_error:.1e}, {worst} error {grad_error:.1e} "
                    f"(tolerances {tolerance.outputs:.0e}, {tolerance.gradients:.0e})")

    x = torch.randn(1, s.length, s.dim, device=device, dtype=s.dtype)
    with torch.no_grad():
        eager_ms = measure(lambda: eager(x), runs=s.runs, device=device).median_ms
        window_ms = measure(lambda: model(x), runs=s.runs, device=device).median_ms
    console.print(f"sliding window {s.window}, batch 1 x {s.length}, {str(s.dtype)[6:]} on {device}: eager "
                  f"{eager_ms:.2f} ms, optimized {window_ms:.2f} ms ({eager_ms / window_ms:.2f}x); output error "
                  f"{error:.1e}; training: output error {train_error:.1e}, worst gradient error {grad_error:.1e} "
                  f"({worst})")
    kernels = f"attention[{_kernel(line)}] inference, attention[{_kernel(train_line)}] training"
    notes = [f"window {s.window}: {kernels}; output error {error:.1e}, worst gradient error {grad_error:.1e}"]
    if device == "cpu":
        console.print(f"  {WINDOW_ON_CPU}")
        notes.append("on a CPU the window runs dense (no block skipped): the speedup is SDPA's against eager's ops")
    return Part(notes=notes, speedup=round(eager_ms / window_ms, 3))


def _retrieval_head(s: Sizes) -> Attention:
    """Causal attention whose key projection is its query projection, scaled up 2.5x: a token's query matches
    the keys of the tokens on its own subject, so each query puts nearly all of its attention on a few
    passages, as the retrieval heads of trained LLMs do (random weights would spread it over every key)."""
    head = Attention(s.dim, s.heads)
    with torch.no_grad():
        head.q_proj.weight.mul_(2.5)
        head.k_proj.weight.copy_(head.q_proj.weight)
    return head


def _subject_tokens(s: Sizes, seed: int, device: str) -> torch.Tensor:
    """(1, topk_length, dim) tokens in 128-token passages, passage b on subject b mod n: a token is its
    subject's vector plus 30% noise. n is chosen so that a subject has at most topk + 1 passages: the ``topk``
    chosen blocks and the query's own can hold all of them."""
    blocks = -(-s.topk_length // BLOCK)
    subjects = -(-blocks // (s.topk + 1))
    generator = torch.Generator().manual_seed(seed)
    vectors = torch.randn(subjects, s.dim, generator=generator)
    which = torch.arange(s.topk_length) // BLOCK % subjects
    tokens = vectors[which] + 0.3 * torch.randn(s.topk_length, s.dim, generator=generator)
    return tokens[None].to(device=device, dtype=s.dtype)


def _topk(s: Sizes, device: str, console: Console) -> Part:
    """Part 2: the report's error against dense under the bound, fresh inputs too, short calls dense."""
    torch.manual_seed(0)
    eager = _retrieval_head(s).to(device=device, dtype=s.dtype).eval()
    config = SparseAttentionConfig(topk=s.topk, min_length=s.topk_length)
    model = optimize(copy.deepcopy(eager), example_inputs=(_subject_tokens(s, 1, device),), sparse_attention=config)
    line = _attention_line(model)
    console.print(f"[bold]top-k sparse attention[/] at {s.topk_length} tokens: {escape(line)}")
    for note in report_of(model).notes:
        if note.startswith("not verified"):
            console.print(f"  {note}")
    found = re.search(r"relative error against dense (\S+)", line)
    if "top-k sparse attention (approximate)" not in line or found is None:
        return Part(f"top-k: no measured top-k rewrite: {line}")
    reported = float(found.group(1))
    fresh = _subject_tokens(s, 2, device)
    short = fresh[:, :s.topk_length // 2]  # below min_length: the dense kernel
    spread = torch.randn_like(fresh)
    with torch.no_grad():
        fresh_error, short_error, spread_error = (rel_err(model(t), eager(t)) for t in (fresh, short, spread))
    console.print(f"top-k relative error: {reported:.1e} reported on the example inputs, {fresh_error:.1e} on fresh "
                  f"ones (bound {TOPK_BOUND:.0e}); {short_error:.1e} at {short.shape[1]} tokens (< min_length: "
                  f"dense); {spread_error:.1e} on random tokens, whose attention no few blocks hold")
    if not (reported < TOPK_BOUND and fresh_error < TOPK_BOUND):
        return Part(f"top-k error {max(reported, fresh_error):.1e} >= {TOPK_BOUND:.0e}")
    if not short_error < _tolerance(s.dtype).outputs:
        return Part(f"top-k: a call below min_length is not dense: relative error {short_error:.1e}")
    notes = [f"top-k error {reported:.1e} reported (bound {TOPK_BOUND:.0e}), {spread_error:.1e} on random tokens"]
    if device == "cuda":  # FlexAttention is fused (compiled) there; on a CPU it runs unfused, for accuracy only
        with torch.no_grad():
            eager_ms = measure(lambda: eager(fresh), runs=s.runs, device=device).median_ms
            sparse_ms = measure(lambda: model(fresh), runs=s.runs, device=device).median_ms
        console.print(f"top-k at {s.topk_length} tokens: eager {eager_ms:.2f} ms, optimized {sparse_ms:.2f} ms "
                      f"({eager_ms / sparse_ms:.2f}x)")
        notes.append(f"top-k {eager_ms / sparse_ms:.2f}x eager")
    return Part(notes=notes)


def run(args) -> DemoResult:
    device = default_device(args)
    s = _sizes(args.quick, device == "cuda")
    # Eager FlexAttention warns that it runs unfused; the top-k rewrite line already says so.
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    console = Console()
    window = _sliding_window(s, device, console)
    if window.problem is not None:
        return DemoResult("failed", notes=[window.problem])
    topk = _topk(s, device, console)
    if topk.problem is not None:
        return DemoResult("failed", notes=[topk.problem])
    return DemoResult("ok", speedup=window.speedup, notes=[*window.notes, *topk.notes],
                      slowdown_expected=WINDOW_ON_CPU if device == "cpu" else None)


if __name__ == "__main__":
    demo_main(__doc__, run)
