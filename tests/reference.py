"""Naive references written straight from the paper's formulas, for parity tests. Slow and simple on
purpose: the full 2^H one-hot and G, explicit softmax attention with repeated key/value heads."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from free_transformer.runs.migrations import split_state_dict


def all_bit_patterns(n_bits: int, dtype=torch.float64) -> torch.Tensor:
    """(2^H, H): row d is U(d), the binary encoding of d with bit h worth 2^h."""
    d = torch.arange(2**n_bits)
    return ((d[:, None] >> torch.arange(n_bits)) & 1).to(dtype)


def naive_mapper_project(bit_logits, weight, index):
    """(Y + G - detach(G)) @ W with Y the one-hot of `index` and G_d = P(B = U(d)), all 2^H columns."""
    U = all_bit_patterns(bit_logits.shape[-1], bit_logits.dtype)  # (2^H, H)
    log_p1 = torch.log(torch.sigmoid(bit_logits))  # (N, H)
    log_p0 = torch.log(1 - torch.sigmoid(bit_logits))
    G = torch.exp(log_p0 @ (1 - U).T + log_p1 @ U.T)  # (N, 2^H)
    Y = F.one_hot(index, 2 ** bit_logits.shape[-1]).to(bit_logits.dtype)
    return (Y + G - G.detach()) @ weight


def naive_kl_to_uniform(bit_logits):
    """H log 2 + sum_z Q(z) log Q(z), summing over all 2^H values."""
    U = all_bit_patterns(bit_logits.shape[-1], bit_logits.dtype)
    p1 = torch.sigmoid(bit_logits)
    Q = torch.exp(torch.log(1 - p1) @ (1 - U).T + torch.log(p1) @ U.T)  # (..., 2^H)
    return bit_logits.shape[-1] * math.log(2) + (Q * torch.log(Q)).sum(-1)


def _rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x, pos, theta):
    """x (B, heads, T, hd), rotate-half convention."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype), torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def naive_block(p, prefix, x_q, x_kv, cfg, causal):
    """One pre-norm block from a state dict `p`; explicit softmax attention, K/V heads repeated."""
    B, T, D = x_q.shape
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def w(name):
        return p[f"{prefix}.{name}"]

    hq = _rms_norm(x_q, w("input_layernorm.weight"), cfg.norm_eps)
    hkv = _rms_norm(x_kv, w("input_layernorm.weight"), cfg.norm_eps)
    q = (hq @ w("self_attn.q_proj.weight").T).view(B, T, nh, hd).transpose(1, 2)
    k = (hkv @ w("self_attn.k_proj.weight").T).view(B, T, nkv, hd).transpose(1, 2)
    v = (hkv @ w("self_attn.v_proj.weight").T).view(B, T, nkv, hd).transpose(1, 2)
    pos = torch.arange(T)
    q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    if causal:
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D) @ w("self_attn.o_proj.weight").T
    x = x_q + y
    h = _rms_norm(x, w("post_attention_layernorm.weight"), cfg.norm_eps)
    mlp = (F.silu(h @ w("mlp.gate_proj.weight").T) * (h @ w("mlp.up_proj.weight").T)) @ w("mlp.down_proj.weight").T
    return x + mlp


def naive_forward(model, tokens, latent_index=None, state=None):
    """Algorithm 1 (baseline) or Algorithm 2 with given Z indices; returns (logits, bit_logits or None).
    The weights are `state` (default the model's), with q, k, v, gate and up as separate matrices (Llama's
    layout: `split_state_dict` of the model's fused projections), each its own matmul."""
    cfg = model.config
    state = split_state_dict(model.state_dict(), cfg) if state is None else state
    p = {k: v.detach() for k, v in state.items()}
    x = p["embed_tokens.weight"][tokens]
    bit_logits = None
    for n in range(cfg.n_layers):
        if cfg.is_free and n == cfg.injection_layer:
            zeta = p["latent.zeta"].expand_as(x)
            y = naive_block(p, "latent.encoder.0", zeta, x, cfg, causal=False)
            for k in range(1, cfg.latent.encoder_layers):  # further blocks: non-causal self-attention
                y = naive_block(p, f"latent.encoder.{k}", y, y, cfg, causal=False)
            bit_logits = _rms_norm(y, p["latent.norm.weight"], cfg.norm_eps) @ p["latent.readout.weight"].T
            bit_logits = bit_logits + p["latent.readout.bias"]
            if cfg.latent.kind == "binary_mapper":  # one-hot Y of size 2^H through the post-sampler
                r = F.one_hot(latent_index, 2**cfg.latent_units).to(x.dtype) @ p["latent.mapper.weight"]
            else:  # bit_linear: the +-1 bits through a (D, H) map
                bits = (latent_index[..., None] >> torch.arange(cfg.latent_units)) & 1
                r = (2 * bits - 1).to(x.dtype) @ p["latent.mapper.weight"].T
            x = naive_block(p, f"layers.{n}", x, x + r, cfg, causal=True)
        else:
            x = naive_block(p, f"layers.{n}", x, x, cfg, causal=True)
    head = p["embed_tokens.weight"] if cfg.tie_embeddings else p["lm_head.weight"]
    return _rms_norm(x, p["norm.weight"], cfg.norm_eps) @ head.T, bit_logits
