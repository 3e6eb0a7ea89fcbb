"""The Free Transformer (Algorithm 2 of the paper) and, with latent_units = 0, the baseline decoder
(Algorithm 1). Both share every block; the Free Transformer adds one module, `LatentPath` (the
non-causal encoder with its learned query zeta, the read-out to the posterior's parameters and the
latent space that samples Z and maps it to R), whose residual R is added to the keys/values input of
block `injection_layer`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base.latent_choice import LatentChoice
from .config import ModelConfig
from .latent import Generators, LatentSource, LatentSpace, PolicyDraw, free_bits_kl
from .latent_path import LatentPath, LatentSample
from .layers import FUSED_PROJECTIONS, Block, KVCache, part_rows, rope_tables
from .loss import ReadoutLoss, cross_entropy


@dataclass
class ModelOutput:
    logits: Tensor | None  # (B, T, V); None when targets were given without return_logits
    loss: Tensor | None = None  # cross-entropy + free-bits KL term (nats), when targets are given
    cross_entropy_nats: Tensor | None = None  # mean over predicted tokens
    kl_nats: Tensor | None = None  # mean KL(Q(Z_t|S) || prior) per token, encoder latents only
    kl_per_token_nats: Tensor | None = None  # (B, T)
    posterior: Tensor | None = None  # (B, T, H * params_per_unit) encoder read-out (or policy params: PolicyDraw)
    latents: Tensor | None = None  # (B, T, *value_shape) the Z_t used (binary kinds: indices in [0, 2^H))

    @classmethod
    def from_parts(cls, logits: Tensor | None, sample: LatentSample | None) -> ModelOutput:
        if sample is None:
            return cls(logits=logits)
        kl = sample.kl_per_token_nats
        return cls(
            logits=logits,
            kl_nats=None if kl is None else kl.mean(),
            kl_per_token_nats=kl,
            posterior=sample.posterior,
            latents=sample.value,
        )


class FreeTransformer(nn.Module):
    rope_cos: Tensor  # (max_seq_len, head_dim), RoPE tables: buffers registered in __init__
    rope_sin: Tensor

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config.check_latent_kind()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        self.latent = LatentPath(config) if config.is_free else None  # None: the baseline decoder
        # RoPE tables are derived from the config, never checkpointed.
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # The fused read-out cross-entropy; its `compile()` fuses each chunk's softmax and gradient.
        self.readout_loss = ReadoutLoss()
        self.init_weights()

    @torch.no_grad()
    def init_weights(
        self, std: float = 0.02, post_sampler_std: float | None = None, *, keep: Callable[[Tensor], bool] | None = None
    ) -> None:
        """Every tensor's initialisation, in one place.

        Embeddings and input projections ~ N(0, std); output projections (o_proj, down_proj) of each
        block ~ N(0, std / sqrt(2 L)) so the residual stream keeps its scale with depth; norms = 1;
        the latent path as `LatentPath.init_weights` says, its mapper giving R a standard deviation
        of post_sampler_std (default std). Tensors on the meta device are skipped.

        A fused projection (FUSED_PROJECTIONS) is drawn part by part, in its parts' order, so that a
        seed gives the weights it gives separate q/k/v and gate/up projections. The parts are views, which
        carry no mark of their parameter: `keep(param)` true leaves such a parameter as it is (the
        Hugging Face wrapper passes its loader's mark of loaded tensors, which its guarded init
        functions read on whole parameters).
        """
        if self.rope_cos.device.type != "meta":
            cos, sin = rope_tables(
                self.config.head_dim, self.config.max_seq_len, self.config.rope_theta, device=self.rope_cos.device
            )
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        out_std = std / math.sqrt(2 * self.config.n_layers)

        def init_block(block: nn.Module) -> None:  # a decoder or encoder Block
            for name, param in block.named_parameters():
                if param.device.type == "meta":
                    continue
                if name.endswith("norm.weight"):
                    nn.init.ones_(param)
                elif name.endswith(("o_proj.weight", "down_proj.weight")):
                    nn.init.normal_(param, std=out_std)
                elif name in FUSED_PROJECTIONS:  # part by part: the draws of separate projections
                    if keep is not None and keep(param):
                        continue
                    for piece in param.split(part_rows(self.config)[name], dim=0):
                        nn.init.normal_(piece, std=std)
                else:
                    nn.init.normal_(param, std=std)

        # The draws come in a fixed order (zeta, embeddings, blocks, head, rest of the latent path): a
        # seed's weights, and so the golden losses (tests/golden), depend on it.
        latent = self.latent if self.latent is not None and self.latent.zeta.device.type != "meta" else None
        if latent is not None:
            nn.init.normal_(latent.zeta, std=1.0)  # normalised before use
        if self.embed_tokens.weight.device.type != "meta":
            nn.init.normal_(self.embed_tokens.weight, std=std)
        for block in self.layers:
            init_block(block)
        if self.norm.weight.device.type != "meta":
            nn.init.ones_(self.norm.weight)
        if self.lm_head is not None and self.lm_head.weight.device.type != "meta":
            nn.init.normal_(self.lm_head.weight, std=std)
        if latent is not None:
            latent.init_weights(init_block, std, post_sampler_std or std, keep)

    # ---- pieces of the forward pass ------------------------------------------------------------

    @property
    def latent_space(self) -> LatentSpace | None:
        """The form of Z (free_transformer.model.latent.space); None for the baseline decoder."""
        return self.latent.mapper if self.latent is not None else None

    @property
    def readout_weight(self) -> Tensor:
        """(V, D): the lm_head's weight, or the token embedding when they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def readout(self, x: Tensor) -> Tensor:
        """Final RMSNorm and logit read-out: (B, T, D) -> (B, T, V)."""
        return F.linear(self.norm(x), self.readout_weight)

    def forward(
        self,
        tokens: Tensor,  # (B, T) int64
        targets: Tensor | None = None,  # (B, T) int64, IGNORE_INDEX for positions without a target
        *,
        latents: LatentSource = LatentChoice.ENCODER,
        kappa_nats: float = 0.0,
        generator: Generators = None,
        cache: KVCache | None = None,
        start: int | Tensor | None = None,
        return_logits: bool | None = None,
    ) -> ModelOutput:
        """Logits for positions [start, start+T) and, given targets, the training loss.

        return_logits: whether `logits` is computed; by default only without targets. Given targets
        alone, the cross-entropy is fused with the read-out (`readout_loss`, free_transformer.model.loss):
        the logits of all tokens never exist, and `logits` is None. With return_logits=True the logits
        are computed and the loss is taken from them (the same value, to float rounding).

        start: the position of the first token; by default the cache's length (0 without a cache). A (B,)
        int64 device tensor makes this a decoding step (free_transformer.inference.engine): one token per row,
        each at its own position, written into the cache there and attending the cache's positions up to it
        under a mask, nothing read back to the host, so that it can be captured as a CUDA graph. The caller
        keeps the positions; the cache's `length` is left as it is.

        latents: where Z comes from (Free Transformer only), resolved (free_transformer.model.latent.sources;
        a user's choice is parsed and resolved by free_transformer.inference.latents): LatentChoice.ENCODER samples it
        from the encoder's posterior (training, KV-cache prefill; needs the whole sequence, start = 0),
        LatentChoice.PRIOR draws every Z_t from the prior, independently, a `PolicyDraw` from the policy head
        (model.latent.policy) with its words, and a tensor (B or 1, T, *value_shape) gives
        the values explicitly (int64 indices (B or 1, T) for the binary kinds). kappa_nats: the free-bits
        threshold of the KL term, in nats per token. generator: one generator, or one per row (each row then
        reproducible on its own).

        Shapes are checked here; the ranges of token ids and latent values are not (that reads values
        on the host): entry points check them once, with `check_tokens` and free_transformer.inference.latents.
        """
        if start is None:
            start = cache.length if cache is not None else 0
        B, T = self._check_shape(tokens, start, cache)
        if isinstance(start, Tensor):  # (B, 1, 1, hd): each row's position
            cos, sin = self.rope_cos.index_select(0, start), self.rope_sin.index_select(0, start)
            cos, sin = cos.view(B, 1, 1, -1), sin.view(B, 1, 1, -1)
        else:
            cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        if isinstance(latents, PolicyDraw) and not self.config.is_free:
            raise ValueError("latents from a policy need a Free Transformer with a policy head; this is a baseline")
        x = self.embed_tokens(tokens)  # (B, T, D)
        sample = None
        for i, block in enumerate(self.layers):
            kv_input = None
            if i == self.config.injection_layer and self.config.is_free:  # queries from X, keys/values from X + R
                # ENCODER is the default: a direct call continuing a cache would otherwise encode a fragment
                if (
                    isinstance(latents, str)
                    and latents == LatentChoice.ENCODER
                    and (isinstance(start, Tensor) or start)
                ):
                    raise ValueError(
                        "encoder latents need the whole sequence: the encoder is non-causal (start must be 0)"
                    )
                assert self.latent is not None  # built when config.is_free
                r, sample = self.latent(x, latents, cos, sin, generator)  # (B, T, D)
                kv_input = x + r.to(x.dtype)
            x = block(x, cos, sin, kv_input=kv_input, cache=cache, layer=i, start=start)
        if return_logits is None:
            return_logits = targets is None
        logits = self.readout(x) if return_logits else None  # (B, T, V)
        out = ModelOutput.from_parts(logits, sample)
        if targets is not None:
            out.cross_entropy_nats = (
                cross_entropy(logits, targets)
                if logits is not None
                else self.readout_loss(self.norm(x), self.readout_weight, targets)
            )
            out.loss = out.cross_entropy_nats
            if out.kl_per_token_nats is not None:
                out.loss = out.loss + free_bits_kl(out.kl_per_token_nats, kappa_nats)
        if cache is not None and not isinstance(start, Tensor):
            cache.length = start + T
        if cache is not None:
            cache.step = None  # the step's rows and mask, shared by its layers, end with the forward
        return out

    def first_half(self, tokens: Tensor) -> Tensor:
        """(B, T) tokens from position 0 -> (B, T, D) the output of the blocks before the injection: what the encoder
        and a policy head read. Causal: position t's depends on X<=t alone, as in a decoding step's forward."""
        _, T = self._check_shape(tokens, 0, None)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.embed_tokens(tokens)  # (B, T, D)
        for block in self.layers[: self.config.injection_layer]:
            x = block(x, cos, sin)
        return x

    def _check_shape(self, tokens: Tensor, start: int | Tensor, cache: KVCache | None) -> tuple[int, int]:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"tokens must be an integer tensor of shape (B, T), got {tuple(tokens.shape)} {tokens.dtype}"
            )
        B, T = tokens.shape
        if isinstance(start, Tensor):  # its value stays on the device: the caller keeps it below the capacity
            if T != 1 or cache is None or start.shape != (B,):
                raise ValueError(
                    "a decoding step (start given as a tensor) takes one token per row, a cache and "
                    "one position per row"
                )
            return B, T
        if start + T > self.config.max_seq_len:
            raise ValueError(f"sequence length {start + T} exceeds max_seq_len {self.config.max_seq_len}")
        if cache is not None and start + T > cache.capacity:
            raise ValueError(f"sequence length {start + T} exceeds the cache's {cache.capacity} positions")
        return B, T

    def check_tokens(self, tokens: Tensor) -> None:
        """Token ids in [0, vocab_size), or a ValueError. Reads the values on the host: for entry points."""
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}), "
                f"got min {int(tokens.min())} max {int(tokens.max())}"
            )

    def new_cache(self, batch_size: int, dtype: torch.dtype | None = None, capacity: int | None = None) -> KVCache:
        """An empty KV cache on the model's device, in its weights' dtype by default, of `capacity`
        positions (default max_seq_len)."""
        return KVCache(
            self.config,
            batch_size,
            device=self.rope_cos.device,
            dtype=dtype or self.embed_tokens.weight.dtype,
            capacity=capacity,
        )

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
