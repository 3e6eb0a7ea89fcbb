"""Building blocks of the Llama-style decoder: RoPE, grouped-query attention with a KV cache, SwiGLU,
and the pre-norm transformer block. Module names follow Hugging Face's Llama, except that q/k/v and
gate/up are each one projection (`qkv_proj`, `gate_up_proj`: Llama's matrices stacked by rows;
FUSED_PROJECTIONS says which)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[Tensor, Tensor]:
    """cos and signed sin, each (max_seq_len, head_dim), in the rotate-half layout of Llama: sin's first
    half is negated, so that `apply_rope` rotates with one roll instead of a negation and a concatenation."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # (T, head_dim) each


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, heads, T, head_dim); cos/sin (T, head_dim) from rope_tables, for the positions of x.

    Llama's x * cos + cat(-x2, x1) * sin, with the sign in the table: cat(x2, x1) * cat(-sin, sin), the same
    products to the bit, with one roll where a negation and a concatenation ran (each its own kernel in eager
    decoding). The tables are cast only when their dtype differs from x's: .to(dtype) casts them with the
    weights."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class KVCache:
    """Keys and values of every attention layer for a batch, of static size max_seq_len.

    `length` is the filled length, read and advanced by every forward given the cache with an int start (or
    none). A decoding step (`FreeTransformer.forward` with a (B,) position tensor as `start`) leaves it: its
    caller keeps each row's position (free_transformer.inference.engine). `capacity` positions are held:
    config.max_seq_len unless a shorter cache is asked for."""

    def __init__(
        self, config: ModelConfig, batch_size: int, *, device=None, dtype=torch.float32, capacity: int | None = None
    ):
        capacity = config.max_seq_len if capacity is None else capacity
        if not 0 < capacity <= config.max_seq_len:
            raise ValueError(f"cache capacity must be in [1, max_seq_len = {config.max_seq_len}], got {capacity}")
        shape = (config.n_layers, batch_size, config.n_kv_heads, capacity, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        # (position, scatter index, mask) of the decoding step in progress: made by its first layer's `write_at`,
        # dropped by the model's forward when it ends
        self.step: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, kv_heads, T, head_dim) at positions [start, start+T); return all up to there."""
        end = start + k.shape[2]
        self.keys[layer, :, :, start:end] = k
        self.values[layer, :, :, start:end] = v
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def write_at(self, layer: int, position: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store one position's k, v (B, kv_heads, 1, head_dim) at each row's device index `position` (B,): rows
        at different lengths, decoded together. Return the whole cache of the layer and the additive mask of the
        keys up to each row's position, (B, 1, 1, capacity). The scatter index and the mask are made once per step:
        every layer of a forward passes the same `position` tensor."""
        if self.step is None or self.step[0] is not position:
            key_positions = torch.arange(self.keys.shape[3], device=position.device)
            # (B, kv_heads, 1, head_dim): row b's position in every element of its row's new key
            at = position.view(-1, 1, 1, 1).expand(k.shape)
            # additive (0 or -inf, in the keys' dtype): SDPA would turn a boolean mask into this at every layer
            mask = torch.zeros(k.shape[0], 1, 1, self.keys.shape[3], dtype=k.dtype, device=k.device)
            mask.masked_fill_((key_positions > position[:, None])[:, None, None, :], float("-inf"))
            self.step = (position, at, mask)
        _, at, mask = self.step
        self.keys[layer].scatter_(2, at, k)  # each row's k at its position
        self.values[layer].scatter_(2, at, v)
        return self.keys[layer], self.values[layer], mask

    def view(self, rows: slice, length: int) -> KVCache:
        """Rows `rows` and the first `length` positions of this cache, sharing its storage: what one row's
        prefill writes into, or the decoding step of the rows in flight reads (continuous batching)."""
        view = object.__new__(KVCache)
        view.keys, view.values = self.keys[:, rows, :, :length], self.values[:, rows, :, :length]
        view.length, view.step = 0, None
        return view


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """Scaled dot-product attention of q (B, h, T, hd) over k, v (B, kv, S, hd), kv dividing h, on the
    fastest kernel SDPA has for the case. Grouped-query attention (kv < h) goes through one of three
    exact routes (`gqa_route`): SDPA's own enable_gqa; the query heads of each kv head folded into
    rows (no copy of K/V; for masked or one-token queries, which every kernel takes); or K/V repeated
    to h heads (where enable_gqa would fall back to the math kernel: float32 on CUDA)."""
    B, h, T, hd = q.shape
    groups = h // k.shape[1]
    route = gqa_route(q.device.type, q.dtype, T, mask is not None) if groups > 1 else "native"
    if route == "fold":  # row g * T + t of kv head j is query head j * groups + g at position t
        rows = q.reshape(B, k.shape[1], groups * T, hd)
        mask = mask.repeat(groups, 1) if mask is not None and mask.dim() == 2 and mask.shape[0] > 1 else mask
        # reshape, not view: the memory-efficient CUDA kernel returns its rows head-minor ((B, M, H, K)
        # memory transposed to (B, H, M, K)), and such rows cannot be viewed back as query heads
        return F.scaled_dot_product_attention(rows, k, v, attn_mask=mask).reshape(B, h, T, hd)
    if route == "expand":
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=route == "native")


