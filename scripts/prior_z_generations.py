"""Why a letters model's generations from prior Z break: its KL split, and generations with Z drawn four ways.

    python scripts/prior_z_generations.py CHECKPOINT [LETTER]

Prints measures.kl_split on 512 fresh sequences of the prompt's letter, and per sequence against the data's entropy
(the position and the noise: 27.4 bits), which bounds how far the codes the decoder is trained on are from the prior's
(KL(Qbar(Z) || prior) = sum_t KL_t - I(Z; S), and I(Z; S) <= H(S)); the decoder's hazard of starting the target
(its probability of the letter at a body position the target has not reached, per eighth of the body) with Z from the
encoder and from the prior, beside the data's 1 / (57 - j); then, for 128 generations after the
prompt "LETTER>" with Z drawn from (a) the prior, (b) the aggregate posterior Q̄_t (the batch's mean of Q(Z_t | S)),
independently per token, (c) the encoder's posterior of real sequences and (d) the same with each token's Z
shuffled across sequences: the share of valid generations, where their targets start (per eighth of the 64
positions), why the invalid ones are invalid, and their share of '!' (the data's: 1/16). docs/demo.md reads it.
"""

import collections
import math
import sys

import torch

from free_transformer.analysis.measures import kl_split
from free_transformer.base.latent_choice import LatentChoice
from free_transformer.data.synthetic import BODY_LENGTH, N_POSITIONS, NOISE_PROBABILITY, analyse_letters, letters_batch
from free_transformer.inference.generate import GenerationConfig, generate
from free_transformer.model.latent import code_log_probabilities
from free_transformer.runs.checkpoint import load_model

SEQUENCES, SAMPLES = 512, 128
NOISE_ENTROPY = -NOISE_PROBABILITY * math.log2(NOISE_PROBABILITY) - (1 - NOISE_PROBABILITY) * math.log2(
    1 - NOISE_PROBABILITY
)
DATA_ENTROPY = math.log2(N_POSITIONS) + BODY_LENGTH * NOISE_ENTROPY  # bits in a sequence of a given letter
EIGHTHS = range(0, N_POSITIONS - 1, 8)  # the first body position of each eighth that can hold a start


def why_invalid(body: str, letter: str) -> str:
    letters = body.count(letter)
    if letters == 0:
        return "no target"
    if any(c not in "_!" + letter for c in body):
        return "other characters"
    return "letters not in one block of 8" if letters <= 8 else "more than 8 letters (a second target)"


def start_hazards(logits: torch.Tensor, tokens: torch.Tensor) -> list[float]:
    """From the model's (B, 65, V) logits of `tokens`: the mean probability of the prompt's letter at body positions
    before the target's first letter, per eighth of the body (the last eighth holds no start): how often the
    decoder would start the target there."""
    body = tokens[:, 2:]  # (B, 64); body position j is predicted at position j + 1
    p_letter = logits[:, 1:].float().softmax(-1).gather(-1, tokens[:, :1, None].expand(-1, BODY_LENGTH, 1))[..., 0]
    j = torch.arange(BODY_LENGTH)
    before = j[None] < (body == tokens[:, :1]).float().argmax(1)[:, None]  # (B, 64): the target not reached yet
    return [float(p_letter[before & (j >= lo) & (j < lo + 8)].mean()) for lo in EIGHTHS]


