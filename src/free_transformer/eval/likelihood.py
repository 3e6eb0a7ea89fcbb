"""Held-out likelihoods in bits per token and bits per byte.

A baseline decoder gives log p(x) exactly. A Free Transformer's p(x) = E_{z ~ p(z)} p(x | z) is
intractable (2^(H T) latent sequences for a binary Z, an integral for a continuous one), so three
estimates are reported, each on the same windows:

- prior cross-entropy: E_{z ~ p(z)} [-log p(x | z)] with K prior draws: what the model pays when
  it generates with prior latents, as the paper does. An upper bound on -log p(x) (Jensen).
- ELBO: E_{z ~ q}[-log p(x | z)] + KL(q(z | x) || p(z)), the training objective without free bits,
  with q the encoder's posterior; the KL is exact (closed form per token, the latent space's `kl`).
  Also an upper bound on -log p(x) (in expectation).
- IWAE (Burda et al.): -log (1/K) sum_k p(x | z_k) p(z_k) / q(z_k | x), z_k ~ q. An upper bound on
  -log p(x) that tightens as K grows and equals the single-sample ELBO estimate at K = 1;
  log q(z | x) - log p(z) per token is the latent space's `log_ratio` (densities for a continuous Z).

The prior draws come from a `LatentPlan` (free_transformer.inference.latents), whose rows are seeded per
window and draw: the one dispenser of Z that generation uses.

The posterior cross-entropy alone is also given, for diagnosis only: it is not a likelihood (the
encoder has read x). Text is cut into non-overlapping windows of max_seq_len + 1 tokens; the first
token of each window is context only, and bytes are counted on the decoded predicted tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..analysis.measures import iwae
from ..base.latent_choice import LatentChoice
from ..base.seeding import benchmark_seed, generators
from ..base.units import LN2
from ..inference.latents import LatentPlan
from ..model.transformer import FreeTransformer


def windows(ids: Sequence[int], length: int) -> list[list[int]]:
    """Non-overlapping windows of `length` + 1 tokens (the last may be shorter, at least 2)."""
    out = []
    for start in range(0, max(0, len(ids) - 1), length):
        piece = list(ids[start : start + length + 1])
        if len(piece) >= 2:
            out.append(piece)
    return out


def _nll_rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(K, T, V) logits, (K, T) targets -> (K,) summed negative log-likelihood in nats.

    logsumexp - target logit in the logits' float32, summed over T in float64: no float64 copy of the
    logits (its accuracy and speed against a float64 log-softmax: docs/results.md)."""
    logits = logits.float()
    target_logit = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (K, T)
    return (torch.logsumexp(logits, dim=-1) - target_logit).double().sum(-1)


@torch.no_grad()
def heldout_likelihood(
    model: FreeTransformer,
    tokenizer,
    text: str,
    *,
    samples: int = 8,
    seed: int = 0,
    max_windows: int | None = None,
    progress: Callable[[int], object] | None = None,  # e.g. a tqdm bar's update: what it returns is ignored
) -> dict:
    """Bits per token and per byte of `text` under the model (see the module docstring)."""
    model.eval()
    device = model.rope_cos.device
    chunks = windows(tokenizer.encode(text), model.config.max_seq_len)
    if max_windows is not None:
        chunks = chunks[:max_windows]
    if not chunks:
        raise ValueError("held-out text too short: it needs at least 2 tokens")
    is_free, K = model.config.is_free, samples
    totals = {"tokens": 0, "bytes": 0}
    per_window = []
    for w, chunk in enumerate(chunks):
        ids = torch.tensor(chunk, device=device)
        inputs, targets = ids[:-1], ids[1:]
        T = inputs.numel()
        n_bytes = len(tokenizer.decode(chunk[1:]).encode("utf-8"))
        record: dict[str, float] = {"tokens": T, "bytes": n_bytes}
        if not is_free:
            logits = model(inputs[None], latents=LatentChoice.PRIOR).logits
            record["exact"] = float(_nll_rows(logits, targets[None])[0])
        else:
            assert model.latent_space is not None  # is_free: the model has a latent path
            gens = generators([benchmark_seed(seed, "heldout", w, k) for k in range(K)], device)
            batch, target_rows = inputs.expand(K, -1), targets.expand(K, -1)
            prior_plan = LatentPlan(K, model.latent_space, prompt_source=LatentChoice.PRIOR, generators=gens)
            prior = model(batch, latents=prior_plan.source(0, T, device))
            record["prior_ce"] = float(_nll_rows(prior.logits, target_rows).mean())
            post = model(batch, latents=LatentChoice.ENCODER, generator=gens)
            nll = _nll_rows(post.logits, target_rows)  # (K,) -log p(x | z_k)
            kl = float(post.kl_per_token_nats[0].double().sum())
            record["posterior_ce"] = float(nll.mean())
            record["kl"] = kl
            record["elbo"] = float(nll.mean()) + kl
            record["iwae"] = iwae(nll, model.latent_space, post.posterior, post.latents)
        totals["tokens"] += T
        totals["bytes"] += n_bytes
        per_window.append(record)
        if progress is not None:
            progress(1)
    measures = ["exact"] if not is_free else ["prior_ce", "elbo", "iwae", "posterior_ce", "kl"]
    result: dict[str, object] = {
        "windows": len(chunks),
        "tokens": totals["tokens"],
        "bytes": totals["bytes"],
        "samples": None if not is_free else K,
        "window_tokens": model.config.max_seq_len,
    }
    for name in measures:
        result[name] = total_of(per_window, name)
    result["per_window"] = per_window
    return result


def total_of(per_window: list[dict], name: str) -> dict:
    """One measure summed over the windows: nats, and bits per token and per byte."""
    nats = sum(w[name] for w in per_window)
    tokens, n_bytes = sum(w["tokens"] for w in per_window), sum(w["bytes"] for w in per_window)
    return {"nats": nats, "bits_per_token": nats / (LN2 * tokens), "bits_per_byte": nats / (LN2 * n_bytes)}
