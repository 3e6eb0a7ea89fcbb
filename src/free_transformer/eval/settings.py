"""What an evaluation is scored under (tasks, documents, latent draws, held-out text). EvalConfig is the one
definition of the options, as a user writes them: a training config's `eval` section, and the source of
`free-transformer eval`'s flags and their defaults. EvalSettings is an EvalConfig checked, its lists resolved
(task names, data files, shots), read as the config it holds for every other option: the same settings give
the same numbers and the same record key whichever of them ran. runner.score scores a model under it, and
scoring draws Z as its latent options say."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from ..base.checks import ConfigError
from ..base.errors import UserError
from ..base.latent_choice import ROW_CHOICES, LatentChoice, RowChoice, as_row_choice
from ..data.corpora import is_named, named_corpus, read_heldout
from ..inference.params import SamplingError, Variation, check_candidates, check_policy_variation, check_variation
from .sandbox import SandboxLimits


class EvalSettingsError(UserError, ValueError):
    """Evaluation settings that cannot be used (unknown task, missing held-out text)."""


def task_names(spec: str) -> list[str]:
    """'arc_easy,boolq', 'all', 'paper', 'mc', 'generative' or 'none' -> task names, in order, once each."""
    from .catalog import PAPER_TASKS, all_tasks, get_benchmark

    if spec.strip() == "none":
        return []
    names: list[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part == "all":
            names += all_tasks()
        elif part == "paper":
            names += PAPER_TASKS
        elif part in ("mc", "generative"):
            names += [t for t in all_tasks() if (get_benchmark(t).kind == "mc") == (part == "mc")]
        else:
            try:
                get_benchmark(part)
            except ValueError as error:
                raise EvalSettingsError(str(error)) from None
            names.append(part)
    if not names:
        raise EvalSettingsError("the task list is empty")
    return list(dict.fromkeys(names))


def _known_task(name: str, what: str) -> None:
    from .catalog import get_benchmark

    try:
        get_benchmark(name)
    except ValueError as error:
        raise EvalSettingsError(f"{what}: {error}") from None


def _pairs(values: Iterable[str], what: str, form: str) -> dict[str, str]:
    out = {}
    for value in (v for v in values if v.strip()):
        key, sep, rest = value.partition("=")
        if not sep or not key.strip() or not rest.strip():
            raise EvalSettingsError(f"{what} expects {form}, got {value!r}")
        out[key.strip()] = rest.strip()
    return out


def _shots(values: Iterable[str]) -> dict[str, int]:
    out = {}
    for value in values:
        key, sep, number = value.rpartition("=")
        try:
            out[key.strip() if sep else "*"] = int(number)
        except ValueError:
            raise EvalSettingsError(f"num-fewshot expects N or TASK=N, got {value!r}") from None
    return out


def _items(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']: a comma-separated option's values."""
    return [part.strip() for part in text.split(",") if part.strip()]