def gqa_route(device_type: str, dtype: torch.dtype, query_len: int, masked: bool) -> str:
    """How `attend` runs grouped-query attention. On CPU SDPA's enable_gqa is fast in every case. On CUDA
    enable_gqa runs on flash attention only (half precision, no mask; in float32 it falls back to the
    math kernel, slower than K/V repeated: docs/gpu.md): masked and one-token queries
    are folded into rows (the memory-efficient kernel takes masks and float32), unmasked float32 gets
    K/V repeated."""
    if device_type != "cuda":
        return "native"
    if masked or query_len == 1:
        return "fold"
    return "expand" if dtype == torch.float32 else "native"


# Each block's fused input projections and the separate ones they stack by rows, in order (Llama's
# weights, and older checkpoints, hold the parts).
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def qkv_rows(config: ModelConfig) -> tuple[int, int, int]:
    """The rows of q, k and v in the fused qkv_proj weight: q_dim, kv_dim, kv_dim."""
    kv_dim = config.n_kv_heads * config.head_dim
    return config.n_heads * config.head_dim, kv_dim, kv_dim


def part_rows(config: ModelConfig) -> dict[str, list[int]]:
    """The rows of each part of a fused projection, keyed and ordered as FUSED_PROJECTIONS."""
    return {
        "self_attn.qkv_proj.weight": list(qkv_rows(config)),
        "mlp.gate_up_proj.weight": [config.ffn_hidden, config.ffn_hidden],
    }


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        # q, k and v as one (D -> q_dim + 2 kv_dim) projection: a decoding step reads the three weights
        # in one GEMV. Its rows are q's, then k's, then v's (`split_sizes`), as Llama's three matrices stacked.
        self.split_sizes = qkv_rows(config)
        self.qkv_proj = nn.Linear(config.dim, sum(self.split_sizes), bias=False)
        self.o_proj = nn.Linear(config.dim, config.dim, bias=False)

    def project(self, x_q: Tensor, x_kv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (.., q_dim) from x_q and k, v (.., kv_dim) from x_kv: one matmul when they are the same
        input; otherwise (the encoder's constant query, the injection block's X against X + R) the
        weight's q rows on x_q and its k, v rows on x_kv, as two matmuls over views of the one weight."""
        q_dim = self.split_sizes[0]
        if x_q is x_kv:
            return self.qkv_proj(x_q).split(self.split_sizes, dim=-1)
        weight = self.qkv_proj.weight
        k, v = F.linear(x_kv, weight[q_dim:]).split(self.split_sizes[1:], dim=-1)
        return F.linear(x_q, weight[:q_dim]), k, v

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
        start: int | Tensor = 0,  # a (B,) device tensor: each row's position in a decoding step (T = 1)
    ) -> Tensor:
        B, T, _ = x_kv.shape
        q, k, v = self.project(x_q, x_kv)
        if cache is None:  # v is a view of the projection's output: SDPA saving it would keep q and k alive too
            v = v.contiguous()
        q = q.expand(B, T, -1).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, h, T, hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, kv, T, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask, is_causal = None, False
        if isinstance(start, Tensor):  # decoding step: the whole cache, keys after each row's position masked
            if cache is None:
                raise ValueError("a decoding step (start given as a tensor) needs a cache")
            k, v, mask = cache.write_at(layer, start, k.to(cache.keys.dtype), v.to(cache.values.dtype))
            k, v, mask = k.to(q.dtype), v.to(q.dtype), mask.to(q.dtype)  # SDPA takes a float mask of q's dtype
        else:
            if cache is not None:
                k, v = cache.update(layer, start, k.to(cache.keys.dtype), v.to(cache.values.dtype))
                k, v = k.to(q.dtype), v.to(q.dtype)
            if causal and start == 0:
                is_causal = T > 1
            elif causal and T > 1:  # a chunk after cached positions: query i sees keys [0, start + i]
                key_pos = torch.arange(start + T, device=q.device)
                mask = key_pos[None, :] <= (start + torch.arange(T, device=q.device))[:, None]  # (T, start+T)
        y = attend(q, k, v, mask, is_causal)  # (B, h, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # gate and up as one (D -> 2F) projection, gate's rows first: one GEMV per decoding step
        self.gate_up_proj = nn.Linear(config.dim, 2 * config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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
        start: int | Tensor = 0,
    ) -> Tensor:
        h_q = self.input_layernorm(x)
        h_kv = h_q if kv_input is None else self.input_layernorm(kv_input)
        x = x + self.self_attn(h_q, h_kv, cos, sin, causal=causal, cache=cache, layer=layer, start=start)
        return x + self.mlp(self.post_attention_layernorm(x))
