"""``DecodeLane``: the static state of decoding ``batch`` sequences in a cache of ``length`` tokens: the KV cache, the
step's input buffers, a compiled prefill and a compiled decode step, and on CUDA the step captured as a CUDA graph.

The buffers never move, so one captured step serves every token: the graph reads the token, position and mask
buffers, writes the cache at the cache's own counter (a tensor transformers' StaticCache advances in place) and
leaves the logits in a fixed output. The greedy and sampling graphs also pick the next token and write it back into
the token buffer, so a token loop is one replay per token with no host work between.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from kernel_pytorch.errors import first_line
from kernel_pytorch.cuda_graph_capture import capture_after_warm_up
from kernel_pytorch.features.generation.empty_cache_prefill import rolled_prompt, static_layers_refusal
from kernel_pytorch.features.generation.model_entries import ModelCalls
from kernel_pytorch.features.generation.sampling import SamplingSettings, draw, warped_scores
from kernel_pytorch.features.generation.model_calls import cache_keyword, new_static_cache, takes_logits_to_keep
from kernel_pytorch.features.generation.prefill_graphs import PrefillGraphs, host_counted_cache

__all__ = ["DecodeLane", "TokenLoop"]

_WARMUP_STEPS = 2  # before capture: compiles the step and lets lazily made kernels and workspaces exist


class TokenLoop:
    """Device tensors of a token loop in progress (greedy or sampling), updated inside the captured step: no host
    sync per token. ``sampling`` (a Python flag) picks which of the two captured steps runs."""

    def __init__(self, batch: int, max_new: int, device: torch.device):
        self.generated = torch.zeros(batch, max_new, dtype=torch.long, device=device)
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)
        self.alive = torch.zeros(max_new, dtype=torch.long, device=device)  # unfinished rows after each step
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.min_new = torch.zeros(1, dtype=torch.long, device=device)
        self.is_eos: torch.Tensor | None = None  # (vocab,) bool, made at the first request (the logits' width)
        self.pad = torch.zeros(1, dtype=torch.long, device=device)
        self.sampling = False
        self.temperature = torch.ones(1, device=device)
        self.top_k = torch.zeros(1, dtype=torch.long, device=device)
        self.top_p = torch.ones(1, device=device)

    def start(self, prefill_logits: torch.Tensor, min_new: int, eos: list[int], pad: int,
              sampling: SamplingSettings | None = None) -> torch.Tensor:
        """Reset for a new request and return its first tokens, chosen from the prefill's logits. The buffers are
        filled in place: the captured step reads these very tensors."""
        self.generated.zero_()
        self.unfinished.fill_(True)
        self.alive.zero_()
        self.step.zero_()
        self.min_new.fill_(min_new)
        vocab = prefill_logits.shape[-1]
        if self.is_eos is None:  # made once, before any step is captured: the graphs read this tensor
            self.is_eos = torch.zeros(vocab, dtype=torch.bool, device=prefill_logits.device)
        self.is_eos.zero_()
        self.is_eos[[token for token in eos if 0 <= token < vocab]] = True
        self.pad.fill_(pad)
        self.sampling = sampling is not None
        if sampling is not None:
            self.temperature.fill_(sampling.temperature)
            self.top_k.fill_(sampling.top_k)
            self.top_p.fill_(sampling.top_p)
        return self.record(self.choose(prefill_logits))

    def steps_taken(self, limit: int) -> int:
        """Tokens the request produced: up to the step after which no row was unfinished, at most ``limit``."""
        finished = (self.alive[:limit] == 0).nonzero()
        return int(finished[0]) + 1 if len(finished) else limit

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token, greedy or sampled; EOS forbidden before ``min_new`` tokens (as transformers'
        MinNewTokensLogitsProcessor, which runs before the sampling warpers)."""
        logits = logits.masked_fill((self.step < self.min_new) & self.is_eos, float("-inf"))
        if not self.sampling:
            return logits.argmax(-1)
        return draw(warped_scores(logits, self.temperature, self.top_k, self.top_p))

    def record(self, tokens: torch.Tensor) -> torch.Tensor:
        """Store this step's tokens (pad once a row finished, as transformers does) and return them."""
        tokens = torch.where(self.unfinished, tokens, self.pad)
        self.generated.index_copy_(1, self.step, tokens.unsqueeze(1))
        self.unfinished &= ~self.is_eos[tokens]
        self.alive.index_copy_(0, self.step, self.unfinished.sum().reshape(1))
        self.step += 1
        return tokens


