"""`free-transformer rl --reward eval:TASK`: an eval task's checker as the reward (free_transformer.train.rl.
eval_reward), and what it needs of the trainer: prompts of several lengths in one step, each group rolled out with
its own length and the GRPO loss over every sample's own actions."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import kernel_sandbox, tiny_checkpoint

from free_transformer.base.counter_random import row_keys
from free_transformer.base.seeding import seed_of
from free_transformer.cli import main
from free_transformer.data.tokenizer import ByteTokenizer
from free_transformer.distributed.env import ParallelEnv
from free_transformer.eval.prepare import prepare
from free_transformer.eval.runner import FEWSHOT_SEED
from free_transformer.eval.sandbox import SandboxLimits, SandboxUnavailable
from free_transformer.model.config import ModelConfig
from free_transformer.train.rl import eval_reward
from free_transformer.train.rl.config import load_rl_config
from free_transformer.train.rl.eval_reward import EvalReward
from free_transformer.train.rl.grpo import grpo_loss
from free_transformer.train.rl.rewards import Episode, RewardError, score
from free_transformer.train.rl.rollout import rollout
from free_transformer.train.rl.trainer import RLRun, RLSetup

WINDOW = ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=80)
SANDBOX = SandboxLimits(allow_hook_only=not kernel_sandbox())  # where the kernel layers are missing, the hook alone
HOOK_ONLY = [] if kernel_sandbox() else ["sandbox.allow_hook_only=true"]


@pytest.fixture(scope="module")
def nq():
    return EvalReward("eval:nq", ByteTokenizer(), WINDOW, max_new_tokens=8)


# ---- the reward of a known answer --------------------------------------------------------------------


def test_an_em_tasks_reward_is_its_exact_match_of_the_generation_cut_at_its_stop(nq):
    doc = nq.docs[0]  # "when was the last time anyone was on the moon": 14 December 1972 UTC, December 1972
    right, wrong = list(f" {doc.answers[1]}\nQuestion: who".encode()), list(b" in the spring\n")
    episode = Episode(nq.prompts[0], lambda prompt, tokens: nq.verdict(doc, prompt, tokens))
    assert score(nq.name, episode, right) == 1.0  # the text after the stop string "\n" is not read
    assert score(nq.name, episode, wrong) == 0.0


def test_an_em_tasks_episodes_are_evals_prompts_cut_to_leave_room_for_the_new_tokens(nq):
    docs = prepare("nq", seed=FEWSHOT_SEED).docs
    assert nq.max_new_tokens == 8 and len(nq.prompts) == len(docs)
    for ids, doc in zip(nq.prompts[:50], docs):
        assert ids == list(doc.prompt.encode())[-(WINDOW.max_seq_len - 8) :]  # eval's prompt, its end kept
    assert nq.note is not None and "lose their beginning" in nq.note
    drawn = nq.episodes(6, torch.Generator().manual_seed(3))
    again = nq.episodes(6, torch.Generator().manual_seed(3))
    assert [e.prompt for e in drawn] == [e.prompt for e in again]  # the generator draws them
    assert len({tuple(e.prompt) for e in drawn}) > 1


def test_an_em_tasks_new_tokens_are_its_budget_capped_at_half_the_window_as_eval_caps_them():
    assert EvalReward("eval:nq", ByteTokenizer(), WINDOW).max_new_tokens == 40  # nq's 48, half of 80
    assert EvalReward("eval:nq", ByteTokenizer(), WINDOW.replace(max_seq_len=512)).max_new_tokens == 48


def test_a_code_tasks_reward_is_its_tests_passing_in_the_sandbox():
    reward = EvalReward("eval:humaneval", ByteTokenizer(), WINDOW, max_new_tokens=8, sandbox=SANDBOX)
    doc = reward.docs[0]  # has_close_elements
    solution = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1 :])\n"
    wrong = "    return False\n"
    episode = Episode(reward.prompts[0], lambda prompt, tokens: reward.verdict(doc, prompt, tokens))
    assert (
        score(reward.name, episode, list((solution + "\ndef other():\n    pass\n").encode())) == 1.0
    )  # cut at "\ndef"
    assert score(reward.name, episode, list(wrong.encode())) == 0.0


def test_a_sandbox_that_cannot_run_programs_is_refused_at_the_start_in_one_line(monkeypatch):
    def unavailable(limits=None):
        raise SandboxUnavailable("generated code is not run without kernel isolation")

    monkeypatch.setattr(eval_reward, "isolation_report", unavailable)
    with pytest.raises(RewardError, match="sandbox.allow_hook_only=true") as raised:
        EvalReward("eval:mbpp", ByteTokenizer(), WINDOW, max_new_tokens=8)
    assert "\n" not in str(raised.value)


# ---- prompts of several lengths in one step -----------------------------------------------------------


def test_the_grpo_loss_over_padded_actions_is_each_samples_mean_over_its_own():
    """Samples of 3 actions and of 2, padded to 3: the loss is the mean over samples of each one's mean over its own
    actions (the two groups' losses averaged by their samples), and the padding gets no gradient."""
    torch.manual_seed(0)
    long, short = torch.randn(2, 3, requires_grad=True), torch.randn(2, 2, requires_grad=True)
    old_long, old_short, kl_long, kl_short = torch.randn(2, 3), torch.randn(2, 2), torch.rand(2, 3), torch.rand(2, 2)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    settings = dict(clip=0.2, kl_coef=0.1)
    apart = [
        grpo_loss(long, old_long, advantages[:2], kl_long, **settings),
        grpo_loss(short, old_short, advantages[2:], kl_short, **settings),
    ]

    def pad(x):
        return torch.nn.functional.pad(x, (0, 1))

    padded = torch.cat([long, pad(short)])
    actions = torch.tensor([[True] * 3] * 2 + [[True, True, False]] * 2)
    together = grpo_loss(
        padded,
        torch.cat([old_long, pad(old_short)]),
        advantages,
        torch.cat([kl_long, pad(kl_short)]),
        actions=actions,
        **settings,
    )
    torch.testing.assert_close(together.loss, (apart[0].loss + apart[1].loss) / 2)
    torch.testing.assert_close(together.kl, (kl_long.sum() + kl_short.sum()) / 10)
    grad = torch.autograd.grad(together.loss, padded)[0]
    assert torch.equal(grad[2:, 2], torch.zeros(2)) and grad[:, :2].abs().sum() > 0


class TwoLengths:
    """Prompts of 2 and 3 bytes in one step; the reward records what it was called with."""

    name, note, max_new_tokens = "two-lengths", None, 5

    def __init__(self):
        self.calls: list[tuple[list[int], list[int]]] = []

    def reward(self, prompt, tokens):
        self.calls.append((prompt, tokens))
        return float(sum(t % 2 for t in tokens))

    def episodes(self, count, generator):
        return [Episode([65 + i, 62] if i % 2 else [65 + i, 62, 62], self.reward) for i in range(count)]


@pytest.mark.parametrize("actions", ["latent", "tokens"])
def test_a_step_rolls_out_each_prompt_length_on_its_own_with_each_rows_own_seed(tmp_path, actions):
    source = tiny_checkpoint(tmp_path, "free", latent_units=4, max_seq_len=80)
    config = load_rl_config(["prompts=4", "group=2", "updates=2"])
    run = RLRun(
        RLSetup(str(source), actions, "letters", "uniform"),
        config,
        tmp_path / "out",
        ParallelEnv("none", torch.device("cpu")),
        resume=False,
    )
    run.task = task = TwoLengths()
    before = copy.deepcopy(run.model)
    metrics = run.grpo_step(7)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    episodes = task.episodes(4, None)
    assert [prompt for prompt, _ in task.calls] == [e.prompt for e in episodes for _ in range(2)]
    for i, episode in enumerate(episodes):  # sample j of prompt i: that prompt alone, the row's own key
        keys = row_keys(torch.tensor([seed_of(config.seed, "rl", 7, i, j) for j in range(2)]))
        alone = rollout(before, torch.tensor([episode.prompt] * 2), 5, keys, policy=actions == "latent")
        assert [tokens for _, tokens in task.calls[2 * i : 2 * i + 2]] == alone.generated()
    trained = dict(run.model.named_parameters())
    assert any(not torch.equal(p, trained[name]) for name, p in before.named_parameters())


# ---- the command -------------------------------------------------------------------------------------


QUICK = ("steps=2", "prompts=2", "group=2", "max_new_tokens=8", "progress=false", "log_every=1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("rl-eval"), "free", latent_units=4, max_seq_len=80)


@pytest.mark.parametrize(("task", "actions"), [("nq", "latent"), ("humaneval", "tokens")])
def test_rl_with_an_eval_tasks_reward_trains_and_resumes(run, tmp_path, capsys, task, actions):
    out = tmp_path / "out"
    assert (
        main(["rl", str(run), "--reward", f"eval:{task}", "--actions", actions, "--out", str(out), *QUICK, *HOOK_ONLY])
        == 0
    )
    assert "lose their beginning to fit max_seq_len 80 with 8 new tokens" in capsys.readouterr().err
    assert main(["rl", "--resume", "--out", str(out), "steps=3"]) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward_calls"] for m in logged] == [4, 8, 12] and all(0 <= m["reward"] <= 1 for m in logged)
    assert (
        json.loads((out / "checkpoints").glob("*/config.json").__next__().read_text())["rl"]["reward"] == f"eval:{task}"
    )


@pytest.mark.parametrize(
    ("reward", "more", "words"),
    [
        ("eval:", [], "names no task: give eval:TASK"),
        ("eval:poems", [], "unknown eval task 'poems'"),
        ("eval:arc_easy", [], "eval task arc_easy is multiple choice"),
        ("eval:humaneval_plus", [], "no installed package ships the task's data"),
        ("eval:nq", ["max_new_tokens=90"], "exceed the model's max_seq_len 80"),
    ],
)
def test_bad_eval_rewards_are_one_line_and_write_nothing(run, tmp_path, capsys, reward, more, words):
    out = tmp_path / "out"
    assert main(["rl", str(run), "--reward", reward, "--actions", "latent", "--out", str(out), *QUICK, *more]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_the_reward_help_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["rl", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "letters, coins, or eval:TASK" in text and "gsm8k" in text and "humaneval" in text
