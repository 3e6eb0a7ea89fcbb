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

from collections.abc import Sequence
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

# Rounds of `LatentPath._settled_draws` at most: the loop then draws the positions they left unsettled.
MAX_ROUNDS = 32


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
        its `given` (B, T, *value_shape) values instead (and continues from them).

        Several positions (a prefill) are drawn by fixed-point rounds, every position at once, each from the Z the
        round before drew at the position before it (`_settled_draws`); one position (a decoding step) in one draw;
        several under torch.compile or a CUDA graph's capture by the loop."""
        policy = self.policy
        if policy is None:
            raise ValueError(
                "latents from a policy need a run with a learned prior or policy (model.latent.policy: "
                "free-transformer rl); this model has none"
            )
        space, noise = self.mapper, draw.noise
        B, T, D = x_half.shape
        if not torch.compiler.is_compiling() and tuple(noise.shape[:2]) != (B, T):
            raise ValueError(f"policy noise must have shape ({B}, {T}, ...), got {tuple(noise.shape)}")
        first_r = (
            x_half.new_zeros(B, 1, D) if draw.previous is None else space.embed(draw.previous[:, None])
        )  # (B, 1, D) R_{-1} of the chunk
        use = None if draw.use is None else draw.use.view(-1, *([1] * (1 + len(space.value_shape))))
        given = draw.given if use is not None else None
        read = policy.read(x_half)  # (B, T, D): what of the head no Z changes, every position at once
        if T == 1:  # a decoding step: one draw, none of the positions' bookkeeping below
            value, params_t = self._policy_draws(read, first_r, noise, given, use)
            return space.embed(value), LatentSample(value, params_t)
        previous_r, start = first_r, 0
        values: list[Tensor] = []
        rs: list[Tensor] = []
        params: list[Tensor] = []
        # the rounds read each one's comparison on the host: not in a compiled graph nor a CUDA graph's capture
        if (
            T > 1
            and not torch.compiler.is_compiling()
            and not (read.is_cuda and torch.cuda.is_current_stream_capturing())
        ):
            settled, exact = self._settled_draws(read, noise, first_r, given, use)
            if settled is not None:
                return settled
            assert exact is not None
            values, params = [exact[0]], [exact[1]]  # (B, k, ...): the loop's first k positions
            rs = [space.embed(exact[0])]
            previous_r, start = rs[0][:, -1:], exact[0].shape[1]
        # each position's (B, 1, ...) views, made in one call rather than a slice a position
        reads, noises = positions(read), positions(noise)
        givens = positions(given) if given is not None else None
        for t in range(start, T):  # Z_t needs Z_{t-1}: one position at a time
            value, params_t = self._policy_draws(reads[t], previous_r, noises[t], givens[t] if givens else None, use)
            previous_r = space.embed(value)  # (B, 1, D)
            values.append(value)
            rs.append(previous_r)
            params.append(params_t)
        return joined(rs), LatentSample(joined(values), joined(params))

    def _policy_draws(
        self, read: Tensor, previous_r: Tensor, noise: Tensor, given: Tensor | None, use: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Z (B, n, *value_shape) and the params (B, n, P) of n positions, each from its `read` and the R of the Z
        before it (B, n, D): the head's draw, or the `given` values of a row whose `use` is False."""
        assert self.policy is not None
        params = self.policy.params(read, previous_r)  # (B, n, P)
        # the draw is no function of the params to differentiate (detach, only when there is a graph to cut)
        value = self.mapper.sample_from_noise(params.detach() if params.requires_grad else params, noise)
        if given is not None:
            assert use is not None, "given values come with the rows that use them"
            value = torch.where(use, value, given if given.dtype == value.dtype else given.to(value.dtype))
        return value, params

    def _settled_draws(
        self, read: Tensor, noise: Tensor, first_r: Tensor, given: Tensor | None, use: Tensor | None
    ) -> tuple[tuple[Tensor, LatentSample] | None, tuple[Tensor, Tensor] | None]:
        """The loop's draws of T positions by rounds over all of them at once: round k draws every Z_t from the Z
        that round k - 1 drew at t - 1 (round 0 from first_r at every position). Z_t depends on its noise and
        Z_{t-1} alone, so after round k positions 0..k are the loop's; a round that draws what the one before drew
        has every position the loop's, and ends it (one comparison a round, read on the host). A head's draws
        follow each other's only through the noise's thresholds, so a change at t rarely reaches far: a few rounds
        replace T steps of the loop. Returns (R, the sample) once settled; otherwise, after min(T, MAX_ROUNDS)
        rounds, (None, (values, params)) of the first positions, those the rounds made the loop's."""
        space = self.mapper
        rounds = min(read.shape[1], MAX_ROUNDS)
        previous_r = first_r.expand_as(read)  # (B, T, D) round 0's R_{t-1}
        values = params = None
        for _ in range(rounds):
            drawn, drawn_params = self._policy_draws(read, previous_r, noise, given, use)  # (B, T, ...), (B, T, P)
            if values is not None and torch.equal(drawn, values):  # previous_r is then the R of drawn's Z_{t-1}
                rs = torch.cat([previous_r[:, 1:], space.embed(drawn[:, -1:])], dim=1)  # (B, T, D) R of each Z
                return (rs, LatentSample(drawn, drawn_params)), None
            values, params = drawn, drawn_params
            previous_r = torch.cat([first_r, space.embed(drawn[:, :-1])], dim=1)  # (B, T, D) R_{t-1}
        assert values is not None and params is not None
        return None, (values[:, :rounds], params[:, :rounds])

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


def positions(x: Tensor) -> Sequence[Tensor]:
    """The T positions of x (B, T, ...) as (B, 1, ...) views: x itself when it holds one (a decoding step's)."""
    return (x,) if x.shape[1] == 1 else x.split(1, dim=1)


def joined(parts: list[Tensor]) -> Tensor:
    """The positions' tensors (B, 1, ...) as one (B, T, ...): a decoding step's one position as it is, no copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
