"""Which step of ``optimize`` (or of PyTorch alone) leaves PyTorch's SDPA backward with a padding mask wrong in the
same process?

    python benchmarks/diagnose_sdpa_gradients.py [--variants none optimize ...] [--out DIR]

On the H100 image (torch 2.11, cuDNN 9.19) PyTorch's cuDNN SDPA backward reuses a plan cached for another output
gradient layout (docs/attention.md, "cuDNN's backward plan cache"): this script found it. Each variant runs in a
fresh process (four at a time): a step (or nothing), then a plain bf16 ``F.scaled_dot_product_attention`` call
with a padding mask (4 heads, head dim 128, 256 tokens), its output and gradients against float32 math, the
same for each SDPA backend alone and for ``attention(kernel="cudnn")``, and the kernels PyTorch's dispatch ran.
Variants:

- ``none``: the check alone;
- ``optimize``, ``optimize-no-verify``, ``optimize-attention-only``, ``optimize-no-attention``,
  ``optimize-no-compile``, ``optimize-only-<pass>``: ``optimize`` of a small transformers Llama trained with a
  padding mask, with every pass, with verification off, with only the attention pass, with every pass but
  attention, uncompiled, with one pass alone;
- ``graph-bf16``, ``graph-float32``: the model's captured training graph, unrewritten, run inside the Dynamo
  backend as the per-graph check runs it (``verify.graphs.GraphInputs``), in bf16 or as the float32 referee;
- ``model-float32``: the end-to-end referee's float32 copy of the model, forward and backward;
- ``pytorch-transposed-grad``, ``pytorch-contiguous-grad``: the check's own call first, its output gradient laid
  out (B, L, H, E) or as the output (PyTorch alone: the first reproduces the fault, the second is its control).

Prints a line per variant and writes ``sdpa_gradients.json``; exit status 1 when a variant other than PyTorch's
own is wrong and ``none`` is right.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_SINGLE_PASSES = ("normalize", "norms", "horizontal_gemm", "activations", "rope")
VARIANTS = ("none", "optimize", "optimize-no-verify", "optimize-attention-only", "optimize-no-attention",
            "optimize-no-compile", *(f"optimize-only-{name}" for name in _SINGLE_PASSES),
            "graph-bf16", "graph-float32", "model-float32", "pytorch-transposed-grad", "pytorch-contiguous-grad")
_BACKENDS = ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH", "kernel_pytorch cudnn")
_WRONG = 0.05  # relative error of the check's output or a gradient that counts as wrong (bf16 noise: ~3e-3)
_BATCH, _LENGTH, _HEADS, _HEAD_DIM = 2, 256, 4, 128


def _padding_mask() -> torch.Tensor:
    """Causal, the last sequence padded after half its tokens: (B, 1, L, L) bool."""
    position = torch.arange(_LENGTH, device="cuda")
    keep = torch.ones(_BATCH, _LENGTH, dtype=torch.bool, device="cuda")
    keep[-1, _LENGTH // 2:] = False
    return ((position[:, None] >= position[None, :])[None] & keep[:, None, :])[:, None]


def check_sdpa_gradients(backend: str | None = None, grad_layout: str = "contiguous") -> list[float]:
    """Relative errors of a bf16 SDPA call with the padding mask (output, dq, dk, dv) against float32 math:
    PyTorch's own choice of kernel, ``backend`` alone (an ``SDPBackend`` name), or ``"kernel_pytorch cudnn"``
    (``attention(kernel="cudnn")``). ``grad_layout="transposed"``: the output gradient laid out (B, L, H, E),
    as a following ``transpose(1, 2)`` gives it, not as the output."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    mask = _padding_mask()
    q, k, v = (torch.randn(_BATCH, _HEADS, _LENGTH, _HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    seed = (torch.randn_like(q) if grad_layout == "contiguous" else
            torch.randn(_BATCH, _LENGTH, _HEADS, _HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2))
    exact = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        expected = F.scaled_dot_product_attention(*exact, attn_mask=mask)
        expected_grads = torch.autograd.grad(expected, exact, seed.float())
    if backend == "kernel_pytorch cudnn":
        from kernel_pytorch.ops.attention import attention

        out = attention(q, k, v, attn_mask=mask, kernel="cudnn")
        grads = torch.autograd.grad(out, (q, k, v), seed)
    else:
        with sdpa_kernel([getattr(SDPBackend, backend)]) if backend else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            grads = torch.autograd.grad(out, (q, k, v), seed)
    return [float((a.double() - b.double()).norm() / b.double().norm())
            for a, b in zip((out, *grads), (expected, *expected_grads))]


def _llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    model = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).train()
    ids = torch.randint(0, 512, (_BATCH, _LENGTH), device="cuda")
    mask = torch.ones_like(ids)
    mask[-1, _LENGTH // 2:] = 0
    return model, {"input_ids": ids, "attention_mask": mask}


def _every_pass_but(kept: str) -> tuple[str, ...]:
    from kernel_pytorch.backends.base import Backend

    return tuple(name for name in Backend.graph_passes if name != kept)


def _kernels_run(call) -> list[str]:
    """The CUDA kernels ``call()`` launches, by name (which kernel PyTorch's dispatch picked)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sorted({event.name[:80] for event in prof.events() if event.device_type.name == "CUDA"})


_OPTIMIZE_OPTIONS = {
    "optimize": {},
    "optimize-no-verify": {"verify": False},
    "optimize-attention-only": {"disable_passes": _every_pass_but("attention")},
    "optimize-no-attention": {"disable_passes": ("attention",)},
    "optimize-no-compile": {"compile": False},
    **{f"optimize-only-{name}": {"disable_passes": _every_pass_but(name)}
       for name in _SINGLE_PASSES},
}


def _captured_graph_runs(model, inputs: dict, float32: bool) -> None:
    """Capture the training graph and run it, unrewritten, inside the backend as the per-graph check does."""
    from kernel_pytorch.verify.graphs import GraphInputs

    def backend(gm, example_inputs):
        graph_inputs = GraphInputs(gm, example_inputs, training=True)
        if float32:
            graph_inputs.run_float32(gm)
        else:
            graph_inputs.run(gm)
        return gm

    torch.compile(model, backend=backend, fullgraph=False)(**inputs)


def _model_float32(model, inputs: dict) -> None:
    reference = copy.deepcopy(model).float()
    reference(**inputs).logits.float().square().mean().backward()


def run_variant(variant: str) -> dict:
    """The step of ``variant`` (module docstring), then the check; in this process."""
    rollbacks = None
    if variant.startswith("pytorch-"):  # the same call first, its output gradient laid out otherwise or not
        check_sdpa_gradients(grad_layout=variant.split("-")[1])
    elif variant != "none":
        model, inputs = _llama()
        if variant in _OPTIMIZE_OPTIONS:
            from kernel_pytorch import optimize, report_of

            optimize(model, example_inputs=inputs, **_OPTIMIZE_OPTIONS[variant])
            rollbacks = [r.pass_name for r in report_of(model).rollbacks]
        elif variant.startswith("graph-"):
            _captured_graph_runs(model, inputs, float32=variant == "graph-float32")
        else:
            _model_float32(model, inputs)
    errors = check_sdpa_gradients()
    return {"variant": variant, "errors": errors, "wrong": max(errors) > _WRONG, "rollbacks": rollbacks,
            "by_backend": {name: _backend_errors(name) for name in _BACKENDS},
            "kernels": _kernels_run(check_sdpa_gradients)}


def _backend_errors(backend: str) -> list[float] | str:
    try:
        return check_sdpa_gradients(backend)
    except RuntimeError as error:  # this backend refuses the call here: recorded, not fatal
        return f"refused: {str(error).splitlines()[0][:120]}"


def _child_result(variant: str) -> dict:
    child = subprocess.run([sys.executable, __file__, "--one", variant], capture_output=True, text=True)
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"variant": variant, "error": child.stderr.strip()[-500:]}


def _errors_text(errors: list[float] | str) -> str:
    return errors if isinstance(errors, str) else " ".join(f"{e:.1e}" for e in errors)


def _line(result: dict) -> str:
    head = f"{result['variant']:30s} "
    if "error" in result:
        return head + "error: " + result["error"]
    backends = "; ".join(f"{name} {_errors_text(errors)}" for name, errors in result["by_backend"].items())
    return (head + f"{'WRONG' if result['wrong'] else 'right'}  errors (out, dq, dk, dv) "
            + _errors_text(result["errors"]) + f"  rollbacks {result['rollbacks']}\n    by backend: {backends}"
            + f"\n    kernels: {result['kernels']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)  # a child process: one variant
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/diagnose_sdpa_gradients.py needs a CUDA GPU")
    if args.one:
        print(json.dumps(run_variant(args.one)))
        return
    # Each variant in a fresh process, four at a time: a correctness check, not a timing.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(_child_result, args.variants))
    for result in results:
        print(_line(result), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version(), "results": results}
    (args.out / "sdpa_gradients.json").write_text(json.dumps(payload, indent=1))
    clean = next((r for r in results if r["variant"] == "none" and "errors" in r), None)
    # PyTorch's own variants reproduce its fault (expected while it lasts); a kernel_pytorch step must not.
    spoiled = [r["variant"] for r in results if r.get("wrong") and not r["variant"].startswith("pytorch-")]
    sys.exit(1 if spoiled and clean is not None and not clean["wrong"] else 0)


if __name__ == "__main__":
    main()
