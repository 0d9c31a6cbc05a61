"""Prefills replayed from CUDA graphs, one per prompt-length bucket of a lane (``generation.prefill_graphs``).

The compiled prefill takes any prompt length (dynamic shapes), but Python issues each of its launches, and on a GPU
the time to first token is mostly that host work (docs/usage.md has the host profile's figures). Here a prompt is
padded up to its bucket, a power of two of at least ``MIN_BUCKET`` tokens, and the bucket's captured graph replays the
whole prefill: after each row's tokens for a prefill into an empty cache
(:meth:`~kernel_pytorch.features.generation.lane.DecodeLane.prefill_into_empty_cache`), on the left and masked for the
masked prefill (:func:`left_padded`). The decoder picks the bucket (:func:`padded_prompt_length`) and sizes the lane's
cache for the bucket plus the new tokens.

Not captured, with the reason kept: caches whose layers count written tokens in a host integer (transformers' static
sliding-window layers), which a replay would not advance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernel_pytorch.errors import first_line
from kernel_pytorch.cuda_graph_capture import capture_after_warm_up

__all__ = ["PrefillGraphs", "MIN_BUCKET", "prompt_bucket", "buckets_below", "padded_prompt_length", "left_padded",
           "host_counted_cache"]

MIN_BUCKET = 16  # shorter prompts share one graph: a few padded tokens cost less than a graph each
_WARMUP_RUNS = 2  # before capture: compiles and lets lazily made kernels and workspaces exist

PrefillBody = Callable[..., torch.Tensor]  # (input ids, positions, ...) -> last logits


def prompt_bucket(prompt_length: int) -> int:
    """The bucket a prompt is padded up to: the next power of two, at least ``MIN_BUCKET``."""
    return max(MIN_BUCKET, 1 << (prompt_length - 1).bit_length())


def buckets_below(length: int) -> list[int]:
    """Every bucket shorter than ``length`` tokens, in increasing order."""
    return [1 << power for power in range(MIN_BUCKET.bit_length() - 1, (length - 1).bit_length())]


def padded_prompt_length(prompt_length: int, room: int) -> int:
    """The prompt's bucket where it fits the ``room`` the cache leaves the prompt, else the prompt's own length."""
    bucket = prompt_bucket(prompt_length)
    return bucket if bucket <= room else prompt_length


def left_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor, length: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt left-padded (id 0, masked out) to ``length`` tokens."""
    missing = length - input_ids.shape[1]
    if missing <= 0:
        return input_ids, attention_mask
    return (torch.nn.functional.pad(input_ids, (missing, 0)), torch.nn.functional.pad(attention_mask, (missing, 0)))


def host_counted_cache(layers: list) -> str:
    """Why a cache's prefill cannot be replayed (a layer counting tokens in a host integer), or ``""``."""
    counted = sorted({type(layer).__name__ for layer in layers if hasattr(layer, "cumulative_length_int")})
    return f"{', '.join(counted)} count cached tokens on the host, which a replay would not advance" if counted else ""


class PrefillGraphs:
    """One lane's prefill graphs: ``run`` replays the graph of a prompt whose length is a bucket, captured at its first
    use, one per kind of prefill (masked over the static cache, or into an empty cache) and bucket. Other lengths, and
    every prompt without CUDA graphs (another device, or a capture that failed), run as they are; ``failure`` then
    says why."""

    def __init__(self, cuda_graphs: bool, refusal: str = ""):
        self.cuda_graphs = cuda_graphs and not refusal
        self.failure = refusal
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.inputs: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}

    def run(self, body: PrefillBody, inputs: tuple[torch.Tensor, ...], reset: Callable[[], None],
            kind: str = "masked") -> torch.Tensor:
        """The prompt's last logits: ``body(*inputs)`` (the first input: the token ids) replayed from the graph of
        its kind and bucket. ``reset`` puts the cache back as the prefill expects it (the capture's warm-up runs write
        it)."""
        length = inputs[0].shape[1]
        if not self.cuda_graphs or length != prompt_bucket(length):
            return body(*inputs)
        key = (kind, length)
        if key not in self.graphs:
            try:
                self._capture(body, key, inputs, reset)
            except RuntimeError as error:  # an op the capture refuses (a host sync): prefills run as they are
                self.cuda_graphs, self.failure = False, first_line(error)
                reset()
                return body(*inputs)
        for buffer, value in zip(self.inputs[key], inputs, strict=True):
            buffer.copy_(value)
        self.graphs[key].replay()
        return self.outputs[key]

    def captured_lengths(self) -> list[int]:
        """The bucket lengths captured so far (of either kind)."""
        return sorted({length for _, length in self.graphs})

    def _capture(self, body: PrefillBody, key: tuple[str, int], inputs: tuple[torch.Tensor, ...],
                 reset: Callable[[], None]) -> None:
        """Warm up and capture, each run from a reset cache (a run writes the bucket's slots and advances the
        cache's counters). The buckets share one memory pool, apart from the decode steps': a step replay could
        otherwise overwrite the prefill's logits in a block the prefill's capture took after the step's capture had
        freed it."""
        buffers = self.inputs.setdefault(key, tuple(t.clone() for t in inputs))
        graph, self.outputs[key] = capture_after_warm_up(lambda: body(*buffers), _WARMUP_RUNS, reset, self.graphs)
        self.graphs[key] = graph
