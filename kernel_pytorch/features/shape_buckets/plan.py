"""``BucketPlan``: what the feature decided for one model (its ladder, pad values, the padding verdict), shared by
the wrapper on the model and on its copies (``OptimizationState.add_around``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from kernel_pytorch.config import OptimizeConfig, ShapeBucketsConfig
from kernel_pytorch.features.shape_buckets.ladder import Ladder, auto_batch_buckets, auto_length_buckets
from kernel_pytorch.features.shape_buckets.padding import IGNORED_LABEL, NamedCall
from kernel_pytorch.features.shape_buckets.safety import Verdict

__all__ = ["BucketPlan", "plan_for", "DEFAULT_MAX_LENGTH"]

# length='auto' without a max_length, for a model that declares no maximum of positions.
DEFAULT_MAX_LENGTH = 4096
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length")


@dataclass
class BucketPlan:
    """The ladder asked for, the pad value per argument name, why lengths are not bucketed at all (no attention
    mask: ``length_off``), and the verdict of the padding check once it ran (None: at the first call)."""

    config: OptimizeConfig
    ladder: Ladder
    fills: dict[str, float]
    training: bool
    length_off: str = ""
    verdict: Verdict | None = None
    template: NamedCall | None = None  # the call the check ran on (example inputs or the first call), for warm_up

    @property
    def settings(self) -> ShapeBucketsConfig:
        return self.config.shape_buckets

    def served_ladder(self) -> Ladder | None:
        """The ladder calls are served at, once the check allowed some padding; None before or when refused."""
        verdict = self.verdict
        if verdict is None or not (verdict.batch or verdict.length):
            return None
        return self.ladder if verdict.batch and verdict.length else \
            self.ladder.without(batch=not verdict.batch, length=not verdict.length)


def plan_for(model: nn.Module, config: OptimizeConfig, training: bool) -> BucketPlan:
    """The plan of ``model`` under ``config.shape_buckets`` (the check not run yet)."""
    settings = config.shape_buckets
    takes_mask = "attention_mask" in inspect.signature(model.forward).parameters
    length_off = "" if takes_mask or settings.length is None else (
        f"{type(model).__name__}.forward takes no attention_mask to mask the padding with")
    batch = auto_batch_buckets(settings.max_batch) if settings.batch == "auto" else settings.batch
    length = None if length_off else (
        auto_length_buckets(settings.max_length or _position_limit(model)) if settings.length == "auto"
        else settings.length)
    return BucketPlan(config, Ladder(batch, length, settings.beyond_largest == "new_bucket"), _fills(model),
                      training, length_off)


def _position_limit(model: nn.Module) -> int:
    """The model's maximum of positions (its transformers config), else DEFAULT_MAX_LENGTH."""
    model_config = getattr(model, "config", None)
    for name in _POSITION_LIMITS:
        value = getattr(model_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return DEFAULT_MAX_LENGTH


def _fills(model: nn.Module) -> dict[str, Any]:
    """Pad values by argument name: the pad token for input_ids (0 without one), -100 (ignored) for labels."""
    pad = getattr(getattr(model, "config", None), "pad_token_id", None)
    return {"input_ids": pad if isinstance(pad, int) else 0, "labels": IGNORED_LABEL}
