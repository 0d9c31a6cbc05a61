"""Attention -> one fused attention call whose kernel the dispatcher chooses: hand-written attention, matched
by meaning rather than by one template, and existing ``F.scaled_dot_product_attention`` calls.

Every ``torch.softmax`` of a normalized graph (see :mod:`kernel_pytorch.passes.normalize`) is a
candidate. The matcher (:mod:`kernel_pytorch.passes.attention_match`) walks back from it through casts,
masks, biases and scale factors to a Q·Kᵀ product, and forward through casts and dropout to a ·V
product, and proves each step; what it cannot prove is skipped, with the reason in the report.

Every SDPA call is a candidate too (transformers' default attention, ``attn_implementation="sdpa"``): left
alone it keeps PyTorch's own kernel choice. :mod:`kernel_pytorch.passes.sdpa_match` reads it into the same
record, its ``attn_mask`` as one mask term, so the call gets what a hand-written one gets: a causal mask
becomes ``is_causal``, a window or block pattern is recognized (guarded where it reads sizes or buffers),
repeated K/V become ``enable_gqa``, and the dispatcher chooses the kernel. Its report line starts with
"SDPA call".

Before and after (a Llama layer as Dynamo captures it, after normalization)::

    # before                                          # after
    k_rep = k[:, :, None].expand(...).reshape(...)    o = attention(q, k, v, None, dropout_p=0.0,
    s = operator.matmul(q, transpose(k_rep, 2, 3))        is_causal=True, scale=0.25,
    s = operator.mul(s, 0.25)                             enable_gqa=True, kernel="sdpa")
    s = operator.add(s, causal_mask)
    p = torch.softmax(s, -1, dtype=torch.float32)
    p = p.to(torch.float32)
    p = F.dropout(p, 0.0, False, False)
    o = operator.matmul(p, v_rep)

What is matched, and how each part is decided:

* **Products**: ``@`` (``operator.matmul``), ``torch.bmm`` on 3-D ``(B*H, L, E)`` tensors (SDPA takes
  them as they are), ``einsum`` (``"bhqd,bhkd->bhqk"`` then ``"bhqk,bhkd->bhqd"``, any letters, operands in
  other layouts permuted; other equations are skipped with the equation in the reason). Kᵀ by
  ``transpose``/``permute``/``.mT`` (all ``transpose``/``permute`` after normalization); a Kᵀ that
  comes from elsewhere is transposed back.
* **Scale**: the product of every constant factor between Q·Kᵀ and the softmax (``* c``, ``/ c``)
  and on Q or K before the product (``q * d ** -0.5``), as the exact Python float; ``1.0`` when there is
  none (T5). A factor that is a tensor must evaluate to a one-element constant from shape-only ops;
  anything else (a parameter, an input) is skipped: "scale cannot be determined".
* **Masks**: additive float masks and biases (``scores + m``, ``scores - alibi``), ``masked_fill`` and
  ``torch.where`` with bool masks and ``-inf`` or ``finfo.min`` fills (other fills are skipped: a fused
  kernel would differ on fully masked rows). A single ``-inf`` fill becomes SDPA's bool mask (True =
  attend); a ``finfo.min`` fill becomes an additive ``where(masked, fill, 0)`` (``x + finfo.min`` rounds
  to ``finfo.min``, so fully masked rows stay uniform as in eager); several terms are summed into one
  additive mask, cast to Q's dtype.
* **Causal**: a single mask term built only from shape-only ops (``full``/``arange``/``triu``/
  comparisons/``where``/``expand``...) is evaluated concretely; if it is exactly top-left causal and
  ``Lq == Lk``, the call gets ``is_causal=True`` and no mask. With static sizes that is a proof. A mask
  that reads **symbolic sizes** or a **buffer** is evaluated at the capture's values and, if causal there,
  rewritten behind a runtime guard that re-checks it for each new size or buffer state (in-place edits
  bump the buffer's version); calls where it fails run the unrewritten graph
  (:mod:`kernel_pytorch.passes.causal_mask`). A mask that depends on an input (padding: HF BERT/Llama
  with ``attention_mask``), or ``Lq != Lk``, is passed as a tensor.
* **Block-structured masks** (:mod:`kernel_pytorch.passes.mask_pattern`): a single mask term that is not
  causal is classified the same way (evaluated, or for document masks checked on probe document ids) as a
  band / sliding window, a document mask, or a block-sparse mask. The dispatcher then chooses between the
  dense kernels (the mask tensor, as before) and the kernels that take the pattern instead
  (``kernel="flex"`` or, for a causal sliding window with the cuDNN frontend installed, ``"cudnn_band"``;
  ``pattern=..., pattern_tensor=...``, no mask tensor, FlexAttention's BlockMask built once per shape and
  pattern); only those rely on the pattern, so only then does a pattern from sizes or buffers carry its guard.
  The report line names what was recognized either way.
* **Softmax**: over the last axis only (``-1`` or ``ndim - 1``), computed in float32 (``dtype=`` or an
  upcast) and cast back: fused kernels accumulate in float32.
* **Dropout** on the probabilities: ``dropout_p`` is ``p`` when the graph trains, ``0.0`` otherwise.
* **GQA/MQA**: K and V repeated per head (``repeat_kv``: ``[:, :, None].expand().reshape()``, or
  ``repeat_interleave(n, dim=heads)``) are used un-repeated with ``enable_gqa=True`` (same
  group-contiguous order); cross-attention with ``Lq != Lk`` is fine.
* **Output layout**: the ·V product is replaced in place, so the ``transpose`` + ``reshape`` after it stay.
* **Top-k sparse attention** (``OptimizeConfig(sparse_attention=...)``, off by default; an approximation,
  :mod:`kernel_pytorch.attention.kernels.topk_sparse`): an eligible call (causal or no mask, no dropout, head dims
  FlexAttention takes, fp16/bf16/fp32, not training) becomes ``sparse_or_dense_attention(q, k, v, ...,
  kernel=<dense choice>, pattern=("topk", ...), min_length=n)``, which runs top-k FlexAttention for query
  lengths >= n and the dense kernel below, decided per call. With concrete example inputs of at least n
  tokens, the relative error against dense attention is measured on them (sampled query blocks) and
  reported. Where the option is set but a call is not eligible, the report says why and it stays dense.

Not attention, skipped with the reason: softmax over another axis, probabilities modified or used
before or beside ·V (returned attention weights), scores used elsewhere, a non-constant scale. Reading only
the scores' dtype or static shape is not a use: T5's ``softmax(scores.float()).type_as(scores)`` matches,
and a reader outside the matched chain reads the dtype or size as a constant instead.
``relu`` attention has no softmax, so it is not a candidate at all.

Example::

    from kernel_pytorch.passes.attention import AttentionPass
    result = AttentionPass().run(gm, ctx)   # after Normalize
    for rewrite in result.rewrites: print(rewrite.location, rewrite.replacement)
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx
from torch.fx import Node

from kernel_pytorch.attention import dispatch
from kernel_pytorch.attention.kernels.eligibility import dtype_names
from kernel_pytorch.attention.kernels.registry import KERNELS, PATTERN_KERNELS
from kernel_pytorch.attention.kernels.topk_sparse import TOPK_ERROR_QUERY_BLOCKS, topk_relative_error
from kernel_pytorch.ops.attention import attention, sparse_or_dense_attention, to_4d
from kernel_pytorch.passes.attention_match import AttentionMatch, NotAttention, Operand, match_attention
from kernel_pytorch.passes.base import GraphPass, PassContext, PassResult, Rewrite, candidates
from kernel_pytorch.passes.causal_mask import CausalMaskGuard, decide_causal
from kernel_pytorch.passes.graph_utils import erase_unused, is_view, set_example_value
from kernel_pytorch.passes.mask_pattern import PatternDecision, decide_pattern
from kernel_pytorch.passes.normalize import is_call
from kernel_pytorch.passes.registry import register_pass
from kernel_pytorch.passes.sdpa_match import is_sdpa_call, match_sdpa_call
from kernel_pytorch.passes.shape_constants import Bindings, ConstantEvaluator, example_value, static_int

__all__ = ["AttentionPass"]


def _attention_op() -> Callable[..., Any]:
    """The fused op the rewrite calls (SDPA's signature plus keyword-only ``kernel``)."""
    return attention


def _choose_kernel(q, k, v, mask, *, is_causal, dropout_p, enable_gqa, ctx: PassContext,
                   sparsity: Optional[tuple] = None, softcap: Optional[float] = None) -> tuple[str, str]:
    if any(not isinstance(t, torch.Tensor) for t in (q, k, v)) or any(
            not isinstance(s, int) for t in (q, k, v, mask) if isinstance(t, torch.Tensor) for s in t.shape):
        return "sdpa", ("PyTorch's SDPA dispatch" if softcap is None else "PyTorch's ops for the soft cap") + \
            " (symbolic or unknown shapes: no kernel measured)"
    try:
        return dispatch.choose_kernel(q, k, v, mask, is_causal=is_causal, dropout_p=dropout_p, enable_gqa=enable_gqa,
                             hardware=ctx.hardware, training=ctx.training, compiled=ctx.compiled, sparsity=sparsity,
                             cuda_graphs=ctx.cuda_graphs, softcap=softcap)
    except Exception as error:  # the rewrite stands on its own; SDPA's dispatch is always correct
        return "sdpa", f"the kernel dispatcher failed ({type(error).__name__}: {error}); PyTorch's SDPA dispatch"


_FLEX = KERNELS["flex"]  # top-k sparse attention runs on FlexAttention's kernels (CPU and GPU)


def _topk_refusal(q, k, v, mask: Optional[Node], plan: "_MaskPlan", dropout_p: float, ctx: PassContext) -> str:
    """Why top-k sparse attention cannot replace this call ("" when it can)."""
    if ctx.training:
        return "it is an inference option and the model trains (the dense kernel is kept)"
    if plan.softcap is not None:
        return "the scores are soft-capped (top-k selection has no soft cap)"
    if mask is not None or plan.pattern is not None:
        return f"the call has a mask other than causal ({plan.description})"
    if dropout_p:
        return "the call has dropout"
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q, k, v have no example values"
    if q.dtype not in _FLEX.dtypes:
        return f"FlexAttention's kernels take {dtype_names(_FLEX.dtypes)}, not {q.dtype}"
    dims, low, high = (q.shape[-1], v.shape[-1]), _FLEX.head_dims.low, _FLEX.head_dims.high
    if not all(isinstance(d, int) and low <= d <= high for d in dims):
        return f"FlexAttention needs head dims in [{low}, {high}] (got {dims[0]}, {dims[1]})"
    return ""


class _Builder:
    """Adds nodes before the ·V product, each with metadata (example value, module stack)."""

    def __init__(self, gm: torch.fx.GraphModule, anchor: Node):
        self.gm = gm
        self.graph = gm.graph
        self.anchor = anchor
        self.carried = {k: v for k, v in anchor.meta.items() if k in ("nn_module_stack", "stack_trace")}

    def function(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        self.annotate(node)
        return node

    def method(self, name: str, *args: Any) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_method(name, args)
        self.annotate(node)
        return node

    def annotate(self, node: Node) -> None:
        """The anchor's module stack, and the node's example value (left out when it cannot be computed:
        the rewrite is still correct, and what reads the value treats it as unknown)."""
        node.meta.update(self.carried)
        set_example_value(self.gm, node)

    def operand(self, operand: Operand) -> Node:
        return operand.node if operand.dims is None else self.function(torch.permute, operand.node, operand.dims)

    def cast(self, node: Node, dtype: torch.dtype) -> Node:
        value = example_value(node)
        return node if isinstance(value, torch.Tensor) and value.dtype == dtype else self.method("to", node, dtype)


def _compact_value(v: Node, builder: _Builder, training: bool) -> tuple[Node, int]:
    """V as the fused kernel saves it for the backward, and the bytes of the larger tensor it was a view of
    (0 when it is not copied).

    The kernel saves its V input, and a view keeps its base's whole storage alive. V reached through views
    of a larger tensor (the q/k/v split of one fused projection, :mod:`horizontal_gemm`) would keep that
    tensor until the backward: in the Llama-style train step of ``benchmarks/e2e.py`` that tensor is about six
    times V per layer (docs/attention.md, "V copied out of a fused projection"). In training such a V is
    copied once into a tensor of its own. Walks back through view ops, whose example values may predate
    earlier rewrites, to the first whose value is a view of a larger storage, and copies that one, so the
    views after it give V the stride order it had. A V copied instead into contiguous (B, H, L, D) order gave
    wrong gradients in the GPU 12-layer train step under Inductor (the verification rolled the attention
    rewrite back; the mechanism was not isolated: the attention kernels alone passed with either
    layout); this copy passes the GPU tests and the train step's verification."""
    node, child = v, None
    while training:
        value = example_value(node)
        if isinstance(value, torch.Tensor) and _views_larger_storage(value):
            if child is None:
                return builder.function(torch.clone, v), int(value.untyped_storage().nbytes())
            with builder.graph.inserting_after(node):
                copy = builder.graph.call_function(torch.clone, (node,), {"memory_format": torch.contiguous_format})
            copy.meta.update({k: node.meta[k] for k in ("nn_module_stack", "stack_trace") if k in node.meta})
            set_example_value(builder.gm, copy)
            child.replace_input_with(node, copy)
            return v, int(value.untyped_storage().nbytes())
        if not (is_view(node) and node.args and isinstance(node.args[0], Node)):
            break
        node, child = node.args[0], node
    return v, 0


def _views_larger_storage(value: torch.Tensor) -> bool:
    """Whether ``value`` is a view into a storage that holds more than its own elements. Sizes are read
    without ``int()``, which would specialize a symbolic size; a symbolic one answers False (no copy)."""
    storage, elements = static_int(value.untyped_storage().nbytes()), static_int(value.numel())
    return storage is not None and elements is not None and storage > elements * value.element_size()


class _MaskPlan:
    """What the attention call gets for its mask: nothing, ``is_causal``, a bool or an additive tensor."""

    def __init__(self) -> None:
        self.is_causal = False
        self.description = "no mask"
        self.notes: list[str] = []  # skip-like report lines (the rewrite still happens)
        self.dead_when_causal: list[Node] = []
        self.guard: Optional[CausalMaskGuard] = None  # set when is_causal holds only for checked values
        self.pattern: Optional[PatternDecision] = None  # a block structure of the (single, non-causal) mask
        self.sparse_call: Optional[Node] = None  # the call, when it became top-k sparse attention
        self.softcap: Optional[float] = None  # the scores' soft cap (Gemma-2), passed on to the kernel


def _negated(mask: Node, builder: _Builder, match: AttentionMatch) -> Node:
    """``~mask``; ``x`` itself when ``mask`` is ``~x`` read only here (``masked_fill(s, ~allowed, -inf)``)."""
    if is_call(mask, operator.invert, torch.logical_not, torch.bitwise_not) and len(mask.users) == 1 and \
            isinstance(mask.args[0], Node) and example_value(mask.args[0]) is not None and \
            example_value(mask.args[0]).dtype == torch.bool:
        match.removable.append(mask)
        return mask.args[0]
    return builder.function(torch.logical_not, mask)


def _mask_node(match: AttentionMatch, builder: _Builder, q_dtype: torch.dtype, constants: ConstantEvaluator,
               bindings: Bindings, plan: _MaskPlan) -> Optional[Node]:
    terms = match.terms
    if not terms:
        return None
    if len(terms) == 1:
        plan.description = "mask bool" if terms[0].kind == "fill" and terms[0].fill == -math.inf else "mask additive"
        decision = decide_causal(terms[0], match, constants, bindings)
        plan.description += decision.detail
        if decision.causal:
            plan.is_causal, plan.guard, plan.description = True, decision.guard, "no mask"
            plan.notes += [decision.note] if decision.note else []
            plan.dead_when_causal = ConstantEvaluator(bindings).ancestors(terms[0].node)
            return None
        term = terms[0]
        plan.pattern, detail = decide_pattern(term, match, constants, bindings)
        plan.description += detail
        if term.kind == "fill" and term.fill == -math.inf:
            # SDPA's bool mask: True means attend.
            return _negated(term.node, builder, match) if term.masked_value else term.node
    else:
        plan.description = f"mask additive ({len(terms)} terms)"
    total: Optional[Node] = None
    for term in terms:
        if term.kind == "fill":
            masked = term.node if term.masked_value else _negated(term.node, builder, match)
            part = builder.function(torch.where, masked, term.fill, 0.0)
        else:
            part = term.node
            if term.multiplier != 1.0:
                part = builder.function(operator.mul, part, term.multiplier)
        total = part if total is None else builder.function(operator.add, total, part)
    return builder.cast(total, q_dtype)


def _pattern_arguments(decision: PatternDecision, mask: Node, builder: _Builder) -> dict[str, Any]:
    """``pattern``/``pattern_tensor`` of the flex call: the document ids as (B, L), the allowed positions
    of a block-sparse mask as 4-D bool (from SDPA's mask: bool True = attend, additive 0 = attend)."""
    pattern = decision.pattern
    tensor = None
    if pattern.kind == "document":
        ids = example_value(decision.doc)
        tensor = builder.function(torch.unsqueeze, decision.doc, 0) if ids.dim() == 1 else decision.doc
    elif pattern.kind == "blocks":
        value = example_value(mask)
        allowed = mask if value.dtype == torch.bool else builder.function(torch.eq, mask, 0)
        tensor = allowed if value.dim() == 4 else builder.function(
            operator.getitem, allowed, (None,) * (4 - value.dim()) + (Ellipsis,))
    return {"pattern": pattern.spec, "pattern_tensor": tensor}


def _match_or_reason(node: Node, constants: ConstantEvaluator) -> Optional[AttentionMatch | str]:
    """The attention around a ``torch.softmax`` call or of an SDPA call, or why it is not attention (None:
    neither)."""
    try:
        if is_call(node, torch.softmax):
            return match_attention(node, constants)
        if is_sdpa_call(node):
            return match_sdpa_call(node)
    except NotAttention as reason:
        return str(reason)
    return None


def _detach_metadata_reads(graph: torch.fx.Graph, match: AttentionMatch) -> None:
    """Readers of the dtype or static shape of a node the rewrite removes read it no longer, so that the
    node can go: ``x.type_as(scores)`` becomes ``x.to(dtype)``; ``scores.size(-1)``, ``scores.dtype`` their
    value. Readers in the matched chain itself are erased with it."""
    removable = set(match.removable)
    for reader in match.metadata_reads:
        if reader._erased or reader in removable:
            continue
        value = example_value(reader)
        if is_call(reader, "type_as"):
            reader.target, reader.args = "to", (reader.args[0], value.dtype)
            continue
        constant = tuple(value) if isinstance(value, tuple) else value  # torch.Size -> a plain tuple
        for user in list(reader.users):
            user.args = torch.fx.node.map_aggregate(user.args, lambda a: constant if a is reader else a)
            user.kwargs = torch.fx.node.map_aggregate(user.kwargs, lambda a: constant if a is reader else a)
        graph.erase_node(reader)


def _describe_scale(match: AttentionMatch, q: Any) -> str:
    if match.scale is not None:
        return f"scale {match.scale!r}"
    head_dim = static_int(q.shape[-1]) if isinstance(q, torch.Tensor) else None
    return f"scale {head_dim ** -0.5!r} (SDPA's default)" if head_dim else "scale 1/sqrt(E) (SDPA's default)"


@register_pass
class AttentionPass(GraphPass):
    """Replace hand-written attention with one fused ``attention(q, k, v, mask, ...)`` call (module docstring)."""

    name = "attention"
    description = "hand-written attention (any spelling of softmax(Q·Kᵀ·s + mask)·V) -> fused attention kernel"

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        result = PassResult()
        graph = gm.graph
        constants = ConstantEvaluator(known=ctx.constant_inputs)
        bindings = Bindings.from_graph(graph, ctx.example_inputs)
        mask_candidates: list[Node] = []
        sparse_calls: list[tuple[Node, int]] = []  # top-k calls and the index of their rewrite record
        for found in candidates(graph.nodes, functools.partial(_match_or_reason, constants=constants), result):
            description, plan, removed = self._rewrite(gm, found.match, constants, bindings, ctx)
            if plan.sparse_call is not None:
                sparse_calls.append((plan.sparse_call, len(result.rewrites)))
            mask_candidates += plan.dead_when_causal
            if plan.guard is not None:
                result.guards.append(plan.guard)
            for note in plan.notes:
                result.skip(found.location, note)
            result.rewrite(found.location, description)
            result.changed += len(removed)
        result.changed += erase_unused(graph, mask_candidates)
        if sparse_calls:
            _report_topk_errors(gm, ctx, sparse_calls, result)
        return result

    @staticmethod
    def _rewrite(gm: torch.fx.GraphModule, match: AttentionMatch, constants: ConstantEvaluator, bindings: Bindings,
                 ctx: PassContext) -> tuple[str, _MaskPlan, set[Node]]:
        graph = gm.graph
        builder = _Builder(gm, match.pv)
        q, k, v = builder.operand(match.q), builder.operand(match.k), builder.operand(match.v)
        v, v_copied = _compact_value(v, builder, ctx.training)
        q_dtype = example_value(q).dtype
        plan = _MaskPlan()
        plan.is_causal, plan.softcap = match.is_causal, match.softcap
        before_mask = set(graph.nodes)
        mask = _mask_node(match, builder, q_dtype, constants, bindings, plan)
        pattern = plan.pattern.pattern if plan.pattern is not None else None
        kernel, why = _choose_kernel(example_value(q), example_value(k), example_value(v), example_value(mask),
                                     is_causal=plan.is_causal, dropout_p=match.dropout_p,
                                     enable_gqa=match.enable_gqa, ctx=ctx,
                                     sparsity=None if pattern is None else pattern.sparsity, softcap=match.softcap)
        kwargs = {"dropout_p": match.dropout_p, "is_causal": plan.is_causal, "scale": match.scale,
                  "enable_gqa": match.enable_gqa, "kernel": kernel}
        if match.softcap is not None:  # only then: a call without one keeps SDPA's own arguments
            kwargs["softcap"] = match.softcap
        if pattern is not None and kernel in PATTERN_KERNELS:
            kwargs.update(_pattern_arguments(plan.pattern, mask, builder))
            plan.dead_when_causal += [*plan.pattern.dead, *(set(graph.nodes) - before_mask)]
            plan.guard, plan.description, mask = plan.pattern.guard, f"mask {pattern.describe()}", None
            plan.notes += [plan.pattern.note] if plan.pattern.note else []
        elif pattern is not None:
            plan.description += f" ({pattern.describe()}: recognized, run dense)"
        target, sparse_text = _attention_op(), ""
        sparse = ctx.config.sparse_attention
        if sparse is not None:
            refusal = _topk_refusal(example_value(q), example_value(k), example_value(v), mask, plan,
                                    match.dropout_p, ctx)
            if refusal:
                plan.notes.append(f"top-k sparse attention not applied: {refusal}")
            else:
                target = sparse_or_dense_attention
                kwargs.update(pattern=sparse.pattern(), min_length=sparse.min_length)
                sparse_text = (f"top-k sparse attention (approximate): {sparse.describe()} (FlexAttention; "
                               f"{kernel} below)")
                if not ctx.compiled:
                    sparse_text += ("; the graph is not compiled, so FlexAttention runs unfused (slower than dense: "
                                    "for checking accuracy only)")
        with graph.inserting_before(match.pv):
            call = graph.call_function(target, (q, k, v, mask), kwargs)
        if target is sparse_or_dense_attention:
            plan.sparse_call = call
        if match.out_dims is None:
            call.meta.update(match.pv.meta)
            out = call
        else:
            builder.annotate(call)
            with graph.inserting_before(match.pv):
                out = graph.call_function(torch.permute, (call, match.out_dims))
            out.meta.update(match.pv.meta)
        match.pv.replace_all_uses_with(out)
        _detach_metadata_reads(graph, match)
        before = set(graph.nodes)
        erase_unused(graph, match.removable)
        removed = before - set(graph.nodes)
        parts = ["SDPA call"] if match.source == "sdpa" else []
        parts += ["causal"] if plan.is_causal else []
        if match.enable_gqa and match.heads:
            parts.append(f"gqa {match.heads[0]}/{match.heads[1]}")
        parts.append(_describe_scale(match, example_value(q)))
        if match.softcap is not None:
            parts.append(f"soft cap {match.softcap!r}")
        if match.dropout_p:
            parts.append(f"dropout {match.dropout_p!r}")
        parts.append(plan.description)
        if v_copied:
            parts.append(f"V copied out of a {v_copied / 2**20:.3g} MiB tensor (the backward keeps V alone)")
        line = f"attention[{kernel}]: {', '.join(parts)} ({why})"
        return line + (f"; {sparse_text}" if sparse_text else ""), plan, removed


def _report_topk_errors(gm: torch.fx.GraphModule, ctx: PassContext, calls: list[tuple[Node, int]],
                        result: PassResult) -> None:
    """Each top-k call's relative error against dense attention on the example inputs, appended to its
    rewrite line: the graph runs once (no grad) with the example inputs, each top-k call computing dense
    attention for the next layers and comparing its sampled query blocks (``topk_relative_error``). Calls
    shorter than min_length at the example run dense, which the line says instead. Any failure leaves a note
    in the line: the error is information, the rewrite stands on its own."""
    found: dict[Node, str] = {}
    try:
        _run_measuring(gm, ctx, {node for node, _ in calls}, found)
    except Exception as error:  # noqa: BLE001 - the measurement is optional; its failure is reported
        first_line = (str(error).strip().splitlines() or [""])[0][:160]
        found = {node: f"error not measured ({type(error).__name__}: {first_line})" for node, _ in calls
                 if node not in found}
    for node, index in calls:
        text = found.get(node, "error not measured (the example inputs are not concrete tensors)")
        old = result.rewrites[index]
        result.rewrites[index] = Rewrite(old.location, f"{old.replacement}; {text}")


def _run_measuring(gm: torch.fx.GraphModule, ctx: PassContext, calls: set[Node], found: dict[Node, str]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not ctx.example_inputs or any(n.name not in ctx.example_inputs for n in placeholders):
        return
    args = []
    for node in placeholders:
        value = ctx.example_inputs[node.name]
        if isinstance(value, torch.SymInt):
            value = value.node.hint
        if isinstance(value, torch.Tensor):
            if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.is_meta:
                return
            value = value if isinstance(value, torch.nn.Parameter) else value.detach().clone()
        args.append(value)

    class Measuring(torch.fx.Interpreter):
        def run_node(self, node: Node) -> Any:
            if node not in calls:
                return super().run_node(node)
            call_args, call_kwargs = self.fetch_args_kwargs_from_env(node)
            q, k, v = call_args[:3]
            dense = dict(call_kwargs)
            pattern, min_length = dense.pop("pattern"), dense.pop("min_length")
            out = attention(*call_args, **dense)
            if q.shape[-2] < min_length:
                found[node] = f"dense at the example length {q.shape[-2]} (< {min_length}): exact there"
                return out
            q4, k4, v4 = (to_4d(t) for t in (q, k, v))
            error = topk_relative_error(q4, k4, v4, is_causal=dense["is_causal"], scale=dense["scale"],
                                        pattern=pattern, query_blocks=TOPK_ERROR_QUERY_BLOCKS)
            blocks = -(-q.shape[-2] // pattern[-1])
            sampled = min(TOPK_ERROR_QUERY_BLOCKS, blocks)
            found[node] = (f"relative error against dense {error:.2e} on the example inputs "
                           f"({sampled} of {blocks} query blocks compared)")
            return out

    with torch.no_grad():
        Measuring(gm).run(*args)

