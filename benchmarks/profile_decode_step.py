"""Where one decode step of ``optimize``'s generation loop spends its GPU time: the torch profiler's kernel table
for a Llama of benchmarks/decode.py's sizes (``1b`` or ``7b``) at batch 1, next to the same step compiled by plain
``torch.compile``, with the kernel count per step and the prefill's time. With ``--prefill``, the same for a prefill
of ``--prompt`` tokens, next to transformers' eager prefill (as decode.py's hand-written loop runs it): where a time
to first token goes. A diagnosis tool for benchmarks/decode.py.

    python benchmarks/profile_decode_step.py [--size 1b|7b] [--layers N] [--prompt 512] [--steps 10] [--no-reference]
                                             [--prefill] [--out DIR]

The calls run without CUDA graphs (the profiler sees the same kernels a replay runs), after a warm-up; ``optimize``'s
step is compiled as ``generate()`` compiles it on CUDA (each distinct layer once, our Triton ops opaque to Inductor),
its prefill uncompiled.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kernel_pytorch  # noqa: E402
from benchmarks.decode import MODEL_SIZES  # noqa: E402
from kernel_pytorch.features.generation.lane import DecodeLane  # noqa: E402
from kernel_pytorch.features.generation.model_entries import ModelCalls  # noqa: E402


def llama(size: str, layers: int | None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    sizes = dict(MODEL_SIZES[size], **({"num_hidden_layers": layers} if layers else {}))
    config = LlamaConfig(**sizes, max_position_embeddings=8192)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def profile_lane(lane: DecodeLane, prompt: int, steps: int, label: str) -> str:
    ids, mask = _prompt(prompt)
    with torch.no_grad():
        for _ in range(2):
            _prefill(lane, ids, mask)
            for _ in range(3):
                lane.step(torch.zeros(1, dtype=torch.long, device="cuda"))
        torch.cuda.synchronize()
        started = time.perf_counter()
        _prefill(lane, ids, mask)
        torch.cuda.synchronize()
        prefill_ms = (time.perf_counter() - started) * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                lane.step(torch.zeros(1, dtype=torch.long, device="cuda"))
            torch.cuda.synchronize()
    return _kernel_report(prof, steps, f"{label}: %d kernels per step, %.0f us GPU time per step; prefill of {prompt} "
                          f"tokens {prefill_ms:.1f} ms", "step")


def profile_prefill(lane: DecodeLane, prompt: int, runs: int, label: str) -> str:
    """The kernels of ``runs`` prefills of ``prompt`` tokens, after two unprofiled ones."""
    ids, mask = _prompt(prompt)
    with torch.no_grad():
        for _ in range(2):
            _prefill(lane, ids, mask)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                _prefill(lane, ids, mask)
            torch.cuda.synchronize()
    return _kernel_report(prof, runs, f"{label}: %d kernels per prefill of {prompt} tokens, %.0f us GPU time",
                          "prefill")


def _prefill(lane: DecodeLane, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """The prompt prefilled as generate() prefills it: into an empty cache where the lane takes it."""
    if lane.takes_empty_cache_prefills:
        lane.prefill_into_empty_cache(ids, mask, ids.shape[1])
    else:
        lane.prefill(ids, mask)


def _prompt(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 32000, (1, length), device="cuda")
    return ids, torch.ones_like(ids)


def _kernel_report(prof, calls: int, head: str, call: str) -> str:
    """``head`` (with the kernels and GPU microseconds per call filled in), the profiler's kernel table and the
    first kernels of one call in launch order."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.device_time for e in kernels) / calls
    one_call = sorted(kernels, key=lambda e: e.time_range.start)[: len(kernels) // calls]
    order = "\n".join(f"{e.device_time:8.1f} us  {e.name[:110]}" for e in one_call[:_SEQUENCE_SHOWN])
    return ("== " + head % (len(kernels) / calls, gpu_us) + "\n"
            + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
            + f"\nthe first {_SEQUENCE_SHOWN} kernels of one {call}, in launch order:\n" + order)


_SEQUENCE_SHOWN = 40  # the embedding, the first two layers and a bit: the per-layer sequence repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(MODEL_SIZES), default="1b", help="benchmarks/decode.py's model sizes")
    parser.add_argument("--layers", type=int, default=None, help="default: the size's")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-reference", action="store_true", help="profile optimize's step only")
    parser.add_argument("--prefill", action="store_true",
                        help="profile --steps prefills of --prompt tokens instead (the reference: transformers eager)")
    args = parser.parse_args(argv)
    model = kernel_pytorch.optimize(llama(args.size, args.layers))
    # compiled as generate() compiles on CUDA: each distinct layer once, our ops opaque (the prefill uncompiled)
    calls = ModelCalls.of(model, model._kernel_pytorch.graph_optimizer, compile_prefill=False, compile_layers_once=True,
                          prefills_replayed=True, steps_replayed=True)
    length = max(1024, -(-(args.prompt + 64) // 256) * 256)  # as generate() sizes the cache: 64 new tokens, rounded
    ours = DecodeLane(model, calls, 1, length, cuda_graphs=False)
    profiled = functools.partial(profile_prefill if args.prefill else profile_lane, prompt=args.prompt,
                                 **({"runs": args.steps} if args.prefill else {"steps": args.steps}))
    sections = [profiled(ours, label="optimize")]
    if not args.no_reference:
        reference = llama(args.size, args.layers)
        # the steps as plain torch.compile compiles them; a prefill as the hand-written loop of decode.py runs it: eager
        plain = ModelCalls.of(reference, None if args.prefill else "inductor")
        name = "transformers eager" if args.prefill else "torch.compile (inductor)"
        sections.append(profiled(DecodeLane(reference, plain, 1, length, cuda_graphs=False), label=name))
    text = "\n\n".join(sections)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile_decode_step.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
