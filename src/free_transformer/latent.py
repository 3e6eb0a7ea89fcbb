"""The latent path: Binary Mapper + post-sampler, its exact gradient, and the KL to the uniform prior.

Notation follows the paper (section "Binary Mapper"): bit h of Z_t is 1 with probability
p_h = sigmoid(L_{t,h}); the index is d = sum_h 2^h * B_h; Y is the one-hot of d and
G_d = prod_h P(B_h = U_h(d)) the probability of every one of the 2^H values. The mapper outputs
Y + G - detach(G) and the post-sampler is a linear map W (2^H, D) applied to it.

The value of Y + G - detach(G) is exactly Y, so the forward is a row lookup W[d]. Its gradients are
    dW = Y^T dR                                   (scatter-add of dR into the sampled rows)
    dL_h = sum_d g_d * G_d * (U_h(d) - p_h)       with g = dR @ W^T,  since dlog G_d / dL_h = U_h(d) - p_h
and are computed here in chunks of 2^c values, G being the outer product of a factor over the c
low bits and a scalar per row for the high bits, so that no N x 2^H tensor ever exists.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

# Each backward chunk holds about this many (row, value) entries: 2^22 floats = 16 MiB in fp32.
CHUNK_ENTRIES = 2**22


Generators = torch.Generator | Sequence[torch.Generator] | None


def _draw_rows(draw, shape: tuple[int, ...], generator: Generators) -> Tensor:
    """draw(shape, generator) for the whole batch, or row by row when given one generator per row
    (dim 0), so that each row is reproducible on its own whatever the batch it sits in."""
    if generator is None or isinstance(generator, torch.Generator):
        return draw(shape, generator)
    if len(generator) != shape[0]:
        raise ValueError(f"got {len(generator)} generators for {shape[0]} rows")
    if len(generator) == 1:  # one-row decoding: no stack copy
        return draw(shape[1:], generator[0]).unsqueeze(0)
    return torch.stack([draw(shape[1:], g) for g in generator])


def rand_rows(shape: tuple[int, ...], generator: Generators, device=None) -> Tensor:
    """Uniform [0, 1) floats of `shape`, row i from generator i when given one per row."""
    return _draw_rows(lambda size, g: torch.rand(size, generator=g, device=device), shape, generator)


def at_least_float32(x: Tensor) -> Tensor:
    """Upcast half-precision values (bit-logits under autocast); keep float32 and float64 as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def sample_bits(bit_logits: Tensor, generator: Generators = None) -> Tensor:
    """Draw the H bits independently, P(B_h = 1) = sigmoid(L_h), and return index = sum_h 2^h B_h."""
    uniform = rand_rows(tuple(bit_logits.shape), generator, bit_logits.device)
    bits = uniform < torch.sigmoid(bit_logits.detach().float())  # (..., H)
    return bits_to_index(bits)


def bits_to_index(bits: Tensor) -> Tensor:
    """(..., H) booleans -> (...,) int64 with bit h worth 2^h."""
    powers = 2 ** torch.arange(bits.shape[-1], device=bits.device, dtype=torch.int64)
    return (bits * powers).sum(-1)  # bool * int64 -> int64


def index_to_bits(index: Tensor, n_bits: int) -> Tensor:
    """(...,) integer indices -> (..., n_bits) float 0/1, bit h worth 2^h."""
    shifts = torch.arange(n_bits, device=index.device, dtype=torch.int64)
    return ((index.unsqueeze(-1) >> shifts) & 1).float()


def uniform_latents(shape: tuple[int, ...], n_bits: int, *, generator: Generators = None, device=None) -> Tensor:
    """Indices drawn from the uniform prior P(Z_t = z) = 2^-H, independently per position (H fair
    bits). One randint, not H bits: it is drawn at every decoded token."""
    return _draw_rows(lambda size, g: torch.randint(0, 2**n_bits, size, generator=g, device=device), shape, generator)


class _BinaryMapperProject(torch.autograd.Function):
    """r = (Y + G - detach(G)) @ W for a given sampled index, without materialising Y or G."""

    @staticmethod
    def forward(ctx, bit_logits: Tensor, weight: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(bit_logits, weight, index)
        # Under autocast the backward's matmul dR @ W^T runs in the autocast dtype, as every other matmul.
        device_type = weight.device.type
        autocast = torch.is_autocast_enabled(device_type) and weight.dtype == torch.float32
        ctx.matmul_dtype = torch.get_autocast_dtype(device_type) if autocast else weight.dtype
        return weight[index]  # (N, D)

    @staticmethod
    def backward(ctx, grad_r: Tensor):
        bit_logits, weight, index = ctx.saved_tensors
        grad_logits = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight).index_add_(0, index, grad_r.to(weight.dtype))
        if ctx.needs_input_grad[0]:
            grad_logits = _bit_logit_grad(bit_logits, weight, grad_r, ctx.matmul_dtype).to(bit_logits.dtype)
        return grad_logits, grad_weight, None


