#!/usr/bin/env python3
"""Test-time search over Z on the synthetic tasks: does choosing among Z candidates beat choosing among token
samples, scored by the model's own likelihood?

    python scripts/search_synthetic.py letters RUN [RUN ...] [--prompts 52] [--sizes 1,4,16]
    python scripts/search_synthetic.py coins RUN [RUN ...] [--prompts 256] [--samples 16] [--prefix 4]

letters: for prompts "X>" (every letter in turn), best-of-N at each N of --sizes with Z from the prior (the prompt's
too), temperature 1, candidates differing in Z only (vary=latent), in token noise only (vary=tokens) or in both;
the chosen candidate is the one of the highest mean log-probability (free_transformer.best_of). Prints, per run and
variation, the share of valid chosen generations (data.synthetic.analyse_letters) and the share of prompts where
any candidate was valid (the oracle's, pass@N).

coins: fresh coin-flip sequences, of which the model sees the first --prefix values (Z of the prompt from the
encoder on them); --samples continuations of each, differing in Z, in tokens or in both; each continuation's
answer is its majority value; maj@k (eval.task_metrics.majority_at_k) against the sequence's hidden coin.

Each line is one run; runs are read with load_model (a run directory or a checkpoint). One thread."""

from __future__ import annotations

import argparse
import statistics

import torch

from free_transformer.base.latent_choice import LatentChoice
from free_transformer.data.synthetic import BODY_LENGTH, LETTERS, analyse_letters, coinflip_batch
from free_transformer.eval.task_metrics import majority_at_k, pass_at_k
from free_transformer.experiments.demo.coins import majority_coin
from free_transformer.inference.generate import GenerationConfig, generate
from free_transformer.inference.search import VARIATIONS, best_of, candidate_sources
from free_transformer.runs.checkpoint import load_model


def letters(run: str, prompts: int, sizes: list[int], seed: int) -> list[str]:
    model, _ = load_model(run)
    config = GenerationConfig(max_new_tokens=BODY_LENGTH, temperature=1.0)
    chosen_letters = [LETTERS[i % len(LETTERS)] for i in range(prompts)]
    ids = [[ord(letter), ord(">")] for letter in chosen_letters]
    lines = []
    for vary in VARIATIONS:
        cells = []
        for n in sizes:
            found = best_of(model, ids, n, config, vary=vary, seed=seed, latents=LatentChoice.PRIOR)
            valid = [
                [analyse_letters(bytes(t).decode("latin-1"), letter).valid for t in tokens]
                for tokens, letter in zip(found.tokens, chosen_letters)
            ]
            chosen = statistics.fmean(v[k] for v, k in zip(valid, found.chosen))
            oracle = statistics.fmean(any(v) for v in valid)
            cells.append(f"N={n}: {chosen:.3f} (any {oracle:.3f})")
        lines.append(f"{run}  {vary:<6}  " + "  ".join(cells))
    return lines


def coins(run: str, prompts: int, samples: int, prefix: int, seed: int) -> list[str]:
    model, saved = load_model(run)
    coin = saved["train"]["data"]["coinflip"]  # the run's training config, as the checkpoint keeps it
    sequences = coinflip_batch(prompts, coin["length"], coin["epsilon"], torch.Generator().manual_seed(seed))
    # the hidden coins: coinflip_batch's first draw, made again from the same seed
    hidden = torch.randint(0, 2, (prompts, 1), generator=torch.Generator().manual_seed(seed))[:, 0].tolist()
    steps = coin["length"] - prefix
    config = GenerationConfig(max_new_tokens=steps, temperature=1.0)
    ids = [s[: 1 + prefix].tolist() for s in sequences]
    lines = []
    for vary in VARIATIONS:
        length = 1 + prefix + steps - 1
        seeds, latents = candidate_sources(
            model, ids, samples, length, seed=seed, vary=vary, context=LatentChoice.ENCODER
        )
        rows = [p for p in ids for _ in range(samples)]
        result = generate(model, rows, config, seeds=seeds, latents=latents)
        answers = [majority_coin(bytes(t).decode("latin-1")) for t in result.tokens]
        cells = []
        for k in (1, 4, samples):
            scores = []
            for i, coin_value in enumerate(hidden):
                mine = answers[i * samples : (i + 1) * samples]
                votes = [None if a is None else str(a) for a in mine]
                scores.append(majority_at_k(votes, [a == coin_value for a in mine], k, seed=seed))
            cells.append(f"maj@{k}: {statistics.fmean(scores):.3f}")
        correct = [sum(a == hidden[i] for a in answers[i * samples : (i + 1) * samples]) for i in range(len(hidden))]
        cells.append(f"pass@{samples}: {statistics.fmean(pass_at_k(samples, c, samples) for c in correct):.3f}")
        lines.append(f"{run}  {vary:<6}  " + "  ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=["letters", "coins"])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--prompts", type=int, default=None, help="letters: 52; coins: 256")
    parser.add_argument("--sizes", default="1,4,16", help="letters: the N of best-of-N")
    parser.add_argument("--samples", type=int, default=16, help="coins: continuations per sequence")
    parser.add_argument("--prefix", type=int, default=4, help="coins: values of the sequence the model sees")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run in args.runs:
        if args.task == "letters":
            lines = letters(run, args.prompts or 52, [int(n) for n in args.sizes.split(",")], args.seed)
        else:
            lines = coins(run, args.prompts or 256, args.samples, args.prefix, args.seed)
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
