"""Reinforcement learning over Z and over tokens, and the learned prior (free_transformer.train.rl): the GRPO loss
against a case computed by hand, the policy's KL against closed forms written independently, the rollout against
the decoding engine, a head that learns a planted reward on Z, and `free-transformer rl` end to end (its bad
inputs, --resume, SIGTERM, a run that generate and convert take, torchrun with 2 processes)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_checkpoint, tiny_model

import free_transformer
from free_transformer import GenerationConfig, generate
from free_transformer.base.counter_random import row_keys
from free_transformer.cli import main
from free_transformer.model.latent import LATENT_KINDS
from free_transformer.runs.checkpoint import load_model
from free_transformer.train.rl.grpo import group_advantages, grpo_loss
from free_transformer.train.rl.rewards import Episode, RewardError, letters_valid, score
from free_transformer.train.rl.rollout import features, latent_log_probs, rollout
from free_transformer.train.rl.trainer import with_policy_head

# ---- GRPO's arithmetic ----------------------------------------------------------------------------------


def test_group_advantages_are_each_reward_less_the_groups_mean_over_its_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    advantages = group_advantages(rewards, eps=0.0 + 1e-12)
    # group 1: mean 1/2, population std 1/2; group 2: all equal, advantage 0
    torch.testing.assert_close(advantages[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))
    torch.testing.assert_close(advantages[1], torch.zeros(4))


def test_the_grpo_loss_of_a_small_case_computed_by_hand():
    """Two samples of two actions each; clip 0.2, beta 0.1.
    sample 0 (A = +1): ratios e^0.5 = 1.6487 (clipped to 1.2: min(1.6487, 1.2) = 1.2) and e^-0.1 = 0.9048 (kept);
    sample 1 (A = -1): ratios e^0.3 = 1.3499 (min(-1.3499, -1.2) = -1.3499, unclipped by the min) and e^-0.5 =
    0.6065 (min(-0.6065, -0.8) = -0.8, clipped)."""
    old = torch.zeros(2, 2)
    new = torch.tensor([[0.5, -0.1], [0.3, -0.5]], requires_grad=True)
    kl = torch.tensor([[0.2, 0.4], [0.0, 0.6]])
    out = grpo_loss(new, old, torch.tensor([1.0, -1.0]), kl, clip=0.2, kl_coef=0.1)
    by_hand = [
        ((1.2 - 0.1 * 0.2) + (math.exp(-0.1) - 0.1 * 0.4)) / 2,
        ((-math.exp(0.3) - 0.0) + (-0.8 - 0.1 * 0.6)) / 2,
    ]
    assert out.loss.item() == pytest.approx(-(by_hand[0] + by_hand[1]) / 2, abs=1e-6)
    assert out.clipped.item() == pytest.approx(0.5)  # 1.6487 -> 1.2 and 0.6065 -> 0.8
    out.loss.backward()
    # the clipped actions get no gradient; d(-r A / 4) / d log r = -r A / 4 for the others
    expected = torch.tensor([[0.0, -math.exp(-0.1) / 4], [math.exp(0.3) / 4, 0.0]])
    torch.testing.assert_close(new.grad, expected)


# ---- the policy's distribution against closed forms ------------------------------------------------------


def test_the_binary_policys_kl_is_the_sum_over_every_code():
    space = LATENT_KINDS["binary_mapper"](3, 8).double()
    q, p = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    codes = torch.arange(8)
    log_q = space.log_prob(q[:, None], codes[None, :])  # (5, 8): every code's log-probability
    log_p = space.log_prob(p[:, None], codes[None, :])
    torch.testing.assert_close(log_q.exp().sum(-1), torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(space.kl_between(q, p), (log_q.exp() * (log_q - log_p)).sum(-1))


def test_the_gaussian_and_categorical_policys_kl_are_torch_distributions_closed_forms():
    from torch.distributions import Categorical, Independent, Normal, kl_divergence

    gaussian = LATENT_KINDS["gaussian"](3, 8).double()
    q, p = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)

    def normal(params):
        return Independent(Normal(params[:, :3], (0.5 * params[:, 3:]).exp()), 1)

    torch.testing.assert_close(gaussian.kl_between(q, p), kl_divergence(normal(q), normal(p)))
    z = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(gaussian.log_prob(q, z), normal(q).log_prob(z))
    categorical = LATENT_KINDS["categorical"](2, 8).double()  # 2 groups of 4 classes
    q, p = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)

    def groups(params):
        return Independent(Categorical(logits=params.view(4, 2, 4)), 1)

    torch.testing.assert_close(categorical.kl_between(q, p), kl_divergence(groups(q), groups(p)))


# ---- the rollout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("units", [4, 0], ids=["free", "baseline"])
def test_a_rollout_with_prior_z_is_the_decoding_engines_sample(units):
    model = tiny_model(latent_units=units)
    prompts = torch.randint(0, 50, (3, 4), generator=torch.Generator().manual_seed(0))
    seeds = [5, 6, 7]
    sample = rollout(model, prompts, 6, row_keys(torch.tensor(seeds)), policy=False)
    engine = generate(model, prompts, GenerationConfig(max_new_tokens=6, temperature=1.0), seeds=seeds, latents="prior")
    assert sample.generated() == engine.tokens
    if units:
        assert sample.latents is not None and torch.equal(sample.latents, torch.stack(engine.latents))


def test_a_policy_rollouts_z_is_the_heads_draw_on_the_whole_sequence():
    """Step by step with the cache, each Z_t from the head at t: the same Z as one forward with the head over the
    sequence the rollout produced (the draw the decoding engine's step is checked against)."""
    from free_transformer.model.latent import PolicyDraw, counter_policy_noise

    model = with_policy_head(tiny_model(), seed=0)
    with torch.no_grad():
        model.latent.policy.out.weight.normal_(0, 1.0)
    keys = row_keys(torch.tensor([1, 2]))
    sample = rollout(model, torch.randint(0, 50, (2, 3)), 5, keys, policy=True)
    positions = torch.arange(sample.fed.shape[1])
    noise = counter_policy_noise(model.latent_space, keys[:, None], positions[None, :])
    assert torch.equal(model(sample.fed, latents=PolicyDraw(noise)).latents, sample.latents)


def test_a_policy_learns_a_planted_reward_on_z():
    """Reward 1 when the first bit of Z_1 is 1: from the prior (half the samples) to nearly all within 150 steps,
    the decoder untouched."""
    torch.manual_seed(0)
    model = with_policy_head(tiny_model(latent_units=4, dtype=torch.float32), seed=0)
    decoder = {name: p.clone() for name, p in model.named_parameters() if not name.startswith("latent.policy")}
    head = list(model.latent.policy.parameters())
    optimizer = torch.optim.Adam(head, lr=1e-2)
    prompts = torch.randint(0, 50, (4, 2), generator=torch.Generator().manual_seed(1)).repeat_interleave(8, 0)
    rewards_seen = []
    for step in range(150):
        keys = row_keys(torch.arange(32) + 1000 * step)
        sample = rollout(model, prompts, 2, keys, policy=True)
        rewards = (sample.latents[:, 1] & 1).float().view(4, 8)  # bit 0 of Z at position 1
        x_half = features(model, sample)
        log_probs, params = latent_log_probs(model, x_half, sample.latents)
        out = grpo_loss(
            log_probs, log_probs.detach(), group_advantages(rewards).flatten(), model.latent_space.kl(params),
            clip=0.2, kl_coef=0.0,
        )  # fmt: skip
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        rewards_seen.append(rewards.mean().item())
    assert sum(rewards_seen[:5]) / 5 < 0.7 and sum(rewards_seen[-10:]) / 10 > 0.95, rewards_seen[::10]
    assert all(torch.equal(p, decoder[name]) for name, p in model.named_parameters() if name in decoder)


# ---- rewards -----------------------------------------------------------------------------------------


def test_a_reward_that_raises_or_is_not_finite_is_one_line_naming_it_and_the_prompt():
    assert score("letters", Episode([75, 62], letters_valid), list(b"K" * 8 + b"_" * 56)) == 1.0

    def broken(prompt, tokens):
        raise KeyError("no\nsuch")

    for reward, words in [(broken, "raised"), (lambda p, t: float("nan"), "returned nan")]:
        with pytest.raises(RewardError) as raised:
            score("mine", Episode([1, 2], reward), [3])
        message = str(raised.value)
        assert "\n" not in message and "reward mine" in message and words in message and "[1, 2]" in message


# ---- the command ---------------------------------------------------------------------------------------


def _rl(*args) -> int:
    return main(["rl", *map(str, args)])


QUICK = ("prompts=2", "group=4", "max_new_tokens=6", "log_every=1", "progress=false")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    return {
        "free": tiny_checkpoint(root, "free", latent_units=4, max_seq_len=80),
        "baseline": tiny_checkpoint(root, "baseline", latent_units=0, max_seq_len=80),
    }


@pytest.mark.parametrize(
    ("run", "args", "words"),
    [
        ("baseline", ["--reward", "letters", "--actions", "latent"], "needs a Free Transformer"),
        ("baseline", ["--learned-prior"], "needs a Free Transformer"),
        ("free", ["--reward", "poems", "--actions", "latent"], "unknown reward 'poems'"),
        ("free", ["--actions", "latent"], "needs a reward"),
        ("free", ["--reward", "letters"], "give --actions"),
        ("free", ["--reward", "letters", "--actions", "latent", "--reference", "learned"], "--reference learned needs"),
        ("free", ["--learned-prior"], "records no training config"),
        ("free", ["--reward", "letters", "--actions", "latent", "steps=0"], "steps must be a positive integer"),
        ("free", ["--reward", "letters", "--actions", "latent", "max_new_tokens=90"], "exceed the model's max_seq_len"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(runs, tmp_path, capsys, run, args, words):
    assert _rl(runs[run], "--out", tmp_path / "out", *QUICK, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (tmp_path / "out").exists()


def test_resume_needs_an_rl_run(tmp_path, capsys):
    assert _rl("--resume", "--out", tmp_path / "none") == 2
    assert "nothing to resume" in capsys.readouterr().err


@pytest.mark.parametrize("actions", ["latent", "tokens"])
def test_a_grpo_run_resumes_and_is_a_run_generate_and_convert_take(runs, tmp_path, capsys, actions):
    out = tmp_path / actions
    assert _rl(runs["free"], "--reward", "letters", "--actions", actions, "--out", out, "steps=2", *QUICK) == 0
    assert _rl(runs["free"], "--reward", "letters", "--actions", actions, "--out", out, *QUICK) == 2  # taken
    assert "already holds a run" in capsys.readouterr().err
    assert _rl("--resume", "--out", out, "steps=3") == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [1, 2, 3] and [m["reward_calls"] for m in logged] == [8, 16, 24]
    assert (out / "training_curves.png").stat().st_size > 0
    model, saved = load_model(out)
    assert saved["rl"]["mode"] == actions and saved["step"] == 3
    assert model.latent.policy is not None if actions == "latent" else model.latent.policy is None
    assert main(["generate", str(out), "--prompt", "K>", "--max-new-tokens", "4", "--seed", "1"]) == 0
    assert main(["convert", str(out), str(tmp_path / "hf"), "--to", "hf"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--history", "2"]) == 0  # what it trained, its reward and KL
    lines = capsys.readouterr().out.splitlines()
    trained = "GRPO over Z (the policy head trained" if actions == "latent" else "GRPO over the tokens (the decoder"
    assert lines[0].startswith(f"run {out}: free-transformer rl from {runs['free']}; {trained}"), lines
    assert "reward letters, 2 prompts x 4 samples a step" in lines[0] and lines[2].startswith("steps: 3 logged of 3")
    assert lines[3].startswith(f"step 3 (24 reward calls): reward {logged[-1]['reward']:.3f}"), lines
    assert lines[4] == f"reward over training (reward calls: reward): 8: {logged[0]['reward']:.3f}, 24: " + (
        f"{logged[-1]['reward']:.3f}"
    )
    assert ("--latents policy" in lines[5]) == (actions == "latent")


def test_the_learned_prior_comes_closer_to_the_encoders_posterior(tmp_path, capsys):
    source = tmp_path / "letters"
    assert main(["train", "--out", str(source), "model.size=debug", "steps=30", "progress=false"]) == 0
    out = tmp_path / "prior"
    assert _rl(source, "--learned-prior", "--out", out, "steps=40", "batch_size=8", "lr=1e-2", "log_every=10") == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["kl_encoder_bits"] < logged[0]["kl_encoder_bits"]
    assert logged[-1]["kl_encoder_bits"] < logged[-1]["kl_uniform_bits"]  # closer than the uniform prior
    # the learned prior as the reference of a latent policy
    again = tmp_path / "rl"
    assert _rl(out, "--reward", "letters", "--actions", "latent", "--reference", "learned", "--out", again, *QUICK) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0 and main(["inspect", str(again)]) == 0
    prior, policy = capsys.readouterr().out.split(f"run {again}")
    assert "a learned prior over Z" in prior.splitlines()[0]
    assert f"step 40: KL of the encoder's posterior to the head's {logged[-1]['kl_encoder_bits']:.4f}" in prior
    assert f"KL to the reference (the learned prior of {out})" in policy


def _env() -> dict:
    path = os.pathsep.join([str(Path(free_transformer.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def test_sigterm_saves_a_checkpoint_and_exits_143(runs, tmp_path):
    out = tmp_path / "stopped"
    args = ["rl", str(runs["free"]), "--reward", "letters", "--actions", "latent", "--out", str(out), "steps=100000"]
    process = subprocess.Popen(
        [sys.executable, "-m", "free_transformer.cli", *args, *QUICK, "checkpoint_every=100000"],
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    assert "stopped by SIGTERM" in err and "--resume --out" in err
    assert load_model(out)[1]["step"] >= 1


@pytest.mark.slow  # torchrun: processes that import torch
def test_torchrun_splits_the_rollouts_over_two_processes(runs, tmp_path):
    out = tmp_path / "two"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += ["-m", "free_transformer.cli", "rl", str(runs["free"]), "--reward", "letters", "--actions", "latent"]
    command += ["--out", str(out), "steps=2", *QUICK, "lr=1e-1"]
    result = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward_calls"] for m in logged] == [8, 16]
    # the same two steps in one process: the same head (the gradients of both halves, averaged)
    one = tmp_path / "one"
    assert (
        _rl(runs["free"], "--reward", "letters", "--actions", "latent", "--out", one, "steps=2", *QUICK, "lr=1e-1") == 0
    )
    two_head, one_head = (load_model(run)[0].latent.policy.state_dict() for run in (out, one))
    for name, tensor in one_head.items():
        torch.testing.assert_close(two_head[name], tensor, rtol=1e-4, atol=1e-6)
