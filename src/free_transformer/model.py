"""The Free Transformer (Algorithm 2 of the paper) and, with latent_bits = 0, the baseline decoder
(Algorithm 1). Both share every block; the Free Transformer adds one non-causal encoder block with a
learned constant query zeta, an RMSNorm + linear readout to H bit-logits, and the post-sampler table
whose row Z_t is added to the keys/values input of block `injection_layer`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .latent import Generators, at_least_float32, free_bits_kl, kl_to_uniform, project_latents, sample_bits, uniform_latents
from .layers import Block, KVCache, rope_tables

LatentSource = Literal["posterior", "prior"]
IGNORE_INDEX = -100


@dataclass
class ModelOutput:
    logits: Tensor  # (B, T, V)
    loss: Tensor | None = None  # cross-entropy + free-bits KL term (nats), when targets are given
    cross_entropy_nats: Tensor | None = None  # mean over predicted tokens
    kl_nats: Tensor | None = None  # mean KL(Q(Z_t|S) || uniform) per token, posterior latents only
    kl_per_token_nats: Tensor | None = None  # (B, T)
    bit_logits: Tensor | None = None  # (B, T, H) encoder read-out, posterior latents only
    latent_index: Tensor | None = None  # (B, T) the Z_t used, each in [0, 2^H)


class FreeTransformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.is_free:
            self.encoder = Block(config)
            self.zeta = nn.Parameter(torch.empty(config.dim))
            self.encoder_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
            self.encoder_readout = nn.Linear(config.dim, config.latent_bits)
            self.post_sampler = nn.Embedding(2**config.latent_bits, config.dim)
        # RoPE tables are derived from the config, never checkpointed.
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, post_sampler_std: float | None = None) -> None:
        """Every tensor's initialisation, in one place.

        Embeddings and input projections ~ N(0, std); output projections (o_proj, down_proj) of each
        block ~ N(0, std / sqrt(2 L)) so the residual stream keeps its scale with depth; norms = 1;
        zeta ~ N(0, 1) (it is normalised before use); encoder read-out ~ N(0, std) with zero bias
        (bits start near p = 1/2, KL near 0); post-sampler rows ~ N(0, post_sampler_std or std).
        """
        if self.rope_cos.device.type != "meta":
            cos, sin = rope_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta,
                                   device=self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if param.device.type == "meta":
                continue
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name == "zeta":
                nn.init.normal_(param, std=1.0)
            elif name.endswith("bias"):
                nn.init.zeros_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, std=out_std)
            elif name == "post_sampler.weight":
                nn.init.normal_(param, std=post_sampler_std or std)
            else:
                nn.init.normal_(param, std=std)

    # ---- pieces of the forward pass ------------------------------------------------------------

    def readout(self, x: Tensor) -> Tensor:
        """Final RMSNorm and logit read-out: (B, T, D) -> (B, T, V)."""
        h = self.norm(x)
        return F.linear(h, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(h)

    def encode(self, x_half: Tensor) -> Tensor:
        """Encoder: (B, T, D) first-half output -> (B, T, H) bit-logits. Non-causal over the T tokens."""
        T, D = x_half.shape[1:]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        query = self.zeta.to(x_half.dtype).view(1, 1, D)  # the same for every position: normed and projected once
        y = self.encoder(query, cos, sin, kv_input=x_half, causal=False)  # (B, T, D)
        return self.encoder_readout(self.encoder_norm(y))

    def forward(
        self,
        tokens: Tensor,  # (B, T) int64
        targets: Tensor | None = None,  # (B, T) int64, IGNORE_INDEX for positions without a target
        *,
        latents: LatentSource | Tensor = "posterior",
        kappa_nats: float = 0.0,
        generator: Generators = None,
        cache: KVCache | None = None,
        start: int = 0,
    ) -> ModelOutput:
        """Logits for positions [start, start+T) and, given targets, the training loss.

        latents: where Z comes from (Free Transformer only): "posterior" samples it with the encoder
        (training, KV-cache prefill; needs the whole sequence, start = 0), "prior" draws every Z_t
        uniformly and independently, and an int tensor (B or 1, T) gives the indices explicitly.
        kappa_nats: the free-bits threshold of the KL term, in nats per token.
        generator: one generator, or one per row (each row then reproducible on its own).
        """
        self._check_tokens(tokens, start)
        B, T = tokens.shape
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        x = self.embed_tokens(tokens)  # (B, T, D)
        out = ModelOutput(logits=x)  # logits filled below
        injection = self.config.injection_layer if self.config.is_free else None
        for i, block in enumerate(self.layers):
            kv_input = None
            if i == injection:  # queries from X, keys and values from X + R
                r = self._latent_residual(x, latents, generator, start, out)  # (B, T, D)
                kv_input = x + r.to(x.dtype)
            x = block(x, cos, sin, kv_input=kv_input, cache=cache, layer=i, start=start)
        out.logits = self.readout(x)
        if targets is not None:
            out.cross_entropy_nats = F.cross_entropy(
                at_least_float32(out.logits).flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX
            )
            out.loss = out.cross_entropy_nats
            if out.kl_per_token_nats is not None:
                out.loss = out.loss + free_bits_kl(out.kl_per_token_nats, kappa_nats)
        if cache is not None:
            cache.length = start + T
        return out

    def _latent_residual(self, x_half, latents, generator, start, out: ModelOutput) -> Tensor:
        B, T, _ = x_half.shape
        weight = self.post_sampler.weight
        if isinstance(latents, Tensor):
            if latents.dim() != 2 or latents.shape[1] != T or latents.shape[0] not in (1, B):
                raise ValueError(f"explicit latents must have shape ({B} or 1, {T}), got {tuple(latents.shape)}")
            if latents.min() < 0 or latents.max() >= 2**self.config.latent_bits:
                raise ValueError(f"latent indices must lie in [0, 2^{self.config.latent_bits})")
            out.latent_index = latents.expand(B, T)
            return project_latents(None, weight, out.latent_index)
        if latents == "prior":
            out.latent_index = uniform_latents((B, T), self.config.latent_bits, generator=generator, device=x_half.device)
            return project_latents(None, weight, out.latent_index)
        if latents != "posterior":
            raise ValueError(f"latents must be 'posterior', 'prior' or an index tensor, got {latents!r}")
        if start != 0:
            raise ValueError("posterior latents need the whole sequence: the encoder is non-causal (start must be 0)")
        bit_logits = at_least_float32(self.encode(x_half))  # (B, T, H)
        out.bit_logits = bit_logits
        out.kl_per_token_nats = kl_to_uniform(bit_logits)
        out.kl_nats = out.kl_per_token_nats.mean()
        out.latent_index = sample_bits(bit_logits, generator)
        return project_latents(bit_logits, weight, out.latent_index)

    def _check_tokens(self, tokens: Tensor, start: int) -> None:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an integer tensor of shape (B, T), got {tuple(tokens.shape)} {tokens.dtype}")
        if start + tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {start + tokens.shape[1]} exceeds max_seq_len {self.config.max_seq_len}"
            )
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}), got min {int(tokens.min())} max {int(tokens.max())}"
            )

    def new_cache(self, batch_size: int, dtype: torch.dtype | None = None) -> KVCache:
        return KVCache(self.config, batch_size, device=self.rope_cos.device,
                       dtype=dtype or self.embed_tokens.weight.dtype)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
