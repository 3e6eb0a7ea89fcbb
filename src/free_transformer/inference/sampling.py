"""Choosing each row's next token from its logits, every row with its own settings given as tensors: the one
sampler of every decoding path (the decoding engine's step, free_transformer.inference.engine, and the Hugging
Face loop's `RowSeededSampler`).

A row's token is drawn by inverting the CDF of its probabilities (probs) at one uniform u: the first token whose
cumulative probability (summed in float64) exceeds u, as torch.multinomial draws one sample; u is word 0 of the
row's counter- based TOKEN stream at the position whose logits these are (`token_uniforms`,
free_transformer.base.counter_random: every row's in one operation, one word a row whatever the vocabulary), where
probs is the softmax of the logits divided by the temperature and filtered by top-k, then top-p, then min-p
(Hugging Face's order). Three rules keep every valid setting finite, so that no row's settings can fail another row
or the request:
- a temperature below GREEDY_BELOW picks the likeliest token (as vLLM does): logits / 1e-39 would overflow;
- top-p and min-p always keep the likeliest token (a top-p of 1e-300 is 0 in float32);
- a row whose probabilities would hold a NaN (a NaN or +inf among its logits, or only -inf) is flagged in
  `non_finite`, for that row alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import counter_random
from .params import GREEDY_BELOW, Sampling

NON_FINITE = "the next-token probabilities contain NaN (non-finite logits)"


@dataclass(frozen=True)
class SamplingVariant:
    """What a batch's step computes after the logits, fixed when a step is compiled and captured: whether any
    row samples (else every row is greedy and no noise is read) and whether any row filters (top-k, top-p or
    min-p: a sort of the vocabulary)."""

    sampled: bool
    filtered: bool

    @classmethod
    def of(cls, rules: Sequence[Sampling]) -> SamplingVariant:
        sampled = [rule for rule in rules if not rule.greedy]
        return cls(bool(sampled), any(filters(rule) for rule in sampled))


def filters(rule: Sampling) -> bool:
    return rule.top_k is not None or (rule.top_p is not None and rule.top_p < 1) or rule.min_p is not None


class RowSettings:
    """Each row's sampling settings as (rows,) device tensors, the inputs of `next_tokens`: written when a row
    takes its place (a host-to-device copy), never during a step. A filter that is off keeps every token."""

    def __init__(self, rows: int, device):
        self.temperature = torch.ones(rows, device=device)  # float32; < GREEDY_BELOW: greedy
        self.top_k = torch.zeros(rows, dtype=torch.int64, device=device)  # 0: off
        self.top_p = torch.full((rows,), torch.inf, device=device)  # inf: off
        self.min_p = torch.zeros(rows, device=device)  # 0: off

    def tensors(self) -> tuple[Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p

    def set(self, rows: slice, rules: Sequence[Sampling]) -> None:
        """Rows `rows` take these rules, one each."""
        values = [
            (
                rule.temperature,
                rule.top_k or 0,
                rule.top_p if rule.top_p is not None and rule.top_p < 1 else torch.inf,
                rule.min_p or 0.0,
            )
            for rule in rules
        ]
        for tensor, column in zip(self.tensors(), zip(*values)):
            tensor[rows] = torch.tensor(column, dtype=tensor.dtype)

    def move(self, source: int, target: int) -> None:
        for tensor in self.tensors():
            tensor[target] = tensor[source]

    def view(self, rows: slice) -> tuple[Tensor, ...]:
        """The tensors of rows `rows`."""
        return tuple(tensor[rows] for tensor in self.tensors())


def next_tokens(
    logits: Tensor, settings: tuple[Tensor, ...], uniforms: Tensor | None, variant: SamplingVariant
) -> tuple[Tensor, Tensor]:
    """(B, V) logits -> the next tokens (B,) and whether each row's probabilities would hold a NaN (B,).
    settings: `RowSettings.view` (temperature, top_k, top_p, min_p), (B,) each; uniforms: (B,) float64 in (0, 1),
    read in the rows that sample (None when no row does). Pure device work: nothing read on the host."""
    temperature, top_k, top_p, min_p = settings
    logits = logits.float()
    top, best = logits.max(-1)  # (B,) each; max propagates a NaN
    # a NaN, a +inf or only -inf in a row's logits (its largest not finite): what makes its probabilities NaN, the
    # filters keeping the likeliest token
    non_finite = ~top.isfinite()
    if not variant.sampled:
        return best, non_finite
    assert uniforms is not None, "a sampled variant draws its noise (None only when no row samples)"
    is_greedy = temperature < GREEDY_BELOW
    scaled = logits / temperature.masked_fill(is_greedy, 1.0)[:, None]
    if variant.filtered:
        scaled = filtered(scaled, top_k, top_p, min_p)
    cdf = torch.softmax(scaled, -1).cumsum(-1, dtype=torch.float64)  # (B, V)
    # the first token whose cumulative probability exceeds u (times the total, 1 up to rounding): a token of
    # probability 0 adds nothing to the sum and is never drawn
    drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    return torch.where(is_greedy, best, drawn.clamp(max=logits.shape[-1] - 1)), non_finite


def filtered(scaled: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """(B, V) logits already divided by the temperature, with the tokens each row's filters drop set to -inf:
    top-k (ties with the k-th kept), then top-p on what is left (a token goes when the tokens strictly more
    likely already reach top_p; the likeliest never goes), then min-p (p_i < min_p * max_j p_j goes)."""
    V = scaled.shape[-1]
    ordered, order = torch.sort(scaled, dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)
    kth = ordered.gather(-1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = torch.softmax(ordered, -1)
    drop = probs.cumsum(-1) - probs >= top_p[:, None]
    drop[:, 0].fill_(False)
    ordered = ordered.masked_fill(drop, float("-inf"))
    scaled = torch.empty_like(scaled).scatter_(-1, order, ordered)
    probs = torch.softmax(scaled, -1)
    return scaled.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))


def token_uniforms(keys: Tensor, positions: Tensor) -> Tensor:
    """(...,) float64 uniforms of each row's TOKEN stream, its word 0: keys its counter-based key
    (counter_random.row_keys) and positions the position whose logits it samples, broadcast to (...,)."""
    return counter_random.uniform64(counter_random.words(keys, positions, counter_random.TOKEN, 1)[..., 0])


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
