"""Numerical comparison of an optimized computation against its reference.

Used twice: per captured graph (each pass's rewrite against the graph as dynamo captured it) and end to
end (the optimized model against the original, on the example inputs). Errors are relative norms,
``||actual - expected|| / ||expected||``, judged against the per-dtype tolerance of the config; in
training, gradients of a fixed random projection of the outputs are compared too.

Low precision (bfloat16, float16): the original model is itself far from exact, so a rewrite that is
*more* accurate (fp32 accumulation, one rounding instead of several) can differ from it by as much as
the tolerance. When a low-precision comparison fails, :class:`NoiseAwareCheck` brings in a float32
run of the original as referee and accepts a leaf whose error against it is within ``NOISE_FACTOR``
times the low-precision original's own error against it (or within the tolerance).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch.utils import _pytree as pytree

from kernel_pytorch.config import OptimizeConfig

__all__ = ["Comparison", "Run", "relative_error", "compare", "compare_against_float32", "compared_counts",
           "NoiseAwareCheck", "NOISE_FACTOR", "computed_in", "NOTHING_COMPARED", "LOW_PRECISION", "is_low_precision",
           "to_float32", "run_reference", "flatten_tensors", "call_arguments", "unless_out_of_memory"]

# Below this RMS the reference counts as zero: errors are then measured against it, as absolute
# errors, so that noise on an all-zero gradient (e.g. 1e-12 after reordering) does not fail.
_RMS_FLOOR = 1e-6
# ... and below this fraction of the largest RMS among the same kind of values (outputs, or gradients).
# A gradient that is zero in exact arithmetic (BERT's key bias: softmax is shift-invariant) comes out
# as rounding noise ~1e-7 of the other gradients' scale on both sides; measured against itself it
# looked like a 1e-3 relative error. A wrong rewrite changes some value by O(its scale), far above.
_RELATIVE_FLOOR = 1e-2
# A rewrite judged against a float32 run of the original may be off by this many times the low-precision
# original's own error against that run. Above 1: two computations in the same low precision that
# round at different places have errors of the same size but not the same value (an fp32-accumulated
# kernel can still round its output once more than eager does); 1.5 leaves room for that while a
# wrong rewrite (an O(1) change of some value) stays orders of magnitude above.
NOISE_FACTOR = 1.5
LOW_PRECISION = (torch.bfloat16, torch.float16)
T = TypeVar("T")
# ``Comparison.worst`` when no leaf had a nonzero error: nothing was compared, or every error was 0. Not an
# output's name: text for users says which (``Comparison.describe``, the report's verification line).
NOTHING_COMPARED = "nothing compared"
# Plain values that ``compare`` checks for equality; other non-tensor leaves are not compared.
_PLAIN_VALUES = (int, float, bool, str, type(None))


def call_arguments(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of ``example_inputs`` as ``optimize`` takes them: a dict is keyword arguments, a
    tuple or list positional arguments, anything else (a tensor) the one positional argument; None, none."""
    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


@dataclass(frozen=True)
class Comparison:
    ok: bool
    worst: str  # which output or gradient came closest to (or went over) its tolerance
    error: float
    tolerance: float  # the limit applied: the dtype's tolerance, or the noise-aware limit
    # Set when judged against a float32 run of the original (``compare_against_float32``): the
    # low-precision original's own error against it on ``worst``, its dtype, and the failed plain check.
    noise: float | None = None
    dtype: str = ""
    plain: Comparison | None = None

    @property
    def rule(self) -> str:
        return "tolerance" if self.plain is None and self.noise is None else "float32 referee"

    def describe(self) -> str:
        verdict = "within" if self.ok else "exceeds"
        if self.noise is None:
            text = ("no output or gradient differs (every error 0, or nothing to compare)"
                    if self.worst == NOTHING_COMPARED else
                    f"{self.worst}: relative error {self.error:.2e} {verdict} tolerance {self.tolerance:.0e}")
            return text + (f" (against float32; against the original, {self.plain.describe()})" if self.plain else "")
        text = (f"{self.worst}: relative error against float32 {self.error:.2e} {verdict} {self.tolerance:.2e}, "
                f"the larger of the tolerance and {NOISE_FACTOR:g}x the {self.dtype} original's own error "
                f"against float32 ({self.noise:.2e})")
        return text + (f"; against the {self.dtype} original, {self.plain.describe()}" if self.plain else "")


