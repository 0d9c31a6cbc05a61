"""Where one decode step of ``optimize``'s generation loop spends its GPU time: the torch profiler's kernel table
for a Llama of benchmarks/decode.py's sizes (``1b`` or ``7b``) at batch 1, next to the same step compiled by plain
``torch.compile``, with the kernel count per step and the prefill's time. A diagnosis tool for
benchmarks/decode.py.

    python benchmarks/profile_decode_step.py [--size 1b|7b] [--layers N] [--prompt 512] [--steps 10] [--no-reference]
                                             [--out DIR]

The steps run without CUDA graphs (the profiler sees the same kernels a replay runs), after a warm-up; ``optimize``'s
step is compiled as ``generate()`` compiles it on CUDA (each distinct layer once, our Triton ops opaque to Inductor),
its prefill uncompiled.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernel_pytorch  # noqa: E402
from benchmarks.decode import MODEL_SIZES  # noqa: E402
from kernel_pytorch.features.generation.lane import DecodeLane, ModelCalls  # noqa: E402


def llama(size: str, layers: int | None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    sizes = dict(MODEL_SIZES[size], **({"num_hidden_layers": layers} if layers else {}))
    config = LlamaConfig(**sizes, max_position_embeddings=8192)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def profile_lane(lane: DecodeLane, prompt: int, steps: int, label: str) -> str:
    ids = torch.randint(0, 32000, (1, prompt), device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for _ in range(2):
            lane.prefill(ids, mask)
            for _ in range(3):
                lane.step(torch.zeros(1, dtype=torch.long, device="cuda"))
        torch.cuda.synchronize()
        started = time.perf_counter()
        lane.prefill(ids, mask)
        torch.cuda.synchronize()
        prefill_ms = (time.perf_counter() - started) * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                lane.step(torch.zeros(1, dtype=torch.long, device="cuda"))
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels) / steps
    head = (f"== {label}: {len(kernels) / steps:.0f} kernels per step, {gpu_us:.0f} us GPU time per step; "
            f"prefill of {prompt} tokens {prefill_ms:.1f} ms")
    one_step = sorted(kernels, key=lambda e: e.time_range.start)[: len(kernels) // steps]
    order = "\n".join(f"{e.device_time:8.1f} us  {e.name[:110]}" for e in one_step[:_SEQUENCE_SHOWN])
    return (head + "\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
            + f"\nthe first {_SEQUENCE_SHOWN} kernels of one step, in launch order:\n" + order)


_SEQUENCE_SHOWN = 40  # the embedding, the first two layers and a bit: the per-layer sequence repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(MODEL_SIZES), default="1b", help="benchmarks/decode.py's model sizes")
    parser.add_argument("--layers", type=int, default=None, help="default: the size's")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-reference", action="store_true", help="profile optimize's step only")
    args = parser.parse_args(argv)
    model = kernel_pytorch.optimize(llama(args.size, args.layers))
    # compiled as generate() compiles on CUDA: each distinct layer once, our ops opaque (the prefill uncompiled)
    calls = ModelCalls.of(model, model._kernel_pytorch.graph_optimizer, compile_prefill=False, compile_layers_once=True,
                          steps_replayed=True)
    ours = DecodeLane(model, calls, 1, 1024, cuda_graphs=False)
    sections = [profile_lane(ours, args.prompt, args.steps, "optimize")]
    if not args.no_reference:
        reference = llama(args.size, args.layers)
        plain = DecodeLane(reference, ModelCalls.of(reference, "inductor"), 1, 1024, cuda_graphs=False)
        sections.append(profile_lane(plain, args.prompt, args.steps, "torch.compile (inductor)"))
    text = "\n\n".join(sections)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_decode_step.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
