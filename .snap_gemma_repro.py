"""GPU: where Gemma-2's soft-capped flex training compile fails (traceback), and flex+softcap alone compiled."""
import traceback
import torch, transformers
import kernel_pytorch.compiled_call as cc
from kernel_pytorch import optimize, report_of
from kernel_pytorch.ops.attention import attention

orig = cc.CompiledCall._after_compile_failure
def patched(self, failure, *a):
    traceback.print_exception(failure)
    return orig(self, failure, *a)
cc.CompiledCall._after_compile_failure = patched

q, k, v = (torch.randn(2, 8, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
f = torch.compile(lambda q, k, v: attention(q, k, v, is_causal=True, kernel="flex", softcap=50.0), fullgraph=True)
try:
    f(q, k, v).sum().backward(); print("flex softcap compiled alone: ok", flush=True)
except Exception:
    traceback.print_exc()
torch.manual_seed(0)
config = transformers.Gemma2Config(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                   max_position_embeddings=4096, sliding_window=512)
config._attn_implementation = "eager"
model = transformers.Gemma2ForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).train()
tokens = {"input_ids": torch.randint(0, 512, (2, 2048), device="cuda")}
optimize(model, example_inputs=tokens)
print([r.replacement for r in report_of(model).rewrites if r.pass_name == "attention"])
print(report_of(model).summary() if hasattr(report_of(model), "summary") else report_of(model))
