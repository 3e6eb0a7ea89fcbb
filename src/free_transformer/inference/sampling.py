"""Choosing each row's next token from its logits, every row with its own settings given as tensors: the one
sampler of every decoding path (the decoding engine's step, free_transformer.inference.engine, and the Hugging
Face loop's `RowSeededSampler`).

A row's token is drawn by inverting the CDF of its probabilities (probs) at one uniform u: the first token whose
cumulative probability (summed in float64) exceeds u, as torch.multinomial draws one sample; u is word 0 of the
row's counter-based TOKEN stream at the position whose logits these are (`token_uniforms`,
free_transformer.base.counter_random: every row's in one operation, one word a row whatever the vocabulary), where
probs is the softmax of the logits divided by the temperature and filtered by each of FILTERS in turn: top-k,
then top-p, then min-p (Hugging Face's order), then any registered after them. Three rules keep every valid setting
finite, so that no row's settings can fail another row or the request:
- a temperature below GREEDY_BELOW picks the likeliest token (as vLLM does): logits / 1e-39 would overflow;
- top-p and min-p always keep the likeliest token (a top-p of 1e-300 is 0 in float32);
- a row whose probabilities would hold a NaN (a NaN or +inf among its logits, only -inf, or logits too large
  for its temperature) is flagged in `non_finite`, for that row alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..base.counter_random import TOKEN, uniform64, words
from .params import GREEDY_BELOW, Sampling

NON_FINITE = "the next-token probabilities contain NaN (non-finite logits)"


@dataclass(frozen=True)
class SamplingFilter:
    """One filter of the next-token logits, declared once: the row settings, the step's variant and `filtered`
    iterate over FILTERS. Each row holds its value in a (rows,) tensor of the step; a row whose filter is off
    holds `off`, which keeps every token, so that rows of different settings share one compiled step."""

    name: str  # the Sampling field that sets it; a rule without that field (or None in it) leaves the filter off
    dtype: torch.dtype  # its tensor's
    off: float  # the tensor value that keeps every token
    # (B, V) logits divided by the temperature, (B,) values -> the logits with the dropped tokens at -inf; the
    # logits are sorted likeliest first in each row when `ordered` (one sort shared by consecutive such filters),
    # else in token order
    apply: Callable[[Tensor, Tensor], Tensor]
    ordered: bool
    read: Callable[[Any], float | None] = float  # a set field's value -> its tensor value (None: keeps every token)

    def value(self, rule: Sampling) -> float:
        """The tensor value of `rule`'s setting: `off` when unset or when its value keeps every token."""
        setting = getattr(rule, self.name, None)
        value = None if setting is None else self.read(setting)
        return self.off if value is None else value

    def on(self, rule: Sampling) -> bool:
        return self.value(rule) != self.off


def _top_k(ordered: Tensor, k: Tensor) -> Tensor:
    """The k likeliest tokens (ties with the k-th kept); k 0 or above the vocabulary: all."""
    V = ordered.shape[-1]
    kth = ordered.gather(-1, (torch.where(k > 0, k.clamp(max=V), V) - 1)[:, None])
    return ordered.masked_fill(ordered < kth, float("-inf"))


def _top_p(ordered: Tensor, p: Tensor) -> Tensor:
    """A token goes when the tokens strictly more likely already reach p; the likeliest never goes."""
    probs = torch.softmax(ordered, -1)
    drop = probs.cumsum(-1) - probs >= p[:, None]
    drop[:, 0].fill_(False)
    return ordered.masked_fill(drop, float("-inf"))


def _min_p(scaled: Tensor, min_p: Tensor) -> Tensor:
    """p_i < min_p * max_j p_j goes (the likeliest never does)."""
    probs = torch.softmax(scaled, -1)
    return scaled.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))


TOP_K = SamplingFilter("top_k", torch.int64, 0, _top_k, ordered=True, read=int)
TOP_P = SamplingFilter("top_p", torch.float32, torch.inf, _top_p, ordered=True, read=lambda p: p if p < 1 else None)
MIN_P = SamplingFilter("min_p", torch.float32, 0.0, _min_p, ordered=False)
FILTERS: tuple[SamplingFilter, ...] = (TOP_K, TOP_P, MIN_P)  # in the order they apply (Hugging Face's)


