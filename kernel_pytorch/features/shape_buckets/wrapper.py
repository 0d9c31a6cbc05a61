"""``ShapeBucketCall``: the wrapper in ``model._compiled_call_impl`` that pads each call up to its bucket, runs the
bucket's compiled entry and slices the outputs back (``padding`` has the rules).

Every bucket runs one compiled entry (a ``CompiledCall``) with dynamic sizes: its few graphs (batch 1 and larger
batches, each grad mode) take any bucket's sizes, so a ladder of dozens of buckets compiles a few graphs, and with
``compile="reduce-overhead"`` Inductor records one CUDA graph per bucket shape, the padding bounding how many.
With ``dynamic=False`` each batch bucket gets static-shape entries of its own instead, each capturing the graphs
of at most half as many length buckets as TorchDynamo recaptures a function (``graphs_per_entry``: its recompile
limit, 32 per entry on torch >= 2.13, 8 before): one graph per bucket, each specialized to its sizes and compiled
at its first call. Calls the buckets do not serve (the check refused padding; a KV cache passed in; argument sizes
unlike the first call's) go to the compiled call found inside, as without the feature.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from kernel_pytorch.compiled_call import CompiledCall, call_in_chain, entry_recompile_limit
from kernel_pytorch.errors import KernelPytorchError
from kernel_pytorch.features.shape_buckets.batch_split import Chunk, fastest_splits, join_outputs, rows_of, splittable
from kernel_pytorch.features.shape_buckets.ladder import Ladder, bucket_for
from kernel_pytorch.features.shape_buckets.padding import (CallShape, NamedCall, Parameters, argument_dims,
                                                           call_shape, lead_tensor, name_call, pad_call, repeated_to,
                                                           slice_outputs, with_attention_mask)
from kernel_pytorch.features.shape_buckets.graphs import BucketGraphs, replayable
from kernel_pytorch.features.shape_buckets.plan import BucketPlan
from kernel_pytorch.features.shape_buckets.safety import Verdict, check_padding
from kernel_pytorch.report import OptimizationReport, ShapeBucketRecord
from kernel_pytorch.timing import median_ms

__all__ = ["ShapeBucketCall", "ShapeBucketError", "bucket_call", "install_wrapper", "run_check", "set_note",
           "static_buckets", "graphs_per_entry", "NOTE_PREFIX"]

NOTE_PREFIX = "shape buckets"
# Arguments whose presence makes a call positional state rather than a fresh sequence: padding would be cached.
_STATEFUL_ARGUMENTS = ("past_key_values", "past_key_value", "cache_params")
_TIMED_CALLS = 3  # per bucket, for split_batch: each after the bucket's first (capturing) call, the median kept


class ShapeBucketError(KernelPytorchError, ValueError):
    """A call is larger than the largest shape bucket; the message names the option that raises it."""


def install_wrapper(model: nn.Module, report: OptimizationReport, *, plan: BucketPlan) -> None:
    """Put a :class:`ShapeBucketCall` around the model's compiled call (at optimize, and on each copy)."""
    model._compiled_call_impl = ShapeBucketCall(model, model._compiled_call_impl, plan, report)
    report.shape_buckets = []  # a copy's report starts from its own calls
    if plan.verdict is not None:
        set_note(report, plan)


