"""GRPO (Shao et al. 2024, "DeepSeekMath", section 4.1): group-relative advantages and the clipped surrogate with a
KL penalty, the same for either kind of action (the latent decisions Z_t, or the tokens):

    A_i = (R_i - mean_g R) / (std_g R + eps)            over the G samples of one prompt (population std)
    r_it = exp(log pi(a_it) - log pi_old(a_it))         the ratio of action t of sample i
    L = -(1/G) sum_i (1/|o_i|) sum_t [min(r_it A_i, clip(r_it, 1 - e, 1 + e) A_i) - beta KL_it]

KL_it is the exact KL(pi(. | s_it) || pi_ref(. | s_it)) at that action's state, in closed form (the latent space's
`kl_between`, or a sum over the vocabulary), rather than the paper's sampled estimator: here it is cheap."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

ADVANTAGE_EPS = 1e-4


def group_advantages(rewards: Tensor, eps: float = ADVANTAGE_EPS) -> Tensor:
    """(prompts, G) rewards -> (prompts, G) advantages: each reward less its group's mean, over the group's
    population standard deviation (+ eps); 0 in a group whose rewards are all equal."""
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True, correction=0)
    return (rewards - mean) / (std + eps)


@dataclass
class GRPOLoss:
    loss: Tensor  # () to minimise
    surrogate: Tensor  # () the mean clipped surrogate (what the policy gains)
    kl: Tensor  # () the mean KL per action to the reference, nats
    clipped: Tensor  # () the share of actions whose clipped term the min took (they get no gradient)


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    kl: Tensor,
    *,
    clip: float,
    kl_coef: float,
    actions: Tensor | None = None,
) -> GRPOLoss:
    """log_probs, old_log_probs, kl: (B, T) per action of each sample; advantages (B,). Every sample has T actions,
    or, given `actions` (B, T) bool, those it marks (samples of prompts of other lengths, padded to one T): the
    means are then over the marked actions alone, and the padding gets no gradient."""
    ratio = torch.exp(log_probs - old_log_probs.detach())  # (B, T)
    advantage = advantages.detach()[:, None]
    clipped_ratio = ratio.clamp(1 - clip, 1 + clip)
    surrogate = torch.minimum(ratio * advantage, clipped_ratio * advantage)  # (B, T)
    was_clipped = (clipped_ratio * advantage < ratio * advantage).float()  # the min took the clipped term: no gradient
    if actions is None:
        per_sample = (surrogate - kl_coef * kl).mean(-1)  # (B,) the mean over a sample's actions
        return GRPOLoss(-per_sample.mean(), surrogate.mean().detach(), kl.mean().detach(), was_clipped.mean())
    mask = actions.to(surrogate.dtype)  # (B, T)
    per_sample = ((surrogate - kl_coef * kl) * mask).sum(-1) / mask.sum(-1)  # (B,)

    def mean(values: Tensor) -> Tensor:  # over every sample's actions
        return (values * mask).sum() / mask.sum()

    return GRPOLoss(-per_sample.mean(), mean(surrogate).detach(), mean(kl).detach(), mean(was_clipped))
