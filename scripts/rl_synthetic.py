#!/usr/bin/env python3
"""Where Z comes from, measured on the synthetic tasks: one sample from the uniform prior, the learned prior or an RL
policy over Z (runs of `free-transformer rl`), against best-of-16 over Z with the verifier.

    python scripts/rl_synthetic.py letters RUN [RUN ...] [--latents prior|policy] [--prompts 26] [--samples 16]
    python scripts/rl_synthetic.py coins RUN [RUN ...] [--latents prior|policy] [--prompts 2048] [--samples 16]
        [--best-of]
    python scripts/rl_synthetic.py figure OUT.png RUN [RUN ...]

letters: every prompt "X>" (letters in turn) sampled --samples times, each sample its own stream (Z from --latents:
the prior, or the run's head), 64 bytes at temperature 1; prints the share of valid samples (one sample's validity,
N = 1), with --best-of the share of prompts whose best-of-16 over Z with the verifier is valid (best_of, Z varied,
the token stream shared: scripts/search_synthetic.py's oracle), the KL of the Z drawn to the uniform prior in bits per
token, and the decoder's cross-entropy on held-out letters with Z from the encoder, the prior and the head.
coins: fresh coin sequences, the model sees the first 4 values; --samples continuations each; maj@1 and maj@16 of
the continuations' majority values against the hidden coin, and the best any choice of the coin does from the values
shown on the same sequences (2,048 of them by default: at 256 that ceiling alone moves by 0.026, one standard
deviation); with --best-of, the hidden coin's share among best-of-16 over Z chosen by a verifier that knows only the
shown values: what choosing Z can reach with this decoder, whose continuations keep the data's flips.
figure: the reward against reward calls of the runs' metrics.jsonl, one line each, a panel a task and a colour an arm
(a run named TASK-ARM-seedN), to OUT.png.

Each line is one run (load_model: a run directory or a checkpoint). One thread."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from free_transformer.base.counter_random import row_keys
from free_transformer.base.latent_choice import LatentChoice
from free_transformer.base.plotting import Line, Panel, draw
from free_transformer.base.seeding import generator, seed_of
from free_transformer.base.units import LN2
from free_transformer.data.synthetic import BODY_LENGTH, LETTERS, letters_batch, majority_coin
from free_transformer.eval.task_metrics import majority_at_k
from free_transformer.inference.generate import GenerationConfig
from free_transformer.inference.search import best_of
from free_transformer.model.latent import PolicyDraw, counter_policy_noise
from free_transformer.runs.checkpoint import load_model
from free_transformer.train.metrics import read_metrics
from free_transformer.train.rl.rewards import Coins, letters_valid
from free_transformer.train.rl.rollout import features, rollout

HELD_OUT = 256  # letters sequences for the cross-entropies


def sample(model, prompts: list[list[int]], samples: int, new_tokens: int, policy: bool, seed: int):
    """`samples` rollouts of each prompt (prompt-major), each its own stream; the mean KL of the Z drawn to the
    uniform prior, bits per token (0 for prior Z)."""
    rows = torch.tensor([p for p in prompts for _ in range(samples)])
    keys = row_keys(torch.tensor([seed_of(seed, "eval", i) for i in range(len(rows))]))
    drawn = rollout(model, rows, new_tokens, keys, policy=policy)
    kl = 0.0
    if policy:
        with torch.no_grad():
            params = model.latent.policy_params(features(model, drawn), drawn.latents)
            kl = float(model.latent_space.kl(params).mean()) / LN2
    return drawn.generated(), kl


@torch.no_grad()
def cross_entropies(model, seed: int) -> dict[str, float]:
    """The decoder's cross-entropy (bits per token) on held-out letters with Z from the encoder, the prior and the
    head (where the run has one)."""
    tokens = letters_batch(HELD_OUT, generator(seed, "held-out letters"))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    keys = row_keys(torch.arange(HELD_OUT) + seed)
    sources = {"encoder": LatentChoice.ENCODER, "prior": LatentChoice.PRIOR}
    if model.latent is not None and model.latent.policy is not None:
        positions = torch.arange(inputs.shape[1])[None, :]
        sources["policy"] = PolicyDraw(counter_policy_noise(model.latent_space, keys[:, None], positions))
    torch.manual_seed(seed)
    return {name: float(model(inputs, targets, latents=z).cross_entropy_nats) / LN2 for name, z in sources.items()}


def letters(run: str, policy: bool, prompts: int, samples: int, best: bool, seed: int) -> str:
    model, _ = load_model(run)
    chosen = [LETTERS[i % len(LETTERS)] for i in range(prompts)]
    ids = [[ord(letter), ord(">")] for letter in chosen]
    generated, kl = sample(model, ids, samples, BODY_LENGTH, policy, seed)
    valid = statistics.fmean(letters_valid(ids[i // samples], tokens) for i, tokens in enumerate(generated))
    cells = [f"valid@1 {valid:.3f}", f"KL {kl:.3f} bits/token"]
    if best:
        config = GenerationConfig(max_new_tokens=BODY_LENGTH, temperature=1.0)
        found = best_of(
            model, ids, 16, config, vary="latent", seed=seed, latents=LatentChoice.PRIOR, scorer=letters_valid
        )
        cells.append(f"best-of-16 over Z {statistics.fmean(max(s) for s in found.scores):.3f}")
    if model.config.is_free:
        ce = cross_entropies(model, seed)
        cells.append("CE " + " ".join(f"{name} {value:.4f}" for name, value in ce.items()) + " bits/token")
    return f"{run}  " + "  ".join(cells)


def coins(run: str, policy: bool, prompts: int, samples: int, best: bool, seed: int) -> str:
    model, saved = load_model(run)
    coin = saved["train"]["data"]["coinflip"]
    task = Coins(coin["length"], coin["epsilon"])
    episodes = task.episodes(prompts, generator(seed, "coins eval"))
    generated, kl = sample(model, [e.prompt for e in episodes], samples, task.max_new_tokens, policy, seed)
    answers = [majority_coin(bytes(tokens).decode("latin-1")) for tokens in generated]
    cells = []
    for k in (1, samples):
        scores = []
        for i, episode in enumerate(episodes):
            mine = answers[i * samples : (i + 1) * samples]
            hidden = episode.reward.keywords["coin"]  # functools.partial(coin_answer, coin=...)
            votes = [None if a is None else str(a) for a in mine]
            scores.append(majority_at_k(votes, [a == hidden for a in mine], k, seed=seed))
        cells.append(f"maj@{k} {statistics.fmean(scores):.3f}")
    cells.append(f"KL {kl:.3f} bits/token")
    if best:
        config = GenerationConfig(max_new_tokens=task.max_new_tokens, temperature=1.0)
        found = best_of(
            model,
            [e.prompt for e in episodes],
            16,
            config,
            vary="latent",
            seed=seed,
            latents=LatentChoice.PRIOR,
            scorer=agrees_with_shown,
        )
        chosen = statistics.fmean(e.reward(e.prompt, tokens) for e, tokens in zip(episodes, found.best))
        cells.append(f"best-of-16 over Z, shown values {chosen:.3f}")
    cells.append(f"best from {task.prefix} values {best_from_prefix(episodes):.3f}")
    return f"{run}  " + "  ".join(cells)


def agrees_with_shown(prompt: list[int], tokens: list[int]) -> float:
    """1.0 when the continuation's majority is the shown values' (any, on their tie): a verifier that knows what the
    model sees and not the hidden coin, so that best-of over Z with it is the most a choice of Z gets from them."""
    shown = majority_coin(bytes(prompt[1:]).decode("latin-1"))
    answer = majority_coin(bytes(tokens).decode("latin-1"))
    return float(answer is not None and (shown is None or answer == shown))


def best_from_prefix(episodes) -> float:
    """The share of these sequences whose hidden coin the majority of the values shown gives (a tie: half): the best
    any choice of the coin does from them (0.784 in expectation at epsilon = 0.3 and 4 values), before the
    continuation's own flips."""
    scores = []
    for episode in episodes:
        shown = bytes(episode.prompt[1:]).decode("latin-1")
        guess = majority_coin(shown)
        scores.append(0.5 if guess is None else float(guess == episode.reward.keywords["coin"]))
    return statistics.fmean(scores)