@dataclass
class EvalConfig:
    """Benchmarks and held-out likelihoods: `free-transformer eval`'s options (its flags are these fields but
    `every`), and a training config's `eval` section, which scores the live model during training, one line
    per evaluation appended to RUN/eval/curve.jsonl (docs/evaluation.md); training's losses are unchanged
    by it."""

    every: int = 0
    """Training only: score every N optimizer steps and at the last step (0: never). One process only: under
    ddp / fsdp, score the checkpoints afterwards with `free-transformer eval RUN --checkpoints all`."""
    tasks: str = "all"
    """Comma-separated task names, or all, paper (the paper's 16 rows), mc (multiple-choice tasks),
    generative (em and pass@1 tasks); none: only the held-out likelihoods (see `eval --list-tasks`)."""
    limit: int | None = None
    """Evaluate only the first N documents of each task (of each subject for mmlu); null: all."""
    latents: RowChoice = LatentChoice.PRIOR
    """Z for the context positions of a Free Transformer: the uniform prior (as the paper generates) or the
    encoder run on the context only (the paper's KV-cache prefill); continuation and generated positions
    then use the prior. policy: every Z from the run's learned prior or policy over Z (free-transformer rl), each
    drawn from the tokens before it (with vary both). Ignored for a baseline."""
    latent_samples: int = 4
    """K latent draws per multiple-choice question, combined as log mean_k P(choice | Z_k)."""
    generation_samples: int = 1
    """Generations per prompt n: em / pass@1 is their mean, and pass@k and maj@k are given for every k <= n."""
    vary: Variation = "both"
    """What differs between a prompt's generations (docs/test-time-search.md): both (each its own Z and its own
    token noise), latent (each its own Z, one token-noise stream: the spread Z alone gives) or tokens (one Z
    for all, each its own token noise; needs a temperature above 0)."""
    temperature: float = 0.0
    """Sampling temperature of the generations (0: greedy, the paper's setting)."""
    seed: int = 0
    """Seed of the latent draws (not training's)."""
    num_fewshot: str = ""
    """Few-shot examples: N for every task or TASK=N for one, comma-separated (empty: each task's own)."""
    data: str = ""
    """Local data files, comma-separated TASK=PATH (race_high, race_middle, humaneval_plus, or to replace a
    shipped one)."""
    max_new_tokens: int | None = None
    """Override every generative task's token budget (null: each task's own)."""
    heldout: str = ""
    """Comma-separated text files for bits per token and per byte (baseline exact; Free: prior CE, ELBO,
    IWAE), or corpus:NAME for a named corpus's held-out documents (e.g. corpus:shakespeare)."""
    heldout_samples: int = 8
    """K samples for the prior cross-entropy and the IWAE bound of the held-out likelihood."""
    heldout_windows: int | None = None
    """Score at most this many windows of the held-out text (null: all)."""
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)
    """The limits of each generated program that a pass@1 task runs (eval/sandbox.py)."""

    def settings(self) -> EvalSettings:
        """These options checked, with the lists resolved: task names, shots, data files (one-line errors)."""
        return EvalSettings(
            self,
            tasks=tuple(task_names(self.tasks)),
            num_fewshot=tuple(sorted(_shots(_items(self.num_fewshot)).items())),
            data=tuple(sorted(_pairs(_items(self.data), "data", "TASK=PATH").items())),
            heldout=tuple(_items(self.heldout)),
        )

    def validate(self) -> None:
        """A training config's section: every >= 0 and, when it scores, settings that can be used now."""
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0, got {self.every}")
        try:
            self.sandbox.check()
        except ValueError as error:
            raise ConfigError(f"eval.sandbox.{error}") from None
        if self.every:
            try:
                self.settings().check_inputs()
            except ValueError as error:
                raise ConfigError(f"eval: {error}") from None


# The options that do not change a score, left out of the record's key: when training scores, and the
# sandbox's limits (checked to fail no honest program: eval/sandbox.py).
UNSCORED = ("every", "sandbox")
# Options added after records were written, with their defaults: in the record's key only when set otherwise,
# so that the records scored before them keep their key (their scores are what the default gives).
KEYED_WHEN_SET = {"vary": "both", "temperature": 0.0}


