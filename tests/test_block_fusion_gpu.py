"""On an NVIDIA GPU (``pytest -m gpu``): block fusion in bf16. The horizontal GEMM pass trains a twin to the
same parameters, and ``compile="reduce-overhead"`` replays CUDA graphs that follow shape changes (a new
length records a new graph; a replay never returns another input's result)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kernel_pytorch import optimize, report_of
from kernel_pytorch.testing import LlamaStyleConfig, LlamaStyleLM

from .conftest import rel_err, twin

pytestmark = pytest.mark.gpu

VOCAB = 512


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.fail("gpu tests were selected (-m gpu) but torch.cuda.is_available() is False")


def _lm(max_seq_len: int) -> LlamaStyleLM:
    torch.manual_seed(0)
    config = LlamaStyleConfig(vocab_size=VOCAB, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=704,
                              max_seq_len=max_seq_len)
    return LlamaStyleLM(config).to(device="cuda", dtype=torch.bfloat16)


def _graph_launches(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(event.count for event in prof.key_averages() if event.key in ("cudaGraphLaunch", "cuGraphLaunch"))


def test_reduce_overhead_replays_cuda_graphs_across_shape_changes():
    counters.clear()
    model = _lm(256).eval()
    reference = twin(model)
    optimize(model, example_inputs=(torch.randint(0, VOCAB, (1, 128), device="cuda"),), compile="reduce-overhead")
    assert report_of(model).verification.passed
    # Same length twice (record, then replay), a new length, the first again, then a third: each call's
    # own tokens, compared with the unoptimized twin.
    with torch.no_grad():
        for seq in (128, 128, 128, 64, 64, 64, 128, 200, 200):
            tokens = torch.randint(0, VOCAB, (1, seq), device="cuda")
            got = model(tokens).clone()  # a replay's outputs live in the graph's pool until the next one
            assert rel_err(got, reference(tokens)) < 2e-2, seq
        assert _graph_launches(lambda: model(torch.randint(0, VOCAB, (1, 64), device="cuda"))) >= 1
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_horizontal_gemm_twin_trains_to_the_same_parameters_in_bf16():
    # 2 x 1024 tokens: above the bf16 training threshold of the pass on an H100 (1727 tokens).
    model = _lm(1024).train()
    reference = twin(model)
    batches = [torch.randint(0, VOCAB, (2, 1025), device="cuda") for _ in range(3)]
    optimize(model, example_inputs=(batches[0][:, :-1],))
    fused = [r.location for r in report_of(model).rewrites if r.pass_name == "horizontal_gemm"]
    assert fused == ["layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"], report_of(model).skipped
    keys = list(reference.state_dict())
    initial = copy.deepcopy(reference.state_dict())
    for net in (model, reference):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
        for batch in batches:
            logits = net(batch[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert list(model.state_dict()) == keys
    for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
        if p.dim() != 2:  # bf16 norm weights at 1.0 do not move: their updates are below half an ulp
            continue
        # SGD is linear in the gradient, and the bf16 GEMMs differ by their rounding only: each matrix
        # moved the same way as its twin's (a gradient missing through the concatenated weight would not).
        update, update_ref = p.float() - initial[name].float(), p_ref.float() - initial[name].float()
        assert update_ref.norm() > 0, name
        assert rel_err(update, update_ref) < 0.25, name  # measured up to 0.10 (k_proj); a lost gradient: 1.0
