"""Does ``optimize(compile="reduce-overhead")`` get CUDA graphs? If not, which graph input is mutated, and where.

    python benchmarks/diagnose_cudagraph_skip.py [--layers 12] [--batch 1] [--seq 128] [--training]

The model is block_fusion.py's latency model (Llama-style blocks on hidden states, d 2048, bf16). It is
compiled twice, with ``torch.compile(mode="reduce-overhead")`` and with ``optimize(compile=
"reduce-overhead")``, Inductor's caches off so every graph is checked afresh. Every call of Inductor's own
mutation checks is printed: ``cudagraph_trees.check_for_mutation`` (CUDA-graph trees, the default; it
logs "skipping cudagraphs due to mutated inputs") or, with ``cudagraph_support_input_mutation`` off,
``cudagraph_utils.check_for_mutation_ignore_cuda_graph_managed_tensor``: the mutated inputs by index and
placeholder name, whether each is static (parameters and buffers, which the trees may mutate), and the
verdict with the stack trace of the mutating use (``get_mutation_stack_trace``). Then Inductor's
CUDA-graph skip counter per variant. Exit status 1 when ``optimize`` was skipped and ``torch.compile``
was not.

The CPU counterpart, run in CI: tests/test_cudagraph_safety.py (the same functionalization on the Triton
path with an sm_90 target).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.block_fusion import BlockStack
from kernel_pytorch import optimize, report_of
from kernel_pytorch.testing import LlamaStyleConfig


def _watch_mutation_checks(found: list[dict]) -> None:
    """Record every call of Inductor's two mutation checks: at compile time (cudagraph_support_input_mutation
    off) and at the first run under CUDA-graph trees (on, the default), which reports the skip."""
    import torch._inductor.cudagraph_trees as cudagraph_trees
    import torch._inductor.cudagraph_utils as cudagraph_utils

    at_compile = cudagraph_utils.check_for_mutation_ignore_cuda_graph_managed_tensor
    at_run = cudagraph_trees.check_for_mutation

    def record(names, mutated, static, verdict):
        static = set(static)
        found.append({"mutated": [(i, names[i] if i < len(names) else "?", i in static) for i in mutated],
                      "inputs": len(names), "verdict": verdict})

    def compile_check(gm, mutated_inputs, mutated_input_idxs, static_input_idxs):
        verdict = at_compile(gm, mutated_inputs, mutated_input_idxs, static_input_idxs)
        names = [node.name for node in gm.graph.nodes if node.op == "placeholder"]
        record(names, mutated_input_idxs, static_input_idxs, verdict)
        return verdict

    def run_check(func, inputs, is_cuda_graph_recorded_tensor):
        verdict = at_run(func, inputs, is_cuda_graph_recorded_tensor)
        names = [placeholder.name for placeholder in func.placeholders]
        record(names, func.mutated_input_idxs, func.static_input_idxs, verdict)
        return verdict

    cudagraph_utils.check_for_mutation_ignore_cuda_graph_managed_tensor = compile_check
    cudagraph_trees.check_for_mutation = run_check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--training", action="store_true", help="forward+backward instead of inference")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (CUDA graphs); on the CPU run tests/test_cudagraph_safety.py")
        return 2
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    inductor_config.force_disable_caches = True
    found: list[dict] = []
    _watch_mutation_checks(found)
    config = LlamaStyleConfig(max_seq_len=max(4096, args.seq))
    torch.manual_seed(0)
    base = BlockStack(config, args.layers).to(device="cuda", dtype=torch.bfloat16).train(args.training)
    x = torch.randn(args.batch, args.seq, config.dim, device="cuda", dtype=torch.bfloat16,
                    requires_grad=args.training)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.layers} layers, "
          f"{args.batch} x {args.seq}, {'training' if args.training else 'inference'}")

    skips = {}
    for name in ("torch.compile", "optimize"):
        torch._dynamo.reset()
        counters.clear()
        found.clear()
        model = copy.deepcopy(base)
        with torch.set_grad_enabled(args.training):
            if name == "optimize":
                optimize(model, example_inputs=(x,), compile="reduce-overhead")
                report = report_of(model)
                per_pass: dict[str, int] = {}
                for record in report.rewrites:
                    per_pass[record.pass_name] = per_pass.get(record.pass_name, 0) + 1
                print(f"\n[{name}] rewrites per pass: {per_pass}; graphs: {report.graphs}; notes: {report.notes}")
            else:
                model = torch.compile(model, mode="reduce-overhead")
                print(f"\n[{name}]")
            for _ in range(3):
                out = model(x)
                if args.training:
                    out.float().sum().backward()
            torch.cuda.synchronize()
        for i, check in enumerate(found):
            print(f"  check {i}: {check['inputs']} inputs; mutated (index, name, static): {check['mutated']}")
            if check["verdict"]:
                print("    " + check["verdict"].replace("\n", "\n    "))
        skips[name] = counters["inductor"]["cudagraph_skips"]
        print(f"  Inductor cudagraph_skips: {skips[name]}")
    ok = skips["optimize"] == 0 or skips["torch.compile"] > 0
    print("\nOK: optimize gets CUDA graphs" if skips["optimize"] == 0 else
          "\nFAIL: optimize's graphs skip CUDA graphs" + ("" if ok else " (torch.compile's do not)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