@dataclass
class Run:
    """Flattened outputs (path -> value) and gradients (name -> tensor or None) of one run."""

    outputs: dict[str, Any]
    gradients: dict[str, torch.Tensor | None] | None
    where: str = ""  # a float32 referee run not made where the checked runs were: where, and why


def relative_error(actual: torch.Tensor, expected: torch.Tensor, rms_floor: float = _RMS_FLOOR) -> float:
    """``||actual - expected|| / max(||expected||, rms_floor * sqrt(n))`` in float64; inf on shape or
    NaN/inf mismatch. Computed slice by slice (:func:`_finite_slices`): a model's logits at vocab 128256 and
    16384 tokens are 2.1e9 values."""
    if actual.shape != expected.shape:
        return math.inf
    if not expected.is_floating_point() and not expected.is_complex():
        return 0.0 if torch.equal(actual.to(expected.dtype), expected) else math.inf
    difference = reference = 0.0
    count = 0
    for a, e, finite in _finite_slices(actual.detach(), expected.detach()):
        hidden = ~finite  # NaN and inf must sit in the same places with the same values
        same_places = torch.equal(finite, torch.isfinite(a))
        if not same_places or not torch.equal(a[hidden].nan_to_num(), e[hidden].nan_to_num()):
            return math.inf
        a, e = torch.where(finite, a, 0.0), torch.where(finite, e, 0.0)
        difference += float(torch.linalg.vector_norm(a - e) ** 2)
        reference += float(torch.linalg.vector_norm(e) ** 2)
        count += int(finite.sum())
    if count == 0:
        return 0.0
    floor = max(rms_floor, _RMS_FLOOR) * math.sqrt(count)
    return math.sqrt(difference) / max(math.sqrt(reference), floor)


# Values per slice of the error sums: 2**24 float64 values are 128 MB beside the compared tensors.
_SLICE = 1 << 24


def _finite_slices(*tensors: torch.Tensor):
    """Aligned flat float64 slices of ``tensors`` (same shape), with where the last one is finite; no mask
    indexing (its index tensor would hold 3 int64 per value of a 3-D tensor: 47 GiB for such logits)."""
    flat = [t.reshape(-1) for t in tensors]
    for start in range(0, flat[0].numel(), _SLICE):  # on the last tensor's device (a referee run on the CPU)
        parts = [t[start:start + _SLICE].to(device=flat[-1].device, dtype=torch.float64) for t in flat]
        yield (*parts, torch.isfinite(parts[-1]))


def flatten_tensors(tree: Any) -> dict[str, Any]:
    """Leaves of a (possibly nested) output, keyed by their path; dataclass outputs are opened too."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    flat: dict[str, Any] = {}
    for path, leaf in leaves:
        key = pytree.keystr(path) or "output"
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for name, value in flatten_tensors(dataclasses.asdict(leaf)).items():
                flat[f"{key}{name}"] = value
        else:
            flat[key] = leaf
    return flat


def compare(actual: Run, expected: Run, config: OptimizeConfig) -> Comparison:
    """The worst output or gradient, by error over its dtype's tolerance."""
    worst = Comparison(True, NOTHING_COMPARED, 0.0, 1.0)
    pairs: list[tuple[str, Any, Any, Literal["outputs", "gradients"]]] = []
    if actual.outputs.keys() != expected.outputs.keys():
        return Comparison(False, f"output structure {sorted(actual.outputs)} vs {sorted(expected.outputs)}",
                          math.inf, 0.0)
    pairs += [(f"output {k}", actual.outputs[k], expected.outputs[k], "outputs") for k in expected.outputs]
    if expected.gradients is not None and actual.gradients is not None:
        pairs += [(f"gradient of {k}", actual.gradients[k], expected.gradients[k], "gradients")
                  for k in expected.gradients]
    scale = {kind: max((_rms(e) for _, _, e, k in pairs if k == kind), default=0.0)
             for kind in ("outputs", "gradients")}
    low = computed_in(expected, config)
    for name, a, e, kind in pairs:
        comparison = _compare_leaf(name, a, e, kind, config, _RELATIVE_FLOOR * scale[kind], low)
        if _badness(comparison) > _badness(worst):
            worst = comparison
    return worst


