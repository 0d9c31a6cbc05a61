"""Compile a captured inference graph one repeated block at a time, each structurally identical block once.

Inductor's compile time grows with the graph, and a transformer's graph holds every layer: the generation warm-up of
a 16-layer model spent most of its time compiling four whole-model graphs, and a 32-layer one did not finish in
440 s (docs/kernels.md, "Generation warm-up"). The layers are the same code on other weights, so this module:

1. propagates fake values through the rewritten graph (the shapes, symbolic ones included, of every node), under
   PyTorch's Python dispatcher as TorchDynamo and AOTAutograd do: there ops such as ``matmul`` decompose in Python,
   on symbolic sizes; their C++ decomposition read a CUDA tensor's sizes as numbers, which pinned the batch of the
   rotary table's ``matmul`` to the traced one (on an H100 the batch-2 decode step then compiled again at batch 8);
2. splits it into partitions: one per block (``layers.N`` in the nodes' module path,
   :func:`~kernel_pytorch.passes.graph_utils.block_of`), the nodes outside the blocks with the latest partition of
   their inputs (those of none, before the first block: the embedding, the mask, the rotary table, with the first
   block), and the nodes after the last block's in a partition of their own (the head). No node is numbered below
   its inputs, so the partitions form a chain;
3. compiles each partition whose structure (ops, constant arguments, and the shapes, strides, dtypes, devices and
   aliasing of its inputs) was not compiled before, and calls the first compilation for the others: the weights and
   caches are the partitions' inputs, so one compiled layer serves every layer.

The result is a ``GraphModule`` calling the compiled partitions in order. Partitions that read a constant attribute
of the graph are keyed by that attribute's name, so they are never shared.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.split_module import split_module
from torch.multiprocessing.reductions import StorageWeakRef

from kernel_pytorch.passes.graph_utils import block_of, layout_of, module_path_of

__all__ = ["compile_blocks_once", "compile_per_block"]

_CALLS = ("call_function", "call_method", "call_module", "get_attr")


def compile_blocks_once(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                        compile_graph: Callable[[torch.fx.GraphModule, list], Callable[..., Any]]
                        ) -> torch.fx.GraphModule:
    """``gm`` split into block partitions, each compiled by ``compile_graph`` once per distinct structure; the
    returned module's ``block_compile_note`` says how many were compiled and reused. Raises ``ValueError`` for a
    graph with fewer than two blocks (nothing to share)."""
    blocks = {block_of(module_path_of(node)) for node in gm.graph.nodes if node.op in _CALLS} - {""}
    if len(blocks) < 2:
        raise ValueError(f"{len(blocks)} repeated block(s) in the graph: nothing to compile once and share")
    fake_mode = torch._guards.TracingContext.get().fake_mode  # the capture's: its symbolic sizes
    fakes = [fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in example_inputs]
    with enable_python_dispatcher():  # as TorchDynamo and AOTAutograd propagate: step 1 of the module docstring
        FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*fakes)
    partitions = _partition_numbers(gm)
    split = split_module(gm, None, partitions.__getitem__, keep_original_order=True)
    values = {node.name: node.meta.get("val") for node in gm.graph.nodes}
    _check_sizes_are_bound(partitions, split, values)
    compiled: dict[tuple, _CompiledPartition] = {}
    reused = 0
    for name, partition in list(split.named_children()):
        inputs = [values[node.name] for node in partition.graph.nodes if node.op == "placeholder"]
        key = _structure(partition, inputs)
        if key in compiled:
            reused += 1
        else:
            compiled[key] = _CompiledPartition.of(partition, inputs, compile_graph)
        setattr(split, name, compiled[key])
    split.block_compile_note = (f"compiled one repeated block at a time: {len(compiled) + reused} partitions, "
                                f"{len(compiled)} compiled, {reused} sharing an identical one's compilation")
    return split


def compile_per_block(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                      compile_graph: Callable[[torch.fx.GraphModule, list], Callable[..., Any]]) -> torch.nn.Module:
    """:func:`compile_blocks_once`, or the whole graph compiled where it cannot split it; either way the module's
    ``block_compile_note`` says which."""
    try:
        return compile_blocks_once(gm, example_inputs, compile_graph)
    except Exception as error:  # the whole graph compiled instead, and the note says why
        whole = _CompiledPartition(compile_graph(gm, list(example_inputs)), single_output=False)
        whole.block_compile_note = f"compiled whole, not one block at a time ({type(error).__name__}: {error})"
        return whole


def _partition_numbers(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """1, 2, ... per block in order of first appearance; a node outside the blocks joins the latest partition of its
    inputs (the first block's for none: the embedding, the mask, the rotary table, whose sizes often come from
    ``SymInt`` inputs alone while the first block's cache tensors carry them), and after the last block's nodes a
    partition of its own (the head). No node is numbered below its inputs, so the partitions form a chain."""
    nodes = list(gm.graph.nodes)
    blocks = [block_of(module_path_of(node)) if node.op in _CALLS else "" for node in nodes]
    last = max((i for i, block in enumerate(blocks) if block), default=-1)
    numbers: dict[torch.fx.Node, int] = {}
    order: dict[str, int] = {}
    for position, (node, block) in enumerate(zip(nodes, blocks)):
        if node.op not in _CALLS:
            continue
        after_inputs = max((numbers[i] for i in node.all_input_nodes if i in numbers), default=1)
        if _takes_from_a_tuple(node) and node.args[0] in numbers:
            numbers[node] = numbers[node.args[0]]  # a tuple never crosses partitions: compiled graphs return flat
        elif block:
            numbers[node] = max(order.setdefault(block, len(order) + 1), after_inputs)
        else:
            numbers[node] = len(order) + 1 if position > last else after_inputs
    return numbers


def _check_sizes_are_bound(partitions: dict[torch.fx.Node, int], split: torch.fx.GraphModule,
                           values: dict[str, Any]) -> None:
    """Raises ``ValueError`` where a partition computes with a symbolic size that none of its tensor inputs has as a
    dimension: Inductor binds sizes from tensor inputs, and such a partition fails when called (on an H100, a prefill
    mask of (1, 1, 512, s18) sized by the cache length, a ``SymInt`` input, raised ``NameError: s18``)."""
    needed: dict[int, set] = {}
    for node, number in partitions.items():
        needed.setdefault(number, set()).update(free_symbols(node.meta.get("val")))
    for number, symbols in needed.items():
        partition = getattr(split, f"submod_{number}")
        inputs = [values[node.name] for node in partition.graph.nodes if node.op == "placeholder"]
        bound = {size.node.expr for value in inputs if isinstance(value, torch.Tensor)
                 for size in value.shape if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol}
        if symbols - bound:
            missing = ", ".join(sorted(map(str, symbols - bound)))
            raise ValueError(f"partition {number} computes with size(s) {missing} that no tensor input of it carries")


def _takes_from_a_tuple(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int)
            and isinstance(node.args[0], torch.fx.Node))


def _structure(partition: torch.fx.GraphModule, inputs: list[Any]) -> tuple:
    """What a partition's compilation depends on: each node's op, target and arguments (nodes by position), and each
    input's shape, stride, dtype, device and which earlier input shares its storage."""
    position: dict[torch.fx.Node, int] = {}
    storages: dict[StorageWeakRef, int] = {}
    items: list[tuple] = []
    placeholders = iter(inputs)
    for index, node in enumerate(partition.graph.nodes):
        position[node] = index
        if node.op == "placeholder":
            items.append(_input_signature(next(placeholders), index, storages))
            continue
        arguments = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: ("node", position[n]))
        items.append((node.op, _target_name(node), repr(arguments)))
    return tuple(items)


