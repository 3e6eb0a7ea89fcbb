"""The paper's Binary Mapper + post-sampler (`model.latent.kind=binary_mapper`, the default), with its
exact gradient and without the 2^H one-hot.

Notation follows the paper (section "Binary Mapper"): Y is the one-hot of the sampled index d and
G_d = prod_h P(B_h = U_h(d)) the probability of every one of the 2^H values. The mapper outputs
Y + G - detach(G) and the post-sampler is a linear map W (2^H, D) applied to it.

The value of Y + G - detach(G) is exactly Y, so the forward is a row lookup W[d]. Its gradients are
    dW = Y^T dR                                   (scatter-add of dR into the sampled rows)
    dL_h = sum_d g_d * G_d * (U_h(d) - p_h)       with g = dR @ W^T,  since dlog G_d / dL_h = U_h(d) - p_h
and are computed here in chunks of 2^c values, G being the outer product of a factor over the c
low bits and a factor per chunk over the high bits, so that no N x 2^H tensor ever exists. The
chunk size comes from a memory budget of the device; the loop has no host synchronisation and
creates no tensor from Python values, so on a GPU it is bound by its matmuls, not by launches.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .binary import BinaryLatentSpace
from .draws import Generators, index_to_bits, sample_bits
from .space import normal_init_, register_latent_kind

# Bytes the backward's per-chunk buffers may take together: g = dR @ W[chunk]^T, G's low factor and their
# product, each (N, 2^c) (`chunk_entry_bytes`). On a CPU larger chunks gain nothing (bench/mapper.py); on a
# GPU fewer, larger chunks mean fewer launches.
CHUNK_BYTES = {"cpu": 2**25, "cuda": 2**30}


def chunk_entry_bytes(matmul_dtype: torch.dtype, compute_dtype: torch.dtype) -> int:
    """Bytes per (row, value) entry of a chunk's three buffers: g in the matmul dtype, the low factor
    and the product g * G_low in the compute dtype."""
    return matmul_dtype.itemsize + 2 * compute_dtype.itemsize


def chunk_bits(n_rows: int, n_bits: int, bytes_per_entry: int, device: torch.device) -> int:
    """c such that a chunk of 2^c values for n_rows rows fits the device's budget (1 <= c <= H)."""
    budget = CHUNK_BYTES.get(device.type, CHUNK_BYTES["cpu"])
    entries = max(1, budget // (bytes_per_entry * max(1, n_rows)))
    return min(n_bits, max(1, int(math.log2(entries))))


def _weighted_sums(g: Tensor, low_factor: Tensor, ones_and_low: Tensor, product: Tensor | None = None) -> Tensor:
    """(1 + c, N): sum_d g_d G_low_d and sum_d g_d G_low_d U_h(d) for each of the c low bits, one row each.
    g, low_factor (N, C); ones_and_low (1 + c, C); product: an (N, C) buffer of low_factor's dtype for
    g * G_low (else a new tensor). The sums come out transposed, (1 + c, C) @ (C, N), rather than as
    (N, C) @ (C, 1 + c), whose output rows are only 1 + c wide: on a 2-core CPU the whole gradient then
    takes 0.8 of the time in bf16, 0.9 in float32 (H=16, N=4096, D=256; not measured on a GPU)."""
    return ones_and_low @ torch.mul(g, low_factor, out=product).T


@functools.cache
def _compiled_weighted_sums():
    """_weighted_sums with its elementwise product fused into the reduction (torch.compile, built once)."""
    return torch.compile(_weighted_sums, dynamic=False)


class _BinaryMapperProject(torch.autograd.Function):
    """r = (Y + G - detach(G)) @ W for a given sampled index, without materialising Y or G."""

    @staticmethod
    def forward(ctx, bit_logits: Tensor, weight: Tensor, index: Tensor, compiled: bool) -> Tensor:
        ctx.save_for_backward(bit_logits, weight, index)
        ctx.compiled = compiled
        # Under autocast the backward's matmul dR @ W^T runs in the autocast dtype, as every other matmul.
        device_type = weight.device.type
        autocast = (
            torch.amp.is_autocast_available(device_type)
            and torch.is_autocast_enabled(device_type)
            and weight.dtype == torch.float32
        )
        ctx.matmul_dtype = torch.get_autocast_dtype(device_type) if autocast else weight.dtype
        return weight[index]  # (N, D)

    @staticmethod
    def backward(ctx, grad_r: Tensor):
        bit_logits, weight, index = ctx.saved_tensors
        grad_logits = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight).index_add_(0, index, grad_r.to(weight.dtype))
        if ctx.needs_input_grad[0]:
            grad_logits = _bit_logit_grad(bit_logits, weight, grad_r, ctx.matmul_dtype, ctx.compiled)
            grad_logits = grad_logits.to(bit_logits.dtype)
        return grad_logits, grad_weight, None, None