def compared_counts(actual: Run, expected: Run) -> tuple[int, int, bool]:
    """``(outputs, gradients, identical)`` for what :func:`compare` compares: the output tensors and the
    gradients (a leaf counts when it is a tensor on either side; gradients only when both runs have them),
    and whether every compared tensor (same shape and dtype, ``torch.equal``) and plain value (same type,
    ``==``) is bit-identical. Outputs of different structures compare nothing: ``(0, 0, False)``."""
    if actual.outputs.keys() != expected.outputs.keys():
        return 0, 0, False
    outputs = [(actual.outputs[k], expected.outputs[k]) for k in expected.outputs]
    gradients = []
    if expected.gradients is not None and actual.gradients is not None:
        gradients = [(actual.gradients.get(k), expected.gradients[k]) for k in expected.gradients]
    identical = all(_bit_identical(a, e) for a, e in outputs + gradients)
    return _tensor_pairs(outputs), _tensor_pairs(gradients), identical


def _tensor_pairs(pairs: list[tuple[Any, Any]]) -> int:
    return sum(isinstance(a, torch.Tensor) or isinstance(e, torch.Tensor) for a, e in pairs)


def _bit_identical(a: Any, e: Any) -> bool:
    """``torch.equal``: NaN is never identical, though ``compare`` accepts NaN against NaN (error 0)."""
    if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor):
        return a.shape == e.shape and a.dtype == e.dtype and torch.equal(a.detach(), e.detach().to(a.device))
    if isinstance(a, torch.Tensor) or isinstance(e, torch.Tensor):
        return False  # a tensor against None (an unused input's gradient) or a plain value
    if isinstance(e, _PLAIN_VALUES):
        return type(a) is type(e) and bool(a == e)
    return True  # other leaves are not compared (compare's _compare_leaf)


def is_low_precision(run: Run) -> bool:
    """Whether any output or gradient of ``run`` is bfloat16 or float16."""
    values = [*run.outputs.values(), *(run.gradients or {}).values()]
    return any(isinstance(v, torch.Tensor) and v.dtype in LOW_PRECISION for v in values)