def _bit_logit_grad(bit_logits: Tensor, weight: Tensor, grad_r: Tensor, matmul_dtype: torch.dtype | None = None
                    ) -> Tensor:
    """dL_h = sum_d (dR . W_d) G_d (U_h(d) - p_h), chunked over d. bit_logits (N, H), weight (2^H, D).
    The matmul runs in matmul_dtype (default weight's; bf16 under autocast), everything after it in
    float32 (float64 for a float64 table).

    Per chunk of 2^c values: g = dR @ W[chunk]^T into one reused buffer, g *= low factor in place,
    then one matmul with [1 | U_low] gives sum_d g_d G_d and sum_d g_d G_d U_h(d) for the c low bits
    at once; the chunk's high-bit factor, a scalar per row, scales those (N, 1 + c) sums only.
    """
    compute_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    logits = bit_logits.to(compute_dtype)
    matmul_dtype = matmul_dtype or weight.dtype
    grad_r = grad_r.to(matmul_dtype)
    n_rows, n_bits = logits.shape
    log_p1 = F.logsigmoid(logits)  # (N, H) log P(B_h = 1)
    log_p0 = F.logsigmoid(-logits)  # (N, H) log P(B_h = 0)
    log_ratio = log_p1 - log_p0

    # Chunks of 2^c consecutive values share their H - c high bits.
    low_bits = min(n_bits, max(1, int(math.log2(max(1, CHUNK_ENTRIES // max(1, n_rows))))))
    chunk = 2**low_bits
    low_pattern = index_to_bits(torch.arange(chunk, device=logits.device), low_bits).to(compute_dtype)  # (C, c)
    # G restricted to the low bits: (N, C) = exp(sum_h log p0_h + U_h (log p1_h - log p0_h))
    low_factor = torch.exp(log_p0[:, :low_bits].sum(-1, keepdim=True) + log_ratio[:, :low_bits] @ low_pattern.T)
    ones_and_low = torch.cat([low_pattern.new_ones(chunk, 1), low_pattern], dim=1)  # (C, 1 + c)
    high_base = log_p0[:, low_bits:].sum(-1, keepdim=True)  # (N, 1)

    weighted = logits.new_zeros(n_rows, 1 + n_bits)  # [sum_d g_d G_d, sum_d g_d G_d U_h(d) for each h]
    g = grad_r.new_empty(n_rows, chunk)  # (N, C), reused by every chunk
    gG = g if g.dtype == compute_dtype else logits.new_empty(n_rows, chunk)
    sums = logits.new_empty(n_rows, 1 + low_bits)
    for start in range(0, 2**n_bits, chunk):
        high_bits = index_to_bits(torch.tensor(start >> low_bits, device=logits.device), n_bits - low_bits)
        high_bits = high_bits.to(compute_dtype)  # (H - c,)
        high_factor = torch.exp(high_base + log_ratio[:, low_bits:] @ high_bits[:, None])  # (N, 1)
        torch.mm(grad_r, weight[start : start + chunk].to(matmul_dtype).T, out=g)
        if gG is not g:
            gG.copy_(g)
        gG.mul_(low_factor)
        torch.mm(gG, ones_and_low, out=sums)  # (N, 1 + c)
        sums.mul_(high_factor)
        weighted[:, : 1 + low_bits] += sums
        weighted[:, 1 + low_bits :] += sums[:, :1] * high_bits
    return weighted[:, 1:] - torch.sigmoid(logits) * weighted[:, :1]


def project_latents(bit_logits: Tensor | None, weight: Tensor, index: Tensor) -> Tensor:
    """R = post-sampler(Z) for given indices (..., ); gradients flow to bit_logits as the paper's
    Y + G - detach(G) estimator prescribes. Without bit_logits (prior or explicit latents) it is a lookup."""
    if bit_logits is None:
        return F.embedding(index, weight)
    lead_shape = index.shape
    r = _BinaryMapperProject.apply(
        bit_logits.reshape(-1, bit_logits.shape[-1]), weight, index.reshape(-1)
    )  # (N, D)
    return r.reshape(*lead_shape, weight.shape[-1])


def binary_mapper_project(
    bit_logits: Tensor, weight: Tensor, generator: Generators = None
) -> tuple[Tensor, Tensor]:
    """Sample Z from the bit-logits and project it: returns (r (..., D), index (...,)).

    bit_logits (..., H); weight (2^H, D), the post-sampler table. Gradients with respect to both
    inputs equal exactly those of (Y + G - detach(G)) @ weight.
    """
    if weight.shape[0] != 2 ** bit_logits.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} rows, expected 2^H = {2 ** bit_logits.shape[-1]}")
    index = sample_bits(bit_logits, generator)
    return project_latents(bit_logits, weight, index), index


def kl_to_uniform(bit_logits: Tensor) -> Tensor:
    """KL(Q(Z_t | S) || uniform) in nats, shape (...,): H log 2 + sum_z Q(z) log Q(z).

    With independent bits the sum over 2^H values splits into H Bernoulli terms:
    sum_h [log 2 + p_h log p_h + (1 - p_h) log(1 - p_h)].
    """
    logits = at_least_float32(bit_logits)
    p1 = torch.sigmoid(logits)
    neg_entropy = p1 * F.logsigmoid(logits) + (1 - p1) * F.logsigmoid(-logits)
    return (math.log(2.0) + neg_entropy).sum(-1)


def free_bits_kl(kl_per_token: Tensor, kappa_nats: float) -> Tensor:
    """The paper's KL term: (1/T) sum_t max(0, KL_t - kappa), averaged over the batch too."""
    return torch.clamp(kl_per_token - kappa_nats, min=0.0).mean()
