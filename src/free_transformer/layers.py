"""Building blocks of the Llama-style decoder: RoPE, grouped-query attention with a KV cache, SwiGLU,
and the pre-norm transformer block. Module names follow Hugging Face's Llama so that weights map
one to one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[Tensor, Tensor]:
    """cos and sin, each (max_seq_len, head_dim), in the rotate-half layout of Llama."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (T, head_dim)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, heads, T, head_dim); cos/sin (T, head_dim) for the positions of x."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KVCache:
    """Keys and values of every attention layer for a batch, filled up to `length` positions."""

    def __init__(self, config: ModelConfig, batch_size: int, *, device=None, dtype=torch.float32):
        shape = (config.n_layers, batch_size, config.n_kv_heads, config.max_seq_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, kv_heads, T, head_dim) at positions [start, start+T); return all up to there."""
        end = start + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        kv_dim = config.n_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.dim, config.dim, bias=False)
        self.k_proj = nn.Linear(config.dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(config.dim, config.dim, bias=False)

    def forward(
        self,
        x_q: Tensor,  # (B, T, D), or (1, 1, D): one query row shared by every position (projected once)
        x_kv: Tensor,  # (B, T, D)
        cos: Tensor,  # (T, head_dim), for positions [start, start+T)
        sin: Tensor,
        *,
        causal: bool,
        cache: KVCache | None = None,
        layer: int = 0,
        start: int = 0,
    ) -> Tensor:
        B, T, _ = x_kv.shape
        q = self.q_proj(x_q).expand(B, T, -1).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, h, T, hd)
        k = self.k_proj(x_kv).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, kv, T, hd)
        v = self.v_proj(x_kv).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, start, k.to(cache.keys.dtype), v.to(cache.values.dtype))
            k, v = k.to(q.dtype), v.to(q.dtype)
        mask, is_causal = None, False
        if causal and start == 0:
            is_causal = T > 1
        elif causal and T > 1:  # a chunk after cached positions: query i sees keys [0, start + i]
            key_pos = torch.arange(start + T, device=q.device)
            mask = key_pos[None, :] <= (start + torch.arange(T, device=q.device))[:, None]  # (T, start+T)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=self.n_kv_heads != self.n_heads
        )  # (B, h, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm block. Queries come from `x`, keys/values from `kv_input` (default: `x` itself).

    `x` may be a single (1, 1, D) row broadcast to every position (the encoder's constant query
    zeta): its norm and query projection are then computed once, and the output is (B, T, D)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self,
        x: Tensor,  # (B, T, D)
        cos: Tensor,
        sin: Tensor,
        *,
        kv_input: Tensor | None = None,  # (B, T, D)
        causal: bool = True,
        cache: KVCache | None = None,
        layer: int = 0,
        start: int = 0,
    ) -> Tensor:
        h_q = self.input_layernorm(x)
        h_kv = h_q if kv_input is None else self.input_layernorm(kv_input)
        x = x + self.self_attn(h_q, h_kv, cos, sin, causal=causal, cache=cache, layer=layer, start=start)
        return x + self.mlp(self.post_attention_layernorm(x))
