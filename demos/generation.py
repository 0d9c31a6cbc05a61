"""Demo: ``optimize`` on a transformers Llama, then an unchanged ``model.generate()``.

Checks that greedy generation gives the unoptimized model's tokens on a left-padded batch (float32; in bf16 on a
GPU the first tokens, since rounding may tip a near tie later), then times transformers' own ``generate()``
against the optimized one: a static-KV-cache loop whose decode steps replay from CUDA graphs on a GPU. A streamer
given to the optimized generate() gets the tokens it returns.
"""

from __future__ import annotations

import copy
import time

import torch
from _common import DemoResult, default_device, demo_main
from rich.console import Console
from transformers.generation.streamers import BaseStreamer

from kernel_pytorch import optimize, report_of

_CPU_SLOWER = ("on a CPU the loop runs each step's graph eagerly; transformers' loop runs the same layers, so "
               "there is little to gain; the speedup comes from CUDA graphs on a GPU")


def _model(quick: bool, device: str) -> tuple[torch.nn.Module, torch.dtype]:
    from transformers import LlamaConfig, LlamaForCausalLM

    if device == "cuda" and not quick:
        sizes, dtype = dict(num_hidden_layers=8, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                            intermediate_size=5632, vocab_size=32000), torch.bfloat16
    else:
        sizes, dtype = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=256, vocab_size=1000), torch.float32
    torch.manual_seed(0)
    config = LlamaConfig(**sizes, pad_token_id=0, eos_token_id=None, max_position_embeddings=2048)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval(), dtype


def _prompts(vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(1, vocab, (2, 24), device=device)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :5], attention_mask[1, :5] = 0, 0  # the second prompt is shorter: left padding
    return input_ids, attention_mask


def _tokens_per_s(model: torch.nn.Module, inputs: tuple[torch.Tensor, torch.Tensor], new: int, device: str) -> float:
    input_ids, attention_mask = inputs
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new, do_sample=False)  # warm
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new, do_sample=False)
    if device == "cuda":
        torch.cuda.synchronize()
    return new * input_ids.shape[0] / (time.perf_counter() - started)


class _CollectingStreamer(BaseStreamer):
    """The prompt and each step's tokens, as generate() puts them (the fast loop puts them as transformers does)."""

    def __init__(self):
        self.puts: list[torch.Tensor] = []

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value if value.dim() == 2 else value.unsqueeze(1))

    def end(self) -> None:
        pass

    def tokens(self) -> torch.Tensor:
        return torch.cat(self.puts, dim=1)


def run(args) -> DemoResult:
    device = default_device(args)
    eager, dtype = _model(args.quick, device)
    model = optimize(copy.deepcopy(eager))
    inputs = _prompts(eager.config.vocab_size, device)
    new = 16 if args.quick else 128
    expected = eager.generate(inputs[0], attention_mask=inputs[1], max_new_tokens=new, do_sample=False)
    tokens = model.generate(inputs[0], attention_mask=inputs[1], max_new_tokens=new, do_sample=False)
    compared = new if dtype == torch.float32 else 8
    prompt = inputs[0].shape[1]
    if not torch.equal(tokens[:, :prompt + compared], expected[:, :prompt + compared]):
        return DemoResult("failed", notes=[f"the first {compared} generated tokens differ from the unoptimized model"])
    streamer = _CollectingStreamer()
    streamed = model.generate(inputs[0], attention_mask=inputs[1], max_new_tokens=new, do_sample=False,
                              streamer=streamer)
    if not torch.equal(streamer.tokens(), streamed.cpu()):
        return DemoResult("failed", notes=["a streamer's tokens differ from the tokens generate() returned"])
    transformers_rate = _tokens_per_s(eager, inputs, new, device)
    optimized_rate = _tokens_per_s(model, inputs, new, device)
    speedup = optimized_rate / transformers_rate
    console = Console()
    for note in report_of(model).notes:
        if note.startswith("generation"):
            console.print(note)
    console.print(f"generate(), batch 2 (left-padded), {new} new tokens, {str(dtype).removeprefix('torch.')} on "
                  f"{device}: transformers {transformers_rate:.0f} tokens/s, optimized {optimized_rate:.0f} tokens/s "
                  f"({speedup:.2f}x)")
    return DemoResult("ok", speedup=round(speedup, 3),
                      notes=[f"the first {compared} tokens equal the unoptimized model's; a streamer got the "
                             "returned tokens"],
                      slowdown_expected=_CPU_SLOWER if device == "cpu" else None)


if __name__ == "__main__":
    demo_main(__doc__, run)
