"""``HostSteps``: what transformers' ``generate()`` does on the host after each token (a streamer's ``put``, the
user's stopping criteria), done step by step at the token loop's host checks, where the device loop runs without
a host sync per token."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["HostSteps", "stopping_criteria"]


def stopping_criteria(criteria: Any, max_time: float | None, stop_strings: Any = None, tokenizer: Any = None) -> list:
    """The user's criteria (a list or ``StoppingCriteriaList``), with transformers' own for ``max_time`` (its clock
    started now, as transformers starts it at the call) and for ``stop_strings`` (read with ``tokenizer``)."""
    from transformers.generation.stopping_criteria import MaxTimeCriteria, StopStringCriteria

    criteria = list(criteria or ())
    if max_time is not None:
        criteria.append(MaxTimeCriteria(max_time=max_time, initial_timestamp=time.time()))
    if stop_strings:
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    return criteria


class HostSteps:
    """Steps of a request reviewed in order, as transformers' ``_sample`` loop does after each token: the step's
    tokens (one per row) put to ``streamer``, then ``criteria`` asked about the sequence so far (``head`` and the
    tokens, ``scores`` None as transformers passes them without ``output_scores``). A row they stop ends there: its
    later tokens become ``pad`` where transformers pads them (an EOS among the criteria: the request's own or one
    of the user's), and the request ends at the step after which every row ended (by EOS or by the criteria)."""

    def __init__(self, loop: Any, rows: int, head: torch.Tensor, streamer: Any, criteria: list, eos: list[int],
                 pad: int):
        from transformers.generation.stopping_criteria import StoppingCriteriaList

        self.loop, self.rows, self.head, self.streamer, self.pad = loop, rows, head, streamer, pad
        self.criteria = StoppingCriteriaList(criteria) if criteria else None
        self.pads = bool(eos) or any(hasattr(criterion, "eos_token_id") for criterion in criteria)
        self.ended = torch.zeros(rows, dtype=torch.bool, device=head.device)
        self.reviewed = 0

    def review(self, stop: int) -> int | None:
        """Steps up to ``stop`` reviewed; returns the step count at which every row had ended, if one did."""
        generated = self.loop.generated
        if self.criteria is None:  # tokens only: one copy to the host for the steps since the last check
            for tokens in generated[:self.rows, self.reviewed:stop].cpu().unbind(1):
                self.streamer.put(tokens)
            self.reviewed = stop
            return None
        for step in range(self.reviewed, stop):
            self.reviewed = step + 1
            tokens = generated[:self.rows, step]
            if self.streamer is not None:
                self.streamer.put(tokens.cpu())
            if self._ends_every_row(tokens, step):
                return step + 1
        return None

    def _ends_every_row(self, tokens: torch.Tensor, step: int) -> bool:
        self.ended |= self.loop.is_eos[tokens]
        sequences = torch.cat([self.head, self.loop.generated[:self.rows, :step + 1]], dim=1)
        stopped = self.criteria(sequences, None) & ~self.ended
        if self.pads and bool(stopped.any()):  # the device loop pads these rows from its next step on
            stopped_rows = stopped.nonzero().squeeze(1)
            self.loop.generated[stopped_rows, step + 1:] = self.pad
            self.loop.unfinished[stopped_rows] = False
        self.ended |= stopped
        return bool(self.ended.all())
