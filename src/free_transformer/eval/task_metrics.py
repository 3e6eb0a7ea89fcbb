"""The paper's measures (appendix "Performance measures") and the bootstrap behind the comparison.

acc_completion: the choice with the highest sum of log-probabilities divided by its token count.
acc_char: the same, divided by its character count. macro_avg/acc_char: acc_char averaged over
sub-categories (MMLU subjects). em: the generated answer equals a reference after normalisation.
pass@1: the proportion of generated programs that pass their tests.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation used for NQ and TriviaQA exact match: lower case, no punctuation,
    no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, references: Sequence[str]) -> bool:
    predicted = normalize_answer(prediction)
    return any(predicted == normalize_answer(r) for r in references)


_GSM8K_STRICT = re.compile(r"[Tt]he answer is (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"-?[$0-9.,]{2,}|-?[0-9]+")


def gsm8k_answer(generation: str) -> str | None:
    """The final number of a chain of thought: "The answer is N" when present (the exemplars' form),
    else the last number in the text."""
    match = _GSM8K_STRICT.search(generation)
    found = match.group(1) if match else (_NUMBER.findall(generation) or [None])[-1]
    if found is None:
        return None
    return found.replace(",", "").replace("$", "").rstrip(".")


def numbers_equal(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    try:
        return float(predicted) == float(reference.replace(",", ""))
    except ValueError:
        return predicted.strip() == reference.strip()


def choose(logprobs: Sequence[float], lengths: Sequence[int]) -> int:
    """Index of the best choice by log-probability divided by length (token or character count)."""
    return int(np.argmax([lp / max(1, n) for lp, n in zip(logprobs, lengths)]))


def aggregate(scores: Sequence[float], groups: Sequence[str | None] | None = None) -> float:
    """Mean of per-document scores, or the mean over groups of each group's mean (macro average)."""
    values = np.asarray(scores, dtype=float)
    if values.size == 0:
        return float("nan")
    if groups is None or all(g is None for g in groups):
        return float(values.mean())
    labels = np.asarray([str(g) for g in groups])
    return float(np.mean([values[labels == g].mean() for g in np.unique(labels)]))


def paired_bootstrap(
    base: Sequence[float],
    other: Sequence[float],
    groups: Sequence[str | None] | None = None,
    *,
    samples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict:
    """Confidence interval of aggregate(other) - aggregate(base) over the same documents.

    Documents are resampled with replacement (within each group when there are groups, so a macro
    average keeps its sub-categories), the same resample for both models: the interval reflects
    how much the difference depends on which questions the benchmark happens to contain.
    """
    a, b = np.asarray(base, dtype=float), np.asarray(other, dtype=float)
    if a.shape != b.shape or a.size == 0:
        raise ValueError("paired bootstrap needs two equally long, non-empty score lists")
    rng = np.random.default_rng(seed)
    labels = (
        np.asarray(["" if g is None else str(g) for g in groups]) if groups is not None else np.zeros(a.size, np.str_)
    )
    members = [np.flatnonzero(labels == g) for g in np.unique(labels)]
    diffs = np.empty(samples)
    for s in range(samples):
        means_a, means_b = [], []
        for idx in members:
            pick = idx[rng.integers(0, idx.size, idx.size)]
            means_a.append(a[pick].mean())
            means_b.append(b[pick].mean())
        diffs[s] = np.mean(means_b) - np.mean(means_a)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(diffs, [alpha, 1 - alpha])
    return {"low": float(low), "high": float(high), "confidence": confidence, "samples": samples}
