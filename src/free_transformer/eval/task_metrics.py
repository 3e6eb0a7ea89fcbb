"""The paper's measures (appendix "Performance measures") and the bootstrap behind the comparison.

acc_completion: the choice with the highest sum of log-probabilities divided by its token count.
acc_char: the same, divided by its character count. macro_avg/acc_char: acc_char averaged over
sub-categories (MMLU subjects). em: the generated answer equals a reference after normalisation.
pass@1: the proportion of generated programs that pass their tests; pass@k and maj@k from n samples per
prompt: `pass_at_k`, `majority_at_k`.
"""

from __future__ import annotations

import itertools
import math
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


def number_key(predicted: str | None) -> str | None:
    """A number's vote in maj@k: numbers equal as numbers_equal has them vote together ("18", "18.0")."""
    if predicted is None:
        return None
    try:
        return repr(float(predicted))
    except ValueError:
        return predicted.strip() or None


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


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimator of pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"):
    the probability that at least one of k samples drawn without replacement from n, `correct` of which pass,
    passes: 1 - C(n - c, k) / C(n, k), computed as a product so that large n does not overflow."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= correct <= n and 1 <= k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - correct + 1, n + 1)))


# Above this many k-subsets of n samples, maj@k is estimated from this many random subsets instead.
MAJORITY_EXACT_SUBSETS = 5000
MAJORITY_RANDOM_SUBSETS = 2000


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """The index of the sample whose answer wins the vote: the most frequent answer among those that give one
    (None: no answer extracted, which does not vote), a tie going to the answer given first. None when no
    sample gives an answer."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, answer in enumerate(answers):
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
            first.setdefault(answer, index)
    if not counts:
        return None
    winner = max(counts, key=lambda answer: (counts[answer], -first[answer]))
    return first[winner]


def majority_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int, seed: int = 0) -> float:
    """maj@k (Lewkowycz et al. 2022, Minerva): the chance that the majority answer of k samples is correct,
    averaged over the k-subsets of the n samples (keeping their order, so a tie goes to the answer the earlier
    sample gave): exactly when there are at most MAJORITY_EXACT_SUBSETS subsets, else over
    MAJORITY_RANDOM_SUBSETS random ones drawn with `seed`. A vote with no answer counts as wrong."""
    n = len(answers)
    if len(correct) != n or not 1 <= k <= n:
        raise ValueError(f"maj@k needs one verdict per answer and 1 <= k <= n, got {len(correct)}, n={n}, k={k}")

    def won(subset: Sequence[int]) -> float:
        winner = majority_vote([answers[i] for i in subset])
        return float(winner is not None and correct[subset[winner]])

    if math.comb(n, k) <= MAJORITY_EXACT_SUBSETS:
        return float(np.mean([won(subset) for subset in itertools.combinations(range(n), k)]))
    rng = np.random.default_rng(seed)
    return float(
        np.mean([won(sorted(rng.choice(n, k, replace=False).tolist())) for _ in range(MAJORITY_RANDOM_SUBSETS)])
    )


def bootstrap_interval(
    scores: Sequence[float], *, samples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> dict[str, float]:
    """The mean of per-document scores with a bootstrap confidence interval over documents."""
    values = np.asarray(scores, dtype=float)
    if values.size == 0:
        raise ValueError("a bootstrap interval needs at least one score")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, (samples, values.size))].mean(axis=1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(means, [alpha, 1 - alpha])
    return {"value": float(values.mean()), "low": float(low), "high": float(high), "confidence": confidence}


# What each measure a table shows means, one line each (a pass@k or maj@k row: its k's own line).
MEASURE_MEANINGS = {
    "acc_completion": "the share of questions whose right choice has the highest log-probability per token",
    "acc_char": "the share of questions whose right choice has the highest log-probability per character",
    "macro_avg/acc_char": "acc_char averaged over sub-categories (each counts the same)",
    "em": "the share of samples whose answer equals a reference after normalisation: the mean over each "
    "prompt's samples, then over prompts (with one sample, the paper's value)",
    "pass@1": "the share of generated programs that pass their tests: the mean over each prompt's samples, "
    "then over prompts (with one sample, the paper's value)",
    "pass@k": "the chance that at least one of k samples is correct, estimated without bias from the n "
    "samples per prompt (Chen et al. 2021)",
    "maj@k": "the chance that the most common answer of k samples is correct (Lewkowycz et al. 2022)",
}


def measure_legend(measures: Sequence[str]) -> list[str]:
    """One line per kind of measure among `measures` (pass@2 and pass@4 are one kind: pass@k), in their
    order; a measure without a known meaning gets no line."""
    kinds = dict.fromkeys(m if m in MEASURE_MEANINGS else re.sub(r"@\d+$", "@k", m) for m in measures)
    return [f"{kind}: {MEASURE_MEANINGS[kind]}" for kind in kinds if kind in MEASURE_MEANINGS]
