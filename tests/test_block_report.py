"""The per-block lines of the report (``OptimizationReport.blocks``): which rewrites each repeated block got,
and its graph operations before and after the passes."""

from __future__ import annotations

import pytest
import torch

import kernel_pytorch
from kernel_pytorch.passes.graph_utils import block_of
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM


def _report(**options):
    torch.manual_seed(0)
    model = LlamaStyleLM(LlamaStyleConfig.tiny(n_layers=3)).train()
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    return kernel_pytorch.report_of(kernel_pytorch.optimize(model, example_inputs=(tokens,), **options))


@pytest.mark.parametrize("options", ({}, {"memory": {"checkpointing": "full"}}), ids=("plain", "checkpointed"))
def test_each_block_lists_its_rewrites_and_fewer_ops(options):
    report = _report(**options)
    blocks = {b.block: b for b in report.blocks}
    assert [name for name in blocks if name] == ["layers.0", "layers.1", "layers.2"]
    for name in ("layers.0", "layers.1", "layers.2"):
        block = blocks[name]
        assert set(block.rewrites) == {"norms", "activations", "rope", "attention"}, block
        assert 0 < block.ops_after < block.ops_before, block
    # Every rewrite is counted in exactly one block line.
    assert sum(sum(b.rewrites.values()) for b in report.blocks) == len(report.rewrites)
    assert report.to_dict()["blocks"][1]["block"] == "layers.0"


def test_blocks_order_naturally_whatever_their_names():
    from kernel_pytorch.report import natural_order

    names = ["layers.10", "", "0", "layers.2", "h.1", "layers.2.x"]
    assert sorted(names, key=natural_order) == ["", "0", "h.1", "layers.2", "layers.2.x", "layers.10"]


def test_block_of_paths():
    assert block_of("layers.3.attn.q_proj") == "layers.3"
    assert block_of("model.layers.10.mlp") == "model.layers.10"
    assert block_of("lm_head") == "" and block_of("") == ""
