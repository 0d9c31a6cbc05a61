"""``Decoder``: static-KV-cache decoding of a transformers causal LM or encoder-decoder, for ``generate()`` and
for plain loops.

    decoder = kernel_pytorch.Decoder(model)                 # the model optimized or not
    logits = decoder.prefill(input_ids, attention_mask, max_new_tokens=64)
    for _ in range(64):
        logits = decoder.step(logits.argmax(-1))

Requests are served by lanes (:class:`~kernel_pytorch.features.generation.lane.DecodeLane`), one per (batch
bucket, cache-length bucket) met so far: a batch is padded up to its bucket with copies of its first row (dropped
from the results), and the cache length is the smallest multiple of 256 tokens that holds prompt and new tokens, at
most ``max_length``: every prefill and decode step attends over its whole cache, so a cache twice as long as the
request costs time as well as memory. Lanes share the compiled prefill and step (dynamic shapes), so a new lane
only allocates its cache and captures; at most ``_MAX_LANES`` are kept, the least recently used dropped first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kernel_pytorch.cuda_graph_capture import ModuleState, module_state, registered_hook
from kernel_pytorch.features.generation.empty_cache_prefill import is_left_padded
from kernel_pytorch.features.generation.host_steps import HostSteps
from kernel_pytorch.features.generation.lane import DecodeLane
from kernel_pytorch.features.generation.model_entries import ModelCalls
from kernel_pytorch.features.generation.model_calls import (cache_bytes, decoder_start_token, default_max_length,
                                                             is_encoder_decoder, why_not_generative)
from kernel_pytorch.features.generation.prefill_graphs import buckets_below, left_padded, padded_prompt_length
from kernel_pytorch.features.generation.sampling import SamplingSettings

__all__ = ["Decoder", "GenerationLimitError"]

_CACHE_STEP = 256  # cache lengths are multiples of this
_MAX_LANES = 8  # lanes kept (each holds a cache and its graphs); the least recently used goes first
_STEPS_BETWEEN_STOP_CHECKS = 16  # a host sync per check: often enough to stop soon after every row ended


class GenerationLimitError(ValueError):
    """A request beyond the decoder's configured limits (cache length, batch buckets)."""


