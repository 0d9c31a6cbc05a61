"""``warm_up(model)``: capture every shape bucket of an optimized model ahead of time, with a progress bar."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from kernel_pytorch.features.shape_buckets.padding import Parameters, name_call
from kernel_pytorch.features.shape_buckets.wrapper import bucket_call
from kernel_pytorch.verify.numerics import call_arguments

__all__ = ["warm_up"]


def warm_up(model: nn.Module, example_inputs: Any = None) -> int:
    """Capture (and compile) every shape bucket of ``model``, optimized with ``shape_buckets``, now rather than at
    the calls that first hit each; returns the number of buckets. The buckets are filled with ``example_inputs``
    (as ``optimize`` takes them), or the first call's inputs, repeated to each bucket's size. The buckets are
    captured in the grad mode of the mode optimized for (inference: under ``torch.no_grad()``), which TorchDynamo
    tells apart: call the model in that mode too.

    Example::

        model = kernel_pytorch.optimize(model, shape_buckets="auto", compile="reduce-overhead")
        warm_up(model, {"input_ids": ids, "attention_mask": mask})
    """
    call = bucket_call(model)
    if example_inputs is None:
        template = call.plan.template
        if template is None:
            raise ValueError("warm_up(model) needs example_inputs, or a call of the model before it, to fill the "
                             "buckets with")
    else:
        template = name_call(Parameters.of(model.forward), *call_arguments(example_inputs))
    return call.capture_buckets(template)
