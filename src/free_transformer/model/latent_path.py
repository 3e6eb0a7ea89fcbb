"""`LatentPath`: everything the Free Transformer adds to the baseline decoder, as one module.

    encoder      `encoder_layers` non-causal blocks: the first takes its queries from the learned
                 constant zeta and its keys/values from the first half's output (the paper's one
                 block); each further block attends over the encoder's own stream.
    readout      RMSNorm + linear map to the posterior's parameters per token (H bit-logits for the
                 binary kinds, H means and H log-variances for the Gaussian).
    mapper       the latent space (`model.latent.kind`, free_transformer.model.latent.space): the form
                 of Z, its prior, its posterior sample and KL, and the map to the residual R. Its
                 attribute name is that of its tensors in checkpoints (`latent.mapper.weight`).
    policy       with model.latent.policy, a causal head over the first half (a learned prior or a
                 policy over Z: free_transformer.model.latent.policy), else None.

Given the first half's output and a latent source (free_transformer.model.latent), it returns R,
to be added to the keys/values input of the injection block, and a `LatentSample` saying which Z
was used and, from the encoder, the posterior and the KL of every token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..base.latent_choice import LatentChoice
from .config import ModelConfig
from .latent import (
    Generators,
    LatentPlan,
    LatentPolicy,
    LatentSource,
    LatentSpace,
    PolicyDraw,
    at_least_float32,
    build_latent_space,
)
from .layers import Block


@dataclass
class LatentSample:
    value: Tensor  # (B, T, *value_shape) the Z_t used
    posterior: Tensor | None = None  # (B, T, H * params_per_unit) the encoder's read-out, or the policy's params
    kl_per_token_nats: Tensor | None = None  # (B, T) KL(Q(Z_t | S) || prior) (source "encoder" only)


class LatentPath(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.units = config.latent_units
        self.zeta = nn.Parameter(torch.empty(config.dim))
        self.encoder = nn.ModuleList(Block(config) for _ in range(config.latent.encoder_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        # the read-out before the mapper: their initial draws, in this order, are a seed's (tests/golden)
        self.readout = nn.Linear(config.dim, config.latent_space_on_meta().posterior_size)
        self.mapper: LatentSpace = build_latent_space(
            config.latent.kind, config.latent_units, config.dim, config.latent.section()
        )
        self.policy = LatentPolicy(config.dim, self.mapper, config.norm_eps) if config.latent.policy else None

    @torch.no_grad()
    def init_weights(self, init_block, std: float, post_sampler_std: float, keep=None) -> None:
        """Everything but zeta (~ N(0, 1), drawn by the model first): encoder blocks as the decoder's
        (`init_block`); norm = 1; read-out ~ N(0, std) with zero bias (the posterior starts near the
        prior, KL near 0); the mapper so that R has standard deviation post_sampler_std; the policy head, if
        any, at the kind's prior (`keep`: FreeTransformer.init_weights's)."""
        for block in self.encoder:
            init_block(block)
        nn.init.ones_(self.norm.weight)
        nn.init.normal_(self.readout.weight, std=std)
        nn.init.zeros_(self.readout.bias)
        self.mapper.reset_parameters(post_sampler_std)
        if self.policy is not None:  # last: a seed's other draws are those of a model without a policy
            self.policy.reset_parameters(self.mapper.prior_params(), std, keep)

    def encode(self, x_half: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """(B, T, D) first-half output -> (B, T, H * params_per_unit) posterior parameters (at least float32).
        Non-causal over the T tokens."""
        D = x_half.shape[-1]
        query = self.zeta.to(x_half.dtype).view(1, 1, D)  # the same for every position: normed and projected once
        y = self.encoder[0](query, cos, sin, kv_input=x_half, causal=False)  # (B, T, D)
        for block in self.encoder[1:]:
            y = block(y, cos, sin, causal=False)
        return at_least_float32(self.readout(self.norm(y)))

    def forward(
        self, x_half: Tensor, source: LatentSource, cos: Tensor, sin: Tensor, generator: Generators = None
    ) -> tuple[Tensor, LatentSample]:
        """R (B, T, D) and the sample it came from. cos/sin: the RoPE tables of the T positions. `source` is
        resolved (free_transformer.inference.latents): its values are not checked here, its shape is."""
        B, T, _ = x_half.shape
        space = self.mapper
        if isinstance(source, Tensor):
            # The shape only (no read of the values, so no sync): a direct forward with values for other
            # positions would otherwise fail inside expand() with a message that names neither.
            # Not under torch.compile: there the caller is the decoding engine, whose buffers have this shape, and
            # Dynamo can misjudge the comparison of two dynamic sizes that are equal.
            shape = (T, *space.value_shape)
            if not torch.compiler.is_compiling() and (
                source.dim() != 2 + len(space.value_shape)
                or tuple(source.shape[1:]) != shape
                or source.shape[0] not in (1, B)
            ):
                raise ValueError(
                    f"explicit latents must have shape ({B} or 1, {', '.join(map(str, shape))}), "
                    f"got {tuple(source.shape)}"
                )
            value = source.expand(B, *shape)
            return space.embed(value), LatentSample(value)
        if isinstance(source, PolicyDraw):
            return self.draw_from_policy(x_half, source)
        if source == LatentChoice.PRIOR:
            value = LatentPlan(B, space, prompt_source=LatentChoice.PRIOR, generators=generator).draw(T, x_half.device)
            return space.embed(value), LatentSample(value)
        if source != LatentChoice.ENCODER:  # not a source at all: a user's choice is parsed where it enters
            raise ValueError(
                "latents must be 'encoder', 'prior', a PolicyDraw or a tensor of values (B or 1, T, ...), "
                f"got {source!r}"
            )
        posterior = self.encode(x_half, cos, sin)  # (B, T, H * params_per_unit)
        kl = space.kl(posterior)  # before sampling: this graph order gives the gradient sums of tests/golden
        r, value = space.sample(posterior, generator)
        return r, LatentSample(value, posterior, kl)

    def draw_from_policy(self, x_half: Tensor, draw: PolicyDraw) -> tuple[Tensor, LatentSample]:
        """R and the sample of Z drawn from the policy head, position after position: params_t from x_half[:, t]
        and R_{t-1} (the R of the Z drawn at t - 1, of draw.previous before the first position, 0 at position 0),
        then Z_t = sample_from_noise(params_t, noise_t), noise (B, T, ...); a row whose `use` (B,) is False takes
        its `given` (B, T, *value_shape) values instead (and continues from them)."""
        if self.policy is None:
            raise ValueError(
                "latents from a policy need a run with a learned prior or policy (model.latent.policy: "
                "free-transformer rl); this model has none"
            )
        space, noise = self.mapper, draw.noise
        B, T, D = x_half.shape
        if not torch.compiler.is_compiling() and tuple(noise.shape[:2]) != (B, T):
            raise ValueError(f"policy noise must have shape ({B}, {T}, ...), got {tuple(noise.shape)}")
        previous_r = (
            x_half.new_zeros(B, 1, D) if draw.previous is None else space.embed(draw.previous[:, None])
        )  # (B, 1, D)
        use = None if draw.use is None else draw.use.view(-1, *([1] * (1 + len(space.value_shape))))
        read = self.policy.read(x_half)  # (B, T, D): what of the head no Z changes, every position at once
        values, rs, params = [], [], []
        for t in range(T):  # Z_t needs Z_{t-1}: one position at a time (a decoding step is one)
            params_t = self.policy.params(position(read, t), previous_r)  # (B, 1, P)
            # the draw is no function of the params to differentiate (detach, only when there is a graph to cut)
            drawn_from = params_t.detach() if params_t.requires_grad else params_t
            value = space.sample_from_noise(drawn_from, position(noise, t))  # (B, 1, *value_shape)
            if draw.given is not None and use is not None:
                given = position(draw.given, t)
                value = torch.where(use, value, given if given.dtype == value.dtype else given.to(value.dtype))
            previous_r = space.embed(value)  # (B, 1, D)
            values.append(value)
            rs.append(previous_r)
            params.append(params_t)
        return joined(rs), LatentSample(joined(values), joined(params))

    def policy_params(self, x_half: Tensor, fed: Tensor, head: LatentPolicy | None = None) -> Tensor:
        """(B, T, P) the params of the policy head (or of another `head`: a frozen reference) at every position of
        a sequence from position 0, with the Z `fed` (B, T, *value_shape) there as each position's Z_{t-1}
        (teacher forcing): what the learned prior and GRPO train."""
        if head is None:
            head = self.policy
        assert head is not None
        r = self.mapper.embed(fed)  # (B, T, D)
        previous_r = torch.cat([torch.zeros_like(r[:, :1]), r[:, :-1]], dim=1)  # (B, T, D) R_{t-1}, 0 at t = 0
        return head(x_half, previous_r)


def position(x: Tensor, t: int) -> Tensor:
    """(B, 1, ...) position t of x (B, T, ...): x itself when it holds that one position (a decoding step's)."""
    return x if x.shape[1] == 1 else x[:, t : t + 1]


def joined(parts: list[Tensor]) -> Tensor:
    """The positions' tensors (B, 1, ...) as one (B, T, ...): a decoding step's one position as it is, no copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
