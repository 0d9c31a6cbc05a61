"""What a compiled training forward saves for the backward, per transformer layer, on the CPU.

    python benchmarks/saved_activations.py --model llama-style|hf-llama|both [--layers 2] [--tokens 2048]
                                           [--batch 1] [--dtype bfloat16] [--scale-to 4x2048x12] [--json PATH]

Why: issue 9's train-step peak on the H100 (``optimize``: 13.94 GiB, transformers ``LlamaForCausalLM`` with
SDPA + ``torch.compile``: 13.69 GiB). Between forward and backward, what a step holds beyond parameters,
gradients and optimizer state is what the compiled forward returns for the backward; this tool lists it
without a GPU and without running any kernel.

How: the model goes through exactly the compile path its provider uses, with Inductor's own front half:

- ``llama-style``: ``kernel_pytorch.optimize(LlamaStyleLM(...), example_inputs=..., mode="training")`` with
  the hardware probe answering "NVIDIA H100" (sm_90, bf16, cuDNN attention, Triton), so the passes make the
  H100's choices (horizontal GEMM fusion by the GPU's machine balance, the attention kernel cuDNN, the first
  eligible one when no GPU can measure). ``verify=False``: the rewritten graph calls GPU kernels that cannot
  run here, and verification would roll them back. Its compiler call (``CompilerChoice.compile``) is
  replaced by Inductor's ``compile_fx``;
- ``hf-llama``: transformers' ``LlamaForCausalLM`` of the same architecture (``benchmarks/e2e.py``'s config,
  ``attn_implementation="sdpa"``) under ``torch.compile(model, backend=compile_fx)``.

In both, ``compile_fx`` runs pre-grad passes, AOTAutograd with Inductor's decompositions, the joint-graph
passes and ``min_cut_rematerialization_partition`` (what ``torch.compile`` does), and then calls its
``inner_compile`` on the partitioned forward and backward graphs; this tool passes its own ``inner_compile``,
which records each graph and returns a stand-in that "runs" it by returning uninitialized tensors of the
recorded shapes and strides (CPU ``empty_strided``: untouched pages cost no memory, no kernel runs). No
Inductor codegen, no compute: a 2-layer full-width trace takes about a minute.

Accounting, per forward graph: the outputs at and after AOTAutograd's ``num_forward`` are what the backward
receives. Each saved tensor is traced back through view ops (``OpOverload.is_view``) to the node that owns
its storage (a view keeps its base alive: the base's storage bytes are counted, once per base); bases that are
graph inputs (parameters, buffers, tokens) are listed apart, as they are alive anyway. Bases are grouped by
transformer layer (``layers.N`` in ``nn_module_stack``, else the ``stack_trace``) and by producer (module path
inside the layer + op). Sizes are the traced ones (``meta["val"]``); ``--scale-to`` multiplies the mean per-layer
bytes by the layer count and everything by the token ratio. Saved activations scale with the tokens; a
(seq x seq) tensor (the HF model's materialized causal mask) is shared by all layers and listed once outside
them, and scales with the batch and seq squared, which the token ratio equals only at the same seq (the
default: traced and scaled at seq 2048). Trace in bfloat16 (the default): in a float32 trace, tensors that are
float32 by design (norm statistics, log-sum-exp) cannot be told from those that follow the model's dtype.

The backward graph is recorded too: ``--backward`` adds a rough liveness walk of each graph (what it
allocates beyond its inputs, and what is alive at its peak), a hint at transient peaks; a model of Inductor's
buffers, not a measurement.

GPU fidelity (llama-style): the norm / RoPE / activation ``triton_op`` bodies are made to take their Triton
path on CPU tensors (``TRITON_DEVICE_TYPES`` patched), so the graph holds the Triton kernels, opaque to the
partitioner, as on the H100; Triton's active driver answers an sm_90 target so that Inductor's analysis of
which kernel arguments are mutated works (without it every argument is cloned). The attention custom op's
device check is relaxed for the cuDNN/flash/efficient kernels, whose fake implementations are aten's meta
kernels. Limits: SDPA in the HF model is decomposed for the CPU
(``_scaled_dot_product_flash_attention_for_cpu``), which saves what the CUDA kernels save (q, k, v, out,
logsumexp, the mask if any; the CUDA kernels add two 8-byte RNG states; the efficient kernel pads the
logsumexp to 32 rows). transformers decides on the CPU as on CUDA whether to materialize the causal mask
(with torch < 2.14 under torch.compile it does, and then repeats K/V to all heads instead of SDPA's GQA).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 2**20
GiB = 2**30
_LAYER = re.compile(r"layers(?:\.|\[['\"]?|_)(\d+)")


# ------------------------------------------------------------------------------------------ recording

@dataclass
class Recorded:
    gm: torch.fx.GraphModule
    backward: bool
    num_forward: int | None  # forward graphs: outputs before this index are not saved for the backward


@dataclass
class Recorder:
    graphs: list[Recorded] = field(default_factory=list)

    def inner_compile(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any):
        """Stands in for ``compile_fx_inner``: records the partitioned graph, returns a boxed callable that
        returns uninitialized tensors of the graph's output shapes (nothing computed)."""
        backward = bool(kwargs.get("is_backward", False))
        num_forward = None
        if not backward and not kwargs.get("is_inference", False):
            context = torch._guards.TracingContext.try_get()
            meta = getattr(context, "fw_metadata", None)
            num_forward = getattr(meta, "num_forward", None)
        self.graphs.append(Recorded(gm, backward, num_forward))
        values = [n.meta.get("val") if isinstance(n, torch.fx.Node) else n for n in _outputs(gm)]

        def run(args: list) -> list:
            args.clear()
            return [_stand_in(v) for v in values]

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def compile_fx(self, gm: torch.fx.GraphModule, example_inputs: Any):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, list(example_inputs), inner_compile=self.inner_compile)