class Decoder:
    """Static-cache decoding for ``model``; see the module docstring. ``max_length``: tokens the largest cache
    holds (None: :func:`default_max_length`); ``batch_buckets``: the batch sizes steps are captured for;
    ``compile_prefill``: whether an optimized model's prefill is compiled (else its rewritten graph runs as is;
    "auto": compiled where the prefills do not replay CUDA graphs; a prompt left unreplayed there, whose bucket does
    not fit the cache or whose capture failed, then runs uncompiled);
    ``compile_layers_once``: Inductor compiles each distinct layer of the prefill and step graphs once ("auto":
    where the steps replay CUDA graphs);
    ``prefill_graphs``: a causal LM's prompts are left-padded to power-of-two buckets and their prefills replayed from
    CUDA graphs (:mod:`~kernel_pytorch.features.generation.prefill_graphs`; "auto": where the steps replay CUDA graphs
    on a CUDA device); ``prefill_any_batch``: one prefill graph
    serves every batch size, batch 1 included."""

    def __init__(self, model: nn.Module, max_length: int | None = None,
                 batch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32), cuda_graphs: bool | str = "auto",
                 compile_prefill: bool | str = "auto", compile_layers_once: bool | str = "auto",
                 prefill_graphs: bool | str = "auto", prefill_any_batch: bool = False):
        reason = why_not_generative(model)
        if reason:
            raise TypeError(f"kernel_pytorch.Decoder: {reason}")
        self.model = model
        self.max_length = max_length or default_max_length(model)
        self.batch_buckets = tuple(batch_buckets)
        self.cuda_graphs = cuda_graphs is True or cuda_graphs == "auto"
        self.notes: list[str] = []
        self.encoder_decoder = is_encoder_decoder(model)
        self._prefill_graphs = prefill_graphs
        self.compile_prefill = compile_prefill is True or (compile_prefill == "auto" and not self.prefill_graphs)
        self.compile_layers_once = compile_layers_once is True or (compile_layers_once == "auto"
                                                                    and self.steps_replay_cuda_graphs)
        self.calls = ModelCalls.of(model, _backend_of(model), self.compile_prefill, self.compile_layers_once,
                                   prefill_any_batch, note=self.notes.append, prefills_replayed=self.prefill_graphs,
                                   steps_replayed=self.steps_replay_cuda_graphs)
        # (batch bucket, cache length, encoder length or 0) -> lane, in order of use, the most recent last
        self.lanes: dict[tuple[int, int, int], DecodeLane] = {}
        self.lane: DecodeLane | None = None  # the lane of the request in progress
        self.batch = 0
        self._built_from: ModuleState | None = None  # the model's state when the lanes were built

    # -- the plain-loop API ------------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                max_new_tokens: int | None = None) -> torch.Tensor:
        """Start a request: the prompt's last logits (batch x vocab). Left padding goes in ``attention_mask``;
        ``max_new_tokens`` picks the cache (None: the largest). With ``prefill_graphs`` the prompt is padded to its
        bucket first: on the right where it prefills into an empty cache (:meth:`DecodeLane.prefill_into_empty_cache`),
        else on the left, masked, and the cache then holds the bucket."""
        mask_given = attention_mask is not None  # without one nothing is padded: no host check of it below
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self.batch = input_ids.shape[0]
        if self.encoder_decoder:  # the prompt goes to the encoder; the decoder starts from its start token
            total = 2 + (max_new_tokens if max_new_tokens is not None else self.max_length)
            self.lane = self._lane(self.batch, min(total, self.max_length), encoder_length=input_ids.shape[1])
            self.lane.encode(*(_pad_rows(t, self.lane.batch) for t in (input_ids, attention_mask)))
            start = self.start_tokens(self.lane.batch, input_ids.device)
            return self.lane.prefill(start, torch.ones_like(start))[:self.batch]
        slots = self._prompt_slots(input_ids.shape[1], max_new_tokens)
        total = slots + (max_new_tokens if max_new_tokens is not None else 0)
        self.lane = self._lane(self.batch, total if max_new_tokens is not None else self.max_length)
        padded_ids, padded_mask = (_pad_rows(t, self.lane.batch) for t in (input_ids, attention_mask))
        why_masked = self.lane.empty_cache_refusal or ("" if not mask_given or is_left_padded(attention_mask) else
                                                       "its attention mask is not left padding (a row with a hole, "
                                                       "or without a token at its end)")
        if not why_masked:
            return self.lane.prefill_into_empty_cache(padded_ids, padded_mask, slots)[:self.batch]
        note = f"generation: a prompt prefilled over the static cache through its mask, not into an empty cache: " \
               f"{why_masked}"
        if note not in self.notes:
            self.notes.append(note)
        padded_ids, padded_mask = left_padded(padded_ids, padded_mask, slots)
        return self.lane.prefill(padded_ids, padded_mask)[:self.batch]

    def _prompt_slots(self, prompt_length: int, max_new_tokens: int | None) -> int:
        """Cache slots a prompt takes: with prefill graphs its bucket, where the cache leaves room for it and one new
        token at least; else its own length."""
        if not self.prefill_graphs:
            return prompt_length
        return padded_prompt_length(prompt_length, self.max_length - max(1, max_new_tokens or 0))

    @property
    def steps_replay_cuda_graphs(self) -> bool:
        """Whether the lanes capture their decode steps as CUDA graphs: with ``cuda_graphs``, on a CUDA device."""
        return self.cuda_graphs and self._device().type == "cuda"

    @property
    def prefill_graphs(self) -> bool:
        """Whether prompts are padded to buckets whose prefills replay CUDA graphs: never for an encoder-decoder (its
        decoder's prompt is one start token); with "auto", where the steps replay CUDA graphs on a CUDA device."""
        if self.encoder_decoder:
            return False
        if self._prefill_graphs == "auto":
            return self.steps_replay_cuda_graphs
        return bool(self._prefill_graphs)

    @property
    def prefill_graphs_option(self) -> bool | str:
        """The option as given (True, False or "auto"), which :attr:`prefill_graphs` resolves."""
        return self._prefill_graphs

    def set_prefill_graphs(self, enabled: bool | str) -> None:
        """Turn the prefill graphs on, off or back to "auto" for later requests; the lanes are dropped, to be rebuilt
        with or without them (the prefill and step are kept as compiled, or not, at construction: an "auto" prefill
        left uncompiled for its CUDA graphs stays uncompiled without them)."""
        self._prefill_graphs = enabled
        self.lanes.clear()
        self.lane = None
        self.notes.append(f"generation: prefill graphs turned {'on' if self.prefill_graphs else 'off'}; lanes rebuilt")

    def start_tokens(self, batch: int, device: torch.device) -> torch.Tensor:
        """An encoder-decoder's first decoder input: its start token per row."""
        return torch.full((batch, 1), decoder_start_token(self.model), dtype=torch.long, device=device)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per sequence (batch,): the next logits (batch x vocab; a buffer the next step reuses)."""
        if self.lane is None:
            raise RuntimeError("Decoder.step() before prefill(): start a request with prefill(input_ids)")
        if self.lane.next_slot >= self.lane.length:
            raise GenerationLimitError(f"the KV cache of {self.lane.length} tokens is full: pass a larger "
                                       "max_new_tokens to prefill() (at most generation max_length="
                                       f"{self.max_length})")
        return self.lane.step(_pad_rows(tokens.reshape(-1), self.lane.batch))[:self.batch]

    # -- the token loop of generate() -------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 min_new_tokens: int = 0, eos: Sequence[int] = (), pad: int = 0,
                 sampling: SamplingSettings | None = None, streamer: Any = None,
                 criteria: Sequence[Any] = ()) -> torch.Tensor:
        """Tokens as transformers' ``generate()`` gives them: the prompt followed by up to ``max_new_tokens`` tokens,
        greedy (``sampling`` None) or sampled, ``pad`` after a row's EOS, stopping once every row ended.
        ``streamer``: a transformers streamer, given the prompt, then each step's tokens (one per row, as transformers
        calls ``put``, in bursts at the loop's host checks), then ``end()``; ``criteria``: transformers stopping
        criteria, asked after each step as transformers asks them (:class:`HostSteps`)."""
        # an encoder-decoder's output is its decoder's tokens: the start token, then the new ones
        head = self.start_tokens(input_ids.shape[0], input_ids.device) if self.encoder_decoder else input_ids
        if streamer is not None:
            streamer.put(head.cpu())
        logits = self.prefill(input_ids, attention_mask, max_new_tokens)
        host = HostSteps(self.lane.loop, self.batch, head, streamer, list(criteria), list(eos), pad) \
            if streamer is not None or criteria else None
        produced = self._loop(logits, max_new_tokens, min_new_tokens, eos, pad, sampling, host)
        if streamer is not None:
            streamer.end()
        return torch.cat([head, self.lane.loop.generated[:self.batch, :produced]], dim=1)

    def _loop(self, logits: torch.Tensor, max_new_tokens: int, min_new_tokens: int = 0, eos: Sequence[int] = (),
              pad: int = 0, sampling: SamplingSettings | None = None, host: HostSteps | None = None) -> int:
        """The tokens after the prefill that gave ``logits`` (in ``self.lane.loop``); returns how many."""
        lane = self.lane
        loop = lane.loop
        first = loop.start(_pad_rows(logits, lane.batch), min_new_tokens, list(eos), pad, sampling)
        lane.tokens.copy_(first.unsqueeze(1))
        done = 1
        end = host.review(done) if host is not None else None
        while end is None and done < max_new_tokens:
            count = min(_STEPS_BETWEEN_STOP_CHECKS, max_new_tokens - done)
            lane.loop_steps(count)
            done += count
            ended = bool(eos) and loop.alive[done - 1].item() == 0
            if ended:  # up to the step that ended the last row, as transformers stops there
                done = loop.steps_taken(done)
            if host is not None:
                end = host.review(done)
            if ended:
                break
        self._note_graph_failure(lane)
        return end if end is not None else done  # alive counts only fall: none hit 0 before

    def _note_graph_failure(self, lane: DecodeLane) -> None:
        name = f"the {lane.batch} x {lane.length} lane"
        notes = [f"generation: the decode step of {name} could not be captured as a CUDA graph and runs compiled "
                 f"without one: {lane.graph_failure}" if lane.graph_failure else ""]
        prefills = lane.prefill_graphs
        if prefills is not None and not prefills.cuda_graphs:
            device = lane.device.type
            off = "generation.cuda_graphs is off" if device == "cuda" else f"no CUDA graphs on {device}"
            why = prefills.failure or f"{off} (prompts are padded to their buckets all the same)"
            notes.append(f"generation: the prefills of {name} run without CUDA graphs: {why}")
        self.notes += [note for note in notes if note and note not in self.notes]

    @torch.no_grad()
    def warm_up(self, batch_sizes: Sequence[int] = (1, 2), cache_lengths: Sequence[int] = (_CACHE_STEP,),
                progress: bool = True) -> float:
        """Compile and capture ahead of requests, with a progress bar: a short greedy request per (batch size, cache
        length). Batch 1 and one larger batch compile every graph the decoder needs (its prefill and step take any
        length, any larger batch and any left padding); other lanes then only allocate their cache and capture. With
        prefill graphs, each lane's prefill buckets are captured too. Returns seconds."""
        started = time.perf_counter()
        # A model whose max_length is under a length asked for warms up its longest lane instead.
        pairs = list(dict.fromkeys((b, min(n, self.max_length)) for b in batch_sizes for n in cache_lengths))
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), disable=not progress,
                      transient=True) as bar:
            task = bar.add_task("generation warm-up", total=len(pairs))
            for batch, length in pairs:
                bar.update(task, description=f"generation warm-up: {batch} sequences x {length} tokens")
                prompt = torch.ones(batch, 8, dtype=torch.long, device=self._device())
                new_tokens = length - self._prompt_slots(prompt.shape[1], None)  # the request fills the lane asked for
                self._loop(self.prefill(prompt, torch.ones_like(prompt), max_new_tokens=new_tokens), max_new_tokens=3)
                if self.prefill_graphs:
                    self._capture_prefill_buckets(batch, length)
                bar.advance(task)
        seconds = time.perf_counter() - started
        self.notes.append(f"generation: warmed up {len(pairs)} lanes in {seconds:.1f} s")
        return seconds

    def _capture_prefill_buckets(self, batch: int, length: int) -> None:
        """A prefill at each bucket the lane's cache holds with a slot to spare: each captures its bucket's graph (the
        first bucket's, which the warm-up request captured, replays)."""
        for bucket in buckets_below(length):
            prompt = torch.ones(batch, bucket, dtype=torch.long, device=self._device())
            self.prefill(prompt, torch.ones_like(prompt), max_new_tokens=length - bucket)  # the same lane

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- lanes -------------------------------------------------------------------------------------------------

    def _lane(self, batch: int, total_length: int, encoder_length: int | None = None) -> DecodeLane:
        bucket = next((b for b in self.batch_buckets if b >= batch), None)
        if bucket is None:
            raise GenerationLimitError(f"a batch of {batch} sequences is above the largest of generation "
                                       f"batch_buckets={self.batch_buckets}: add a larger bucket")
        if total_length > self.max_length:
            raise GenerationLimitError(f"{total_length} tokens (prompt + new tokens) do not fit the KV cache of "
                                       f"generation max_length={self.max_length} tokens: raise it, "
                                       "optimize(model, generation={'max_length': ...})")
        state = module_state(self.model)
        if state.hooked:  # the steps are traced without guards on the hooks, and replays run no Python
            raise RuntimeError(f"kernel_pytorch.Decoder cannot run {registered_hook(self.model)}: its compiled and "
                               "captured steps would skip the hook; remove it, or call model.generate() (after "
                               "optimize it then runs transformers' loop through the optimized model, hooks and all)")
        length = min(_rounded(total_length), self.max_length)
        key = (bucket, length, _rounded(encoder_length) if encoder_length else 0)
        self._drop_lanes_if_the_model_changed(state)
        lane = self.lanes.pop(key, None)
        if lane is None:
            if len(self.lanes) >= _MAX_LANES:
                self._drop_lane(next(iter(self.lanes)))
            lane = self._new_lane(*key)
        self.lanes[key] = lane  # most recently used last
        return lane

    def _drop_lanes_if_the_model_changed(self, state: ModuleState) -> None:
        """Lanes replay CUDA graphs that read the parameters and buffers at the addresses they had at capture: after
        ``model.to(...)``, ``model.half()`` or a parameter replaced by another tensor, a replay would read freed or
        stale memory; after ``.train()`` / ``.eval()`` it would replay the other mode's dropout. Every lane is
        rebuilt then (an in-place update, an optimizer step or ``load_state_dict``, keeps the addresses and the
        lanes)."""
        what = state.changed_since(self._built_from)
        if what and self.lanes:
            self.notes.append(f"generation: {what} since its {len(self.lanes)} lane(s) were built (.to(), .half(), "
                              "a replaced parameter, .train() / .eval()): lanes rebuilt")
            self.lanes.clear()
        self._built_from = state

    def _drop_lane(self, key: tuple[int, int, int]) -> None:
        del self.lanes[key]
        self.notes.append(f"generation: lane of {_lane_name(key)} dropped (at most {_MAX_LANES} lanes are kept; the "
                          "least recently used goes)")

    def _new_lane(self, batch: int, length: int, encoder_length: int) -> DecodeLane:
        started = time.perf_counter()
        lane = DecodeLane(self.model, self.calls, batch, length, self.cuda_graphs, encoder_length or None,
                          self.prefill_graphs)
        size = _lane_bytes(self.model, (batch, length, encoder_length), lane.dtype) / 2**20
        self.notes.append(f"generation: lane of {_lane_name((batch, length, encoder_length))} (KV cache "
                          f"{size:.1f} MiB, made in {time.perf_counter() - started:.1f} s)")
        return lane

    def summary(self) -> str:
        """One line: the lanes, their hits and the memory their caches hold."""
        if not self.lanes:
            return "generation: no request served yet"
        total = sum(_lane_bytes(self.model, key, lane.dtype) for key, lane in self.lanes.items()) / 2**20
        lanes = ", ".join(f"{_lane_name(key)} ({lane.hits} request{'s' * (lane.hits != 1)}{_prefill_buckets(lane)})"
                          for key, lane in self.lanes.items())
        return f"generation lanes: {lanes}; KV caches {total:.1f} MiB"


