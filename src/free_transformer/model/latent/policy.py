"""`LatentPolicy`: a distribution over Z_t that depends on the prefix X<=t, for generation. The uniform prior is
the paper's and stays the default; this head is a choice of where Z comes from (`LatentChoice.POLICY`), trained
either to match the encoder's posterior (a learned prior, p(Z_t | X<=t) against Q(Z_t | S)) or by reinforcement
learning against a reward (a policy over the latent decisions).

The head reads the output of the decoder's first half at position t, which is already causal: it has seen
X<=t and nothing after, and R_{t-1}, the residual of the Z fed at t - 1 (0 at position 0). The first half never
sees Z, so without R_{t-1} the head's draws at two positions would be independent given the tokens, and a code
that spreads one decision over several positions (the encoder's at kappa = 1 bit) could not be followed: with it,
Z_t can continue Z_{t-1}. Decoding needs no state of its own (no KV cache): at each step the first half's output
for the fed token is there, and the Z of the position before is what the row fed; the head maps them to params,
and Z_t is drawn from them with the noise of the row's counter-based words (`draws.counter_policy_noise`).

    x_half (B, T, D) -> RMSNorm -> Linear(D, D) --+--> SiLU -> Linear(D, posterior_size) -> params (B, T, P)
    R_{t-1} (B, T, D) -> Linear(D, D, no bias) ---+

params are in the latent kind's posterior terms (H bit-logits for the binary kinds, H means and H log-variances
for the Gaussian, H * K logits for the categorical); the last layer starts at weight 0 and bias the kind's
`prior_params`, so an untrained head is the kind's own prior."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .draws import at_least_float32
from .space import LatentSpace


class LatentPolicy(nn.Module):
    def __init__(self, dim: int, space: LatentSpace, norm_eps: float = 1e-5):
        super().__init__()
        if not space.has_learned_prior:
            raise space._no_learned_prior()
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.hidden = nn.Linear(dim, dim)
        self.memory = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, space.posterior_size)
        self.reset_parameters(space.prior_params())  # a kind without a learned prior refuses here, in one line

    @torch.no_grad()
    def reset_parameters(self, prior: Tensor, std: float = 0.02, keep: Callable[[Tensor], bool] | None = None) -> None:
        """norm = 1; hidden and memory ~ N(0, std), bias 0; the last layer 0 with `prior` (the kind's prior_params)
        as its bias, unless `keep(bias)` (a loaded tensor: FreeTransformer.init_weights)."""
        if self.out.weight.is_meta:
            return
        nn.init.ones_(self.norm.weight)
        nn.init.normal_(self.hidden.weight, std=std)
        nn.init.zeros_(self.hidden.bias)
        nn.init.normal_(self.memory.weight, std=std)
        nn.init.zeros_(self.out.weight)
        if keep is None or not keep(self.out.bias):
            self.out.bias.copy_(prior.to(self.out.bias))

    def forward(self, x_half: Tensor, previous_r: Tensor) -> Tensor:
        """(B, T, D) first-half output and (B, T, D) R_{t-1} at each position -> (B, T, posterior_size) params (at
        least float32), position by position."""
        return self.params(self.read(x_half), previous_r)

    def read(self, x_half: Tensor) -> Tensor:
        """(B, T, D) first-half output -> (B, T, D) its part of the hidden layer, which no Z changes: a draw position
        after position computes it for all of them at once."""
        # the functions on the modules' weights, not the modules' calls: a decoding step runs the head at every
        # token, and at a small width a module call's bookkeeping costs a good part of its operation's time
        norm, hidden = self.norm, self.hidden
        normed = F.rms_norm(x_half, norm.normalized_shape, norm.weight, norm.eps)
        return F.linear(normed, hidden.weight, hidden.bias)

    def params(self, read: Tensor, previous_r: Tensor) -> Tensor:
        """(B, T, D) `read`'s output and (B, T, D) R_{t-1} -> (B, T, posterior_size) params (at least float32)."""
        previous_r = previous_r if previous_r.dtype == read.dtype else previous_r.to(read.dtype)
        memory, out = F.linear(previous_r, self.memory.weight), self.out  # memory: a Linear without bias
        return at_least_float32(F.linear(F.silu(read + memory), out.weight, out.bias))