def _bit_logit_grad(
    bit_logits: Tensor, weight: Tensor, grad_r: Tensor, matmul_dtype: torch.dtype | None = None, compiled: bool = False
) -> Tensor:
    """dL_h = sum_d (dR . W_d) G_d (U_h(d) - p_h), chunked over d. bit_logits (N, H), weight (2^H, D).
    The matmul runs in matmul_dtype (default weight's; bf16 under autocast), everything after it in
    float32 (float64 for a float64 table); compiled fuses each chunk's product and reduction.

    Chunk k holds the 2^c values whose high bits spell k. Per chunk: g = dR @ W[chunk]^T into one
    reused buffer, then g * G_low (into another) summed against [1 | U_low] gives sum_d g_d G_d and sum_d g_d G_d U_h(d)
    for the c low bits, up to the chunk's high-bit factor (a scalar per row, all computed before the
    loop). The high bits' sums come after the loop from the per-chunk masses in one matmul.
    """
    compute_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    logits = bit_logits.to(compute_dtype)
    matmul_dtype = matmul_dtype or weight.dtype
    grad_r = grad_r.to(matmul_dtype)
    table = weight.to(matmul_dtype)  # one cast for all chunks (a no-op without autocast)
    n_rows, n_bits = logits.shape
    device = logits.device
    log_p1 = F.logsigmoid(logits)  # (N, H) log P(B_h = 1)
    log_p0 = F.logsigmoid(-logits)  # (N, H) log P(B_h = 0)
    log_ratio = log_p1 - log_p0

    low_bits = chunk_bits(n_rows, n_bits, chunk_entry_bytes(matmul_dtype, compute_dtype), device)
    chunk, n_chunks = 2**low_bits, 2 ** (n_bits - low_bits)
    low_pattern = index_to_bits(torch.arange(chunk, device=device), low_bits).to(compute_dtype)  # (C, c)
    high_pattern = index_to_bits(torch.arange(n_chunks, device=device), n_bits - low_bits).to(compute_dtype)  # (K, H-c)
    # G = low factor (N, C) x high factor (N, K): exp(sum_h log p0_h + U_h (log p1_h - log p0_h)) over each part
    low_factor = torch.exp(log_p0[:, :low_bits].sum(-1, keepdim=True) + log_ratio[:, :low_bits] @ low_pattern.T)
    high_factor = torch.exp(log_p0[:, low_bits:].sum(-1, keepdim=True) + log_ratio[:, low_bits:] @ high_pattern.T)
    ones_and_low = torch.cat([low_pattern.new_ones(1, chunk), low_pattern.T], dim=0)  # (1 + c, C)
    high_factor = high_factor.T.contiguous()  # (K, N): chunk k's factor is row k

    low_sums = logits.new_zeros(1 + low_bits, n_rows)  # rows: sum_d g_d G_d, sum_d g_d G_d U_h(d) for h < c
    chunk_mass = logits.new_empty(n_chunks, n_rows)  # row k: sum over chunk k of g_d G_d
    g = grad_r.new_empty(n_rows, chunk)  # (N, C), reused by every chunk
    product = logits.new_empty(n_rows, chunk)  # (N, C) g * G_low, reused (compiled: Inductor's own buffer)
    for k in range(n_chunks):
        torch.mm(grad_r, table[k * chunk : (k + 1) * chunk].T, out=g)
        if compiled:
            sums = _compiled_weighted_sums()(g, low_factor, ones_and_low)
        else:
            sums = _weighted_sums(g, low_factor, ones_and_low, product)
        sums.mul_(high_factor[k])  # (1 + c, N)
        low_sums += sums
        chunk_mass[k] = sums[0]
    high_sums = high_pattern.T @ chunk_mass  # (H - c, N): sum_d g_d G_d U_h(d) for the high bits
    weighted = torch.cat([low_sums[1:], high_sums], dim=0).T  # (N, H)
    return weighted - torch.sigmoid(logits) * low_sums[0, :, None]


