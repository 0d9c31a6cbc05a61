"""``FastGenerate``: what ``model.generate`` is after ``optimize``: greedy and sampling requests through the
static-cache :class:`~kernel_pytorch.features.generation.decoder.Decoder`, every other request (and every request
while a forward or backward hook is registered) through transformers' own ``generate`` with a report line naming
why."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from kernel_pytorch.config import GenerationConfig
from kernel_pytorch.cuda_graph_capture import registered_hook
from kernel_pytorch.features.generation.decoder import Decoder
from kernel_pytorch.features.generation.requests import loop_request

__all__ = ["FastGenerate"]

_LANES_LINE = "generation lanes"  # how Decoder.summary() starts


class FastGenerate:
    """``model.generate`` replaced on the instance (the class's generate stays transformers'); see the module
    docstring. Copies of the model get one of their own, with a decoder of their own."""

    def __init__(self, model: nn.Module, config: GenerationConfig):
        self.model, self.config = model, config
        self.decoder: Decoder | None = None  # made at the first fast request: it allocates caches and compiles

    def __call__(self, inputs: Any = None, generation_config: Any = None, **kwargs: Any) -> Any:
        hook = registered_hook(self.model)
        if hook:
            self._note(f"generation: generate() while {hook} is registered runs transformers' own loop through the "
                       "optimized model, which runs the hook (the static-cache loop's steps would skip it)")
            return self._transformers_generate(inputs, generation_config, **kwargs)
        request = loop_request(self.model, inputs, generation_config, kwargs)
        if isinstance(request, str):
            self._note(f"generation: generate() with {request} runs transformers' own loop (the static-cache loop "
                       "serves greedy and sampling requests)")
            return self._transformers_generate(inputs, generation_config, **kwargs)
        decoder = self._decoder()
        notes = len(decoder.notes)
        tokens = decoder.generate(request.input_ids, request.attention_mask, request.max_new_tokens,
                                  request.min_new_tokens, request.eos, request.pad, request.sampling, request.streamer,
                                  request.criteria)
        for note in decoder.notes[notes:]:
            self._note(note)
        self._set_lanes_line(decoder.summary())
        return tokens

    def warm_up(self, batch_sizes: tuple[int, ...] = (1, 2), cache_lengths: tuple[int, ...] = (256,),
                progress: bool = True) -> float:
        """Compile and capture the loop before the first request (``Decoder.warm_up``); returns seconds."""
        decoder = self._decoder()
        lanes = len(decoder.notes)
        seconds = decoder.warm_up(batch_sizes, cache_lengths, progress)
        for note in decoder.notes[lanes:]:
            self._note(note)
        return seconds

    def _transformers_generate(self, inputs: Any, generation_config: Any, **kwargs: Any) -> Any:
        return type(self.model).generate(self.model, inputs, generation_config=generation_config, **kwargs)

    def _decoder(self) -> Decoder:
        if self.decoder is None:
            config = self.config
            self.decoder = Decoder(self.model, config.max_length, config.batch_buckets, config.cuda_graphs,
                                   compile_prefill=config.compile_prefill,
                                   compile_layers_once=config.compile_layers_once,
                                   prefill_graphs=config.prefill_graphs, prefill_any_batch=config.prefill_any_batch)
            if not self.decoder.compile_prefill:
                why = ": their CUDA graphs leave a compile no host work to save" if self.decoder.prefill_graphs else ""
                self._note("generation: prefills run their rewritten graphs uncompiled (generation.compile_prefill="
                           f"{self.config.compile_prefill!r}{why}); decode steps are compiled")
        return self.decoder

    def _note(self, text: str) -> None:
        state = getattr(self.model, "_kernel_pytorch", None)
        if state is not None:
            state.report.note(text)

    def _set_lanes_line(self, line: str) -> None:
        """The report's one line on the lanes (their requests and cache memory), replaced at each request."""
        state = getattr(self.model, "_kernel_pytorch", None)
        if state is not None:
            state.report.set_note(_LANES_LINE, line)

    def __reduce__(self) -> tuple:
        # A copy of the model (deepcopy, pickle) gets a FastGenerate of its own: no caches, no CUDA graphs.
        return FastGenerate, (self.model, self.config)