def figure(out: str, runs: list[str]) -> None:
    """One panel per task (the run name's first word: letters, coins), one colour per arm (the run name less its
    -seedN: letters-latent, letters-tokens, ...), a line per run."""
    panels: dict[str, Panel] = {}
    colours: dict[str, int] = {}
    for run in runs:
        logged = read_metrics(Path(run) / "metrics.jsonl", ("step",))
        arm = Path(run).name.rsplit("-seed", 1)[0]
        task = arm.split("-")[0]
        panel = panels.setdefault(task, Panel(f"{task}: reward of the step's samples", "mean reward"))
        xs, ys = [m["reward_calls"] for m in logged], [m["reward"] for m in logged]
        first = arm not in colours  # one legend entry an arm, not a run
        panel.lines.append(Line(colours.setdefault(arm, len(colours)), arm if first else "_nolegend_", xs, ys))
    draw(list(panels.values()), out, xlabel="reward calls", legend="panels", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=["letters", "coins", "figure"])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--latents", choices=["prior", "policy"], default="prior")
    parser.add_argument("--prompts", type=int, default=None, help="letters: 26; coins: 2048")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument(
        "--best-of",
        action="store_true",
        help="also best-of-16 over Z with the verifier (coins: one that knows the shown values, not the coin)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.task == "figure":
        figure(args.runs[0], args.runs[1:])
        return
    for run in args.runs:
        policy = args.latents == "policy"
        if args.task == "letters":
            line = letters(run, policy, args.prompts or 26, args.samples, args.best_of, args.seed)
        else:
            line = coins(run, policy, args.prompts or 2048, args.samples, args.best_of, args.seed)
        print(line, flush=True)


if __name__ == "__main__":
    main()
