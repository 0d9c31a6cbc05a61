"""Decoding benchmark (issue 27): text generation of transformers causal LMs on one GPU, four ways side by
side in one process, bf16.

    python benchmarks/decode.py [--quick | --device cpu] [--models 1b 7b] [--providers ...]
                                [--batches 1 8 32] [--out DIR] [--fresh] [--generation JSON] [--optimize JSON]
                                [--host-profile]
                                [--prefill-graphs-ab]

``--prefill-graphs-ab``: after optimize's measurements, the same compiled model with ``generation.prefill_graphs``
flipped (on by default on CUDA, off on the CPU; lanes rebuilt, nothing recompiled) measures its batch points and
TTFTs again (``without_prefill_graphs`` or ``with_prefill_graphs``): an A/B of the prefill's CUDA graphs within one
process, each arm's peak memory over those calls in ``points_peak_gib``.

Models: transformers ``LlamaForCausalLM`` built from a ``LlamaConfig`` (random weights, no downloads, the
default attention implementation, SDPA; no end-of-sequence token, so that every call generates exactly the
tokens asked for):

- ``1b``: 16 layers, hidden 2048, 16 heads / 4 kv heads, intermediate 5632, vocab 32000;
- ``7b``: 32 layers, hidden 4096, 32 heads / 8 kv heads, intermediate 14336, vocab 32000.

Providers, each on a fresh model from the same seed, greedy decoding:

1. ``transformers eager``: ``model.generate(input_ids, attention_mask=..., max_new_tokens=..., do_sample=False)``
   (dynamic KV cache);
2. ``transformers static compile``: the same call with ``cache_implementation="static"``; transformers then
   compiles the decode steps itself (``torch.compile(model.__call__, **CompileConfig().to_dict())``: Inductor,
   ``reduce-overhead``, on CUDA devices; the prefill runs uncompiled); what it did is recorded
   (``transformers_compile``);
3. ``static loop (reduce-overhead)``: the gpt-fast recipe written by hand over the same model: a transformers
   ``StaticCache``, the prefill as a plain forward, then ``decode_one_token`` (one token's forward with the
   static cache, argmax) compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)`` and called in
   a Python loop;
4. ``optimize``: ``model = kernel_pytorch.optimize(model)``, then the unchanged call of 1. The lines of
   ``report_of(model).to_dict()`` that mention generation are recorded, with the decode passes' decisions (each once,
   counted).

Per (model, provider): ``warmup_s`` = setup (optimize's call; nothing for the others) + the first generate
call (batch 1, prompt 512, 256 new tokens), where the compiling happens (a tiny model's generate runs once
before the first provider, so that none carries the process's first imports and CUDA library loads). Then per
batch size (1, 8, 32; prompt 512, 256 new tokens): one short call (compiles / records that batch's shapes),
then ``runs`` (5) timed calls (``harness.measure``, or the static loop's own clock), median. ``ttft_ms`` (time
to first token: prefill + first token) is ``generate(max_new_tokens=1)``, or the static loop's prefill timed
apart; decode time is the 255 later tokens: the static loop's loop timed apart, else (total - TTFT) per
interleaved pair of calls, the median of the pairs.
``decode_tokens_per_s_per_seq`` = 255 / decode time; ``decode_tokens_per_s`` = that x the batch. ``ttft_ms``
per prompt (512, 4096) at batch 1, after the batch points.

HBM limit: ``hbm.copy_gb_per_s`` = a device-to-device ``copy_`` of 2 GiB (bytes read + written / time), measured
once per run. A decode step reads every weight once (the embedding as one row per sequence, the LM head in
full) plus each sequence's KV cache at the run's mean cache length (prompt + new tokens / 2): the limit in
tokens/s per sequence = copy bandwidth / those bytes, and ``hbm_share`` = measured / limit.

Recompiles: for ``optimize``, after the batch points and TTFTs, a sweep of prompt lengths (1, 7, 100, 512,
2048) x batch sizes (1, 3, 8, 32), 4 new tokens each, counts the graphs Dynamo compiled
(``torch._dynamo.utils.counters["stats"]["unique_graphs"]``, and any "recompiles" counter the installed
torch has) with the recompile reasons Dynamo recorded; the sweep stops at a time budget (checked between
calls, so one compile can overrun it) and says where. ``graphs_compiled`` of every provider counts its graphs
from setup to the end of its TTFTs (the batch sizes' recompiles included).

Correctness: each provider's greedy tokens at batch 1 (first call) against ``transformers eager``'s:
``equal_leading_tokens_vs_eager`` (bf16 can diverge after a while; recorded, not failed).

``--quick``: ``1b`` only, batch 1, 64 new tokens. ``--device cpu``: a smoke run of the whole flow on a tiny
fp32 model (2 layers, hidden 64, prompt 8, 8 new tokens, batch 1 and 2; no HBM limit), not a measurement;
transformers compiles only on GPUs, so provider 2 runs its static cache uncompiled there.

Issue 27's targets (``targets``: ``meets``, ``miss_ratio`` = how far off as a factor, > 1 missed, and
``missed_by`` in the target's unit): optimize's batch-1 decode >= 55% of the HBM limit on ``1b``, >= 80% on
``7b``; optimize >= 1.3x the static loop's decode tokens/s (per batch size); optimize's TTFT at 512 and 4096 no
slower than the faster of providers 2 and 3; optimize's warm-up <= 60 s on ``1b``; no graph compiled in the
recompile sweep.

Results merge into ``--out``/decode.json (``decode_quick.json``, ``decode_cpu.json``), written after each
(model, provider), so that runs of some models / providers / batches build one file (``--fresh`` starts a new
one; a file from another device is never merged; a provider's batch points not re-measured are kept, each with
its date). Also decode.png: decode tokens/s per provider and batch, the HBM limit as a line. An error (out
of memory, a compile failure, a provider that raises) is recorded for its case or point and the run goes on;
GPU memory is released between providers.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import inspect
import json
import pstats
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import (dynamo_changes, dynamo_compile_counts, dynamo_snapshot, environment,  # noqa: E402
                                measure, same_device_models, save_figure, scaled_run_args, scaled_run_parser,
                                synchronize, write_final_result, write_result)
from kernel_pytorch.errors import first_line  # noqa: E402

EAGER = "transformers eager"
STATIC_COMPILE = "transformers static compile"
STATIC_LOOP = "static loop (reduce-overhead)"
OURS = "optimize"
PROVIDERS = (EAGER, STATIC_COMPILE, STATIC_LOOP, OURS)

MODEL_SIZES = {
    "1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
               intermediate_size=5632, vocab_size=32000),
    "7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=32000),
}
TINY_SIZE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=128)
FIRST_TOKEN_ID = 3  # prompt ids avoid the ids transformers' tokenizers reserve (pad, bos, eos)

HBM_SHARE_TARGET = {"1b": 0.55, "7b": 0.80}
SPEEDUP_VS_LOOP_TARGET = 1.3
WARMUP_TARGET_S = {"1b": 60.0}
COPY_BYTES = 2 * 2**30
GIB = 2**30


@dataclass(frozen=True)
class Setup:
    """Sizes and timing of one run: ``full`` (the issue's), ``quick`` or ``cpu`` (smoke)."""

    scale: str
    device: str
    dtype: torch.dtype
    prompt: int
    new_tokens: int
    batches: tuple[int, ...]
    ttft_prompts: tuple[int, ...]
    runs: int
    warm_tokens: int  # new tokens of the short call before a point's timed calls
    max_positions: int
    sweep_prompts: tuple[int, ...]
    sweep_batches: tuple[int, ...]
    sweep_new_tokens: int
    sweep_budget_s: float  # the recompile sweep stops here: a provider that recompiles every shape is slow
    host_profile: Path | None = None  # where optimize's host profile of a batch-1 TTFT call is written
    generation: dict | None = None  # optimize(model, generation=...) for the optimize provider
    optimize_options: dict | None = None  # its other optimize(model, ...) options, e.g. {"compile": False}
    prefill_graphs_ab: bool = False  # optimize's batch points and TTFTs again with prefill graphs flipped


def make_setup(quick: bool, device: str) -> Setup:
    if device == "cpu":
        return Setup("cpu", "cpu", torch.float32, prompt=8, new_tokens=8, batches=(1, 2), ttft_prompts=(8, 32),
                     runs=3, warm_tokens=2, max_positions=64, sweep_prompts=(1, 7), sweep_batches=(1, 3),
                     sweep_new_tokens=2, sweep_budget_s=30.0)
    full = Setup("full", "cuda", torch.bfloat16, prompt=512, new_tokens=256, batches=(1, 8, 32),
                 ttft_prompts=(512, 4096), runs=5, warm_tokens=8, max_positions=8192,
                 sweep_prompts=(1, 7, 100, 512, 2048), sweep_batches=(1, 3, 8, 32), sweep_new_tokens=4,
                 sweep_budget_s=45.0)
    return replace(full, scale="quick", new_tokens=64, batches=(1,), sweep_budget_s=30.0) if quick else full


# ------------------------------------------------------------------------------------------------ models

def llama_config(name: str, s: Setup):
    import transformers

    size = TINY_SIZE if s.scale == "cpu" else MODEL_SIZES[name]
    return transformers.LlamaConfig(**size, max_position_embeddings=s.max_positions, tie_word_embeddings=False,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_model(name: str, s: Setup) -> nn.Module:
    """A fresh model from seed 0, made on the device (initialising 7B parameters on the CPU takes a minute)."""
    import transformers

    config = llama_config(name, s)
    torch.manual_seed(0)
    with torch.device(s.device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype=s.dtype).eval()


def model_info(name: str, model: nn.Module, s: Setup) -> dict:
    """The sizes the HBM limit is computed from."""
    c = model.config
    element = torch.empty((), dtype=s.dtype).element_size()
    head_dim = c.hidden_size // c.num_attention_heads
    embedding = model.get_input_embeddings().weight
    return {"model": f"transformers LlamaForCausalLM ({'tiny, cpu smoke' if s.scale == 'cpu' else name}), "
                     f"attn_implementation={c._attn_implementation!r}",
            "config": {**(TINY_SIZE if s.scale == "cpu" else MODEL_SIZES[name]),
                       "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": False},
            "dtype": str(s.dtype), "parameters": sum(p.numel() for p in model.parameters()),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "embedding_bytes": embedding.numel() * embedding.element_size(),
            "embedding_row_bytes": c.hidden_size * element,
            "kv_bytes_per_token": 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * element}


def prompt_ids(s: Setup, vocab: int, batch: int, length: int) -> torch.Tensor:
    """The same prompts for every provider; row 0 of any batch is the batch-1 prompt."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(FIRST_TOKEN_ID, vocab, (batch, length), generator=generator).to(s.device)


# --------------------------------------------------------------------------------------------- providers

def cache_keyword(model: nn.Module) -> str:
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name deprecated)."""
    parameters = inspect.signature(model.get_decoder().forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class GenerateRunner:
    """``model.generate`` as a user calls it, with ``extra`` keyword arguments."""

    splits_decode = False

    def __init__(self, model: nn.Module, extra: dict[str, Any] | None = None):
        self.model = model
        self.extra = extra or {}

    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, **self.extra)
        return _new_tokens(out[:, ids.shape[1]:], new_tokens)


class StaticLoop:
    """gpt-fast's decode loop over the transformers model: prefill as a plain forward into a ``StaticCache``,
    then one compiled (reduce-overhead, fullgraph) step per token called from Python."""

    splits_decode = True

    def __init__(self, model: nn.Module, device: str, cache_length: int):
        self.model = model
        self.device = device
        self.cache_length = cache_length  # the run's prompt + new tokens: shorter calls reuse that cache
        self.keyword = cache_keyword(model)
        self.cache, self.cache_shape = None, (0, 0)
        self.decode_one_token = torch.compile(self._decode_one_token, mode="reduce-overhead", fullgraph=True)

    def _decode_one_token(self, token: torch.Tensor, position: torch.Tensor, cache) -> torch.Tensor:
        logits = self.model(token, position_ids=position, use_cache=True, **{self.keyword: cache}).logits
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    def _cache_for(self, batch: int, length: int):
        """One cache per batch size, reset between calls: CUDA graphs replay on the same cache tensors."""
        from transformers import StaticCache

        if self.cache is None or self.cache_shape[0] != batch or self.cache_shape[1] < length:
            self.cache = None  # the old one freed before the new one is allocated
            self.cache = StaticCache(config=self.model.config, max_cache_len=length)
            self.cache_shape = (batch, length)
        else:
            self.cache.reset()
        return self.cache

    def _prefill(self, ids: torch.Tensor, cache) -> torch.Tensor:
        batch, length = ids.shape
        positions = torch.arange(length, device=ids.device).unsqueeze(0).expand(batch, -1)
        logits = self.model(ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                            **{self.keyword: cache}).logits
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    def run(self, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float, float]:
        """The new tokens, the seconds to the first one (prefill) and of the decode loop after it."""
        batch, length = ids.shape
        cache = self._cache_for(batch, max(length + new_tokens, self.cache_length))
        with torch.no_grad():
            synchronize(self.device)
            started = time.perf_counter()
            token = self._prefill(ids, cache)
            synchronize(self.device)
            prefilled = time.perf_counter()
            position = torch.full((batch, 1), length, dtype=torch.long, device=ids.device)
            tokens = [token]
            for _ in range(new_tokens - 1):
                # clone: the step's output lives in the CUDA graph's memory, overwritten by the next replay
                token = self.decode_one_token(token, position, cache).clone()
                position += 1
                tokens.append(token)
            synchronize(self.device)
            finished = time.perf_counter()
        return torch.cat(tokens, dim=1), prefilled - started, finished - prefilled

    def generate(self, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return self.run(ids, new_tokens)[0]


def _new_tokens(tokens: torch.Tensor, asked: int) -> torch.Tensor:
    if tokens.shape[1] != asked:  # a shorter output would inflate tokens/s
        raise RuntimeError(f"generated {tokens.shape[1]} new tokens, asked for {asked}")
    return tokens


def make_runner(provider: str, model: nn.Module, s: Setup, result: dict):
    """The provider applied to ``model``; optimize runs here (its time is ``setup_s``)."""
    if provider == EAGER:
        return GenerateRunner(model)
    if provider == STATIC_COMPILE:
        return GenerateRunner(model, {"cache_implementation": "static"})
    if provider == STATIC_LOOP:
        result["compile"] = {"mode": "reduce-overhead", "fullgraph": True, "backend": "inductor",
                             "cache_keyword": cache_keyword(model)}
        return StaticLoop(model, s.device, s.prompt + s.new_tokens)
    import kernel_pytorch
    from benchmarks.profile_warm_up import timed_compiles

    if s.generation:
        result["generation_config"] = s.generation
    if s.optimize_options:
        result["optimize_options"] = s.optimize_options
    options = {**(s.optimize_options or {}), **({"generation": s.generation} if s.generation else {})}
    before = dynamo_snapshot()
    with timed_compiles(result.setdefault("graph_compiles", [])):
        optimized = kernel_pytorch.optimize(model, **options)
        # The documented bounded warm-up: batch 1 and one larger batch compile every graph later requests use.
        if callable(getattr(optimized.generate, "warm_up", None)):
            optimized.generate.warm_up(progress=False)
    # Why a call of the warm-up compiled again (a graph more than the prefill and the two decode steps need).
    result["warm_up_recompile_reasons"] = sorted(set(dynamo_changes(before)[1]))[:10]
    return GenerateRunner(optimized)


def transformers_compile_record(model: nn.Module, s: Setup) -> dict:
    """What transformers' generate did with the static cache: whether it compiled, with which CompileConfig."""
    compiled = getattr(model, "_compiled_call", None) is not None
    config = getattr(model, "_last_compile_config", None)
    record = {"compiled_decode_steps": compiled,
              "compile_config": {k: str(v) if callable(v) else v for k, v in config.to_dict().items()}
              if config is not None else None,
              "generation_config.compile_config": str(model.generation_config.compile_config),
              "prefill": "uncompiled (transformers compiles the decode steps only)"}
    if not compiled:
        record["why_not"] = (f"transformers compiles only on cuda/xpu/neuron/tpu devices (this run: {s.device})"
                             if s.device == "cpu" else "transformers' auto-compile criteria not met")
    return record


def generation_lines(report: dict) -> list[str]:
    """The entries of a report's dict that mention generation, each as one line."""
    lines: list[str] = []

    def visit(value: Any, where: str) -> None:
        if isinstance(value, dict):
            flat = {k: v for k, v in value.items() if not isinstance(v, (dict, list))}
            text = "; ".join(f"{k}={v}" for k, v in flat.items())
            if "generat" in text.lower():
                lines.append(f"{where}: {text}")
            for key, inner in value.items():
                if isinstance(inner, (dict, list)):
                    visit(inner, f"{where}.{key}" if where else key)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    if "generat" in item.lower():
                        lines.append(f"{where}: {item}")
                else:
                    visit(item, where)

    visit(report, "")
    return lines[:40]


# The passes that pick kernels: the decode passes (the steps' kernels) and attention (the prefills' kernel, which
# decides much of a long prompt's time to first token).
_KERNEL_CHOICE_PASSES = ("attention", "decode_attention", "decode_linear", "decode_fusion", "decode_rope_cache")


def decode_kernel_lines(report: dict) -> list[str]:
    """What the kernel-choosing passes did (:data:`_KERNEL_CHOICE_PASSES`), each distinct line once with its count
    (one per layer and graph otherwise)."""
    counts: dict[str, int] = {}
    for kind, text_key in (("rewrites", "replacement"), ("skipped", "reason")):
        for record in report.get(kind, []):
            if record.get("pass_name") in _KERNEL_CHOICE_PASSES:
                line = f"{record['pass_name']} {'skip' if kind == 'skipped' else 'rewrite'}: {record.get(text_key)}"
                counts[line] = counts.get(line, 0) + 1
    return [f"{count} x {line}" for line, count in counts.items()]


def block_compile_lines(report: dict) -> list[str]:
    """How Inductor compiled each graph compiled one layer at a time (generation.compile_layers_once): partitions
    compiled and shared, or why it was compiled whole."""
    return [note for note in report.get("notes", []) if "one repeated block at a time" in note]


# ----------------------------------------------------------------------------------------- measurements

def copy_bandwidth(s: Setup) -> dict:
    """Device-to-device copy of ``COPY_BYTES``: bytes read + written per second, the HBM ceiling."""
    if s.device != "cuda":
        return {"not_applicable": "cpu run: no HBM limit"}
    timing = _copy_timing()
    torch.cuda.empty_cache()
    return {"copy_bytes": COPY_BYTES, "copy_ms": round(timing.median_ms, 3),
            "copy_gb_per_s": round(2 * COPY_BYTES / timing.median_ms / 1e6, 1)}


def _copy_timing():
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_()
    target = torch.empty_like(source)
    return measure(lambda: target.copy_(source), warmup=3, runs=10, device="cuda")


def warm_process(s: Setup) -> None:
    """One tiny model's generate, untimed: the imports and CUDA libraries (cuBLAS, SDPA's kernels) that the
    first generate of a process loads are not counted in the first provider's warm-up."""
    import transformers

    config = transformers.LlamaConfig(**TINY_SIZE, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(s.device):
        model = transformers.LlamaForCausalLM(config).to(dtype=s.dtype).eval()
    GenerateRunner(model).generate(prompt_ids(s, TINY_SIZE["vocab_size"], 1, 4), 2)


def decode_step_bytes(info: dict, batch: int, mean_cache_length: float) -> float:
    """Bytes one decode step must read: every weight once (embedding: one row per sequence), then each
    sequence's KV cache."""
    weights = info["weight_bytes"] - info["embedding_bytes"] + batch * info["embedding_row_bytes"]
    return weights + batch * info["kv_bytes_per_token"] * mean_cache_length


def hbm_limit(info: dict, hbm: dict, batch: int, s: Setup) -> dict:
    if "copy_gb_per_s" not in hbm:
        return {}
    mean_length = s.prompt + s.new_tokens / 2
    step_bytes = decode_step_bytes(info, batch, mean_length)
    per_seq = hbm["copy_gb_per_s"] * 1e9 / step_bytes
    return {"mean_cache_length": mean_length, "step_bytes": round(step_bytes),
            "hbm_limit_tokens_per_s_per_seq": round(per_seq, 1), "hbm_limit_tokens_per_s": round(per_seq * batch, 1)}


def _median_s(fn: Callable[[], Any], s: Setup) -> float:
    return measure(fn, warmup=0, runs=s.runs, device=s.device).median_ms / 1e3


def _once_s(fn: Callable[[], Any], s: Setup) -> float:
    return measure(fn, warmup=0, runs=1, device=s.device).median_ms / 1e3


def time_point(runner, ids: torch.Tensor, s: Setup) -> tuple[float, float, str]:
    """(TTFT seconds, decode seconds of the tokens after the first, how) at one batch and prompt."""
    if runner.splits_decode:
        splits = [runner.run(ids, s.new_tokens)[1:] for _ in range(s.runs)]
        return (statistics.median(t for t, _ in splits), statistics.median(d for _, d in splits),
                "prefill and decode loop timed apart")
    # Interleaved pairs: a slow spell of the host hits both calls of a pair, not one of two medians taken apart
    # (which once read 994 tokens/s as 1274: CHANGELOG, "Fixed").
    pairs = [(_once_s(lambda: runner.generate(ids, 1), s), _once_s(lambda: runner.generate(ids, s.new_tokens), s))
             for _ in range(s.runs)]
    return (statistics.median(first for first, _ in pairs), statistics.median(total - first for first, total in pairs),
            "decode = generate(new tokens) - generate(1 token), the median of interleaved pairs' differences")


def measure_point(runner, info: dict, hbm: dict, batch: int, s: Setup) -> dict:
    started = time.perf_counter()
    ids = prompt_ids(s, info["config"]["vocab_size"], batch, s.prompt)
    runner.generate(ids, s.warm_tokens)  # this batch's shapes compiled / recorded before the timed calls
    ttft, decode, how = time_point(runner, ids, s)
    if decode <= 0:  # total - TTFT of a few milliseconds on a busy CPU
        raise RuntimeError(f"decode time not measurable: {decode * 1e3:.2f} ms ({how})")
    steps = s.new_tokens - 1
    per_seq = steps / decode
    point = {"date": environment()["date"], "batch": batch, "prompt": s.prompt, "new_tokens": s.new_tokens,
             "ttft_ms": round(ttft * 1e3, 2), "decode_ms": round(decode * 1e3, 2),
             "decode_ms_per_token": round(decode * 1e3 / steps, 3), "timing": how,
             "decode_tokens_per_s_per_seq": round(per_seq, 1), "decode_tokens_per_s": round(per_seq * batch, 1),
             "seconds": round(time.perf_counter() - started, 1)}  # the short call and the timed ones
    limit = hbm_limit(info, hbm, batch, s)
    if limit:
        point.update(limit, hbm_share=round(per_seq / limit["hbm_limit_tokens_per_s_per_seq"], 3))
    else:
        point["hbm_limit"] = "not applicable on cpu"
    return point


def measure_ttft(runner, info: dict, prompt: int, s: Setup) -> float:
    ids = prompt_ids(s, info["config"]["vocab_size"], 1, prompt)
    if runner.splits_decode:
        return statistics.median(runner.run(ids, 1)[1] for _ in range(s.runs))
    return _median_s(lambda: runner.generate(ids, 1), s)


def measure_ttfts(runner, info: dict, s: Setup) -> dict[str, Any]:
    """TTFT in ms per prompt length of ``s.ttft_prompts`` (or why a length failed)."""
    return {str(p): _guarded(lambda: round(measure_ttft(runner, info, p, s) * 1e3, 2), s) for p in s.ttft_prompts}


def measure_other_prefill_arm(runner, info: dict, hbm: dict, s: Setup, memory: PeakMemory) -> tuple[str, dict]:
    """The same compiled model with ``generation.prefill_graphs`` flipped: the batch points and TTFTs again, in this
    process (new lanes and their captures, no new compile), with their peak memory (``points_peak_gib``, as the
    provider's own). Returns the arm's key (``with_prefill_graphs`` or ``without_prefill_graphs``) and its record.
    The prefill stays as compiled at construction: pass ``--generation '{"compile_prefill": true}'`` for a compiled
    prefill in both arms (the default leaves it uncompiled where it replays CUDA graphs)."""
    decoder = runner.model.generate.decoder
    option, first = decoder.prefill_graphs_option, decoder.prefill_graphs
    decoder.set_prefill_graphs(not first)
    try:
        memory.phase()
        batches = {str(b): _guarded(lambda: measure_point(runner, info, hbm, b, s), s) for b in s.batches}
        ttfts = measure_ttfts(runner, info, s)
        arm = {"ttft_ms": ttfts, "batches": batches, "points_peak_gib": memory.phase(), "lanes": decoder.summary()}
        return ("without_prefill_graphs" if first else "with_prefill_graphs"), arm
    finally:
        decoder.set_prefill_graphs(option)


def write_host_profile(fn: Callable[[], Any], path: Path) -> None:
    """The host's cumulative profile of ``fn()`` (where a call's time goes besides the GPU's), written to ``path``."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(60)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stream.getvalue())


def recompile_sweep(runner, info: dict, s: Setup) -> dict:
    """Graphs Dynamo compiles over a sweep of prompt lengths and batch sizes after warm-up (issue: none)."""
    before = dynamo_snapshot()
    started = time.perf_counter()
    done, errors, stopped = [], {}, None
    for batch in s.sweep_batches:
        for prompt in s.sweep_prompts:
            if time.perf_counter() - started > s.sweep_budget_s:
                stopped = stopped or f"time budget of {s.sweep_budget_s:.0f} s spent before batch {batch} x {prompt}"
                continue
            try:
                runner.generate(prompt_ids(s, info["config"]["vocab_size"], batch, prompt), s.sweep_new_tokens)
                done.append([batch, prompt])
            except Exception as error:  # an out-of-memory or a refused shape: recorded, the sweep goes on
                errors[f"{batch}x{prompt}"] = first_line(error)
                free_memory(s)
    moved, reasons = dynamo_changes(before)
    return {"batch_x_prompt": done, "new_tokens": s.sweep_new_tokens,
            "seconds": round(time.perf_counter() - started, 1),
            "graphs_compiled": moved["unique_graphs"], "frames_compiled": moved["frames"],
            "recompiles_counted": {k: v for k, v in moved.items() if k not in ("unique_graphs", "frames")},
            "recompile_reasons": sorted(set(reasons))[:10], "errors": errors, "stopped": stopped}


# ------------------------------------------------------------------------------------------------ one case

def free_memory(s: Setup) -> None:
    gc.collect()
    if s.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def release(s: Setup) -> None:
    """Everything of the last provider released: memory, Dynamo's caches, peak statistics."""
    gc.collect()
    torch._dynamo.reset()
    free_memory(s)
    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()


class PeakMemory:
    """A provider's peak CUDA memory per phase of its run (each phase resets PyTorch's peak statistics) and over
    the whole run; nothing off CUDA."""

    def __init__(self, s: Setup):
        self.cuda = s.device == "cuda"
        self.allocated = self.reserved = 0.0

    def phase(self) -> float | None:
        """The peak allocated GiB since the last phase."""
        if not self.cuda:
            return None
        allocated = torch.cuda.max_memory_allocated() / GIB
        self.allocated = max(self.allocated, allocated)
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved() / GIB)
        torch.cuda.reset_peak_memory_stats()
        return round(allocated, 2)

    def whole_run(self) -> dict:
        self.phase()
        return {"peak_gib": round(self.allocated, 2), "reserved_gib": round(self.reserved, 2)} if self.cuda else {}


def run_provider(name: str, provider: str, s: Setup, hbm: dict, info_out: dict) -> dict:
    """One (model, provider): build, warm up, batch points, TTFTs, recompile sweep (optimize). Errors are
    recorded per point, or for the case when the warm-up fails; everything is released before returning."""
    result: dict[str, Any] = {"date": environment()["date"]}
    model = runner = None
    memory = PeakMemory(s)
    try:
        model = build_model(name, s)
        info_out.update(model_info(name, model, s))
        info = dict(info_out)
        graphs_before = dynamo_compile_counts()["unique_graphs"]
        started = time.perf_counter()
        runner = make_runner(provider, model, s, result)
        result["setup_s"] = round(time.perf_counter() - started, 2)
        tokens = runner.generate(prompt_ids(s, info["config"]["vocab_size"], 1, s.prompt), s.new_tokens)
        synchronize(s.device)
        result["warmup_s"] = round(time.perf_counter() - started, 2)
        result["tokens_batch1"] = tokens[0].tolist()
        if provider == STATIC_COMPILE:
            result["transformers_compile"] = transformers_compile_record(model, s)
        memory.phase()  # the warm-up's
        result["batches"] = {}
        for batch in s.batches:
            result["batches"][str(batch)] = _guarded(lambda: measure_point(runner, info, hbm, batch, s), s)
        result["ttft_ms"] = measure_ttfts(runner, info, s)
        result["points_peak_gib"] = memory.phase()  # the batch points' and TTFTs'
        result["graphs_compiled"] = dynamo_compile_counts()["unique_graphs"] - graphs_before
        if provider == OURS and s.host_profile:
            write_host_profile(lambda: measure_ttft(runner, info, s.ttft_prompts[0], s), s.host_profile)
        if provider == OURS:
            result["recompiles"] = recompile_sweep(runner, info, s)
            if s.prefill_graphs_ab:
                arm, record = measure_other_prefill_arm(runner, info, hbm, s, memory)
                result[arm] = record
            result["report_generation_lines"] = _report_lines(runner.model)
            result["setup_phases_s"] = _setup_phases(runner.model)
        result.update(memory.whole_run())
    except Exception as error:  # a provider that raises (out of memory, compile failure) must not end the run
        traceback.print_exc()  # the cause, on stderr: the result keeps the error's first line
        result["error"] = first_line(error)
        if provider == OURS and model is not None:
            result["report_generation_lines"] = _report_lines(model)
    model = runner = None
    release(s)
    return result


def _guarded(fn: Callable[[], Any], s: Setup) -> Any:
    """``fn()``, or ``{"error": ...}`` when it raises (out of memory at batch 32, a length refused)."""
    try:
        return fn()
    except Exception as error:
        free_memory(s)
        return {"error": first_line(error)}


def _report_lines(model: nn.Module) -> list[str]:
    try:
        import kernel_pytorch

        report = kernel_pytorch.report_of(model).to_dict()
        return generation_lines(report) + decode_kernel_lines(report) + block_compile_lines(report)
    except Exception as error:  # not optimized (optimize raised before returning)
        return [f"no report: {first_line(error)}"]


def _setup_phases(model: nn.Module) -> dict[str, float]:
    """Where optimize's warm-up went: the report's seconds per phase (passes, verify, compile), summed over graphs."""
    import kernel_pytorch

    return {phase: round(seconds, 2) for phase, seconds in kernel_pytorch.report_of(model).timings_s.items()}


# ---------------------------------------------------------------------------- comparisons, targets, summary

def add_token_agreement(entry: dict) -> None:
    """Per provider: how many leading batch-1 tokens equal transformers eager's."""
    providers = entry.get("providers", {})
    reference = providers.get(EAGER, {}).get("tokens_batch1")
    for result in providers.values():
        tokens = result.get("tokens_batch1")
        if reference is None or tokens is None:
            result.pop("equal_leading_tokens_vs_eager", None)
            continue
        equal = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
        result["equal_leading_tokens_vs_eager"] = equal
        result["tokens_compared"] = min(len(tokens), len(reference))


def _point(result: dict, batch: int) -> dict:
    return result.get("batches", {}).get(str(batch), {})


def _ttft(result: dict, prompt: str) -> float | None:
    value = result.get("ttft_ms", {}).get(prompt)
    return value if isinstance(value, (int, float)) else None


def _target(what: str, model: str, value: float | None, target: float | None, unit: str,
            higher_is_better: bool) -> dict:
    """One target line: ``meets``; ``miss_ratio`` = how many times off (> 1: missed by that factor; None for a
    zero target); ``missed_by`` = the gap in ``unit`` when missed. None where either side was not measured."""
    meets = ratio = missed_by = None
    if value is not None and target is not None:
        meets = value >= target if higher_is_better else value <= target
        if value and target:
            ratio = round(target / value if higher_is_better else value / target, 3)
        missed_by = None if meets else round(abs(value - target), 3)
    return {"what": what, "model": model, "provider": OURS, "value": value, "target": target, "unit": unit,
            "higher_is_better": higher_is_better, "meets": meets, "miss_ratio": ratio, "missed_by": missed_by}


def targets(payload: dict) -> list[dict]:
    """Issue 27's targets from what the file holds (GPU runs; the cpu smoke run measures nothing)."""
    if payload.get("scale") == "cpu":
        return []
    out = []
    for name, entry in payload.get("models", {}).items():
        providers = entry.get("providers", {})
        ours, loop = providers.get(OURS, {}), providers.get(STATIC_LOOP, {})
        if name in HBM_SHARE_TARGET:
            out.append(_target("batch-1 decode, share of the HBM limit", name, _point(ours, 1).get("hbm_share"),
                               HBM_SHARE_TARGET[name], "fraction", True))
        batches = sorted({int(b) for b in ours.get("batches", {})} | {int(b) for b in loop.get("batches", {})})
        for batch in batches:
            base = _point(loop, batch).get("decode_tokens_per_s_per_seq")
            out.append(_target(f"batch-{batch} decode >= {SPEEDUP_VS_LOOP_TARGET}x {STATIC_LOOP}", name,
                               _point(ours, batch).get("decode_tokens_per_s_per_seq"),
                               round(base * SPEEDUP_VS_LOOP_TARGET, 1) if base else None, "tokens/s per sequence",
                               True))
        prompts = sorted({p for r in providers.values() for p in r.get("ttft_ms", {})}, key=int)
        for prompt in prompts:
            fastest = [t for t in (_ttft(providers.get(p, {}), prompt) for p in (STATIC_COMPILE, STATIC_LOOP))
                       if t is not None]
            out.append(_target(f"TTFT at prompt {prompt} <= the faster of {STATIC_COMPILE} and {STATIC_LOOP}",
                               name, _ttft(ours, prompt), min(fastest) if fastest else None, "ms", False))
        if name in WARMUP_TARGET_S:
            out.append(_target("warm-up (setup + first generate)", name, ours.get("warmup_s"),
                               WARMUP_TARGET_S[name], "s", False))
        out.append(_target("graphs compiled after warm-up (recompile sweep)", name,
                           ours.get("recompiles", {}).get("graphs_compiled"), 0, "graphs", False))
    return out


def case_line(name: str, provider: str, result: dict) -> str:
    if "error" in result:
        return f"{name} {provider}: {result['error']}"
    cells = [f"warm-up {result.get('warmup_s')} s"]
    for batch, point in result.get("batches", {}).items():
        if "error" in point:
            cells.append(f"b{batch} {point['error']}")
            continue
        share = f" ({point['hbm_share']:.0%} of HBM limit)" if "hbm_share" in point else ""
        cells.append(f"b{batch} {point['decode_tokens_per_s_per_seq']} tok/s/seq{share}")
    for prompt, ttft in result.get("ttft_ms", {}).items():
        cells.append(f"TTFT@{prompt} {ttft if not isinstance(ttft, dict) else ttft['error']}"
                     + (" ms" if not isinstance(ttft, dict) else ""))
    if "equal_leading_tokens_vs_eager" in result:
        cells.append(f"{result['equal_leading_tokens_vs_eager']}/{result['tokens_compared']} tokens = eager")
    if "recompiles" in result:
        cells.append(f"sweep: {result['recompiles']['graphs_compiled']} graphs compiled")
    return f"{name} {provider}: " + "; ".join(cells)


def summary_lines(payload: dict) -> list[str]:
    lines = [case_line(name, provider, result) for name, entry in payload.get("models", {}).items()
             for provider, result in entry.get("providers", {}).items()]
    for t in payload.get("targets", []):
        verdict = {True: "meets", None: "not measured",
                   False: f"MISSED by {t['missed_by']} {t['unit']}"
                          + (f" ({t['miss_ratio']}x off)" if t["miss_ratio"] else "")}[t["meets"]]
        lines.append(f"target {t['model']}: {t['what']}: {t['value']} vs {t['target']} {t['unit']} -> {verdict}")
    return lines


# ------------------------------------------------------------------------------------------- file, plot

def merge_provider(old: dict | None, new: dict) -> dict:
    """The new result, with the batch points of ``old`` this run did not measure (each keeps its date)."""
    if not old or "error" in new:
        return new
    kept = {b: p for b, p in old.get("batches", {}).items() if b not in new.get("batches", {})}
    return {**new, "batches": dict(sorted({**kept, **new.get("batches", {})}.items(), key=lambda kv: int(kv[0])))}


def plot(payload: dict, path: Path) -> None:
    """Decode tokens/s (all sequences) per provider, grouped by batch size, one panel per model; the HBM
    limit as a black line over each group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(payload.get("models", {}))
    if not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        providers = payload["models"][name].get("providers", {})
        batches = sorted({int(b) for r in providers.values() for b in r.get("batches", {})})
        width = 0.8 / max(1, len(providers))
        for i, (provider, result) in enumerate(providers.items()):
            values = [_point(result, b).get("decode_tokens_per_s", 0.0) for b in batches]
            ax.bar([x + i * width for x in range(len(batches))], values, width, label=provider,
                   color="tab:red" if provider == OURS else None)
        for x, batch in enumerate(batches):
            limit = next((_point(r, batch)["hbm_limit_tokens_per_s"] for r in providers.values()
                          if "hbm_limit_tokens_per_s" in _point(r, batch)), None)
            if limit:
                ax.hlines(limit, x - width / 2, x + 0.8 - width / 2, color="black", linewidth=1.5,
                          label="HBM limit" if x == 0 else None)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_yscale("log")
        ax.set_ylabel("decode tokens/s (all sequences)")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"decode, {payload['environment']['device']} ({payload.get('scale')})", fontsize=9)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = scaled_run_parser(__doc__, "1b only, batch 1, 64 new tokens")
    parser.add_argument("--models", nargs="+", choices=list(MODEL_SIZES), default=None,
                        help="default: 1b 7b; with --quick or --device cpu 1b")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="default: 1 8 32; --quick 1")
    parser.add_argument("--fresh", action="store_true", help="do not merge into the existing result file")
    parser.add_argument("--generation", type=json.loads, default=None, metavar="JSON",
                        help="optimize(model, generation=...), e.g. '{\"compile_prefill\": false}'")
    parser.add_argument("--optimize", type=json.loads, default=None, metavar="JSON",
                        help="other optimize(model, ...) options, e.g. '{\"compile\": false}' (the rewritten graphs run "
                             "uncompiled; the decode steps and prefills still replay CUDA graphs)")
    parser.add_argument("--prefill-graphs-ab", action="store_true",
                        help="after optimize's measurements, its batch points and TTFTs again with "
                             "generation.prefill_graphs flipped in the same process (result: without_prefill_graphs "
                             "or with_prefill_graphs)")
    parser.add_argument("--host-profile", action="store_true",
                        help="write optimize's host profile (cProfile) of TTFT calls to OUT/decode_ttft_profile.txt")
    args = scaled_run_args(parser, argv)
    if args.models is None:
        args.models = ["1b"] if args.quick or args.device == "cpu" else list(MODEL_SIZES)
    if args.batches is not None and min(args.batches) < 1:
        parser.error("--batches must be positive")
    return args


def result_name(s: Setup) -> str:
    return "decode" + {"full": "", "quick": "_quick", "cpu": "_cpu"}[s.scale]


def run(args: argparse.Namespace, s: Setup) -> None:
    name = result_name(s)
    started = time.perf_counter()
    hbm = copy_bandwidth(s)
    warm_process(s)
    release(s)  # the copy's buffers out of the first provider's peak
    payload: dict[str, Any] = {"scale": s.scale, "dtype": str(s.dtype), "prompt": s.prompt,
                               "new_tokens": s.new_tokens, "batches": list(s.batches),
                               "ttft_prompts": list(s.ttft_prompts), "runs": s.runs, "hbm": hbm,
                               "models": same_device_models(args.out / f"{name}.json", args.fresh)}
    for model_name in args.models:
        entry = payload["models"].setdefault(model_name, {"info": {}, "providers": {}})
        for provider in (p for p in PROVIDERS if p in args.providers):  # eager first: the tokens' reference
            case_started = time.perf_counter()
            result = run_provider(model_name, provider, s, payload["hbm"], entry["info"])
            result["seconds"] = round(time.perf_counter() - case_started, 1)
            entry["providers"][provider] = merge_provider(entry["providers"].get(provider), result)
            entry["providers"] = dict(sorted(entry["providers"].items(), key=lambda kv: PROVIDERS.index(kv[0])))
            entry["environment"] = environment()
            add_token_agreement(entry)
            print(f"{case_line(model_name, provider, entry['providers'][provider])} ({result['seconds']:.0f} s)",
                  flush=True)
            payload["targets"] = targets(payload)
            write_result(name, payload, args.out)  # kept up to date if the command is cut off
    payload["targets"] = targets(payload)
    payload["summary"] = summary_lines(payload)
    payload["seconds"] = round(time.perf_counter() - started, 1)
    write_final_result(name, payload, args.out, plot)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/decode.py needs a CUDA GPU (or --device cpu for a smoke run)")
    s = make_setup(args.quick, args.device)
    if args.batches:
        s = replace(s, batches=tuple(args.batches))
    if args.host_profile:
        s = replace(s, host_profile=args.out / "decode_ttft_profile.txt")
    if args.generation:
        s = replace(s, generation=args.generation)
    if args.optimize:
        s = replace(s, optimize_options=args.optimize)
    s = replace(s, prefill_graphs_ab=args.prefill_graphs_ab)
    threads = torch.get_num_threads()
    if s.device == "cpu":
        # The tiny model's ops are too small to share out; a second thread waiting on a busy core stalls each.
        torch.set_num_threads(1)
    try:
        run(args, s)
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
