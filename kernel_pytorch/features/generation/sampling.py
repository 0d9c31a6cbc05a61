"""Sampling the next token as transformers' ``generate(do_sample=True)`` does (temperature, then top-k, then top-p,
then a draw from the softmax), with the settings in device tensors so that one captured step serves any of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SamplingSettings", "warped_scores", "draw"]


@dataclass(frozen=True)
class SamplingSettings:
    """transformers' sampling settings as resolved for a request (its defaults: temperature 1, top-k 50, top-p 1)."""

    temperature: float = 1.0
    top_k: int = 50  # 0: off
    top_p: float = 1.0  # 1.0: off


def warped_scores(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """``logits`` (rows x vocab) after transformers' Temperature, TopK and TopP warpers (``min_tokens_to_keep=1``):
    the tokens they remove at -inf. ``top_k`` 0 and ``top_p`` 1 leave a warper out, as transformers does."""
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    ascending = scores.sort(dim=-1).values
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth_largest = ascending.gather(-1, (vocab - k).expand(scores.shape[0], 1))
    scores = scores.masked_fill(scores < kth_largest, float("-inf"))
    ascending, order = scores.sort(dim=-1)
    remove = ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
    remove[..., -1:] = False  # the most likely token always stays
    remove &= (top_p < 1.0)  # top_p 1 removes nothing (a float sum may stay just below 1 - 0)
    return scores.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def draw(scores: torch.Tensor) -> torch.Tensor:
    """One token per row from ``softmax(scores)``: the arg-max of probabilities over exponential noise, the
    same distribution as ``torch.multinomial`` and, unlike it, free of host syncs inside a CUDA graph."""
    probabilities = scores.softmax(dim=-1)
    return (probabilities / torch.empty_like(probabilities).exponential_()).argmax(dim=-1)