@dataclass(frozen=True, eq=False)
class EvalSettings:
    """An EvalConfig checked (EvalConfig.settings), with its list options resolved: `tasks`, `num_fewshot`,
    `data` and `heldout` here; every other option is read from the config as written (`settings.limit`,
    `settings.latent_samples`, `settings.sandbox`...). Two evaluations under settings of equal `key` of the
    same weights give the same numbers; `key` names the settings in the record (RUN/eval/curve.jsonl)."""

    options: EvalConfig  # a copy, its latents in their canonical spelling
    tasks: tuple[str, ...]
    num_fewshot: tuple[tuple[str, int], ...]  # (task or "*", shots)
    data: tuple[tuple[str, str], ...]  # (task, local data file)
    heldout: tuple[str, ...]  # files or corpus:NAME

    def __post_init__(self) -> None:
        options = self.options
        if options.limit is not None and options.limit < 1:
            raise EvalSettingsError(f"the document limit must be >= 1, got {options.limit}")
        for name in ("latent_samples", "generation_samples", "heldout_samples"):
            if getattr(options, name) < 1:
                raise EvalSettingsError(f"{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")
        try:
            check_candidates(options.generation_samples, "generation_samples")
        except SamplingError as error:
            raise EvalSettingsError(error.spelt("--generation-samples")) from None
        if not 0 <= options.temperature < math.inf:
            raise EvalSettingsError(f"temperature must be a finite number >= 0, got {options.temperature}")
        try:
            check_variation(options.vary, options.temperature)
        except SamplingError as error:
            raise EvalSettingsError(error.spelt("--vary")) from None
        for name in ("max_new_tokens", "heldout_windows"):
            value = getattr(options, name)
            if value is not None and value < 1:
                raise EvalSettingsError(f"{name.replace('_', '-')} must be >= 1, got {value}")
        for task, shots in self.num_fewshot:
            if task != "*":
                _known_task(task, "num-fewshot")
            if shots < 0:
                raise EvalSettingsError(f"num-fewshot must be >= 0, got {shots} for {task}")
        for task, _ in self.data:
            _known_task(task, "data")
        try:
            latents = as_row_choice(LatentChoice.parse(options.latents, allowed=ROW_CHOICES))  # the eval's one parse
        except ValueError as error:
            raise EvalSettingsError(str(error)) from None
        try:
            check_policy_variation(options.vary, latents)
        except SamplingError as error:
            raise EvalSettingsError(error.spelt("--vary")) from None
        object.__setattr__(self, "options", replace(options, latents=latents))

    def check_model(self, model) -> None:
        """A one-line EvalSettingsError when these settings cannot score `model`: latents policy on a Free
        Transformer without a policy head (a baseline ignores the latents)."""
        if self.latents == LatentChoice.POLICY and model.config.is_free and model.latent.policy is None:
            raise EvalSettingsError(
                "--latents policy needs a run with a learned prior or policy over Z (free-transformer rl); "
                "this run has none"
            )

    def __getattr__(self, name: str):
        """An option used as written, from the config (not called for the fields above)."""
        if name.startswith("__") or name == "options":  # copy and pickle probe an instance not yet filled
            raise AttributeError(name)
        return getattr(self.options, name)

    def __eq__(self, other) -> bool:
        """Equal when they score alike: the same resolved options and the same sandbox, however written."""
        return isinstance(other, EvalSettings) and (self.to_dict(), self.sandbox) == (other.to_dict(), other.sandbox)

    __hash__ = None  # type: ignore[assignment]  # unhashable, as a list is: the options are a mutable EvalConfig

    def to_dict(self) -> dict:
        """The options a score depends on, the lists resolved: the record's "settings"."""
        values = {
            item.name: getattr(self.options, item.name)
            for item in fields(EvalConfig)
            if item.name not in UNSCORED and KEYED_WHEN_SET.get(item.name, ...) != getattr(self.options, item.name)
        }
        values.update(
            tasks=list(self.tasks), num_fewshot=dict(self.num_fewshot), data=dict(self.data), heldout=list(self.heldout)
        )
        return values

    @property
    def key(self) -> str:
        """A short digest of the settings: evaluations with the same key belong to the same curve."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def latent_draws(self, model, generation: bool = False) -> int:
        """Draws of Z per multiple-choice question (per prompt with `generation`): 1 for a baseline."""
        if not model.config.is_free:
            return 1
        return self.generation_samples if generation else self.latent_samples

    def describe_latents(self, model) -> dict:
        """Where the model's Z came from, as the results say it."""
        if not model.config.is_free:
            return {"model": "baseline", "latents": "none (baseline decoder, exact probabilities)"}
        context = "encoder posterior on the context only (KV-cache prefill)" if self.latents == "encoder" else "prior"
        where = f"context Z: {context}; continuation and generated Z: prior"
        if self.latents == LatentChoice.POLICY:
            where = "every Z from the run's policy head (a learned prior or an RL policy over Z), position by position"
        return {
            "model": "free",
            "latent_kind": model.config.latent.kind,
            "latents": where,
            "context": self.latents,
            "mc_estimator": f"log mean_k P(continuation | context, Z^k) over K={self.latent_samples} draws",
            "samples": self.latent_samples,
            "generation_samples": self.generation_samples,
            "vary": self.vary,
            "temperature": self.temperature,
            "seed": self.seed,
        }

    def check_inputs(self) -> None:
        """Fail now, not after hours of scoring, if there is nothing to evaluate or held-out text is missing."""
        if not self.tasks and not self.heldout:
            raise EvalSettingsError("no task and no held-out text: nothing to evaluate")
        for path in self.heldout:
            if is_named(path):
                named_corpus(path).files()  # raises if unknown or not installed
            elif not Path(path).is_file():
                raise EvalSettingsError(f"held-out text not found: {path}")

    def heldout_text(self) -> str:
        return "\n".join(read_heldout(p) for p in self.heldout)