class ShapeBucketCall:
    """Pad, run the bucket's compiled entry, slice (module docstring)."""

    def __init__(self, model: nn.Module, inner: Any, plan: BucketPlan, report: OptimizationReport):
        self.model, self.inner, self.plan, self.report = model, inner, plan, report
        self.parameters = Parameters.of(model.forward)
        self.entries: dict[tuple[int, int], CompiledCall] = {}
        self.records: dict[CallShape, ShapeBucketRecord] = {}
        self.graphs = BucketGraphs(model, report) if plan.settings.cuda_graphs else None
        self.bucket_seconds: dict[CallShape, float] = {}  # split_batch: each bucket's call, timed at warm-up
        self.splits: dict[CallShape, tuple[Chunk, ...]] = {}  # split_batch: (batch, length bucket) -> its calls

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = name_call(self.parameters, args, kwargs)
        if self.plan.verdict is None:
            try:
                self._check(call)
            except Exception:  # inputs the model itself rejects: its own error, from the call as without buckets
                return self.inner(*args, **kwargs)
        ladder = self.plan.served_ladder()
        if ladder is None or _continues_a_sequence(call):
            return self.inner(*args, **kwargs)
        shape = call_shape(call, ladder.length is not None)
        if shape is None:
            return self.inner(*args, **kwargs)
        call = with_attention_mask(call, shape, lead_tensor(call).device) if ladder.length else call
        dims = argument_dims(call, shape, self.plan.verdict.arguments)
        if dims is None:
            self.report.note(f"{NOTE_PREFIX}: a call whose argument sizes do not follow its lead argument's batch and "
                            "length as the first call's did ran unbucketed")
            return self.inner(*args, **kwargs)
        bucket = self._bucket(shape, ladder)
        chunks = self._chunks(shape, bucket)
        outs, start = [], 0
        for rows, batch in chunks:  # one padded call, unless split_batch measured a faster split
            part = call if len(chunks) == 1 else rows_of(call, dims, start, start + rows)
            part_shape, part_bucket = CallShape(rows, shape.length), CallShape(batch, bucket.length)
            padded_args, padded_kwargs = pad_call(part, part_shape, part_bucket, dims, self.plan.fills)
            out = self._run(part_bucket, ladder, padded_args, padded_kwargs)
            self._count(part_shape, part_bucket)
            outs.append(slice_outputs(out, part_shape, part_bucket, self.plan.verdict.outputs))
            start += rows
        return join_outputs(outs, self.plan.verdict.outputs)

    # -- the first call ------------------------------------------------------------------------------------------

    def _check(self, call: NamedCall) -> None:
        """The padding check on the first call's inputs (no example inputs were given to optimize)."""
        self.plan.verdict = run_check(self.model, self.plan, call)
        self.plan.template = call
        set_note(self.report, self.plan)
        if self.plan.settings.warm_up:
            self.capture_buckets(call)

    def capture_buckets(self, template: NamedCall) -> int:
        """Capture every bucket of the served ladder now, with a progress bar, on ``template``'s values repeated to
        each bucket's size; the number of buckets. These calls are not counted in the report's table."""
        from rich.progress import Progress  # the report's own dependency; only warm-ups draw a bar

        if self.plan.verdict is None:
            self._check(template)
        ladder = self.plan.served_ladder()
        shape = None if ladder is None else call_shape(template, ladder.length is not None)
        if shape is None:
            return 0
        template = with_attention_mask(template, shape, lead_tensor(template).device) if ladder.length else template
        dims = argument_dims(template, shape, self.plan.verdict.arguments) or {}
        buckets = [CallShape(b, n) for b in ladder.batch or (shape.batch,) for n in ladder.length or (shape.length,)]
        timed = self.plan.settings.split_batch and not self._split_refusal()
        seconds: dict[CallShape, float] = {}
        with Progress(transient=True) as progress, _grad_mode(self.plan.training):
            task = progress.add_task(f"capturing {len(buckets)} shape buckets", total=len(buckets))
            for bucket in buckets:
                args, kwargs = repeated_to(template, shape, bucket, dims).arguments()
                self._run(bucket, ladder, args, kwargs)
                if timed:
                    seconds[bucket] = median_ms(lambda: self._run(bucket, ladder, args, kwargs),
                                                lead_tensor(template).device, warmup=0, runs=_TIMED_CALLS) / 1e3
                progress.advance(task)
        if timed:
            self.set_bucket_seconds(seconds)
            self.report.set_note(f"{NOTE_PREFIX}: split_batch", f"{NOTE_PREFIX}: split_batch: every bucket's call "
                                 "timed at warm-up; a batch between batch buckets runs as the calls those times say "
                                 "are fastest, padded or split among smaller buckets (each counted in the table)")
        return len(buckets)

    # -- split_batch ---------------------------------------------------------------------------------------------

    def _split_refusal(self) -> str:
        """Why split_batch cannot apply to this model ('' when it can); a refusal is noted once."""
        ladder = self.plan.served_ladder()
        reason = ("the batch is not bucketed" if ladder is None or ladder.batch is None else
                  splittable(self.plan.verdict.outputs))
        if reason:
            self.report.note(f"{NOTE_PREFIX}: split_batch not used: {reason}; batches are padded")
        return reason

    def set_bucket_seconds(self, seconds: dict[CallShape, float]) -> None:
        """Each bucket's seconds per call, and from them the calls that serve each batch size fastest at each
        length bucket, planned here once rather than per call."""
        self.bucket_seconds = dict(seconds)
        batches = tuple(sorted({bucket.batch for bucket in seconds}))
        self.splits = {CallShape(batch, length): chunks for length in {bucket.length for bucket in seconds}
                       for batch, chunks in fastest_splits(batches, {b: seconds[CallShape(b, length)]
                                                                     for b in batches}).items()}

    def _chunks(self, shape: CallShape, bucket: CallShape) -> tuple[Chunk, ...]:
        """(rows, batch bucket) per call serving ``shape``: the fastest by the warm-up's times, else one padded (a
        size above the ladder, or no times)."""
        return self.splits.get(CallShape(shape.batch, bucket.length)) or ((shape.batch, bucket.batch),)

    # -- buckets -------------------------------------------------------------------------------------------------

    def _run(self, bucket: CallShape, ladder: Ladder, args: tuple, kwargs: dict) -> Any:
        """The bucket's compiled entry on a padded call: replayed from the bucket's CUDA graph where the option is on
        and the call allows (:func:`~kernel_pytorch.features.shape_buckets.graphs.replayable`)."""
        entry = self._entry(bucket, ladder)
        key = replayable(args, kwargs) if self.graphs is not None else None
        return entry(*args, **kwargs) if key is None else self.graphs.run(key, entry, args, kwargs)

    def _bucket(self, shape: CallShape, ladder: Ladder) -> CallShape:
        batch = shape.batch if ladder.batch is None else self._size(shape.batch, ladder.batch, "batch")
        length = shape.length if ladder.length is None else self._size(shape.length, ladder.length, "length")
        return CallShape(batch, length)

    def _size(self, size: int, buckets: tuple[int, ...], dim: str) -> int:
        bucket = bucket_for(size, buckets)
        if bucket is not None:
            return bucket
        auto = getattr(self.plan.settings, dim) == "auto"
        if not self.plan.ladder.grow:
            fix = f"raise shape_buckets.max_{dim}" if auto else f"add a larger bucket to shape_buckets.{dim}"
            raise ShapeBucketError(f"a {dim} of {size} is larger than the largest {dim} bucket ({buckets[-1]}): {fix}, "
                                   "or set shape_buckets.beyond_largest='new_bucket'")
        self.report.note(f"{NOTE_PREFIX}: a {dim} of {size}, above the largest bucket ({buckets[-1]}), was served as a "
                        "bucket of its own (beyond_largest='new_bucket')")
        return size

    def _entry(self, bucket: CallShape, ladder: Ladder) -> CompiledCall:
        """The compiled entry of ``bucket``, made at its first call: the one with dynamic sizes, or (``dynamic=False``)
        its batch size's static entry for its group of length buckets (a length above the ladder gets one of its own)."""
        if static_buckets(self.plan):
            group = -1 if bucket.length not in (ladder.length or ()) else \
                ladder.length.index(bucket.length) // graphs_per_entry()
            key = (bucket.batch, group)
        else:
            key = (0, 0)
        entry = self.entries.get(key)
        if entry is None:
            compiled = self._compiled_call()
            entry = self.entries[key] = CompiledCall(self.model, compiled.backend, not static_buckets(self.plan),
                                                     self.report)
        return entry

    def _compiled_call(self) -> CompiledCall:
        call = call_in_chain(self.inner, CompiledCall)
        if call is None:
            raise KernelPytorchError("shape_buckets found no compiled call inside its wrapper")
        return call

    def _count(self, shape: CallShape, bucket: CallShape) -> None:
        record = self.records.get(bucket)
        if record is None:
            record = self.records[bucket] = ShapeBucketRecord(batch=bucket.batch, length=bucket.length)
            self.report.shape_buckets.append(record)
        record.calls += 1
        record.real_elements += shape.batch * (shape.length or 1)
        record.padded_elements += bucket.batch * (bucket.length or 1)