def declared_filters() -> tuple[SamplingFilter, ...]:
    """FILTERS as they are now (register_filter rebinds it): for a module that imports names, not this one."""
    return FILTERS


def register_filter(new: SamplingFilter) -> SamplingFilter:
    """Append `new` to FILTERS: it applies after every filter declared before it, to the rows whose rule sets its
    field (a field of a Sampling subclass). Register before making the engines that are to apply it: an engine's
    row settings hold the filters of when it was made (the kept compiled engines are keyed by FILTERS)."""
    global FILTERS
    if any(declared.name == new.name for declared in FILTERS):
        raise ValueError(f"a sampling filter of the field {new.name!r} is already declared")
    FILTERS = (*FILTERS, new)
    return new


@dataclass(frozen=True)
class SamplingVariant:
    """What a batch's step computes after the logits, fixed when a step is compiled and captured: whether any
    row samples (else every row is greedy and no noise is read), whether any row filters (any of FILTERS on:
    a sort of the vocabulary), and whether a greedy row is among rows that sample (else no row's likeliest
    token is looked for)."""

    sampled: bool
    filtered: bool
    mixed: bool = False

    @classmethod
    def of(cls, rules: Sequence[Sampling]) -> SamplingVariant:
        sampled = [rule for rule in rules if not rule.greedy]
        return cls(bool(sampled), any(filters(rule) for rule in sampled), bool(sampled) and len(sampled) < len(rules))


def filters(rule: Sampling) -> bool:
    """Whether any of the declared filters drops tokens for `rule`."""
    return any(declared.on(rule) for declared in FILTERS)


class RowSettings:
    """Each row's sampling settings as (rows,) device tensors, the inputs of `next_tokens`: the temperature, then
    one value of each of FILTERS (as declared when these settings are made). Written when a row takes its place
    (a host-to-device copy), never during a step."""

    def __init__(self, rows: int, device):
        self.temperature = torch.ones(rows, device=device)  # float32; < GREEDY_BELOW: greedy
        self.filters = FILTERS
        self.values = tuple(torch.full((rows,), f.off, dtype=f.dtype, device=device) for f in self.filters)

    def tensors(self) -> tuple[Tensor, ...]:
        return self.temperature, *self.values

    def set(self, rows: slice, rules: Sequence[Sampling]) -> None:
        """Rows `rows` take these rules, one each."""
        columns = [[rule.temperature for rule in rules]]
        columns += [[declared.value(rule) for rule in rules] for declared in self.filters]
        for tensor, column in zip(self.tensors(), columns, strict=True):
            tensor[rows] = torch.tensor(column, dtype=tensor.dtype)

    def move(self, source: int, target: int) -> None:
        for tensor in self.tensors():
            tensor[target] = tensor[source]

    def view(self, rows: slice) -> tuple[Tensor, ...]:
        """The tensors of rows `rows`: the temperature, then each filter's value."""
        return tuple(tensor[rows] for tensor in self.tensors())