def _rounded(length: int) -> int:
    """``length`` rounded up to a multiple of _CACHE_STEP."""
    return -(-length // _CACHE_STEP) * _CACHE_STEP


def _lane_name(key: tuple[int, int, int]) -> str:
    batch, length, encoder_length = key
    encoder = f" (encoder {encoder_length} tokens)" if encoder_length else ""
    return f"{batch} sequences x {length} tokens{encoder}"


def _lane_bytes(model: nn.Module, key: tuple[int, int, int], dtype: torch.dtype) -> int:
    batch, length, encoder_length = key
    return cache_bytes(model, batch, length + encoder_length, dtype)


def _prefill_buckets(lane: DecodeLane) -> str:
    """``, prefills replayed at 16, 512 tokens`` for a lane whose prefill graphs were captured, else ``""``."""
    lengths = lane.prefill_graphs.captured_lengths() if lane.prefill_graphs is not None else []
    return f", prefills replayed at {', '.join(map(str, lengths))} tokens" if lengths else ""


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with copies of its first row appended up to ``rows`` rows (a bucket's filler rows)."""
    missing = rows - tensor.shape[0]
    if missing <= 0:
        return tensor
    return torch.cat([tensor, tensor[:1].expand(missing, *tensor.shape[1:])], dim=0)


def _backend_of(model: nn.Module) -> Any:
    """The optimized model's dynamo backend (its passes and compiler), or None: decode the model as it is."""
    state = getattr(model, "_kernel_pytorch", None)
    if state is None or not getattr(state, "active", False):
        return None
    return state.graph_optimizer
