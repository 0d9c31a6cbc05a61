"""Host time per call of the ``"cudnn_band"`` attention kernel (cuDNN's causal sliding window): through
``attention(kernel="cudnn_band")``, through its op alone, and through the cuDNN frontend's own
``torch.ops.cudnn.sdpa_fwd`` / ``sdpa_bwd`` for comparison, at a size where the kernels are shorter than
their launches, so the wall time of many back-to-back calls is the host's. A diagnosis tool for
benchmarks/sparse_attention.py, whose per-call figures include the host time the GPU waits for.

    python benchmarks/profile_cudnn_band.py [--length 256] [--heads 16] [--head-dim 128] [--window 128]

Needs a CUDA GPU and the extra ``cudnn`` (nvidia-cudnn-frontend).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import host_us_per_call  # noqa: E402
from kernel_pytorch.ops import attention  # noqa: E402


def _op_calls(forward, backward, q):
    """(forward, forward + backward) closures over a pair of ops called directly, no autograd."""
    grad = torch.randn_like(q)

    def step():
        out, stats = forward()
        return backward(grad, out, stats)

    return forward, step


def host_table(length: int, heads: int, head_dim: int, window: int) -> str:
    import cudnn.sdpa.fwd.torch_op  # noqa: F401  (registers the frontend's torch.ops.cudnn.sdpa_fwd / sdpa_bwd)

    q, k, v = (torch.randn(1, heads, length, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = head_dim ** -0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(q)
    pattern = ("band", 0, window - 1)
    ours, theirs = torch.ops.kernel_pytorch, torch.ops.cudnn

    def attention_step():
        out = attention(*leaves, kernel="cudnn_band", pattern=pattern)
        return torch.autograd.grad(out, leaves, grad)

    rows = {
        "attention(kernel='cudnn_band'), autograd": (
            lambda: attention(q, k, v, kernel="cudnn_band", pattern=pattern), attention_step),
        "kernel_pytorch::cudnn_band_fwd / _bwd": _op_calls(
            lambda: ours.cudnn_band_fwd(q, k, v, window, scale),
            lambda g, o, s: ours.cudnn_band_bwd(g, q, k, v, o, s, window, scale), q),
        "frontend cudnn::sdpa_fwd / sdpa_bwd": _op_calls(
            lambda: theirs.sdpa_fwd(q, k, v, scale, is_causal=True, window_left=window, return_lse=True),
            lambda g, o, s: theirs.sdpa_bwd(g, q, k, v, o, s, scale, is_causal=True, window_left=window), q),
    }
    lines = [f"== host time per call, (1, {heads}, {length}, {head_dim}) bf16, window {window} (us)",
             f"{'':<44}{'forward':>10}{'fwd + bwd':>12}"]
    for name, (forward, step) in rows.items():
        with torch.no_grad():
            forward_us = host_us_per_call(forward)
        lines.append(f"{name:<44}{forward_us:>10.1f}{host_us_per_call(step):>12.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_cudnn_band.py times a GPU kernel; no CUDA device found")
    torch.manual_seed(0)
    print(host_table(args.length, args.heads, args.head_dim, args.window))


if __name__ == "__main__":
    main()
