"""What Z holds, measured one way everywhere: during training (validation), in `inspect`, in the demo,
in the study and in held-out likelihoods.

    saving           the bits Z saves: the cross-entropy with Z from the prior minus with Z from the
                     encoder, how much knowing the sequence's own Z helps the decoder (0 when it ignores Z)
    bits_saved       the saving at every predicted token of given sequences
    dead_units       the units of Z (bits, dimensions, groups) whose KL to the prior is under DEAD_UNIT_KL
    kl_split         the per-token KL as information about the sequence plus prior mismatch, the part
                     that generation from the prior gets wrong at every token
    iwae             the importance-weighted bound, from the latent space's log q(z | x) - log p(z)
    honest_bits      the tightest honest estimate of -log2 P(x) from the held-out bounds
    latent_verdict   a one-line warning when Z is unused (collapse) or carries the tokens (copying)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..base.latent_choice import ContextChoice, LatentChoice
from ..base.units import LN2
from ..model.latent import Generators, LatentPlan, LatentSpace

# A unit of Z (a bit, a dimension, a group) whose KL to the prior is under this (bits per token) carries
# nothing; meaningful where the units are independent (LatentSpace.independent_units).
DEAD_UNIT_KL = 0.01
# Z is unused (collapsed) when it saves less than this per token (bits) once training has settled.
COLLAPSED_SAVING = 0.01
# The encoder channels the tokens when the KL sits at its free budget kappa (within 10 %), kappa is at
# least this (bits), and Z saves at least half of the KL it spends: the training loss then flatters the
# model by about the KL, and generation, which draws Z from the prior, is that much worse.
COPYING_KAPPA, COPYING_SHARE = 2.0, 0.5


def saving(prior_ce_bits, encoder_ce_bits):
    """The bits Z saves: the cross-entropy with Z drawn from the prior minus the cross-entropy with Z from
    the encoder (which has read the sequence), both in bits; floats or tensors of one shape alike."""
    return prior_ce_bits - encoder_ce_bits


@torch.no_grad()
def bits_saved(model, tokens: torch.Tensor, *, samples: int = 2, seed: int = 0) -> torch.Tensor:
    """(B, T) sequences -> (B, T - 1) `saving` at each predicted token, each cross-entropy averaged over
    `samples` draws of Z."""
    model.eval()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    sources: tuple[ContextChoice, ...] = (LatentChoice.PRIOR, LatentChoice.ENCODER)
    ce = {source: torch.zeros(targets.shape, dtype=torch.float64, device=tokens.device) for source in sources}
    for k in range(samples):
        for source in ce:
            generator = torch.Generator(device=tokens.device).manual_seed(seed + k)
            plan = LatentPlan(inputs.shape[0], model.latent_space, prompt_source=source, generators=generator)
            latents = plan.source(0, inputs.shape[1], tokens.device)  # ENCODER, or (B, T - 1, ...) prior Z
            logits = model(inputs, latents=latents, generator=generator).logits  # (B, T - 1, V)
            nats = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")  # (B, T - 1)
            ce[source] += nats.double() / (samples * LN2)
    return saving(ce[LatentChoice.PRIOR], ce[LatentChoice.ENCODER])


def dead_units(kl_bits_per_unit: list[float]) -> int:
    return sum(value < DEAD_UNIT_KL for value in kl_bits_per_unit)


@torch.no_grad()
def kl_split(
    space: LatentSpace, posterior: torch.Tensor, *, generator: Generators = None, max_entries: int = 2**22
) -> dict[str, float]:
    """The mean per-token KL(Q(Z_t | S) || prior) of a batch of sequences, (B, T, P) posteriors, split in
    bits per token into

        information     I(Z_t; S) over the batch: what Z_t tells about its sequence
        prior_mismatch  KL(Qbar_t || prior), Qbar_t = the batch's mean of Q(Z_t | S), the values the decoder
                        is trained on at position t; a prior draw takes them in other proportions

    (KL = information + prior_mismatch, each averaged over t.) The free-bits hinge charges neither below
    kappa. Exact over the values of a space that lists them (`value_log_probs`: a binary Z's 2^H codes),
    Qbar accumulated over slices of the batch of at most `max_entries`; for another space a Monte Carlo
    estimate, one draw of `generator` per sequence and position, E_{z ~ Qbar}[log Qbar(z) - log p(z)] with
    Qbar a mixture of the B posteriors."""
    B, T, _ = posterior.shape
    kl = float(space.kl(posterior.double()).mean()) / LN2
    listed = space.value_log_probs(posterior[:1, :1])
    if listed is not None:
        log_p = listed[1]  # (N,)
        mean_q = torch.zeros(T, log_p.numel(), dtype=torch.float64, device=posterior.device)
        rows = max(1, max_entries // (T * log_p.numel()))
        for chunk in posterior.split(rows):
            chunk_listed = space.value_log_probs(chunk)
            assert chunk_listed is not None  # the space listed its values above: it lists them for every slice
            mean_q += chunk_listed[0].exp().sum(0) / B  # (b, T, N) summed over the slice
        mismatch = float((mean_q * (mean_q.clamp_min(1e-300).log() - log_p)).sum(-1).mean()) / LN2
    else:
        values = space.sample(posterior, generator)[1]  # (B, T, *value_shape), z_b ~ Q(Z_t | S_b)
        rows = max(1, max_entries // (B * T * posterior.shape[-1]))
        total = 0.0
        for chunk in values.split(rows):  # log Qbar(z) - log p(z) = logsumexp_b' log_ratio_b'(z) - log B
            ratios = space.log_ratio(posterior.unsqueeze(0), chunk.unsqueeze(1))  # (b, B, T)
            total += float((torch.logsumexp(ratios, dim=1) - math.log(B)).sum())
        mismatch = total / (B * T) / LN2
    return {"information": kl - mismatch, "prior_mismatch": mismatch}


def iwae(nll: torch.Tensor, space: LatentSpace, posterior: torch.Tensor, values: torch.Tensor) -> float:
    """-log (1/K) sum_k p(x | z_k) p(z_k) / q(z_k | x) in nats, from K draws z_k ~ q: nll (K,) the
    -log p(x | z_k), posterior (K, T, P) and values (K, T, *value_shape) the encoder's. An upper bound of
    -log p(x)."""
    K = nll.shape[0]
    log_ratio = -nll - space.log_ratio(posterior, values).sum(-1)  # (K,) log p(x | z) + log p(z) - log q(z | x)
    return float(-(torch.logsumexp(log_ratio, 0) - math.log(K)))


def honest_bits(measures: dict, unit: str = "bits_per_byte") -> float:
    """The tightest honest estimate of -log2 P(x): exact for a baseline; for a Free Transformer the lower of
    its two upper bounds, IWAE (posterior proposals) and the prior-Z cross-entropy (Jensen). IWAE with K
    draws is loose when the posterior is far from the prior; the prior-Z bound then wins."""
    like = measures["likelihood"]
    if not measures["free"]:
        return like["exact"][unit]
    return min(like["iwae"][unit], like["prior_ce"][unit])


def latent_verdict(saved: float, kl: float, kappa_bits: float, prior_ce: float, settled: bool) -> str | None:
    """A one-line warning when Z is unused (once training has `settled`) or carries the tokens; else None.
    saved: bits Z saves per token, kl: KL per token (bits), prior_ce: cross-entropy with prior Z (bits)."""
    if settled and saved < COLLAPSED_SAVING:
        return (
            f"Z is unused: it saves {saved:.3f} bits per token (KL {kl:.3f} bits), the decoder ignores it; "
            "a larger post_sampler_init_std or optim.latent_lr_scale, or another seed, may revive it"
        )
    if copies_tokens(saved, kl, kappa_bits):
        return (
            f"Z carries the tokens: KL {kl:.2f} bits at kappa {kappa_bits:g} and Z saves {saved:.2f} bits per "
            f"token, so the training loss flatters the model; generation (prior Z) scores {prior_ce:.3f} bits "
            "per token"
        )
    return None


def collapsed(saved: float) -> bool:
    return saved < COLLAPSED_SAVING


def copies_tokens(saved: float, kl: float, kappa_bits: float) -> bool:
    return kappa_bits >= COPYING_KAPPA and kl >= 0.9 * kappa_bits and saved >= COPYING_SHARE * kl
