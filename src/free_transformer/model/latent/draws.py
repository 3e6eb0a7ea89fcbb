"""Drawing Z and measuring it: random draws row by row, independent bits from the encoder's bit-logits,
index <-> bits, and the KL of bits to the uniform prior in closed form.

Bit h of Z_t is 1 with probability p_h = sigmoid(L_{t,h}); the index is d = sum_h 2^h B_h.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ...base.counter_random import LATENT, words
from ...base.units import LN2

Generators = torch.Generator | Sequence[torch.Generator] | None


def rand_rows(shape: tuple[int, ...], generator: Generators, device=None) -> Tensor:
    """Uniform [0, 1) floats of `shape`, row i from generator i when given one per row."""
    return fill_rows_(torch.empty(shape, device=device), lambda out, g: out.uniform_(generator=g), generator)


def at_least_float32(x: Tensor) -> Tensor:
    """Upcast half-precision values (bit-logits under autocast); keep float32 and float64 as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def sample_bit_values(bit_logits: Tensor, generator: Generators = None) -> Tensor:
    """(..., H) booleans drawn independently, P(B_h = 1) = sigmoid(L_h)."""
    uniform = rand_rows(tuple(bit_logits.shape), generator, bit_logits.device)
    return uniform < torch.sigmoid(bit_logits.detach().float())


def sample_bits(bit_logits: Tensor, generator: Generators = None) -> Tensor:
    """Draw the H bits independently, P(B_h = 1) = sigmoid(L_h), and return index = sum_h 2^h B_h."""
    return bits_to_index(sample_bit_values(bit_logits, generator))


def bits_to_index(bits: Tensor) -> Tensor:
    """(..., H) booleans -> (...,) int64 with bit h worth 2^h."""
    shifts = torch.arange(bits.shape[-1], device=bits.device, dtype=torch.int64)
    return torch.bitwise_left_shift(bits.long(), shifts).sum(-1)  # one op fewer than bits * 2 ** shifts


def index_to_bits(index: Tensor, n_bits: int) -> Tensor:
    """(...,) integer indices -> (..., n_bits) float 0/1, bit h worth 2^h."""
    shifts = torch.arange(n_bits, device=index.device, dtype=torch.int64)
    return ((index.unsqueeze(-1) >> shifts) & 1).float()


def code_log_probabilities(bit_logits: Tensor) -> Tensor:
    """(..., H) bit-logits -> (..., 2^H) log Q(Z_t = z) of every code z, in float64 (bit h of z worth 2^h)."""
    H = bit_logits.shape[-1]
    codes = index_to_bits(torch.arange(2**H, device=bit_logits.device), H).double()  # (2^H, H)
    logits = bit_logits.double()
    return F.logsigmoid(logits) @ codes.T + F.logsigmoid(-logits) @ (1 - codes).T


def fill_rows_(out: Tensor, fill, generator: Generators) -> Tensor:
    """fill(tensor, generator) on `out` whole, or row by row (dim 0) when given one generator per row,
    so that each row is reproducible on its own whatever the batch it sits in. In place: a buffer of
    fixed address (the decoding engine's latent buffer) keeps it."""
    if generator is None or isinstance(generator, torch.Generator):
        fill(out, generator)
        return out
    if len(generator) != out.shape[0]:
        raise ValueError(f"got {len(generator)} generators for {out.shape[0]} rows")
    for row, row_generator in zip(out, generator):
        fill(row, row_generator)
    return out


def kl_to_uniform(bit_logits: Tensor) -> Tensor:
    """KL(Q(Z_t | S) || uniform) in nats, shape (...,): H log 2 + sum_z Q(z) log Q(z).

    With independent bits the sum over 2^H values splits into H Bernoulli terms:
    sum_h [log 2 + p_h log p_h + (1 - p_h) log(1 - p_h)].
    """
    return kl_per_bit(bit_logits).sum(-1)


def kl_per_bit(bit_logits: Tensor) -> Tensor:
    """(..., H) the KL of each bit to a fair coin, in nats: log 2 + p log p + (1 - p) log(1 - p)."""
    logits = at_least_float32(bit_logits)
    p1 = torch.sigmoid(logits)
    neg_entropy = p1 * F.logsigmoid(logits) + (1 - p1) * F.logsigmoid(-logits)
    return LN2 + neg_entropy


def free_bits_kl(kl_per_token: Tensor, kappa_nats: float) -> Tensor:
    """The paper's KL term: (1/T) sum_t max(0, KL_t - kappa), averaged over the batch too."""
    return torch.clamp(kl_per_token - kappa_nats, min=0.0).mean()


def counter_prior(space, keys: Tensor, positions: Tensor) -> Tensor:
    """Prior Z of `space` (a LatentSpace) from each row's counter-based LATENT stream: keys and positions
    broadcast to (...,), the result (..., *value_shape). Row i's Z at position t depends on (keys[i], t) alone."""
    return space.prior_from_words(words(keys, positions, LATENT, space.prior_words))


def counter_policy_words(space, keys: Tensor, positions: Tensor) -> Tensor:
    """(..., policy_words) int64 words for a draw from `space`'s learned prior or policy (`PolicyDraw`): each row's
    LATENT stream at its position, keys and positions broadcast to (...,). The words of a policy draw at t are those
    of the prior draw at t and more: a row's Z depends on (keys[i], t) and the head's params alone."""
    return words(keys, positions, LATENT, space.policy_words)


def counter_policy_noise(space, keys: Tensor, positions: Tensor) -> Tensor:
    """`space.policy_noise` of counter_policy_words(space, keys, positions): what a `PolicyDraw` takes."""
    return space.policy_noise(counter_policy_words(space, keys, positions))
