"""``OptimizeConfig``: every knob of :func:`kernel_pytorch.optimize`, validated by pydantic.

Unknown fields are errors (``extra="forbid"``), so a misspelt option never passes silently. A wrong value
raises :class:`~kernel_pytorch.errors.ConfigError` (a ``ValueError``) with one line per wrong option, naming it,
the value given and the values its annotation allows, in place of pydantic's one entry per Union member.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Literal, Optional, Union

import torch
from pydantic import (
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from kernel_pytorch.config_model import ConfigModel, allowed_values, not_allowed
from kernel_pytorch.device_names import DEVICE_ALIASES, DeviceName, Vendor  # re-exported: their old home
from kernel_pytorch.pass_names import check_pass_names

__all__ = ["OptimizeConfig", "Float8Config", "MemoryConfig", "GenerationConfig", "SparseAttentionConfig",
           "ShapeBucketsConfig", "Tolerance", "DEPRECATED_FLAT_OPTIONS", "DEFAULT_TOLERANCES", "Vendor",
           "DEVICE_ALIASES", "DeviceName", "CompileMode"]

CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
# The modes whose Inductor options replay CUDA graphs (torch._inductor.list_mode_options, which config does not
# import: Inductor is heavy at import time; tests/test_shape_bucket_graphs.py checks the two agree).
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")


class Tolerance(ConfigModel):
    """Largest accepted relative error ``||optimized - reference|| / ||reference||`` for one dtype."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    outputs: PositiveFloat
    gradients: PositiveFloat


# Relative-norm errors. float32: the fused kernels reorder reductions, which costs ~1e-7 relative;
# 1e-5 leaves room for long reductions while still catching any wrong rewrite (those land >1e-3).
# bf16/fp16: one rounding step is 2^-8 / 2^-11 relative per element; a chain of fused ops differs
# from the eager chain by a few of those.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(outputs=1e-10, gradients=1e-9),
    "float32": Tolerance(outputs=1e-5, gradients=1e-4),
    "float16": Tolerance(outputs=5e-3, gradients=1e-2),
    "bfloat16": Tolerance(outputs=2e-2, gradients=4e-2),
}