def _outputs(gm: torch.fx.GraphModule) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (tuple, list)) else [args]


def _stand_in(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(tuple(int(s) for s in value.shape), tuple(int(s) for s in value.stride()),
                                   dtype=value.dtype, device="cpu")
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    return value


# ---------------------------------------------------------------------------------------------- models

def h100_hardware():
    from kernel_pytorch.hardware import HardwareInfo

    return HardwareInfo(vendor="nvidia", device_name="NVIDIA H100 80GB HBM3 (simulated)", compute_capability=(9, 0),
                        memory_bytes=80 * GiB, bf16=True, fp8=True, fp8_formats=("float8_e4m3fn", "float8_e5m2"),
                        tensor_cores=True, cudnn_attention=True, cudnn_version=91900, triton_usable=True,
                        triton_version="3.5.0")


def llama_config(layers: int):
    from kernel_pytorch.testing import LlamaStyleConfig

    return LlamaStyleConfig(n_layers=layers)


def _tokens(vocab: int, batch: int, seq: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=generator)


def _build(make, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return make().to(dtype=dtype).train()


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """benchmarks/e2e.py's loss: cross-entropy of the logits in fp32."""
    targets = tokens.roll(-1, 1).flatten()
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets)


def trace_llama_style(layers: int, batch: int, seq: int, dtype: torch.dtype, simulate_h100: bool,
                      checkpointing: str = "off") -> tuple:
    import kernel_pytorch
    from kernel_pytorch import api
    from kernel_pytorch.capture import CompilerChoice
    from kernel_pytorch.testing import LlamaStyleLM

    config = llama_config(layers)
    model = _build(lambda: LlamaStyleLM(config), dtype)
    tokens = _tokens(config.vocab_size, batch, seq)
    recorder = Recorder()
    patches = [(CompilerChoice, "compile", lambda self, gm, example_inputs: recorder.compile_fx(gm, example_inputs))]
    if simulate_h100:
        hardware = h100_hardware()
        patches.append((api, "detect_hardware", lambda device="auto": hardware))
        # The cuDNN kernel the H100 gets, traced on CPU fake tensors: its fake implementation (aten's meta
        # kernel) answers for any device once the custom op's device check lets a CPU tensor through.
        attention_ops = importlib.import_module("kernel_pytorch.ops.attention")  # the package re-exports a function

        patches.append((attention_ops, "_refuse_device", lambda kernel, q: None))
        # The norm / RoPE / activation triton_ops take their Triton path on CPU tensors, as on the GPU: the
        # graph then holds the Triton kernels (opaque to the partitioner) rather than their aten fallback.
        triton_utils = importlib.import_module("kernel_pytorch.ops.triton_utils")
        if triton_utils.HAS_TRITON:
            patches.append((triton_utils, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"})))
            patches += _sm90_triton_target()
    with _patched(patches):
        memory = {"memory": {"checkpointing": checkpointing}} if checkpointing != "off" else {}
        model = kernel_pytorch.optimize(model, example_inputs=(tokens,), mode="training", verify=False,
                                        compile=True, strict=True, **memory)
        model.zero_grad(set_to_none=True)
        _loss(model(tokens), tokens).backward()  # the step's own call: records forward and backward
    report = kernel_pytorch.report_of(model)
    info = {"rewrites": dict(collections.Counter(r.pass_name for r in report.rewrites)),
            "rewrite_lines": sorted({r.replacement for r in report.rewrites}),
            "skipped": sorted({f"{s.pass_name}: {s.reason}" for s in report.skipped})[:20],
            "notes": report.notes, "graphs": report.graphs,
            "hardware": hardware.summary() if simulate_h100 else "this CPU"}
    return recorder, info


def trace_hf_llama(layers: int, batch: int, seq: int, dtype: torch.dtype) -> tuple:
    import transformers

    from benchmarks.e2e import hf_llama_config

    config = hf_llama_config(llama_config(layers), "sdpa")
    model = _build(lambda: transformers.LlamaForCausalLM(config), dtype)
    tokens = _tokens(config.vocab_size, batch, seq)
    recorder = Recorder()
    compiled = torch.compile(model, backend=recorder.compile_fx)
    for _ in range(2):  # a second call: any recompilation (a guard on the first call's state) is recorded too
        model.zero_grad(set_to_none=True)
        _loss(compiled(input_ids=tokens).logits, tokens).backward()
    forwards = [g for g in recorder.graphs if not g.backward]
    info = {"graphs": len(forwards), "model": "transformers LlamaForCausalLM, attn_implementation='sdpa'"}
    if len(forwards) > 1:  # keep the graphs of the first call only
        seen, kept = 0, []
        for g in recorder.graphs:
            seen += not g.backward
            if seen <= _first_call_graphs(recorder):
                kept.append(g)
        recorder.graphs = kept
    return recorder, info


def _first_call_graphs(recorder: Recorder) -> int:
    """Forward graphs compiled by the first call: all forwards until the first backward graph follows
    as many backwards as forwards (dynamo compiles forwards in call order, backwards lazily)."""
    forwards = backwards = 0
    for g in recorder.graphs:
        if g.backward:
            backwards += 1
            if backwards == forwards:
                return forwards
        else:
            forwards += 1
    return forwards


class _Sm90Driver:
    """Triton's active driver, as far as Inductor's kernel-mutation analysis asks it (the compile target):
    with no GPU there is no driver, the analysis fails and every kernel argument is taken as mutated (so
    each is cloned, which the H100's graph would not do)."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def _sm90_triton_target() -> list:
    config = importlib.import_module("triton.runtime.driver").driver  # the DriverConfig instance
    return [(config, "_active", _Sm90Driver())]


@contextlib.contextmanager
def _patched(patches: list):
    old = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(old):
            setattr(obj, name, value)


# -------------------------------------------------------------------------------------------- analysis

@dataclass
class Saved:
    """One storage kept for the backward: its owning node and the saved outputs that view it."""

    base: torch.fx.Node
    bytes: int
    shape: tuple
    dtype: torch.dtype
    layer: str  # "layers.N" or "" (outside the layers)
    producer: str  # module path inside the layer + op
    is_input: bool  # a graph input (parameter, buffer, model input): alive anyway
    views: list[str] = field(default_factory=list)


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        return bool(target.is_view)
    return target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def storage_base(node: torch.fx.Node) -> tuple[torch.fx.Node, list[str]]:
    """The node whose storage ``node`` lives in, and the view ops passed through."""
    chain = []
    while _is_view(node) and isinstance(node.args[0], torch.fx.Node):
        chain.append(_op_name(node))
        node = node.args[0]
    return node, chain


def _op_name(node: torch.fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    target = node.target
    name = getattr(target, "__name__", str(target))
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target._schema.name.split('::')[-1]}"
    elif isinstance(target, torch._ops.HigherOrderOperator):
        name = target.name()
        if "triton_kernel" in name:
            kernel = node.kwargs.get("kernel_idx")
            try:
                from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

                name = f"triton:{kernel_side_table.get_kernel(kernel).fn.__name__}"
            except Exception:  # noqa: BLE001, S110 - a name for the table only: the HOP's name stays
                pass
    elif name == "getitem" and isinstance(node.args[0], torch.fx.Node):
        return f"{_op_name(node.args[0])}[{node.args[1]}]"
    return name


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        return _clean_path(list(stack.values())[-1][0])
    return ""


def _clean_path(path: str) -> str:
    path = re.sub(r"^L\[['\"](self|module)['\"]\]\.?|^L__(self|module)___?|^self\.?", "", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path).replace("_modules['", "").replace("']", "")
    return re.sub(r"layers_(\d+)_", r"layers.\1.", path)


def _provenance(node: torch.fx.Node) -> str:
    """The name of the node of the captured (rewritten) graph this one was traced from (``from_node``)."""
    sources = node.meta.get("from_node") or []
    return getattr(sources[0], "name", "") if sources else ""


def _split_layer(path: str) -> tuple[str, str] | None:
    match = _LAYER.search(path)
    if not match:
        return None
    return f"layers.{int(match.group(1))}", path[match.end():].lstrip("._") or "(block)"


def _layer_and_local(node: torch.fx.Node) -> tuple[str, str]:
    """(``layers.N`` or "", the module path inside it). A node without a module stack (a rewrite that
    spans modules, e.g. a residual add fused into the next norm) takes the layer of the nearest node that
    consumes it and is named "<captured node> -> <consumer's module>"."""
    path = _module_path(node)
    found = _split_layer(path) if path else None
    if found:
        return found
    if path:
        return "", path
    trace = _split_layer(" ".join(re.findall(r"layers\S*", node.meta.get("stack_trace") or "")))
    if trace:
        return trace
    seen, frontier = {node}, list(node.users)
    for _ in range(12):
        following = []
        for user in frontier:
            if user in seen:
                continue
            seen.add(user)
            user_path = _module_path(user)
            if user_path:
                layer, local = _split_layer(user_path) or ("", user_path)
                return layer, f"{_provenance(node) or node.name} -> {local}"
            following += list(user.users)
        frontier = following
    return "", _provenance(node) or "(model)"


def _nbytes(value: torch.Tensor) -> int:
    try:
        return int(value.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001 - a tensor without storage (symbolic sizes): from its strides
        size = 1 + sum((int(s) - 1) * int(st) for s, st in zip(value.shape, value.stride())) if value.numel() else 0
        return size * value.element_size()


def saved_tensors(record: Recorded, seq: int) -> list[Saved]:
    """The storages the forward ``record`` keeps for the backward. A (seq x seq) tensor (an attention mask)
    (4-D: SDPA's mask layout) is used by every layer: it is put outside the layers, named "shared", so that
    it is counted once."""
    outputs = _outputs(record.gm)
    start = record.num_forward if record.num_forward is not None else 0
    bases: dict[torch.fx.Node, Saved] = {}
    for out in outputs[start:]:
        if not isinstance(out, torch.fx.Node) or not isinstance(out.meta.get("val"), torch.Tensor):
            continue  # symbolic sizes, None
        base, chain = storage_base(out)
        value = base.meta.get("val")
        if not isinstance(value, torch.Tensor):
            value = out.meta["val"]
        if base not in bases:
            layer, local = _layer_and_local(base)
            if value.dim() == 4 and int(value.shape[-1]) == int(value.shape[-2]) == seq:  # (B, H|1, S, S)
                layer, local = "", f"shared by the layers, (seq x seq): {layer} {local}"
            bases[base] = Saved(base, _nbytes(value), tuple(int(s) for s in value.shape), value.dtype, layer,
                                f"{local}: {_op_name(base)}", base.op == "placeholder")
        if chain:
            bases[base].views.append("/".join(reversed(chain)))
    return list(bases.values())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float32", "fp32")


def summarize(saved: list[Saved]) -> dict:
    """Per layer: producer -> (bytes, count, shape/dtype); plus inputs and the rest of the model."""
    layers: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    inputs = []
    for s in saved:
        if s.is_input:
            inputs.append(s)
            continue
        key = s.producer
        entry = layers[s.layer].setdefault(key, {"bytes": 0, "count": 0, "shapes": set(), "views": set()})
        entry["bytes"] += s.bytes
        entry["count"] += 1
        entry["shapes"].add(f"{_dtype_name(s.dtype)}{list(s.shape)}")
        entry["views"].update(s.views)
    return {"layers": layers, "inputs": inputs}


def fmt(nbytes: float) -> str:
    return f"{nbytes / MiB:9.2f} MiB"


def print_tables(name: str, summary: dict, scale_tokens: float, scale_layers: int, n_layers: int) -> dict:
    layers = summary["layers"]
    block_names = sorted((k for k in layers if k), key=lambda k: int(k.split(".")[1]))
    print(f"\n=== {name}: saved for the backward (bytes as traced) ===")
    per_layer_totals = {}
    for layer in block_names + ([""] if "" in layers else []):
        rows = sorted(layers[layer].items(), key=lambda kv: -kv[1]["bytes"])
        total = sum(e["bytes"] for _, e in rows)
        per_layer_totals[layer] = total
        print(f"-- {layer or 'outside the layers'}: {fmt(total)} in {sum(e['count'] for _, e in rows)} storages")
        for producer, e in rows:
            views = f"  (saved as views: {', '.join(sorted(e['views']))})" if e["views"] else ""
            print(f"   {fmt(e['bytes'])}  x{e['count']:<2} {producer:<55} {', '.join(sorted(e['shapes']))}{views}")
    inputs = summary["inputs"]
    if inputs:
        print(f"-- graph inputs saved (parameters, buffers, tokens: alive anyway, not counted): {len(inputs)}, "
              f"{fmt(sum(s.bytes for s in inputs))}")
    block_total = sum(per_layer_totals[k] for k in block_names)
    mean = block_total / max(len(block_names), 1)
    outside = per_layer_totals.get("", 0)
    scaled = (mean * scale_layers + outside) * scale_tokens
    print(f"total: {fmt(block_total + outside)} ({len(block_names)} layers, {fmt(mean)} per layer, "
          f"{fmt(outside)} outside)")
    print(f"scaled to {scale_layers} layers x {scale_tokens:g}x the tokens: per layer {fmt(mean * scale_tokens)}, "
          f"outside {fmt(outside * scale_tokens)}, total {scaled / GiB:.3f} GiB")
    return {"per_layer_mean_bytes": mean, "outside_bytes": outside, "scaled_total_bytes": scaled,
            "scaled_per_layer_bytes": mean * scale_tokens,
            "per_layer": {layer: {p: {"bytes": e["bytes"], "count": e["count"], "shapes": sorted(e["shapes"]),
                                      "views": sorted(e["views"])} for p, e in layers[layer].items()}
                          for layer in layers}}


_EXTERN = ("mm", "addmm", "bmm", "_scaled_dot_product", "attention", "triton", "convolution", "cat",
           "embedding_dense_backward", "scatter", "index_put")
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "var", "prod", "argmax")


def _materialized(node: torch.fx.Node, outputs: set) -> bool:
    """Whether Inductor (roughly) gives ``node`` a buffer of its own: extern kernels (matmuls, attention,
    custom/Triton ops), concatenations, reductions, graph outputs and what feeds an extern kernel; other
    pointwise results are taken as fused into their consumers."""
    if node.op != "call_function" or _is_view(node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    op = _op_name(node)
    if any(m in op for m in _EXTERN) or op.split("[")[0] in _REDUCTIONS or node in outputs:
        return True
    users, seen = list(node.users), set()
    while users:
        user = users.pop()
        if user in seen:
            continue
        seen.add(user)
        if _is_view(user):
            users += list(user.users)
        elif user.op == "call_function" and any(m in _op_name(user) for m in _EXTERN):
            return True
    return False


def transient_peak(record: Recorded, parameter_views: frozenset = frozenset()) -> dict:
    """A liveness walk over a graph in its node order. Counted: the graph's non-parameter inputs (for a
    backward: the saved tensors and incoming gradients) until their last use, the buffers it makes
    (``_materialized``; a view keeps its base) until their last use, and what it returns from the moment it
    is made (for a backward: the parameter gradients). Returns the largest total above the total at the
    start ("transient"), where it happens, and the largest buffers made inside the graph alive then; a rough
    model of Inductor (which fuses more, reuses buffers, and may reorder)."""
    graph = record.gm.graph
    outputs = {a for a in _outputs(record.gm) if isinstance(a, torch.fx.Node)}
    order = {n: i for i, n in enumerate(graph.nodes)}
    base_of = {n: storage_base(n)[0] for n in graph.nodes}
    last_use: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            base = base_of[arg]
            last_use[base] = max(last_use.get(base, 0), order[node])
    output_bases = {base_of[o] for o in outputs}
    alive: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "placeholder" and not node.name.startswith("primals") and node.name not in parameter_views and \
                isinstance(node.meta.get("val"), torch.Tensor):
            alive[node] = node.meta["val"].numel() * node.meta["val"].element_size()
    start = sum(alive.values())
    peak, peak_at, peak_set = 0, None, []
    for node in graph.nodes:
        if node.op == "output":
            break
        if node.op != "placeholder" and (_materialized(node, outputs) or node in output_bases):
            alive[node] = _nbytes(node.meta["val"])
        total = sum(alive.values()) - start
        if total > peak:
            peak, peak_at = total, node
            peak_set = sorted(((b, n) for n, b in alive.items() if n.op != "placeholder"), key=lambda x: -x[0])
        for dead in [n for n in alive if n not in output_bases and last_use.get(n, -1) <= order[node]]:
            del alive[dead]
    rows = []
    for nbytes, n in peak_set[:10]:
        layer, local = _layer_and_local(n)
        kind = " (returned)" if n in output_bases else ""
        value = n.meta["val"]
        rows.append((nbytes, f"{layer + ' ' if layer else ''}{local}: {_op_name(n)} {_dtype_name(value.dtype)}"
                             f"{list(value.shape)}{kind}"))
    where = ""
    if peak_at is not None:
        layer, local = _layer_and_local(peak_at)
        where = f"{layer} {local}: {_op_name(peak_at)}".strip()
    return {"start_bytes": start, "peak_above_start_bytes": peak, "at": where, "largest": rows}


# ------------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("llama-style", "hf-llama", "both"), default="both")
    parser.add_argument("--layers", type=int, default=2, help="transformer layers traced (default 2)")
    parser.add_argument("--tokens", type=int, default=2048, help="sequence length traced (default 2048)")
    parser.add_argument("--batch", type=int, default=1, help="batch traced (default 1)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--scale-to", default="4x2048x12", metavar="BxSxL",
                        help="report totals at batch x seq x layers (default: issue 9's step, 4x2048x12)")
    parser.add_argument("--no-simulate-h100", action="store_true",
                        help="llama-style: let optimize probe this CPU (attention kernel 'sdpa', CPU machine balance "
                             "for the horizontal GEMM decision) instead of making the H100's choices")
    parser.add_argument("--backward", action="store_true",
                        help="also estimate each graph's transient peak (its own buffers alive at once, by a liveness "
                             "walk in node order) and list what is alive then")
    parser.add_argument("--graphs", action="store_true", help="print the recorded forward graphs")
    parser.add_argument("--checkpointing", choices=("off", "full", "selective"), default="off",
                        help="llama-style: optimize's memory={'checkpointing': ...} on every block")
    parser.add_argument("--no-marginal", action="store_true",
                        help="scale with the mean per-layer bytes instead of tracing once more with one more layer "
                             "(the marginal layer's bytes are exact whatever layer a tensor is attributed to)")
    parser.add_argument("--json", type=Path, default=None, help="write the tables to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    batch, seq, layers = (int(x) for x in args.scale_to.lower().split("x"))
    scale_tokens = batch * seq / (args.batch * args.tokens)
    models = ["llama-style", "hf-llama"] if args.model == "both" else [args.model]
    results = {}
    for name in models:
        started = time.perf_counter()
        torch._dynamo.reset()
        if name == "llama-style":
            recorder, info = trace_llama_style(args.layers, args.batch, args.tokens, dtype, not args.no_simulate_h100,
                                               args.checkpointing)
        else:
            recorder, info = trace_hf_llama(args.layers, args.batch, args.tokens, dtype)
        seconds = time.perf_counter() - started
        forwards = [g for g in recorder.graphs if not g.backward]
        print(f"\n##### {name}: {len(forwards)} forward graph(s), {len(recorder.graphs) - len(forwards)} backward, "
              f"traced in {seconds:.0f} s; {json.dumps(info, indent=1, default=str)}")
        saved = [s for g in forwards for s in saved_tensors(g, args.tokens)]
        if args.graphs:
            for g in forwards:
                print(g.gm.print_readable(print_output=False))
        table = print_tables(name, summarize(saved), scale_tokens, layers, args.layers)
        if args.backward:
            parameter_views = frozenset(o.name for g in forwards for o in _outputs(g.gm)[g.num_forward or 0:]
                                        if isinstance(o, torch.fx.Node) and storage_base(o)[0].op == "placeholder")
            for kind, graphs in (("forward", forwards), ("backward", [g for g in recorder.graphs if g.backward])):
                for g in graphs:
                    t = transient_peak(g, parameter_views)
                    print(f"\n-- {name}: {kind} graph, liveness estimate as traced: inputs {fmt(t['start_bytes'])}, "
                          f"peak {fmt(t['peak_above_start_bytes'])} above them at {t['at']}; buffers alive then:")
                    for nbytes, what in t["largest"]:
                        print(f"   {fmt(nbytes)}  {what}")
                    table.setdefault("transients", {})[kind] = t
        if not args.no_marginal:
            torch._dynamo.reset()
            more = (trace_llama_style(args.layers + 1, args.batch, args.tokens, dtype, not args.no_simulate_h100,
                                      args.checkpointing)
                    if name == "llama-style" else trace_hf_llama(args.layers + 1, args.batch, args.tokens, dtype))[0]
            total = lambda rec: sum(x.bytes for g in rec.graphs if not g.backward
                                    for x in saved_tensors(g, args.tokens) if not x.is_input)
            traced, marginal = total(recorder), total(more) - total(recorder)
            scaled = (traced + (layers - args.layers) * marginal) * scale_tokens
            print(f"marginal layer (traced with {args.layers + 1} layers minus {args.layers}): {fmt(marginal)}; "
                  f"{fmt(marginal * scale_tokens)} scaled; total scaled to {layers} layers: {scaled / GiB:.3f} GiB")
            table.update(marginal_layer_bytes=marginal, scaled_per_layer_bytes=marginal * scale_tokens,
                         scaled_total_bytes=scaled)
        results[name] = {"info": info, "seconds": round(seconds, 1), **table}
    if len(models) == 2:
        compare(results, scale_tokens)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


def compare(results: dict, scale_tokens: float) -> None:
    ours, hf = results["llama-style"], results["hf-llama"]
    print("\n=== difference, scaled (llama-style optimize minus HF sdpa + compile) ===")
    print(f"per layer (marginal unless --no-marginal): {fmt(ours['scaled_per_layer_bytes'])} vs "
          f"{fmt(hf['scaled_per_layer_bytes'])}: "
          f"{fmt(ours['scaled_per_layer_bytes'] - hf['scaled_per_layer_bytes'])}")
    print(f"outside the layers: {fmt(ours['outside_bytes'] * scale_tokens)} vs {fmt(hf['outside_bytes'] * scale_tokens)}")
    print(f"total: {ours['scaled_total_bytes'] / GiB:.3f} GiB vs {hf['scaled_total_bytes'] / GiB:.3f} GiB: "
          f"{(ours['scaled_total_bytes'] - hf['scaled_total_bytes']) / MiB:+.1f} MiB")


if __name__ == "__main__":
    main()
