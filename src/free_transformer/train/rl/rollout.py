"""Sampling for reinforcement learning: a step-by-step loop over the KV cache that draws each row's Z and tokens
from its counter-based streams (free_transformer.base.counter_random), as the decoding engine draws them:

    Z fed at position t     the prior's: counter_prior(space, key, t); the policy's: sample_from_noise(params_t,
                            counter_policy_noise(space, key, t)), params_t the head's output at t from the
                            prefix and Z_{t-1} (a prompt's positions in one forward, which draws them in turn)
    token sampled from t    inference.sampling.sample_next with the row's key at t (its TOKEN stream)

With Z from the prior this is `generate(..., latents="prior", seeds=...)` token for token (tests/test_rl.py); with
Z from the policy it is the reference a decoding step that draws Z from the head is checked against.

The log-probabilities an update needs are recomputed from the rollout: the latent actions' from the first half's
output (`features`, no gradient: the decoder is frozen) and the rollout's Z through the head alone; the token
actions' from one teacher-forced forward with the rollout's Z."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...base.latent_choice import LatentChoice
from ...inference.params import Sampling
from ...inference.sampling import sample_next
from ...model.latent import LatentSource, PolicyDraw, counter_policy_noise
from ...model.latent.draws import counter_prior
from ...model.transformer import FreeTransformer


@dataclass
class Rollout:
    tokens: Tensor  # (B, P + N) int64: the prompts, then the N generated tokens
    latents: Tensor | None  # (B, P + N - 1, *value_shape) the Z fed at each position; None for a baseline
    prompt_length: int  # P

    @property
    def fed(self) -> Tensor:
        """(B, P + N - 1) the tokens fed to the model (the last generated one never is)."""
        return self.tokens[:, :-1]

    def generated(self) -> list[list[int]]:
        """Each row's N generated token ids."""
        return self.tokens[:, self.prompt_length :].tolist()


def _latents(
    model: FreeTransformer, keys: Tensor, start: int, length: int, policy: bool, previous: Tensor | None = None
) -> LatentSource:
    """What the forward of positions [start, start + length) takes: the rows' policy noise (continuing from the Z
    `previous` (B, *value_shape) fed at start - 1) or prior Z."""
    space = model.latent_space
    if space is None:
        return LatentChoice.PRIOR  # a baseline has no Z
    positions = torch.arange(start, start + length, device=keys.device)[None, :]
    if policy:
        return PolicyDraw(counter_policy_noise(space, keys[:, None], positions), previous)  # noise (B, length, ...)
    return counter_prior(space, keys[:, None], positions)  # (B, length, *value_shape)


@torch.no_grad()
def rollout(
    model: FreeTransformer, prompts: Tensor, new_tokens: int, keys: Tensor, *, policy: bool, temperature: float = 1.0
) -> Rollout:
    """Sample `new_tokens` tokens after each of the (B, P) prompts, row i from its key keys[i] (B,) (row_keys of its
    seed), Z from the policy head when `policy`, else from the prior."""
    B, P = prompts.shape
    rule = Sampling(temperature=temperature)
    cache = model.new_cache(B, capacity=P + new_tokens)
    out = model(prompts, latents=_latents(model, keys, 0, P, policy), cache=cache)
    tokens, latents = [prompts], [out.latents]
    for n in range(new_tokens):
        position = P - 1 + n  # the position whose logits the next token is drawn from
        assert out.logits is not None  # a forward without targets returns its logits
        following = sample_next(out.logits[:, -1], rule, keys, position)  # (B,)
        tokens.append(following[:, None])
        if n + 1 < new_tokens:
            previous = None if out.latents is None else out.latents[:, -1]  # (B, *value_shape) the Z fed last
            source = _latents(model, keys, position + 1, 1, policy, previous)
            out = model(following[:, None], latents=source, cache=cache)
            latents.append(out.latents)
    fed = None if model.latent_space is None else torch.cat(latents, dim=1)
    return Rollout(torch.cat(tokens, dim=1), fed, P)


@torch.no_grad()
def features(model: FreeTransformer, sample: Rollout) -> Tensor:
    """(B, P + N - 1, D) the first half's output at every fed position: what the head reads."""
    return model.first_half(sample.fed)


def latent_log_probs(model: FreeTransformer, x_half: Tensor, latents: Tensor) -> tuple[Tensor, Tensor]:
    """(log pi(Z_t | X<=t, Z_{t-1}) (B, T), params (B, T, P)) of the rollout's Z under the head, with its
    gradient."""
    assert model.latent is not None and model.latent.policy is not None and model.latent_space is not None
    params = model.latent.policy_params(x_half, latents)
    return model.latent_space.log_prob(params, latents), params


def token_log_probs(model: FreeTransformer, sample: Rollout, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """(log p(x_t | X<t, Z) of the generated tokens (B, N), the log-softmax over the vocabulary there (B, N, V)),
    by one teacher-forced forward with the rollout's Z, with the decoder's gradient."""
    latents = sample.latents if sample.latents is not None else LatentChoice.PRIOR
    logits = model(sample.fed, latents=latents).logits
    assert logits is not None
    log_softmax = F.log_softmax(logits[:, sample.prompt_length - 1 :].float() / temperature, dim=-1)  # (B, N, V)
    chosen = sample.tokens[:, sample.prompt_length :, None]
    return log_softmax.gather(-1, chosen)[..., 0], log_softmax