class DecodeLane:
    """Decoding for one (batch, cache length) pair; see the module docstring."""

    def __init__(self, model: nn.Module, calls: ModelCalls, batch: int, length: int, cuda_graphs: bool,
                 encoder_length: int | None = None, prefill_graphs: bool = False):
        parameter = next(model.parameters())
        self.model, self.batch, self.length, self.encoder_length = model, batch, length, encoder_length
        self.device, self.dtype = parameter.device, parameter.dtype
        self.cache = new_static_cache(model, batch, length, self.device, self.dtype, encoder_length)
        if encoder_length:  # an encoder-decoder: the encoder's output and mask, padded to encoder_length
            width = model.config.get_text_config(decoder=True).hidden_size
            self.encoder_states = torch.zeros(batch, encoder_length, width, dtype=self.dtype, device=self.device)
            self.encoder_mask = torch.zeros(batch, encoder_length, dtype=torch.long, device=self.device)
        self.cache_keyword = cache_keyword(model)
        self.last_logits_only = takes_logits_to_keep(model)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.mask = torch.zeros(batch, length, dtype=torch.long, device=self.device)
        self.write_index = torch.zeros(1, dtype=torch.long, device=self.device)
        self.next_slot = 0  # write_index as the host knows it: checking the cache is not full needs no sync
        self.prefilled_slots = 0  # tokens the last prefill ran over: the prompt and its padding
        self.prefill_call, self.step_call, self.encode_call = calls.prefill, calls.step, calls.encode
        self.empty_cache_prefill = calls.empty_cache_prefill
        self.empty_cache_refusal = calls.empty_cache_refusal or static_layers_refusal(self._cache_layers())
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.loop = TokenLoop(batch, length, self.device)
        self.hits = 0
        self.graph_failure = ""  # why capturing a step failed (its steps then run without CUDA graphs)
        # prefills of bucket lengths replayed from CUDA graphs (the decoder pads prompts to the buckets)
        self.prefill_graphs = PrefillGraphs(self.cuda_graphs, host_counted_cache(self._cache_layers())) \
            if prefill_graphs else None
        self._mark_sizes()

    def _mark_sizes(self) -> None:
        """TorchDynamo's duck sizing gives sizes of equal value at a trace one symbol, so a model constant equal to
        a size that varies pinned that size: a head dim equal to the first prompt bucket, or KV heads equal to the
        first batch above 1 (2 for some models), and the next bucket or batch compiled again. So the caches' heads
        and head dims (and an encoder's width) are static, and the encoder's length gets a symbol of its own
        (``_forward`` marks the prompt's). The batch and cache length stay duck-sized: one symbol each for every
        cache tensor (a symbol per tensor made each compile about twice as slow on the CPU)."""
        _mark_static(self._cache_tensors(), dims=(1, 3))
        if self.encoder_length:
            _mark_static([self.encoder_states], dims=(2,))
            _own_symbol([self.encoder_states, self.encoder_mask], dim=1)
            _own_symbol(_keys_and_values(self.cache.cross_attention_cache.layers), dim=2)

    # -- prefill ---------------------------------------------------------------------------------------------

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """An encoder-decoder's encoder, once per request (compiled like the decoder): its output and mask go into
        the lane's buffers, zero padded (masked) up to ``encoder_length``."""
        length = input_ids.shape[1]
        encoder = self.model.get_encoder()
        _own_symbol([input_ids, attention_mask], dim=1)  # the prompt's length (see _mark_sizes)
        states = self.encode_call(encoder, input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        self.encoder_states.zero_()
        self.encoder_states[:, :length] = states
        self.encoder_mask.zero_()
        self.encoder_mask[:, :length] = attention_mask

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Start a request: reset the cache, run the prompt (``batch`` x P, left padding in ``attention_mask``) and
        return the last position's logits (``batch`` x vocab; a buffer the next prefill reuses when replayed from a
        CUDA graph); the next step is position P."""
        if input_ids.shape[1] == 1:  # one masked pad token on the left: length 1 would be a graph of its own
            input_ids = torch.cat([torch.zeros_like(input_ids), input_ids], dim=1)
            attention_mask = torch.cat([torch.zeros_like(attention_mask), attention_mask], dim=1)
        prompt_length = input_ids.shape[1]
        self._start_request(prompt_length, attention_mask, prompt_length)
        self.cache.reset()
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        logits = self._prefill_logits(input_ids, positions)
        self._end_prefill(positions[:, -1:] + 1, prompt_length, prompt_length)
        return logits

    def _start_request(self, width: int, attention_mask: torch.Tensor, slots: int) -> None:
        """A request of ``width`` prompt columns whose prefill runs over ``slots`` cache slots: the mask holds the
        prompt's columns, nothing after them."""
        if slots >= self.length:
            raise ValueError(f"a prompt of {slots} tokens does not fit the KV cache of {self.length} tokens")
        self.hits += 1
        self.mask.zero_()
        self.mask[:, :width] = attention_mask

    def _end_prefill(self, next_positions: torch.Tensor, width: int, slots: int) -> None:
        """The first step's position per row, and its slot: right after the prompt's ``width`` columns."""
        self.positions.copy_(next_positions)
        self.write_index.fill_(width)
        self.next_slot, self.prefilled_slots = width, slots

    def _prefill_logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.prefill_graphs is None:
            return self._prefill_forward(input_ids, positions)
        return self.prefill_graphs.run(self._prefill_forward, (input_ids, positions), self.cache.reset)

    def _prefill_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._forward(self.prefill_call, input_ids, positions, prefill=True).logits[:, -1]

    @property
    def takes_empty_cache_prefills(self) -> bool:
        """Whether :meth:`prefill_into_empty_cache` serves this lane (else :attr:`empty_cache_refusal` says why)."""
        return not self.empty_cache_refusal

    def prefill_into_empty_cache(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, slots: int
                                 ) -> torch.Tensor:
        """:meth:`prefill` for rows padded on the left only (:func:`is_left_padded`), with causal attention into an
        empty cache (:mod:`~kernel_pytorch.features.generation.empty_cache_prefill`): the rows rolled to start with
        their tokens and padded on the right to ``slots`` tokens (the prompt's bucket, or its width). The cache then
        holds the prompt's width P as :meth:`prefill` leaves it, and the next step is slot P. The cache is not reset:
        every slot after the prompt stays masked until a step writes it."""
        width = input_ids.shape[1]
        slots = max(slots, width, 2)  # one column of padding at least: a width of 1 would be a graph of its own
        self._start_request(width, attention_mask, slots)
        right = (0, slots - width)
        inputs = (torch.nn.functional.pad(input_ids, right), torch.nn.functional.pad(attention_mask, right),
                  torch.full((1,), width, dtype=torch.long, device=input_ids.device))
        if self.prefill_graphs is None:
            logits = self._empty_cache_prefill_forward(*inputs)
        else:
            logits = self.prefill_graphs.run(self._empty_cache_prefill_forward, inputs, lambda: None, "empty cache")
        self._end_prefill(attention_mask.sum(-1, keepdim=True), width, slots)
        return logits

    def _empty_cache_prefill_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                     written: torch.Tensor) -> torch.Tensor:
        """What a prefill into an empty cache does, captured as is: roll, run the model (its layers write the static
        cache), set the cache's counters."""
        rolled = rolled_prompt(input_ids, attention_mask, written)
        _own_symbol([rolled.input_ids, rolled.positions], dim=1)  # the prompt's length (see _mark_sizes)
        logits = self.empty_cache_prefill(input_ids=rolled.input_ids, position_ids=rolled.positions,
                                          last_position=rolled.last, slot_of=rolled.slot_of,
                                          static_layers=self._cache_layers())
        for counter in self._cache_counters():  # the next token goes after the prompt
            counter.copy_(written.reshape(()))
        return logits

    # -- decode steps ----------------------------------------------------------------------------------------

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One decode step for ``tokens`` (``batch``): the next position's logits (a buffer, overwritten next step)."""
        self.tokens.copy_(tokens.reshape(self.batch, 1))
        self.next_slot += 1
        return self._run("logits")

    def loop_steps(self, count: int) -> None:
        """``count`` steps of the token loop; each feeds its token to the next (``self.loop`` holds the tokens)."""
        kind = "sample" if self.loop.sampling else "greedy"
        self.next_slot += count
        for _ in range(count):
            self._run(kind)

    def _run(self, kind: str) -> torch.Tensor:
        if not self.cuda_graphs:
            return self._step_body(kind)
        if kind not in self.graphs:
            try:
                self._capture(kind)
            except RuntimeError as error:  # an op the capture refuses (a host sync): run the step as it is
                self.cuda_graphs, self.graph_failure = False, first_line(error)
                return self._step_body(kind)
        self.graphs[kind].replay()
        return self.outputs[kind]

    def _step_body(self, kind: str) -> torch.Tensor:
        """What one step does, captured as is: mark the new column as seen, run the model, advance the counters;
        the greedy and sample kinds also choose, record and feed back the token."""
        self.mask.index_fill_(1, self.write_index, 1)
        logits = self._forward(self.step_call, self.tokens, self.positions, prefill=False).logits[:, -1]
        self.positions += 1
        self.write_index += 1
        if kind != "logits":
            self.tokens.copy_(self.loop.record(self.loop.choose(logits)).unsqueeze(1))
        return logits

    def _forward(self, call: Callable[..., Any], input_ids: torch.Tensor, positions: torch.Tensor,
                 prefill: bool) -> Any:
        if prefill:
            _own_symbol([input_ids, positions], dim=1)  # the prompt's length (see _mark_sizes)
        if self.encoder_length:  # positions are relative in T5-style models: none are passed
            kwargs = {"decoder_input_ids": input_ids, "decoder_attention_mask": self.mask,
                      "attention_mask": self.encoder_mask, "encoder_outputs": (self.encoder_states,),
                      self.cache_keyword: self.cache, "use_cache": True}
            return call(self.model, **kwargs)
        kwargs = {"input_ids": input_ids, "attention_mask": self.mask, "position_ids": positions,
                  self.cache_keyword: self.cache, "use_cache": True}
        if prefill and self.last_logits_only:
            kwargs["logits_to_keep"] = 1
        return call(self.model, **kwargs)

    def _capture(self, kind: str) -> None:
        """Warm the step up on a side stream, capture it, then put every buffer it advanced back (also when the
        capture fails)."""
        saved = self._saved_state()
        try:
            self._warm_up_and_capture(kind, saved)
        finally:
            self._restore_state(saved)  # capture records without running: buffers and cache counters as they were

    def _warm_up_and_capture(self, kind: str, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        graph, self.outputs[kind] = capture_after_warm_up(lambda: self._step_body(kind), _WARMUP_STEPS,
                                                          lambda: self._restore_state(saved), self.graphs)
        self.graphs[kind] = graph

    def _saved_state(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = self.loop
        tensors = [self.tokens, self.positions, self.mask, self.write_index, *self._cache_counters(),
                   g.generated, g.unfinished, g.alive, g.step]
        return [(t, t.clone()) for t in tensors]

    @staticmethod
    def _restore_state(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for tensor, value in saved:
            tensor.copy_(value)

    def _cache_counters(self) -> list[torch.Tensor]:
        """The cache layers' write counters (tensors transformers' static layers advance in place)."""
        counters = (getattr(layer, "cumulative_length", None) for layer in self._cache_layers())
        return [c for c in counters if isinstance(c, torch.Tensor)]

    def _cache_tensors(self) -> list[torch.Tensor]:
        return _keys_and_values(self._cache_layers())

    def _cache_layers(self) -> list:
        """The cache's layers, of both caches of an encoder-decoder."""
        caches = [getattr(self.cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
        return [layer for cache in caches if cache is not None for layer in cache.layers] or \
            list(getattr(self.cache, "layers", ()))


def _keys_and_values(layers: list) -> list[torch.Tensor]:
    """The cache layers' key and value tensors: (batch, heads, length, head dim)."""
    return [tensor for layer in layers for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None))
            if isinstance(tensor, torch.Tensor)]


def _mark_static(tensors: list[torch.Tensor], dims: tuple[int, ...]) -> None:
    for tensor in tensors:
        for dim in dims:
            torch._dynamo.mark_static(tensor, dim)


def _own_symbol(tensors: list[torch.Tensor], dim: int) -> None:
    """``dim`` of each tensor a symbol that no other size of equal value shares (a marked dim is not duck-sized)."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
