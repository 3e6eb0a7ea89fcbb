"""What an evaluation is scored under (tasks, documents, latent draws, held-out text): one type for
`free-transformer eval`'s flags and a config's `eval` section, so that the same settings give the same
numbers (and the same record key) whichever of them ran. runner.score scores a model under it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from ..base.errors import UserError
from ..data.corpora import is_named, named_corpus, read_heldout
from ..inference.latents import CONTEXT_CHOICES, parse_latents
from .scoring import LatentPolicy


class EvalSettingsError(UserError, ValueError):
    """Evaluation settings that cannot be used (unknown task, missing held-out text)."""


def task_names(spec: str) -> list[str]:
    """'arc_easy,boolq', 'all', 'paper', 'mc', 'generative' or 'none' -> task names, in order, once each."""
    from .catalog import DEFAULT_TASKS, PAPER_TASKS, get_benchmark

    if spec.strip() == "none":
        return []
    names: list[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part == "all":
            names += DEFAULT_TASKS
        elif part == "paper":
            names += PAPER_TASKS
        elif part in ("mc", "generative"):
            names += [t for t in DEFAULT_TASKS if (get_benchmark(t).kind == "mc") == (part == "mc")]
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


@dataclass(frozen=True)
class EvalSettings:
    """Everything that changes a score. Two evaluations under equal settings of the same weights give
    the same numbers; `key` names the settings in the record (RUN/eval/curve.jsonl)."""

    tasks: tuple[str, ...] = ()
    limit: int | None = None
    latents: Literal["prior", "encoder"] = "prior"  # the Z of context positions (latent_choice.CONTEXT_CHOICES)
    latent_samples: int = 4
    generation_samples: int = 1
    seed: int = 0
    num_fewshot: tuple[tuple[str, int], ...] = ()  # (task or "*", shots)
    data: tuple[tuple[str, str], ...] = ()  # (task, local data file)
    max_new_tokens: int | None = None
    heldout: tuple[str, ...] = ()  # files or corpus:NAME
    heldout_samples: int = 8
    heldout_windows: int | None = None

    def __post_init__(self) -> None:
        if not self.tasks and not self.heldout:
            raise EvalSettingsError("no task and no held-out text: nothing to evaluate")
        if self.limit is not None and self.limit < 1:
            raise EvalSettingsError(f"the document limit must be >= 1, got {self.limit}")
        if self.heldout_samples < 1:
            raise EvalSettingsError(f"held-out samples must be >= 1, got {self.heldout_samples}")
        for name in ("max_new_tokens", "heldout_windows"):
            value = getattr(self, name)
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
            object.__setattr__(self, "latents", parse_latents(self.latents, allowed=CONTEXT_CHOICES, indices=False))
            self.policy
        except ValueError as error:
            raise EvalSettingsError(str(error)) from None

    @classmethod
    def from_options(cls, *, tasks: str = "all", data: Iterable[str] = (), num_fewshot: Iterable[str] = (),
                     heldout: Iterable[str] = (), **fields) -> EvalSettings:
        """Settings from options as a user writes them (`free-transformer eval`'s flags, a config's `eval`
        section): a task spec (task_names), TASK=PATH data files, N or TASK=N shots, held-out files."""
        return cls(tasks=tuple(task_names(tasks)), data=tuple(sorted(_pairs(data, "data", "TASK=PATH").items())),
                   num_fewshot=tuple(sorted(_shots(num_fewshot).items())),
                   heldout=tuple(p.strip() for p in heldout if p.strip()), **fields)

    @property
    def policy(self) -> LatentPolicy:
        return LatentPolicy(context=self.latents, samples=self.latent_samples,
                            generation_samples=self.generation_samples, seed=self.seed)

    def to_dict(self) -> dict:
        values = asdict(self)
        values["num_fewshot"], values["data"] = dict(self.num_fewshot), dict(self.data)
        values["tasks"], values["heldout"] = list(self.tasks), list(self.heldout)
        return values

    @property
    def key(self) -> str:
        """A short digest of the settings: evaluations with the same key belong to the same curve."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def check_heldout(self) -> None:
        """Fail now, not after hours of scoring, if held-out text is missing."""
        for path in self.heldout:
            if is_named(path):
                named_corpus(path).files()  # raises if unknown or not installed
            elif not Path(path).is_file():
                raise EvalSettingsError(f"held-out text not found: {path}")

    def heldout_text(self) -> str:
        return "\n".join(read_heldout(p) for p in self.heldout)
