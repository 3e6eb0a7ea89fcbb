"""A generation's verdict under its benchmark's own checker, the one rule `eval` scores a generative task by and
`free-transformer rl --reward eval:TASK` rewards with:

    em      the benchmark's exact match of the generation with the document's references (`is_correct`), and the
            answer maj@k votes with (`answer`)
    code    the document's tests run on the generation in the sandbox (programs.check_completion): correct only
            when every test held, with the sandbox's status (passed, failed, timeout, ...)

The generation is the text after the prompt, already cut at the benchmark's stop strings."""

from __future__ import annotations

from dataclasses import dataclass

from .programs import check_completion
from .sandbox import SandboxLimits
from .tasks import Benchmark, GenerationDoc


@dataclass(frozen=True)
class Verdict:
    correct: bool
    status: str | None = None  # code: the sandbox's status of the program
    answer: str | None = None  # em: the answer maj@k counts (None: no vote)


def has_checker(benchmark: Benchmark) -> bool:
    """Whether the benchmark judges generations (em, code); a multiple-choice one compares choices instead."""
    return benchmark.kind in ("em", "code")


def check_generation(
    benchmark: Benchmark, doc: GenerationDoc, generation: str, limits: SandboxLimits | None = None
) -> Verdict:
    """The verdict on `generation` for the document `doc` of `benchmark`; a code task's program runs under
    `limits` (None: the sandbox's defaults)."""
    if benchmark.kind == "code":
        assert doc.test is not None  # a code benchmark's `test` gives every row its test
        outcome = check_completion(doc.test, generation, limits)
        return Verdict(outcome.passed, status=outcome.status)
    if benchmark.kind == "em":
        return Verdict(benchmark.is_correct(generation, doc), answer=benchmark.answer(generation))
    raise ValueError(f"{benchmark.name} is multiple choice: it has no checker of generations")
