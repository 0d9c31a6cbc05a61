"""The decode_attention pass (kernel_pytorch/passes/decode_attention.py): one-token SDPA calls of decode steps go to
the decode op, on transformers families with SDPA attention and on a plain decode loop; other calls are left to
the attention pass; results equal the unoptimized model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernel_pytorch
from kernel_pytorch import report_of

from .generation_models import causal_lm, left_padded_prompts

# GQA through repeat_kv, a sliding-window mask, MHA (tests/test_generation.py runs every family's tokens through the
# same pass; these count its rewrites)
SDPA_FAMILIES = ["llama", "mistral_sliding", "gpt2"]


def _decode_rewrites(model) -> list:
    return [r for r in report_of(model).rewrites if r.pass_name == "decode_attention"]


@pytest.mark.parametrize("family", SDPA_FAMILIES)
def test_decode_steps_of_transformers_models_take_the_decode_op(family):
    model = causal_lm(family)
    reference = copy.deepcopy(model)
    optimized = kernel_pytorch.optimize(model)
    input_ids, attention_mask = left_padded_prompts(3, 9)
    tokens = optimized.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
    expected = reference.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(tokens, expected)
    rewrites = _decode_rewrites(optimized)
    # every layer of the step graph, and nothing in the prefill's (many query tokens)
    assert len(rewrites) == model.config.num_hidden_layers, rewrites
    assert len({r.graph for r in rewrites}) == 1
    assert all("-> decode_attention" in r.replacement for r in rewrites)
    # the cache as it is (repeat_kv read through): 2 cache heads for 4 query heads in the GQA families
    kv_heads = model.config.num_key_value_heads if family != "gpt2" else model.config.n_head
    assert all(f", {kv_heads}, 256, 16) cache, 4 query heads" in r.replacement for r in rewrites), rewrites


class CachedAttention(nn.Module):
    """A plain decode step: one new token's q/k/v, the k/v written into a cache buffer at ``position``, SDPA over
    the cache with GQA and a mask of the filled positions."""

    def __init__(self, dim=64, heads=8, kv_heads=2, length=40):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.register_buffer("k_cache", torch.randn(1, kv_heads, length, self.head_dim))
        self.register_buffer("v_cache", torch.randn(1, kv_heads, length, self.head_dim))

    def forward(self, x, position):
        q = self.q(x).view(1, 1, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(1, 1, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        self.k_cache.index_copy_(2, position, k)
        self.v_cache.index_copy_(2, position, v)
        filled = (torch.arange(self.k_cache.shape[2]) <= position)[None, None, None, :]
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=filled, enable_gqa=True)
        return out.transpose(1, 2).reshape(1, 1, -1)


def test_a_plain_decode_step_takes_the_decode_op():
    torch.manual_seed(0)
    model = CachedAttention().eval()
    reference = copy.deepcopy(model)
    x, position = torch.randn(1, 1, 64), torch.tensor([7])
    optimized = kernel_pytorch.optimize(model, example_inputs=(x, position))
    with torch.no_grad():
        for step in range(7, 12):
            x = torch.randn(1, 1, 64)
            got, want = optimized(x, torch.tensor([step])), reference(x, torch.tensor([step]))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(_decode_rewrites(optimized)) == 1


class OneQueryAttention(nn.Module):
    """One query token attending over a context (attention pooling): a one-token SDPA call that trains."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))

    def forward(self, query, context):
        def split(t):
            return t.view(t.shape[0], t.shape[1], self.heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(split(self.q(query)), split(self.k(context)), split(self.v(context)))
        return out.transpose(1, 2).flatten(2)


def test_training_graphs_are_left_to_the_attention_pass():
    torch.manual_seed(0)
    model = OneQueryAttention().train()
    optimized = kernel_pytorch.optimize(model, example_inputs=(torch.randn(2, 1, 64), torch.randn(2, 9, 64)))
    skipped = [s for s in report_of(optimized).skipped if s.pass_name == "decode_attention"]
    assert not _decode_rewrites(optimized)
    assert [s.reason for s in skipped] == ["a training graph (the decode kernel has no backward)"]


def test_a_prefill_with_a_symbolic_length_is_passed_over_without_a_guard_on_it():
    """Traced as ``generation.prefill_any_batch`` traces a prefill (sizes of 1 not specialized), comparing the symbolic
    query length with 1 would add a guard to the prefill's graph; the pass reads only what is statically known."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental import _config as shape_config
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from kernel_pytorch.passes import decode_attention

    dynamic_length = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC,
                                                             DimDynamic.DYNAMIC, DimDynamic.STATIC])
    with shape_config.patch(backed_size_oblivious=True):
        shape_env = ShapeEnv()
        q = FakeTensorMode(shape_env=shape_env).from_tensor(torch.randn(1, 4, 9, 16), symbolic_context=dynamic_length)
        graph = torch.fx.Graph()
        node = graph.placeholder("q")
        node.meta["example_value"] = q
        call = graph.call_function(F.scaled_dot_product_attention, (node, node, node, None, 0.0, True),
                                   {"scale": None, "enable_gqa": False})  # the normalize pass's spelling
        assert isinstance(q.shape[2], torch.SymInt) and not shape_env.guards
        assert decode_attention._match(call, None) is None
        assert not shape_env.guards