class SparseAttentionConfig(ConfigModel):
    """Content-aware (top-k) block-sparse attention for long-context inference: an **approximation**
    (:mod:`kernel_pytorch.attention.kernels.topk_sparse`). Per query block of ``block`` tokens, the key blocks with
    the largest pooled q·k scores are attended, plus the first ``sink_blocks`` and the ``local_blocks``
    blocks ending at the diagonal; from ``min_length`` query tokens on, dense below.

    Example::

        config = OptimizeConfig(sparse_attention=SparseAttentionConfig(keep_ratio=0.1, min_length=16384))
        OptimizeConfig(sparse_attention="topk")   # the defaults below
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["topk"] = Field("topk", description="How key blocks are chosen; 'topk' by pooled q·k scores.")
    # FlexAttention's tile (FLEX_BLOCK_SIZE): the unit at which its kernel skips work. Its GPU kernel needs
    # sparse blocks that are multiples of its own tiles (128 at hd128), so only multiples of 128.
    block: PositiveInt = Field(128, description="Tokens per block (a multiple of 128).")
    # 16 blocks = 2048 keys per query block: query-aware top-k methods (Quest, 2024) report budgets of a
    # few thousand keys as close to dense on long-context tasks (not measured here). A fixed budget keeps
    # the work O(L) per query block; at L = 32k causal, 16 + sink + diagonal is ~14% of the causal tiles.
    topk: Optional[PositiveInt] = Field(
        None, description="Key blocks chosen by score per query block, on top of the sink and local blocks "
        "(None: 16 unless keep_ratio is set).")
    keep_ratio: Optional[float] = Field(
        None, gt=0.0, le=1.0, description="Instead of topk: the fraction of the key blocks each query block may "
        "see (with causal masking: of its causal blocks) chosen by score, rounded up, on top of sink and local.")
    # The first tokens draw much of the attention mass in trained LLMs (attention sinks, StreamingLLM 2023),
    # and the nearest tokens carry local context: both are kept whatever their pooled score.
    local_blocks: NonNegativeInt = Field(1, description="Blocks ending at the diagonal always kept (1: the "
                                         "diagonal block).")
    sink_blocks: NonNegativeInt = Field(1, description="First key blocks always kept.")
    # Below this, sparse kernels lose: at L = 8192 causal about half the causal tiles are kept at topk=16, and
    # FlexAttention's dense rate is below cuDNN's (docs/attention.md); benchmarks/sparse_attention.py --parts topk.
    min_length: PositiveInt = Field(8192, description="Query length from which the sparse path runs (a runtime "
                                    "check per call: shorter calls run dense attention).")

    @field_validator("block")
    @classmethod
    def _flex_tile(cls, value: int) -> int:
        if value % 128:
            raise ValueError(f"block must be a multiple of 128 (FlexAttention's tile), got {value}")
        return value

    @model_validator(mode="after")
    def _one_budget(self) -> SparseAttentionConfig:
        if self.topk is not None and self.keep_ratio is not None:
            raise ValueError("set topk or keep_ratio, not both")
        return self

    @property
    def budget(self) -> tuple[Optional[int], Optional[float]]:
        """(topk, keep_ratio) as the kernel takes them: exactly one is None."""
        if self.keep_ratio is not None:
            return None, float(self.keep_ratio)
        return (16 if self.topk is None else self.topk), None

    def pattern(self) -> tuple:
        """The pattern ``attention(..., kernel="flex", pattern=...)`` takes (plain values, for graphs)."""
        topk, keep_ratio = self.budget
        return ("topk", topk, keep_ratio, self.local_blocks, self.sink_blocks, self.block)

    def describe(self) -> str:
        topk, keep_ratio = self.budget
        budget = f"top {topk} blocks" if topk is not None else f"keep ratio {keep_ratio:g} of the blocks"
        return (f"{budget} of {self.block} tokens per query block, + {self.sink_blocks} sink + {self.local_blocks} "
                f"local, from {self.min_length} tokens")


class Float8Config(ConfigModel):
    """FP8 linear layers: ``optimize(model, fp8=Float8Config(mode="auto", recipe="rowwise"))``, or a dict of these
    fields; ``fp8=True`` / ``"auto"`` / ``False`` are short for ``Float8Config(mode=...)``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Union[bool, Literal["auto"]] = Field(
        False, description="Run eligible linear layers as FP8 matmuls (the 'fp8' graph pass, after the q/k/v and "
        "gate/up fusion: kernel_pytorch.passes.fp8_linear): True converts every candidate; 'auto' times each "
        "linear's real (M, K, N) on this GPU and converts only where FP8 is faster. Off by default: FP8 changes "
        "results (~28 dB SQNR) beyond the bf16 tolerances, so the checks then use fp8.tolerance instead."
    )
    emulate: bool = Field(
        False, description="With mode=True: run FP8's quantization numerics in fp32 on any device (CPU included), "
        "for testing a model's FP8 accuracy; no speedup."
    )
    recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="Dynamic scaling: one scale per tensor, or one per row along each matmul's "
        "reduction dimension (more robust to outliers, slower)."
    )
    filter: Union[Callable[[Any, str], bool], None] = Field(
        None, description="filter(module, fqn) -> bool: which candidate linear layers may convert."
    )
    include_output_head: bool = Field(
        False, description="Also convert the output head (the last linear the forward calls)."
    )
    tolerance: Tolerance = Field(
        Tolerance(outputs=0.1, gradients=0.15),
        description="Relative errors accepted end to end when layers run in FP8 (0.1 is 20 dB, torchao's output "
        "floor; 0.15 ~ 16.5 dB for gradients, summed over layers)."
    )

    @model_validator(mode="after")
    def _emulation_converts_everything(self) -> Float8Config:
        if self.emulate and self.mode is not True:
            raise ValueError(f"fp8 emulate=True runs FP8 numerics without FP8 speed, so there is nothing for "
                             f"mode={self.mode!r} to measure or decide: use fp8={{'mode': True, 'emulate': True}}")
        return self