def _input_signature(value: Any, index: int, storages: dict[StorageWeakRef, int]) -> tuple:
    if not isinstance(value, torch.Tensor):
        return layout_of(value)
    return (*layout_of(value), storages.setdefault(StorageWeakRef(value.untyped_storage()), index))


def _target_name(node: torch.fx.Node) -> str:
    if node.op in ("get_attr", "call_method", "call_module"):
        return str(node.target)  # an attribute's name: partitions reading other attributes are not shared
    return torch.fx.node._get_qualified_name(node.target) if callable(node.target) else str(node.target)


class _CompiledPartition(torch.nn.Module):
    """A compiled partition, called with the partition's inputs; a partition with one output returns it bare."""

    def __init__(self, compiled: Callable[..., Any], single_output: bool):
        super().__init__()
        self.compiled, self.single_output = compiled, single_output

    @classmethod
    def of(cls, partition: torch.fx.GraphModule, inputs: list[Any],
           compile_graph: Callable[[torch.fx.GraphModule, list], Callable[..., Any]]) -> _CompiledPartition:
        output = next(node for node in partition.graph.nodes if node.op == "output")
        single_output = not isinstance(output.args[0], (tuple, list))
        if single_output:  # compilers take graphs that return a tuple
            output.args = ((output.args[0],),)
            partition.recompile()
        return cls(compile_graph(partition, inputs), single_output)

    def forward(self, *args: Any) -> Any:
        outputs = self.compiled(*args)
        return outputs[0] if self.single_output else outputs