def bucket_call(model: nn.Module) -> ShapeBucketCall:
    """The :class:`ShapeBucketCall` in ``model``'s chain of calls."""
    call = call_in_chain(getattr(model, "_compiled_call_impl", None), ShapeBucketCall)
    if call is None:
        raise ValueError(f"{type(model).__name__} was not optimized with shape_buckets (optimize(model, "
                         "shape_buckets='auto'))")
    return call


def _continues_a_sequence(call: NamedCall) -> bool:
    """Whether the call passes a KV cache (or a recurrent state): its positions continue cached ones."""
    named = {**dict(call.positional), **call.keywords}
    return any(named.get(name) is not None for name in _STATEFUL_ARGUMENTS)


def static_buckets(plan: BucketPlan) -> bool:
    """Whether each bucket gets a static-shape graph of its own (``dynamic=False``) rather than sharing one entry
    with dynamic sizes."""
    return plan.config.dynamic is False


@functools.cache
def graphs_per_entry() -> int:
    """Buckets per compiled entry: half the recaptures TorchDynamo allows it (its recompile limit), the other half
    left for each bucket's graph in the other grad mode."""
    return max(1, entry_recompile_limit() // 2)


def _grad_mode(training: bool) -> Any:
    return torch.enable_grad() if training else torch.no_grad()


def run_check(model: nn.Module, plan: BucketPlan, call: NamedCall) -> Verdict:
    """The padding verdict for calls like ``call`` (with an attention mask of ones added where it has none)."""
    ladder = plan.ladder
    shape = call_shape(call, ladder.length is not None)
    if shape is not None and ladder.length is not None and lead_tensor(call).dim() >= 2:
        call = with_attention_mask(call, shape, lead_tensor(call).device)
    return check_padding(model, call, ladder.batch is not None, ladder.length is not None,
                         ladder.length[-1] if ladder.length else None, plan.fills, plan.config, plan.training)


def set_note(report: OptimizationReport, plan: BucketPlan) -> None:
    """The report's shape-buckets note: the ladder served and the check's measurement, and why a dim is not padded."""
    verdict, served = plan.verdict, plan.served_ladder()
    lengths = (plan.length_off,) if plan.length_off else verdict.length_refused
    by_dim = ((("batch sizes and lengths", lengths),) if lengths == verdict.batch_refused else
              (("lengths", lengths), ("batch sizes", verdict.batch_refused)))
    refused = [f"{dims} not bucketed: {'; '.join(reasons)}" for dims, reasons in by_dim if reasons]
    if served is None:
        text = f"{NOTE_PREFIX} refused, calls run unbucketed: {'. '.join(refused)}"
    else:
        entries = (f"static-shape entries of at most {graphs_per_entry()} buckets of one batch size (dynamic=False)"
                   if static_buckets(plan) else "one compiled entry with dynamic sizes for every bucket")
        text = (f"{NOTE_PREFIX}: {served.describe()}, {entries}; {verdict.measured}; calls and padding waste in the "
                "shape buckets table"
                + "".join(f". {line}" for line in refused))
    report.set_note(NOTE_PREFIX, text)