def next_tokens(
    logits: Tensor, settings: tuple[Tensor, ...], uniforms: Tensor | None, variant: SamplingVariant
) -> tuple[Tensor, Tensor]:
    """(B, V) logits -> the next tokens (B,) and whether each row's probabilities would hold a NaN (B,).
    settings: `RowSettings.view` (the temperature, then each filter's value), (B,) each; uniforms: (B,) float64 in
    (0, 1), read in the rows that sample (None when no row does). Pure device work: nothing read on the host."""
    temperature, *values = settings
    logits = logits.float()
    if not variant.sampled:
        top, best = logits.max(-1)  # (B,) each; max propagates a NaN
        # a NaN, a +inf or only -inf among a row's logits: its largest is not finite
        return best, ~top.isfinite()
    assert uniforms is not None, "a sampled variant draws its noise (None only when no row samples)"
    is_greedy = temperature < GREEDY_BELOW if variant.mixed else None
    # a greedy row's logits are divided by 1 (by its temperature, 0, they would not be finite)
    divisor = temperature if is_greedy is None else temperature.masked_fill(is_greedy, 1.0)
    scaled = logits / divisor[:, None]
    if variant.filtered:
        scaled = filtered(scaled, values)
    cdf = torch.softmax(scaled, -1).cumsum(-1, dtype=torch.float64)  # (B, V)
    total = cdf[:, -1]  # (B,) 1 up to rounding; NaN when the probabilities hold one (a NaN or +inf among the
    # logits, only -inf, or logits too large for the temperature), the filters keeping the likeliest token
    # the first token whose cumulative probability exceeds u times the total (V - 1 where u below 1 rounds to the
    # total): a token of probability 0 adds nothing to the sum and is never drawn
    drawn = torch.searchsorted(cdf, (uniforms * total)[:, None], right=True)[:, 0].clamp(max=logits.shape[-1] - 1)
    if is_greedy is not None:
        drawn = torch.where(is_greedy, logits.argmax(-1), drawn)
    return drawn, total.isnan()


def filtered(scaled: Tensor, values: Sequence[Tensor]) -> Tensor:
    """(B, V) logits already divided by the temperature, with the tokens each row's filters drop set to -inf:
    each of FILTERS in turn on what the ones before it left, with its (B,) values (`RowSettings.view` after the
    temperature). Consecutive ordered filters share one sort of the vocabulary."""
    by_likelihood: tuple[Tensor, Tensor] | None = None  # while ordered filters apply: the sorted logits, the order
    for declared, value in zip(FILTERS, values, strict=True):
        if declared.ordered:
            ordered, order = by_likelihood or torch.sort(scaled, dim=-1, descending=True)
            by_likelihood = declared.apply(ordered, value), order
        else:
            scaled, by_likelihood = _in_token_order(scaled, by_likelihood), None
            scaled = declared.apply(scaled, value)
    return _in_token_order(scaled, by_likelihood)


def _in_token_order(scaled: Tensor, by_likelihood: tuple[Tensor, Tensor] | None) -> Tensor:
    """The sorted logits put back in token order (`scaled` itself when there are none)."""
    if by_likelihood is None:
        return scaled
    ordered, order = by_likelihood
    return torch.empty_like(scaled).scatter_(-1, order, ordered)


def token_uniforms(keys: Tensor, positions: Tensor) -> Tensor:
    """(...,) float64 uniforms of each row's TOKEN stream, its word 0: keys its counter-based key
    (base.counter_random.row_keys) and positions the position whose logits it samples, broadcast to (...,)."""
    return uniform64(words(keys, positions, TOKEN, 1)[..., 0])


def sample_next(logits: Tensor, rule: Sampling, keys: Tensor, position: int) -> Tensor:
    """(B, V) logits of position `position` -> (B,) tokens, every row with `rule` and row i's noise from its
    key keys[i] (B,), as the decoding engine draws it; a ValueError when a row's probabilities hold a NaN. For a
    loop that is not the engine's (Hugging Face's)."""
    B = logits.shape[0]
    settings = RowSettings(B, logits.device)
    settings.set(slice(0, B), [rule] * B)
    variant = SamplingVariant.of([rule])
    positions = torch.full((B,), position, dtype=torch.int64, device=logits.device)
    uniforms = token_uniforms(keys.to(logits.device), positions) if variant.sampled else None
    tokens, non_finite = next_tokens(logits, settings.view(slice(0, B)), uniforms, variant)
    if bool(non_finite.any()):
        raise ValueError(NON_FINITE)
    return tokens


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """(n, V) logits and (n,) tokens -> (n,) float64 log-probability of each token under the model's softmax
    (temperature 1, no filter): the one score of a candidate's tokens (best-of, in `best_of()` and the server,
    sums it over a candidate's tokens as they are sampled: free_transformer.inference.engine)."""
    return torch.log_softmax(logits.double(), dim=-1).gather(-1, tokens[:, None])[:, 0]