class MemoryConfig(ConfigModel):
    """The memory wrappers: ``optimize(model, memory=MemoryConfig(checkpointing="full", offload_optimizer=True))``,
    or a dict of these fields (``kernel_pytorch.memory.options`` applies them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpointing: Literal["off", "full", "selective"] = Field(
        "off", description="Activation checkpointing of the model's repeated blocks (kernel_pytorch.memory."
        "apply_checkpointing): 'full' recomputes whole blocks, 'selective' saves matmul/attention outputs."
    )
    budget_gb: PositiveFloat | None = Field(
        None, description="The GiB of saved activations to fit. With checkpointing: measured on the example "
        "inputs, just enough blocks are checkpointed (None: all of them). With offload_activations='auto': "
        "activations are offloaded if the model still saves more than this at its first training call."
    )
    offload_activations: bool | Literal["auto"] = Field(
        False, description="Saved activations of at least 1 MiB go to pinned host memory during the forward and "
        "come back for the backward (kernel_pytorch.memory.install_activation_offload, around the compiled "
        "model). True: always; 'auto': only if the saved activations measured at the first training call exceed "
        "budget_gb, or without a budget, the GPU memory the rest of the step needs. Without a CUDA GPU: "
        "a report line, nothing offloaded (there is no device memory to save)."
    )
    offload_optimizer: bool | Literal["auto"] = Field(
        False, description="Optimizer states in pinned host memory: kernel_pytorch.memory.make_optimizer(model, "
        "lr=...) returns an OffloadedOptimizer (True: every state on the host; 'auto': gpu_fraction='auto', the "
        "states that fit after the first step stay on the GPU) instead of torch.optim.AdamW. True needs a CUDA "
        "GPU (optimize raises HardwareUnavailableError without one); 'auto' falls back to AdamW with a report line."
    )

    @model_validator(mode="after")
    def _budget_has_a_user(self) -> MemoryConfig:
        if self.budget_gb is not None and self.checkpointing == "off" and self.offload_activations != "auto":
            raise ValueError("memory budget_gb applies to activation checkpointing and to offload_activations='auto'; "
                             "set checkpointing='full' or 'selective', or offload_activations='auto', too")
        return self


class GenerationConfig(ConfigModel):
    """Fast ``model.generate()`` for transformers causal LMs and encoder-decoders: ``optimize(model,
    generation=GenerationConfig(...))``, a dict of these fields, or True / False / 'auto' for ``enabled``
    (``kernel_pytorch.features.generation``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool | Literal["auto"] = Field(
        "auto", description="Replace the model's generate() by a static-KV-cache decode loop (CUDA graphs on NVIDIA "
        "GPUs) where the request allows, transformers' own loop with a report line where it does not. 'auto': on "
        "for transformers models that can generate (causal LMs, encoder-decoders); True also says why a model "
        "cannot."
    )
    max_length: PositiveInt | None = Field(
        None, description="The most tokens (prompt + new tokens) a request's KV cache may hold; None: the model's "
        "max_position_embeddings. Each request gets the smallest cache, in steps of 256 tokens, that holds it. "
        "A longer request raises an error naming this option."
    )
    batch_buckets: tuple[PositiveInt, ...] = Field(
        (1, 2, 4, 8, 16, 32), description="Batch sizes a decode step is captured for; a batch is padded up to "
        "the next one. A batch above the largest raises an error naming this option."
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto", description="Replay each decode step from a CUDA graph ('auto': on CUDA devices)."
    )
    compile_prefill: bool | Literal["auto"] = Field(
        "auto", description="Compile the prefill (and an encoder-decoder's encoder) with the model's compiler. False: "
        "their graphs get the same passes, verified, and run uncompiled: a shorter warm-up (only the decode steps "
        "are compiled). 'auto': uncompiled where the prefills replay CUDA graphs (prefill_graphs), where the "
        "compile saves no host work and costs most of the warm-up; compiled elsewhere, where the uncompiled graph's "
        "launches are host-bound. docs/usage.md has the figures."
    )
    compile_layers_once: bool | Literal["auto"] = Field(
        "auto", description="Compile the prefill's and the step's graphs one decoder layer at a time, each distinct "
        "layer once (the first and last layers and the embedding and head apart; the weights and caches are "
        "inputs), so that the warm-up's compile time does not grow with depth (the prefill's only where it is "
        "compiled: compile_prefill). Fusions across layer boundaries are left to the passes. 'auto': where the "
        "decode steps replay CUDA graphs, whose replays do not pay the partitions' extra calls on the host."
    )

    prefill_graphs: bool | Literal["auto"] = Field(
        "auto", description="Pad a causal LM's prompt to a power-of-two bucket of at least 16 tokens and replay its "
        "prefill from a CUDA graph captured per lane and bucket, so that the first token does not wait for the host "
        "to issue the prefill's launches. The padding goes after each row's tokens (the prefill into an empty cache "
        "attends causally, so it reaches no real token, and decoding overwrites its slots); a prompt left on the "
        "masked prefill (a mask that is not left padding) is padded on the left, and its cache holds the bucket. "
        "'auto': on where the decode steps replay CUDA graphs on a CUDA device (elsewhere the padding would only add "
        "work). Models whose cache counts tokens on the host (static sliding-window layers) keep uncaptured "
        "prefills, with a report line."
    )

    prefill_any_batch: bool = Field(
        False, description="Experimental: trace the prefill (and an encoder-decoder's encoder) without TorchDynamo's "
        "specialization of sizes of 1, so that one graph serves batch 1 and larger batches: one capture, rewrite and "
        "compile fewer in the warm-up. The decode steps keep a graph of their own at batch 1, where the decode "
        "passes pick kernels for one token row. On CUDA, PyTorch's SDPA still guards the batch to 1 when traced "
        "(docs/usage.md)."
    )

    symbolic_batch_gemv: bool = Field(
        False, description="Experimental: the decode step graph for batches above 1 (its batch a symbolic size) also "
        "gets the grouped GEMV kernel for its linears, timed against cuBLAS at 16, 8 and 2 rows (from the most down) "
        "and kept for calls of up to the first count it won at (cuBLAS above, through the op's own F.linear calls). "
        "Adds those timings and the kernel's several-row compiles to the warm-up (docs/usage.md has its "
        "measurements)."
    )

    @field_validator("batch_buckets")
    @classmethod
    def _ascending(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or list(value) != sorted(set(value)):
            raise ValueError(f"generation batch_buckets={value!r} must be distinct batch sizes in ascending order")
        return value


class ShapeBucketsConfig(ConfigModel):
    """Shape buckets: calls of varying batch size and sequence length served from a bounded set of captured graphs,
    each call padded up to its bucket (the padding masked) and its outputs sliced back
    (``kernel_pytorch.features.shape_buckets``): ``optimize(model, shape_buckets=ShapeBucketsConfig(batch=(1, 8)))``, a
    dict of these fields, ``"auto"`` (these defaults) or a list of sequence lengths (``length``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch: Union[Literal["auto"], tuple[PositiveInt, ...], None] = Field(
        "auto", description="Batch buckets: 'auto' (powers of two below max_batch, then max_batch), batch sizes in "
        "ascending order, or None (batch sizes are not padded)."
    )
    length: Union[Literal["auto"], tuple[PositiveInt, ...], None] = Field(
        "auto", description="Sequence-length buckets: 'auto' (multiples of 16 up to 128, then 192, 256, 384, 512, ...: "
        "powers of two and their halfway points, up to max_length), lengths in ascending order, or None (lengths are "
        "not padded). Padding the sequence needs a model whose forward takes an attention_mask."
    )
    max_batch: PositiveInt = Field(32, description="The largest batch bucket of batch='auto'.")
    max_length: Optional[PositiveInt] = Field(
        None, description="The largest length bucket of length='auto'; None: the model's max_position_embeddings "
        "(or n_positions), else 4096."
    )
    beyond_largest: Literal["error", "new_bucket"] = Field(
        "error", description="A call larger than the largest bucket: 'error' raises an error naming max_batch or "
        "max_length; 'new_bucket' makes its size a bucket of its own, with a report note."
    )
    warm_up: bool = Field(
        False, description="Capture every bucket ahead of time, with a progress bar: at optimize time with "
        "example_inputs (their values fill the buckets), else at the first call."
    )
    split_batch: bool = Field(
        False, description="Time every bucket's call at the warm-up (needs warm_up=True) and serve a batch between "
        "two batch buckets as the fastest calls by those times: padded up, or its rows split among smaller buckets "
        "and the outputs joined. For models whose every output has a batch dim (not a loss over the batch)."
    )
    cuda_graphs: bool = Field(
        False, description="Replay each bucket's inference calls on CUDA "
        "from a CUDA graph of its own, captured at the bucket's first call (or at the warm-up), all sharing one "
        "memory pool; outputs are fresh copies. Calls with autograd, off CUDA, or with unhashable non-tensor "
        "arguments run compiled as without it. Not with compile='reduce-overhead' or 'max-autotune', whose "
        "Inductor CUDA graphs it replaces."
    )

    @field_validator("batch", "length")
    @classmethod
    def _ascending(cls, value: object, info: Any) -> object:
        if isinstance(value, tuple) and (not value or list(value) != sorted(set(value))):
            raise ValueError(f"shape_buckets.{info.field_name}={list(value)!r} must be distinct sizes in ascending "
                             "order")
        return value

    @model_validator(mode="after")
    def _split_batch_is_measured(self) -> ShapeBucketsConfig:
        if self.split_batch and not (self.warm_up and self.batch is not None):
            raise ValueError("shape_buckets.split_batch chooses between padding and splitting by timing every bucket "
                             "at the warm-up: it needs warm_up=True and batch buckets")
        return self

    @model_validator(mode="after")
    def _limits_apply_to_auto(self) -> ShapeBucketsConfig:
        for limit, ladder in (("max_batch", "batch"), ("max_length", "length")):
            # Compared with the default, not model_fields_set: a config dumped and read back sets every field.
            if getattr(self, limit) != type(self).model_fields[limit].default and getattr(self, ladder) != "auto":
                raise ValueError(f"shape_buckets.{limit} sets the largest bucket of {ladder}='auto'; with "
                                 f"{ladder}={getattr(self, ladder)!r} the largest listed bucket is the limit")
        return self


# The options that became fields of a section: flat name -> (section, field). Accepted for one release, with a
# FutureWarning naming the new spelling (shown to users, unlike a DeprecationWarning raised inside pydantic).
DEPRECATED_FLAT_OPTIONS: dict[str, tuple[str, str]] = {
    "fp8_emulate": ("fp8", "emulate"), "fp8_recipe": ("fp8", "recipe"), "fp8_filter": ("fp8", "filter"),
    "fp8_include_output_head": ("fp8", "include_output_head"), "fp8_tolerance": ("fp8", "tolerance"),
    "checkpointing": ("memory", "checkpointing"), "memory_budget_gb": ("memory", "budget_gb"),
    "offload_activations": ("memory", "offload_activations"), "offload_optimizer": ("memory", "offload_optimizer"),
}


class OptimizeConfig(ConfigModel):
    """Options of :func:`kernel_pytorch.optimize`.

    Example::

        config = OptimizeConfig(compile="max-autotune", disable_passes=("normalize",))
        model = kernel_pytorch.optimize(model, config, example_inputs=(tokens,))
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: Union[Literal["auto"], Vendor] = Field(
        "auto", validate_default=True,  # so that the default, too, is a DeviceName
        description="Which hardware to target; 'auto' probes (KERNEL_PYTORCH_DEVICE overrides 'auto'); an alias "
        "('cuda', 'rocm', 'hip', 'xla', 'xpu') or any case names its vendor.",
    )
    mode: Literal["auto", "inference", "training"] = Field(
        "auto", description="'auto' follows model.training at optimize time."
    )
    compile: Union[bool, Literal["auto"], CompileMode] = Field(
        "auto",
        description="Hand the rewritten graphs to the hardware's compiler. 'auto': on where the backend's "
        "compiler is the fast default (GPUs), off on CPU (compile time rarely pays back there).",
    )
    dynamic: Union[bool, None] = Field(
        None, description="TorchDynamo's dynamic-shape setting (None: specialize first, generalize on change)."
    )
    verify: Union[bool, Literal["auto"]] = Field(
        "auto", description="Compare against the original and roll back what breaks tolerance; 'auto': on "
        "when example_inputs are given."
    )
    tolerances: dict[str, Tolerance] = Field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    disable_passes: tuple[str, ...] = Field((), description="Registered pass names not to run.")
    extra_passes: tuple[str, ...] = Field((), description="Registered pass names to run after the backend's own.")
    strict: bool = Field(
        False, description="Raise when a pass fails instead of skipping it with a report line (for development)."
    )
    fp8: Float8Config = Field(
        default_factory=Float8Config, description="FP8 linear layers (Float8Config, a dict of its fields, or "
        "True / 'auto' / False for its mode): off by default."
    )
    memory: MemoryConfig = Field(
        default_factory=MemoryConfig, description="Activation checkpointing, activation and optimizer-state "
        "offload (MemoryConfig, or a dict of its fields): off by default."
    )
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="Fast generate() for transformers causal LMs and "
        "encoder-decoders: static KV "
        "cache, decode steps replayed from CUDA graphs (GenerationConfig, a dict of its fields, or True / False / "
        "'auto' for its enabled field): 'auto' by default."
    )
    context_parallel: Any = Field(
        None, description="A torch.distributed ProcessGroup (or None: off) whose ranks share each sequence: every "
        "rank passes the full inputs; the model runs on its zigzag shard of the sequence (dim 1 of each tensor "
        "input) with causal attention as ring attention and RoPE tables at the global positions, and the "
        "outputs are gathered back (kernel_pytorch.distributed.context_parallel)."
    )

    training_logits: Literal["keep", "drop"] = Field(
        "keep", description="'drop': in training, a model that computes its loss from its LM head's logits "
        "(transformers' labels=) returns no logits (None), as Liger-Kernel's patched models do: the head and the "
        "loss run fused and the logits are never materialized (on a GPU unless the fused loss measured more than 50% "
        "slower than the unfused one). Changes the model's outputs, so off ('keep') by "
        "default; inference and calls without labels keep their logits."
    )

    sparse_attention: Optional[SparseAttentionConfig] = Field(
        None, description="Content-aware top-k block-sparse attention for long-context inference (an "
        "approximation; off by default): None, 'topk' (SparseAttentionConfig's defaults), a SparseAttentionConfig "
        "or a dict of its fields. Applied to eligible attention (causal or unmasked, no dropout, head dims "
        "FlexAttention takes) in inference only; calls shorter than min_length stay dense. Turns verify='auto' off "
        "(verification would roll the approximation back); the report gives its measured error instead."
    )
    shape_buckets: Optional[ShapeBucketsConfig] = Field(
        None, description="Serve calls of varying batch size and sequence length from a bounded set of captured "
        "graphs: each call is padded up to its bucket, the padding masked, and its outputs sliced back; padding the "
        "model cannot be shown to ignore is refused with a report line. None or False: off; 'auto': "
        "ShapeBucketsConfig's defaults; a list of sequence lengths; a ShapeBucketsConfig or a dict of its fields."
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_options_into_sections(cls, data: Any) -> Any:
        """The flat spellings of section fields (``fp8_recipe=``, ``checkpointing=``...) for one more release."""
        if not isinstance(data, dict) or not DEPRECATED_FLAT_OPTIONS.keys() & data.keys():
            return data
        data = dict(data)
        for flat in [name for name in data if name in DEPRECATED_FLAT_OPTIONS]:
            section, field = DEPRECATED_FLAT_OPTIONS[flat]
            warnings.warn(f"OptimizeConfig option {flat!r} is deprecated and goes in the next release: write "
                          f"{section}={{{field!r}: ...}}", FutureWarning, stacklevel=4)
            fields = _section_fields(section, data.get(section))
            if fields is None:  # the section itself is wrong: left for its own error
                data.pop(flat)
                continue
            data[section] = {**fields, field: data.pop(flat)}
        return data

    @field_validator("fp8", mode="before")
    @classmethod
    def _fp8_mode_shorthand(cls, value: object) -> object:
        if _is_fp8_mode(value):
            return {"mode": value}
        if isinstance(value, str):
            raise ValueError(not_allowed("fp8", value, (True, False, "auto")) + ", or a Float8Config (or a dict of "
                             "its fields)")
        return value

    @field_validator("generation", mode="before")
    @classmethod
    def _generation_shorthand(cls, value: object) -> object:
        if value is True or value is False or value == "auto":
            return {"enabled": value}
        return value

    @model_validator(mode="before")
    @classmethod
    def _sparse_attention_unverified(cls, data: Any) -> Any:
        """Verification compares with the exact model and rolls back what differs beyond the tolerance: it
        would undo the approximation of sparse_attention (and every other rewrite of the same graphs) at each
        graph captured at or above min_length. So verify='auto' is off with sparse_attention, and verify=True
        is refused; the attention pass reports the approximation's measured error instead."""
        if not isinstance(data, dict) or data.get("sparse_attention") is None:
            return data
        if data.get("verify", "auto") is True:
            raise ValueError("sparse_attention is an approximation, which verify=True would roll back (it compares "
                             "with the exact model); use verify='auto' (off with sparse_attention) or False")
        return {**data, "verify": False}

    @field_validator("shape_buckets", mode="before")
    @classmethod
    def _shape_buckets_shorthand(cls, value: object) -> object:
        if value is None or value is False:
            return None
        if isinstance(value, str) and value == "auto":
            return {}
        if isinstance(value, (list, tuple)):
            return {"length": tuple(value)}
        if isinstance(value, (ShapeBucketsConfig, dict)):
            return value
        raise ValueError(f"shape_buckets takes None or False (off), 'auto', a list of sequence lengths, a "
                         f"ShapeBucketsConfig or a dict of its fields, got {value!r}")

    @model_validator(mode="after")
    def _shape_buckets_combine(self) -> OptimizeConfig:
        """Shape buckets run compiled entries of their own around the whole sequence."""
        if self.shape_buckets is None:
            return self
        conflict = ("context_parallel: a rank's shard would be padded in the middle of the sequence"
                    if self.context_parallel is not None else
                    "memory.offload_activations: bucketed calls run compiled entries of their own, outside its wrapper"
                    if self.memory.offload_activations is not False else
                    f"compile={self.compile!r} when shape_buckets.cuda_graphs is on: Inductor's CUDA graphs and the "
                    "buckets' own would capture the same calls (choose one)"
                    if self.shape_buckets.cuda_graphs and self.compile in CUDA_GRAPH_COMPILE_MODES else "")
        if conflict:
            raise ValueError(f"shape_buckets does not combine with {conflict}")
        return self

    @field_validator("sparse_attention", mode="before")
    @classmethod
    def _sparse_attention_spelling(cls, value: object) -> object:
        if value is None or isinstance(value, (SparseAttentionConfig, dict)):
            return value
        if value == "topk":
            return SparseAttentionConfig()
        raise ValueError(f"sparse_attention takes None, 'topk', a SparseAttentionConfig or a dict of its fields, "
                         f"got {value!r}")

    @field_validator("device", mode="wrap")
    @classmethod
    def _device_alias(cls, value: object, to_vendor: ValidatorFunctionWrapHandler) -> DeviceName:
        """The vendor for an alias or any case ('CUDA' -> 'nvidia'), keeping the spelling given for messages."""
        name = value.strip().lower() if isinstance(value, str) else value
        try:
            vendor = to_vendor(DEVICE_ALIASES.get(name, name) if isinstance(name, str) else name)
        except ValidationError:
            allowed = allowed_values(cls.model_fields["device"].annotation) + tuple(DEVICE_ALIASES)
            raise ValueError(not_allowed("device", value, allowed)) from None
        return DeviceName(vendor, value.written if isinstance(value, DeviceName) else str(value))

    @field_validator("context_parallel")
    @classmethod
    def _is_process_group(cls, value: object) -> object:
        # Any rather than ProcessGroup in the annotation: pydantic takes no arbitrary classes without
        # arbitrary_types_allowed, and torch.distributed may be unavailable in this build of torch.
        import torch.distributed as dist

        if value is not None and not (dist.is_available() and isinstance(value, dist.ProcessGroup)):
            raise ValueError(f"context_parallel takes a torch.distributed ProcessGroup or None, got "
                             f"{type(value).__name__}")
        return value

    @field_validator("tolerances", mode="before")
    @classmethod
    def _merge_tolerances(cls, value: object) -> object:
        if not isinstance(value, dict):
            return value
        unknown = [name for name in value if not isinstance(getattr(torch, str(name), None), torch.dtype)]
        if unknown:
            raise ValueError(f"tolerances: {unknown} are not torch dtype names (e.g. 'float32', 'bfloat16')")
        return {**DEFAULT_TOLERANCES, **value}

    @field_validator("disable_passes", "extra_passes")
    @classmethod
    def _known_passes(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return check_pass_names(names)

    def __getattr__(self, name: str) -> Any:
        """Reads of the flat spellings (``config.fp8_recipe``), for one more release."""
        if name in DEPRECATED_FLAT_OPTIONS:
            section, field = DEPRECATED_FLAT_OPTIONS[name]
            warnings.warn(f"OptimizeConfig.{name} is deprecated and goes in the next release: read "
                          f"config.{section}.{field}", FutureWarning, stacklevel=2)
            return getattr(getattr(self, section), field)
        return super().__getattr__(name)

    def tolerance_for(self, dtype: torch.dtype) -> Tolerance | None:
        """The tolerance for ``dtype``; ``None`` (exact match required) for dtypes without an entry."""
        return self.tolerances.get(str(dtype).removeprefix("torch."))


def _section_fields(section: str, value: object) -> dict[str, Any] | None:
    """A section's value as given (None, a dict, a section object, or fp8's mode shorthand) as a dict of fields;
    None for anything else (the section's validation then says what is wrong)."""
    if value is None:
        return {}
    if isinstance(value, ConfigModel):
        return {name: getattr(value, name) for name in type(value).model_fields}
    if section == "fp8" and _is_fp8_mode(value):
        return {"mode": value}
    return dict(value) if isinstance(value, dict) else None


def _is_fp8_mode(value: object) -> bool:
    """``fp8=True`` / ``False`` / ``"auto"``: short for ``Float8Config(mode=value)``."""
    return isinstance(value, bool) or value == "auto"