def to_float32(value: Any) -> Any:
    """A bfloat16/float16 tensor as a float32 leaf (same ``requires_grad``); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
        return value.detach().float().requires_grad_(value.requires_grad)
    return value


def compare_against_float32(actual: Run, original: Run, float32: Run, config: OptimizeConfig) -> Comparison:
    """The worst leaf of ``actual`` judged against ``float32`` (a float32 run of the original): accepted when
    its error is at most ``max(tolerance, NOISE_FACTOR * error of original against float32)``."""
    if actual.outputs.keys() != float32.outputs.keys() or original.outputs.keys() != float32.outputs.keys():
        return Comparison(False, "output structure differs from the float32 run", math.inf, 0.0)
    pairs: list[tuple[str, Any, Any, Any, Literal["outputs", "gradients"]]] = [
        (f"output {k}", actual.outputs[k], original.outputs[k], float32.outputs[k], "outputs")
        for k in float32.outputs]
    if float32.gradients is not None and actual.gradients is not None and original.gradients is not None:
        pairs += [(f"gradient of {k}", actual.gradients.get(k), original.gradients.get(k), float32.gradients[k],
                   "gradients") for k in float32.gradients]
    scale = {kind: max((_rms(r) for *_, r, k in pairs if k == kind), default=0.0) for kind in ("outputs", "gradients")}
    worst = Comparison(True, NOTHING_COMPARED, 0.0, 1.0)
    low = computed_in(original, config)
    for name, a, o, r, kind in pairs:
        floor = _RELATIVE_FLOOR * scale[kind]
        if not (isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and o.is_floating_point()):
            comparison = _compare_leaf(name, a, o, kind, config, floor, low)  # exact or absent leaves: as before
        elif a is not None and not isinstance(a, torch.Tensor):
            comparison = Comparison(False, f"{name} (tensor vs {type(a).__name__})", math.inf, 0.0)
        else:
            tolerance = config.tolerance_for(_judged_as(o.dtype, low))
            own = relative_error(o, r, floor)
            error = relative_error(torch.zeros_like(r) if a is None else a, r, floor)
            limit = max(getattr(tolerance, kind) if tolerance is not None else 0.0, NOISE_FACTOR * own)
            comparison = Comparison(error <= limit, name, error, limit, noise=own,
                                    dtype=str(o.dtype).removeprefix("torch."))
        if _badness(comparison) > _badness(worst):
            worst = comparison
    return worst


class NoiseAwareCheck:
    """``check(actual)``: :func:`compare` against ``reference``; when that fails and ``reference`` is low
    precision, judged again against a float32 run of the original (``float32_run()``, called at most once;
    it returns the run, or a string saying why there is none, and the plain verdict stands)."""

    def __init__(self, reference: Run, float32_run: Callable[[], Run | str], config: OptimizeConfig):
        self.reference, self.config = reference, config
        self._float32_run = float32_run
        self._float32: Run | str | None = None

    @property
    def unavailable(self) -> str | None:
        """Why no float32 referee could be had, once one was asked for."""
        return self._float32 if isinstance(self._float32, str) else None

    @property
    def referee_where(self) -> str:
        """Where the float32 referee ran when not where the checked runs did ("" otherwise, or before one ran)."""
        return self._float32.where if isinstance(self._float32, Run) else ""

    def __call__(self, actual: Run, config: OptimizeConfig | None = None) -> Comparison:
        """``config``: whose tolerances judge this run (default: the check's own)."""
        config = config or self.config
        plain = compare(actual, self.reference, config)
        if plain.ok or not is_low_precision(self.reference):
            return plain
        if self._float32 is None:
            self._float32 = self._float32_run()
        if isinstance(self._float32, str):
            return plain
        return dataclasses.replace(compare_against_float32(actual, self.reference, self._float32, config),
                                   plain=plain)


def _rms(value: Any) -> float:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
        return 0.0
    squares, count = 0.0, 0
    for part, finite in _finite_slices(value.detach()):
        squares += float(torch.linalg.vector_norm(torch.where(finite, part, 0.0)) ** 2)
        count += int(finite.sum())
    return math.sqrt(squares / max(count, 1))


def computed_in(run: Run, config: OptimizeConfig) -> torch.dtype | None:
    """The low precision ``run`` computed in (of its bfloat16/float16 leaves, the dtype with the looser
    tolerance), or None. A float32 leaf of such a run is judged by that dtype's tolerance: transformers'
    ``labels=`` loss is float32 but computed from bfloat16 logits, and a rewrite moved it by 1.3e-5 (a
    GPU run), over float32's 1e-5 and far under bfloat16's 2e-2, which rolled back every optimization."""
    present = {v.dtype for v in [*run.outputs.values(), *(run.gradients or {}).values()]
               if isinstance(v, torch.Tensor) and v.dtype in LOW_PRECISION}
    tolerances = {dtype: config.tolerance_for(dtype) for dtype in present}
    judged = [dtype for dtype, tolerance in tolerances.items() if tolerance is not None]
    return max(judged, key=lambda dtype: tolerances[dtype].outputs, default=None)


def _judged_as(dtype: torch.dtype, low: torch.dtype | None) -> torch.dtype:
    """The dtype whose tolerance judges a leaf of ``dtype`` in a run computed in ``low``."""
    return low if low is not None and dtype in (torch.float32, torch.float64) else dtype


def _compare_leaf(name: str, a: Any, e: Any, kind: str, config: OptimizeConfig, rms_floor: float,
                  low: torch.dtype | None = None) -> Comparison:
    if isinstance(e, torch.Tensor) or isinstance(a, torch.Tensor):
        if a is None or e is None:  # an unused input's gradient is None on one side: compare to zeros
            a = torch.zeros_like(e) if a is None else a
            e = torch.zeros_like(a) if e is None else e
        if not isinstance(a, torch.Tensor) or not isinstance(e, torch.Tensor):
            return Comparison(False, f"{name} (tensor vs {type(a).__name__})", math.inf, 0.0)
        tolerance = config.tolerance_for(_judged_as(e.dtype, low))
        limit = getattr(tolerance, kind) if tolerance is not None else 0.0
        error = relative_error(a, e, rms_floor)
        return Comparison(error <= limit, name, error, limit)
    equal = bool(a == e) if isinstance(e, _PLAIN_VALUES) else True
    return Comparison(equal, name, 0.0 if equal else math.inf, 0.0)


def _badness(c: Comparison) -> float:
    if not c.ok:
        return math.inf if c.tolerance == 0 else 1.0 + c.error / c.tolerance
    return c.error / c.tolerance if c.tolerance else 0.0


def run_reference(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any] | None,
    wrt: dict[str, torch.Tensor] | None,
    seed: int = 0,
    skip: frozenset[str] = frozenset(),
) -> Run:
    """Run ``fn`` with the random number generators seeded by ``seed`` (and the caller's RNG state
    restored after); with ``wrt``, also differentiate a random projection of the outputs w.r.t. it.

    The projection weights come from generators seeded per output, so two runs (reference and
    candidate) weigh their outputs identically; outputs named in ``skip`` are left out of the projection (the
    others keep their seeds).
    """
    kwargs = kwargs or {}
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        # The loss is built inside the grad-mode block too: a caller under torch.no_grad() has no graph otherwise.
        with torch.enable_grad() if wrt else torch.no_grad():
            out = fn(*args, **kwargs)
            outputs = flatten_tensors(out)
            gradients = _gradients(outputs, wrt, seed, skip) if wrt else None
    return Run({k: _detached(v) for k, v in outputs.items()}, gradients)


