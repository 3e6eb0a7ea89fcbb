"""`LatentPath`: everything the Free Transformer adds to the baseline decoder, as one module.

    encoder      `encoder_layers` non-causal blocks: the first takes its queries from the learned
                 constant zeta and its keys/values from the first half's output (the paper's one
                 block); each further block attends over the encoder's own stream.
    readout      RMSNorm + linear map to H bit-logits per token.
    mapper       the variant that turns the sampled bits into the residual R (`model.latent.kind`).

Given the first half's output and a latent source (free_transformer.model.latent), it returns R,
to be added to the keys/values input of the injection block, and a `LatentSample` saying which Z
was used and, from the encoder, the bit-logits and the KL of every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .latent import (ENCODER, PRIOR, Generators, LatentSource, at_least_float32, kl_to_uniform, latent_kind,
                     uniform_latents)
from .layers import Block


@dataclass
class LatentSample:
    index: Tensor  # (B, T) the Z_t used, each in [0, 2^H)
    bit_logits: Tensor | None = None  # (B, T, H) the encoder's read-out (source "encoder" only)
    kl_per_token_nats: Tensor | None = None  # (B, T) KL(Q(Z_t | S) || uniform) (source "encoder" only)


class LatentPath(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.bits = config.latent_bits
        self.zeta = nn.Parameter(torch.empty(config.dim))
        self.encoder = nn.ModuleList(Block(config) for _ in range(config.latent.encoder_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.readout = nn.Linear(config.dim, config.latent_bits)
        self.mapper = latent_kind(config.latent.kind)(config.latent_bits, config.dim)

    @torch.no_grad()
    def init_weights(self, init_block, std: float, post_sampler_std: float) -> None:
        """Everything but zeta (~ N(0, 1), drawn by the model first): encoder blocks as the decoder's
        (`init_block`); norm = 1; read-out ~ N(0, std) with zero bias (bits start near p = 1/2, KL near
        0); the mapper so that R has standard deviation post_sampler_std."""
        for block in self.encoder:
            init_block(block)
        nn.init.ones_(self.norm.weight)
        nn.init.normal_(self.readout.weight, std=std)
        nn.init.zeros_(self.readout.bias)
        self.mapper.reset_parameters(post_sampler_std)

    def encode(self, x_half: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """(B, T, D) first-half output -> (B, T, H) bit-logits (at least float32). Non-causal over the T tokens."""
        D = x_half.shape[-1]
        query = self.zeta.to(x_half.dtype).view(1, 1, D)  # the same for every position: normed and projected once
        y = self.encoder[0](query, cos, sin, kv_input=x_half, causal=False)  # (B, T, D)
        for block in self.encoder[1:]:
            y = block(y, cos, sin, causal=False)
        return at_least_float32(self.readout(self.norm(y)))

    def forward(self, x_half: Tensor, source: LatentSource, cos: Tensor, sin: Tensor,
                generator: Generators = None) -> tuple[Tensor, LatentSample]:
        """R (B, T, D) and the sample it came from. cos/sin: the RoPE tables of the T positions. `source` is
        resolved (free_transformer.inference.latents): its values are not checked here."""
        B, T, _ = x_half.shape
        if isinstance(source, Tensor):
            # The shape only (no read of the values, so no sync): a direct forward with indices for other
            # positions would otherwise fail inside expand() with a message that names neither.
            if source.dim() != 2 or source.shape[1] != T or source.shape[0] not in (1, B):
                raise ValueError(f"explicit latents must have shape ({B} or 1, {T}), got {tuple(source.shape)}")
            index = source.expand(B, T)
            return self.mapper.lookup(index), LatentSample(index)
        if source == PRIOR:
            index = uniform_latents((B, T), self.bits, generator=generator, device=x_half.device)
            return self.mapper.lookup(index), LatentSample(index)
        if source != ENCODER:  # not a source at all (a user's spelling is parsed by inference.latents.parse_latents)
            raise ValueError(f"latents must be {ENCODER!r}, {PRIOR!r} or an index tensor (B or 1, T), got {source!r}")
        bit_logits = self.encode(x_half, cos, sin)  # (B, T, H)
        kl = kl_to_uniform(bit_logits)  # before sampling: this graph order gives the gradient sums of tests/golden
        r, index = self.mapper.sample(bit_logits, generator)
        return r, LatentSample(index, bit_logits, kl)