def main(checkpoint: str, letter: str = "K") -> None:
    torch.set_num_threads(1)
    model, _ = load_model(checkpoint)
    if not model.config.is_free:
        sys.exit(f"{checkpoint} is a baseline: it has no Z")
    model.eval()
    tokens = letters_batch(SEQUENCES, torch.Generator().manual_seed(123))
    tokens = torch.where(tokens == tokens[:, :1], ord(letter), tokens)  # every sequence about the prompt's letter
    with torch.no_grad():
        encoded = model(tokens[:, :-1], latents=LatentChoice.ENCODER, generator=torch.Generator().manual_seed(1))
        prior_logits = model(
            tokens[:, :-1], latents=LatentChoice.PRIOR, generator=torch.Generator().manual_seed(2)
        ).logits
    bit_logits = encoded.bit_logits
    split = kl_split(bit_logits)
    print(
        f"KL {split['information'] + split['prior_mismatch']:.3f} bits/token = information "
        f"{split['information']:.3f} + prior mismatch {split['prior_mismatch']:.3f}"
    )
    # Per sequence: sum_t KL_t = I(Z; S) + KL(Qbar(Z) || prior), since Q(Z | S) is a product over t; and
    # sum_t I(Z_t; S) - I(Z; S) is the total correlation of Qbar(Z) across positions. I(Z; S) <= DATA_ENTROPY.
    per_sequence = {k: v * bit_logits.shape[1] for k, v in split.items()}
    correlations = max(0.0, per_sequence["information"] - DATA_ENTROPY)
    print(
        f"per sequence: KL {sum(per_sequence.values()):.1f} bits, the data's entropy {DATA_ENTROPY:.1f}: the codes "
        f"the decoder is trained on are at least {per_sequence['prior_mismatch'] + correlations:.1f} bits from the "
        f"prior's, {per_sequence['prior_mismatch']:.1f} in each position's codes and at least {correlations:.1f} in "
        "their correlations across positions"
    )

    data = [sum(1 / (N_POSITIONS - j) for j in range(lo, lo + 8)) / 8 for lo in EIGHTHS]
    for name, hazards in (
        ("Z from the encoder", start_hazards(encoded.logits, tokens)),
        ("Z from the prior", start_hazards(prior_logits, tokens)),
        ("in the data", data),
    ):
        print(f"hazard of starting the target per eighth, {name}: " + " ".join(f"{h:.3f}" for h in hazards))

    length = 2 + BODY_LENGTH - 1  # the latents a generation reads: prompt and body but the last token
    q = code_log_probabilities(bit_logits[:SAMPLES, :length]).exp()  # (SAMPLES, length, 2^H)
    mean_q = code_log_probabilities(bit_logits[:, :length]).exp().mean(0)  # (length, 2^H)
    posterior = torch.multinomial(q.reshape(-1, q.shape[-1]).float(), 1, generator=torch.Generator().manual_seed(8))
    posterior = posterior.view(SAMPLES, length)
    shuffle = torch.stack(
        [torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + t)) for t in range(length)], 1
    )
    latents = {
        "the prior": None,
        "the aggregate posterior, independently per token": torch.multinomial(
            mean_q.float(), SAMPLES, replacement=True, generator=torch.Generator().manual_seed(7)
        ).T,
        "the encoder, of real sequences": posterior,
        "the encoder, tokens shuffled across sequences": posterior.gather(0, shuffle),
    }
    prompt = torch.tensor([[ord(letter), ord(">")]]).expand(SAMPLES, -1)
    config = GenerationConfig(max_new_tokens=BODY_LENGTH, temperature=1.0)
    for name, z in latents.items():
        result = generate(model, prompt, config, seeds=range(1000, 1000 + SAMPLES), latents=z)
        bodies = [bytes(row).decode("latin-1") for row in result.tokens]
        analyses = [analyse_letters(body, letter) for body in bodies]
        starts = collections.Counter(a.position // 8 for a in analyses if a.valid)
        invalid = collections.Counter(why_invalid(b, letter) for b, a in zip(bodies, analyses) if not a.valid)
        noise = sum(body.count("!") for body in bodies) / (SAMPLES * BODY_LENGTH)
        print(
            f"Z from {name}: valid {sum(a.valid for a in analyses) / SAMPLES:.2f}; target starts per eighth "
            f"{[starts.get(i, 0) for i in range(8)]}; invalid: {dict(invalid.most_common())}; '!' {noise:.3f}"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
