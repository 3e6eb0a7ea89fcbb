"""The training cross-entropy, fused with the logit read-out so that the logits of all tokens never exist.

`cross_entropy` is the plain definition, for callers that hold the logits anyway. `readout_cross_entropy`
gives the same loss from the normalised hidden states and the read-out weight (the lm_head, or the tied
embedding): the logits are computed chunk by chunk over tokens, each chunk's gradient with respect to its
logits is formed right away (the loss is the last node of the graph, so it is known in forward up to the
scalar that backward brings), pushed through the read-out's two matmuls into dL/dh and dL/dW, and the
chunk's logits are dropped. dL/dW is summed over the chunks by their matmuls themselves, into one buffer
in float32 at least (under bf16 on CUDA too: addmm's out_dtype), with no (V, D) product per chunk.
Backward only multiplies the two saved gradients by that scalar.

Why an autograd Function with the gradient in forward rather than torch.utils.checkpoint per chunk:
checkpoint would recompute every chunk's logits in backward (one more read-out matmul, the largest
matmul of a small model) and, under torch.compile, leave the chunks' live ranges to Inductor's
partitioner and memory planner; here the loop is eager, so no (N, V) tensor can exist in forward or
backward by construction (each chunk's buffers die with its iteration), and the saved state is one
(N, D) and one (V, D) tensor. Once compiled (`ReadoutLoss.compile`; the model holds a ReadoutLoss as
`readout_loss`) the per-chunk log-sum-exp, target gather, softmax minus one-hot and the cast of the
gradient to the matmul dtype run as one compiled function (one fused pass over the chunk's logits
instead of eager softmax, subtract and casts); the matmuls are the same BLAS calls either way.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .latent import at_least_float32

IGNORE_INDEX = -100

# Bytes a chunk's buffers may take together, per (row, vocabulary entry): the matmul's logits, their
# upcast to the compute dtype (float32 at least; the gradient is formed in place there) and the
# gradient cast back to the matmul dtype. Fewer chunks cost memory; more chunks cost time, as each
# chunk's dL/dW matmul reads and writes the (V, D) float32 sum (at the paper's size V x D is a fifth of
# N x V). 256 rows at a 32,768 vocabulary in float32 on a CPU; 2,048 rows (4 chunks of the 8,192
# tokens, 2 GiB) at the paper's 2^17 vocabulary in bf16 on a GPU.
CHUNK_BYTES = {"cpu": 2**27, "cuda": 2**31}


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy (nats) over the targets that are not IGNORE_INDEX, in float32 at least.
    logits (..., V), targets (...)."""
    return F.cross_entropy(at_least_float32(logits).flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)


def chunk_rows(n_rows: int, vocab_size: int, matmul_dtype: torch.dtype, device: torch.device) -> int:
    """Rows per chunk: the largest power of two whose buffers fit the device's budget, at most n_rows."""
    per_row = vocab_size * (
        at_least_float32(torch.empty(0, dtype=matmul_dtype)).element_size() + 2 * matmul_dtype.itemsize
    )
    rows = max(1, CHUNK_BYTES.get(device.type, CHUNK_BYTES["cpu"]) // per_row)
    return max(1, min(n_rows, 2 ** (rows.bit_length() - 1)))


def _nll_and_grad(logits: Tensor, targets: Tensor, scale: Tensor, grad_dtype: torch.dtype | None):
    """One chunk: the summed negative log-likelihood of its targets and, given grad_dtype, d(loss)/d(logits)
    for loss = that sum * scale, cast to grad_dtype. logits (C, V) in the matmul dtype; targets (C,)."""
    logits = at_least_float32(logits)  # the softmax in float32 at least, as F.cross_entropy under autocast
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)[:, None]  # (C, 1) an index for every row, masked out below
    lse = torch.logsumexp(logits, dim=-1)  # (C,)
    nll = torch.where(valid, lse - logits.gather(1, safe).squeeze(1), 0).sum()
    if grad_dtype is None:
        return nll, None
    # In place over the chunk's logits (this function's own buffer: the matmul's output or its upcast).
    grad = logits.sub_(lse[:, None]).exp_()  # softmax
    grad.scatter_add_(1, safe, grad.new_full(safe.shape, -1.0))  # minus the one-hot of the target
    weight = torch.where(valid, scale, 0)  # (C,): 1 / (number of targets), 0 where ignored
    return nll, grad.mul_(weight[:, None]).to(grad_dtype)


@functools.cache
def _adds_into_float32(device: torch.device) -> bool:
    """Whether addmm can add a bf16 product into a float32 tensor in place on this device (`out_dtype`
    with a float32 `self`: CUDA in recent torch, not the CPU); tried once per device."""
    acc, a = torch.zeros(1, 1, device=device), torch.zeros(1, 1, dtype=torch.bfloat16, device=device)
    try:
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError, NotImplementedError):  # no out_dtype; no kernel here; no float32 self
        return False
    return True