def _gradients(outputs: dict[str, Any], wrt: dict[str, torch.Tensor], seed: int,
               skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor | None]:
    loss = None
    for index, (key, value) in enumerate(outputs.items()):
        if key in skip:
            continue
        if isinstance(value, torch.Tensor) and value.requires_grad and value.is_floating_point():
            generator = torch.Generator(device=value.device).manual_seed(seed + index)
            weight = torch.randn(value.shape, generator=generator, device=value.device, dtype=torch.float32)
            term = (value.float() * weight).sum()
            loss = term if loss is None else loss + term
    if loss is None:
        return {name: None for name in wrt}
    grads = torch.autograd.grad(loss, list(wrt.values()), allow_unused=True)
    return dict(zip(wrt.keys(), grads))


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def unless_out_of_memory(run: Callable[[], T]) -> T | None:
    """``run()``, or None when the GPU ran out of memory (its cache emptied): a check that does not fit next to
    the model (hand-written attention's fp32 scores at long lengths) is skipped with a report line, not fatal."""
    result = _attempt(run)
    if result is _OUT_OF_MEMORY:  # emptied here, where no traceback holds the failed run's tensors any more
        torch.cuda.empty_cache()
        return None
    return result


_OUT_OF_MEMORY = object()


def _attempt(run: Callable[[], T]) -> T | object:
    try:
        return run()
    except torch.cuda.OutOfMemoryError:
        return _OUT_OF_MEMORY