def project_latents(bit_logits: Tensor | None, weight: Tensor, index: Tensor, compiled: bool = False) -> Tensor:
    """R = post-sampler(Z) for given indices (..., ); gradients flow to bit_logits as the paper's
    Y + G - detach(G) estimator prescribes. Without bit_logits (prior or explicit latents) it is a lookup.
    compiled: fuse the backward's per-chunk elementwise work with torch.compile."""
    if bit_logits is None:
        return F.embedding(index, weight)
    lead_shape = index.shape
    r = _BinaryMapperProject.apply(
        bit_logits.reshape(-1, bit_logits.shape[-1]), weight, index.reshape(-1), compiled
    )  # (N, D)
    return r.reshape(*lead_shape, weight.shape[-1])


def binary_mapper_project(
    bit_logits: Tensor, weight: Tensor, generator: Generators = None, compiled: bool = False
) -> tuple[Tensor, Tensor]:
    """Sample Z from the bit-logits and project it: returns (r (..., D), index (...,)).

    bit_logits (..., H); weight (2^H, D), the post-sampler table. Gradients with respect to both
    inputs equal exactly those of (Y + G - detach(G)) @ weight.
    """
    if weight.shape[0] != 2 ** bit_logits.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} rows, expected 2^H = {2 ** bit_logits.shape[-1]}")
    index = sample_bits(bit_logits, generator)
    return project_latents(bit_logits, weight, index, compiled), index


@register_latent_kind("binary_mapper")
class BinaryMapper(BinaryLatentSpace):
    """The paper's mapper: a (2^H, D) post-sampler table, one row per value of Z_t; the bit-logits get
    the exact gradient of Y + G - detach(G) (all 2^H values weighted by their probability)."""

    max_units = 24  # a 2^24 x D table is already larger than any model it would sit in

    def __init__(self, units: int, dim: int):
        super().__init__(units, dim)
        self.weight = nn.Parameter(torch.empty(2**units, dim))  # (2^H, D), rows contiguous like an embedding
        self.reset_parameters(1.0)  # as nn.Embedding does (a seed's draws: tests/golden); init_weights rescales
        self.compiled_backward = False  # the backward's chunk bodies compiled: `compile_backward`

    def sample(self, bit_logits: Tensor, generator: Generators = None) -> tuple[Tensor, Tensor]:
        return binary_mapper_project(bit_logits, self.weight, generator, self.compiled_backward)

    def embed(self, value: Tensor) -> Tensor:
        return F.embedding(value, self.weight)

    def compile_backward(self) -> None:
        self.compiled_backward = True

    def reset_parameters(self, std: float) -> None:
        normal_init_(self.weight, std=std)

    def training_flops_per_token(self) -> float:
        # The forward is a row lookup; the exact backward needs dR @ W^T over all 2^H rows (the O(2^H)
        # products with G are left out, as norms and activations are everywhere).
        return 2.0 * 2**self.units * self.dim
