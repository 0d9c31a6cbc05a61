"""Shape buckets as a feature: ``optimize(model, shape_buckets="auto" | [lengths] | ShapeBucketsConfig(...))``."""

from __future__ import annotations

import functools

import torch.nn as nn

from kernel_pytorch.config import OptimizeConfig
from kernel_pytorch.features.base import Feature, OptimizeRun, register_feature
from kernel_pytorch.features.shape_buckets.padding import Parameters, name_call
from kernel_pytorch.features.shape_buckets.plan import BucketPlan, plan_for
from kernel_pytorch.features.shape_buckets.wrapper import NOTE_PREFIX, bucket_call, install_wrapper, run_check
from kernel_pytorch.verify.model import meta_device_reason
from kernel_pytorch.verify.numerics import call_arguments

__all__ = ["ShapeBucketsFeature"]


@register_feature
class ShapeBucketsFeature(Feature):
    name = "shape_buckets"
    plan: BucketPlan

    @classmethod
    def enabled(cls, config: OptimizeConfig) -> bool:
        return config.shape_buckets is not None

    def prepare(self, model: nn.Module, run: OptimizeRun) -> None:
        """The ladder, and the padding check on the example inputs, eagerly, before capture (without example inputs
        the wrapper checks at the first call)."""
        self.plan = plan_for(model, run.config, run.training)
        if run.example_inputs is not None and not meta_device_reason(model, run.example_inputs):
            self.plan.template = name_call(Parameters.of(model.forward), *call_arguments(run.example_inputs))
            self.plan.verdict = run_check(model, self.plan, self.plan.template)

    def install(self, model: nn.Module, run: OptimizeRun) -> None:
        model._kernel_pytorch.add_around(functools.partial(install_wrapper, plan=self.plan))
        if self.plan.settings.warm_up and self.plan.template is not None:
            bucket_call(model).capture_buckets(self.plan.template)

    def after_check(self, model: nn.Module, run: OptimizeRun) -> None:
        if not model._kernel_pytorch.active:
            run.report.notes.append(f"{NOTE_PREFIX}: removed with the rolled-back optimizations")
