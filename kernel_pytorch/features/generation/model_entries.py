"""``ModelCalls``: how the generation lanes call the model (the prefill, the prefill into an empty cache, the decode
step, an encoder-decoder's encoder), each a compiled entry of its own through an optimized model's backend."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.fx.experimental import _config as shape_config

from kernel_pytorch.compiled_call import RecompileLimitWatch, call_module, compiled_entry
from kernel_pytorch.features.generation.empty_cache_prefill import EmptyCachePrefill, empty_cache_refusal
from kernel_pytorch.features.generation.model_calls import is_encoder_decoder

if TYPE_CHECKING:  # capture imports the features, this module among them
    from kernel_pytorch.capture import GraphOptimizer

__all__ = ["ModelCalls"]


@dataclass(frozen=True)
class ModelCalls:
    """How lanes run the model: ``call(model, **kwargs)`` for the prefill and for a step. Shared by every lane of a
    decoder (dynamic shapes: batch 1 and larger batches are the only variants, whatever the lanes)."""

    prefill: Callable[..., Any]
    step: Callable[..., Any]
    encode: Callable[..., Any]  # an encoder-decoder's encoder: ``encode(encoder, **kwargs)``
    # a prompt into an empty cache (:class:`EmptyCachePrefill`, its keyword arguments), or None: why not
    empty_cache_prefill: Callable[..., Any] | None = None
    empty_cache_refusal: str = ""

    @classmethod
    def of(cls, model: nn.Module, backend: GraphOptimizer | None, compile_prefill: bool = True,
           compile_layers_once: bool = False, prefill_any_batch: bool = False,
           note: Callable[[str], None] = lambda _: None, prefills_replayed: bool = False,
           steps_replayed: bool = False) -> ModelCalls:
        """Captured through ``backend`` (an optimized model's own: its passes and verification), each call with a
        dynamo cache of its own; without a backend the model runs as it is, still from a static cache. Without
        ``compile_prefill`` the prefill and the encoder run their rewritten graphs uncompiled; with
        ``compile_layers_once`` Inductor compiles each distinct layer once (:mod:`kernel_pytorch.block_compile`);
        with ``prefill_any_batch`` one prefill (and encoder) graph serves batch 1 too
        (:func:`_traced_with_constants`). ``prefills_replayed`` / ``steps_replayed``: those calls replay CUDA graphs,
        so Inductor compiles them with our Triton ops opaque (:class:`~kernel_pytorch.capture.CompilerChoice`). A call
        reaching TorchDynamo's recompile limit goes to ``note`` and warns
        (:class:`~kernel_pytorch.compiled_call.RecompileLimitWatch`)."""
        refusal = empty_cache_refusal(model)
        empty_cache = None if refusal else EmptyCachePrefill(model)
        if backend is None:
            return cls(call_module, call_module, call_module,
                       functools.partial(call_module, empty_cache) if empty_cache else None, refusal)

        def compiled_by(compiled: bool, replayed: bool) -> GraphOptimizer:
            compiler = getattr(backend, "compiler", None)  # a plain dynamo backend (tests) has no options
            if compiler is None or (compiled and compiler.name != "inductor"):
                return backend
            if not compiled:
                return backend.with_compiler(replace(compiler, name="eager"))
            return backend.with_compiler(replace(compiler, per_block=compile_layers_once, opaque_triton_ops=replayed))

        once_per_request = compiled_by(compile_prefill, prefills_replayed)
        per_step = compiled_by(True, steps_replayed)
        encoder = model.get_encoder() if is_encoder_decoder(model) else None

        def entry(module: nn.Module | None, module_backend: GraphOptimizer, any_batch: bool,
                  what: str) -> Callable[..., Any]:
            if module is None:
                return call_module
            watch = RecompileLimitWatch(f"the generation {what} of {type(model).__name__}", note)
            return _traced_with_constants(compiled_entry(module, module_backend, dynamic=True), watch, any_batch)

        empty = entry(empty_cache, once_per_request, prefill_any_batch, "prefill into an empty cache") \
            if empty_cache else None
        return cls(entry(model, once_per_request, prefill_any_batch, "prefill"),
                   entry(model, per_step, False, "decode step"),
                   entry(encoder, once_per_request, prefill_any_batch, "encoder"),
                   functools.partial(empty, empty_cache) if empty else None, refusal)


def _traced_with_constants(compiled: Callable[..., Any], watch: RecompileLimitWatch,
                           any_batch: bool = False) -> Callable[..., Any]:
    """``compiled`` traced with the model's float attributes (attention scale, RoPE scaling) as constants: with
    dynamic shapes Dynamo otherwise makes each a graph input read by ``.item()``, and a scale that is not a
    constant keeps the attention passes from rewriting (and Inductor from folding) it. A changed attribute
    then recompiles, as any guarded constant does. ``any_batch``: sizes of 1 not specialized either
    (``backed_size_oblivious``): Dynamo otherwise compiles a call at batch 1 for batch 1 alone (its 0/1
    specialization), and the prefill got two graphs, each traced, rewritten and compiled; the decode steps keep
    theirs, where at batch 1 the decode passes pick kernels for one token row. The lanes mark their tensors' sizes
    against TorchDynamo's duck sizing (``DecodeLane._mark_sizes``). ``watch`` reports the recompile limit."""
    shape_patches = {"backed_size_oblivious": True} if any_batch else {}

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(specialize_float=True), shape_config.patch(**shape_patches), \
                watch.watching():
            return compiled(*args, **kwargs)

    return call
