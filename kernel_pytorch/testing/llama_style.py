"""A Llama-style decoder written by hand: the model of docs/design.md's baselines.

Everything a fused-kernel library has to recognise is spelled out the way model code writes it:
attention with an additive causal mask and a float32 softmax, RMSNorm with a float upcast, rotate-half
RoPE, grouped-query attention through ``repeat_kv`` (expand + reshape), and a SwiGLU MLP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaStyleConfig", "LlamaStyleLM", "LlamaStyleBlock", "LlamaStyleAttention", "LlamaStyleMLP",
           "RMSNorm", "apply_rotary", "rotary_tables"]


@dataclass(frozen=True)
class LlamaStyleConfig:
    """Defaults are docs/design.md's benchmark model: 12 layers, d 2048, 16 heads (4 kv), ffn 5632, vocab 32000."""

    vocab_size: int = 32000
    dim: int = 2048
    n_layers: int = 12
    n_heads: int = 16
    n_kv_heads: int = 4
    ffn_dim: int = 5632
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0

    @classmethod
    def tiny(cls, **changes) -> LlamaStyleConfig:
        """A few-thousand-parameter version for CPU tests; odd sizes on purpose."""
        base = dict(vocab_size=97, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=80, max_seq_len=64)
        return cls(**{**base, **changes})

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.type_as(x)


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_seq_len, head_dim) in the rotate-half layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, kv_heads, seq, head_dim = x.shape
    if n_rep == 1:
        return x
    x = x[:, :, None, :, :].expand(batch, kv_heads, n_rep, seq, head_dim)
    return x.reshape(batch, kv_heads * n_rep, seq, head_dim)


class LlamaStyleAttention(nn.Module):
    def __init__(self, config: LlamaStyleConfig):
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.n_heads * hd, config.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        c = self.config
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        k = _repeat_kv(k, c.n_heads // c.n_kv_heads)
        v = _repeat_kv(v, c.n_heads // c.n_kv_heads)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(c.head_dim)
        scores = scores + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = F.dropout(probs, p=c.dropout, training=self.training)
        out = torch.matmul(probs, v)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class LlamaStyleMLP(nn.Module):
    def __init__(self, config: LlamaStyleConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaStyleBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaStyleConfig):
        super().__init__()
        self.input_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = LlamaStyleAttention(config)
        self.post_attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = LlamaStyleMLP(config)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.input_norm(x), cos, sin, mask)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaStyleLM(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab). Rotary tables are non-persistent buffers,
    so ``state_dict`` holds only parameters."""

    def __init__(self, config: LlamaStyleConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(LlamaStyleBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.embed(tokens)
        cos = self.rope_cos[:seq].to(x.dtype)
        sin = self.rope_sin[:seq].to(x.dtype)
        mask = torch.full((seq, seq), float("-inf"), device=tokens.device, dtype=x.dtype).triu(1)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))