def _add_product(acc: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """acc = a @ b if first, else acc + a @ b, the sum formed by the matmul itself where it can be: no
    product of acc's size is made. acc (M, P) float32 or a's dtype; a (M, K) and b (K, P) of one dtype.
    A bf16 product into float32 (autocast, or bf16 weights): the matmul accumulates in float32 and adds
    into acc (cuBLAS), or, where addmm cannot (the CPU), the product is made in bf16 and then added."""
    beta = 0 if first else 1  # beta 0: acc's values are not read (it starts uninitialised)
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
    elif _adds_into_float32(acc.device):
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    elif first:
        acc.copy_(a @ b)
    else:
        acc += a @ b


@functools.cache
def _compiled_nll_and_grad():
    """_nll_and_grad fused by torch.compile (built once; one graph per chunk shape)."""
    return torch.compile(_nll_and_grad, dynamic=False)


class _ReadoutCrossEntropy(torch.autograd.Function):
    """loss = mean CE of (h @ weight^T) over non-ignored targets; h (N, D), weight (V, D), targets (N,)."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, rows: int | None, compiled: bool) -> Tensor:
        device_type = h.device.type
        # Under autocast the read-out matmul runs in the autocast dtype, as F.linear would run it.
        has_autocast = torch.amp.is_autocast_available(device_type)  # not on the meta device
        autocast = has_autocast and torch.is_autocast_enabled(device_type)
        matmul_dtype = torch.get_autocast_dtype(device_type) if autocast else weight.dtype
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_dtype = matmul_dtype if want_h or want_w else None
        step = _compiled_nll_and_grad() if compiled else _nll_and_grad
        n_rows, vocab = h.shape[0], weight.shape[0]
        rows = rows or chunk_rows(n_rows, vocab, matmul_dtype, h.device)
        # the dtypes are set explicitly below
        with torch.autocast(device_type, enabled=False) if has_autocast else contextlib.nullcontext():
            w = weight.to(matmul_dtype)  # one cast for all chunks (a no-op without autocast)
            hm = h.to(matmul_dtype)
            count = (targets != IGNORE_INDEX).sum()  # a device tensor: no host synchronisation
            scale = 1 / count.to(at_least_float32(torch.empty(0, dtype=matmul_dtype)).dtype)
            nll = scale.new_zeros(())
            grad_h = torch.empty_like(h) if want_h else None  # (N, D)
            # (V, D) summed over chunks in float32 at least; the first chunk's matmul writes every entry
            grad_w = (
                (torch.empty if n_rows else torch.zeros)(
                    weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device
                )
                if want_w
                else None
            )
            for first in range(0, n_rows, rows):
                h_chunk = hm[first : first + rows]  # (C, D)
                chunk_nll, grad = step(h_chunk @ w.T, targets[first : first + rows], scale, grad_dtype)
                nll = nll + chunk_nll
                if grad_h is not None:  # want_h: allocated only then
                    grad_h[first : first + rows] = grad @ w  # (C, D)
                if grad_w is not None:  # want_w: allocated only then
                    _add_product(grad_w, grad.T, h_chunk, first=first == 0)  # (V, D)
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return nll / count.to(nll.dtype)

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return (
            None if grad_h is None else grad_h * grad_loss.to(grad_h.dtype),
            None if grad_w is None else grad_w * grad_loss.to(grad_w.dtype),
            None,
            None,
            None,
        )


def readout_cross_entropy(
    h: Tensor, weight: Tensor, targets: Tensor, *, rows: int | None = None, compiled: bool = False
) -> Tensor:
    """cross_entropy(h @ weight^T, targets) without the logits of all tokens at once.

    h (..., D): the normalised hidden states; weight (V, D): the read-out (lm_head or tied embedding);
    targets (...), IGNORE_INDEX where there is none. rows: tokens per chunk (default from CHUNK_BYTES).
    compiled: fuse each chunk's softmax, log-likelihood and gradient with torch.compile.
    Returns the loss in float32 at least; gradients reach h and weight (not twice-differentiable).
    """
    return _ReadoutCrossEntropy.apply(h.flatten(0, -2), weight, targets.flatten(), rows, compiled)


class ReadoutLoss:
    """The model's training cross-entropy, `readout_cross_entropy`: eager until `compile()`, after which
    each chunk's softmax, log-likelihood and gradient run as one torch.compile'd function. The chunk
    loop stays eager either way, so no chunk's logits outlive their iteration; the losses and gradients
    are those of the eager path to float rounding. Holds no tensors: the model keeps it as a plain
    attribute, outside its state dict."""

    def __init__(self):
        self.compiled = False

    def compile(self) -> None:
        """Fuse each chunk's elementwise work with torch.compile (built on the first call)."""
        self.compiled = True

    def __call__(self, h: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
        """h (..., D) normalised hidden states, weight (V, D), targets (...): the mean loss, in nats."""
        return readout_cross_entropy(h, weight, targets, compiled=self.compiled)
