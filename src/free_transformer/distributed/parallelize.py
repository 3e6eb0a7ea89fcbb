"""The parallelisation plan, kept out of the model file (as torchtitan's infra/parallelize.py):
activation checkpointing and torch.compile per block, then FSDP2 or DDP.

fsdp (FSDP2): `fully_shard` on every decoder block and on each encoder block, then on the root, which
takes what is left (embeddings, final norm, read-out, and of the latent path zeta, its norm and
read-out, and the mapper, e.g. the post-sampler table). Each block's parameters are all-gathered just before it runs
and freed after; gradients are
reduce-scattered (averaged) as backward leaves each block. ddp: one full replica per rank, gradients
all-reduced (averaged) in buckets during backward.

Either way the optimizer sees ordinary parameters (DTensor shards under fsdp) with the model's own
names, so parameter groups, clipping and checkpoints need no special case.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from ..base.devices import torch_dtype
from ..model.transformer import FreeTransformer
from .env import ParallelEnv

_DDP_OPTIONS = inspect.signature(DistributedDataParallel.__init__).parameters

# FSDP2 warns when a wrapped module returns a view (an in-place op on it would skip a hook). The
# training loop only reads the model's outputs, never modifies them in place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def blocks(model: FreeTransformer) -> list[nn.Module]:
    """The decoder blocks and, in a Free Transformer, the encoder blocks."""
    return [*model.layers, *(model.latent.encoder if model.latent is not None else [])]  # latent: None in a baseline


def apply_activation_checkpointing(model: FreeTransformer) -> FreeTransformer:
    """Checkpoint every block in place (non-reentrant torch.utils.checkpoint around its forward): only its
    inputs are kept, the block runs again in backward. Module and parameter names do not change. The
    blocks draw no random numbers (Z is sampled between them), and checkpoint restores the RNG state
    for the recomputation anyway, so the results are those of the plain model."""
    for block in blocks(model):
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def apply_compile(model: FreeTransformer) -> FreeTransformer:
    """torch.compile every block in place (Module.compile: names and state dict unchanged). The blocks
    share one code path, so the decoder blocks reuse the same compiled graphs. The Binary Mapper's
    backward (a custom autograd Function with a chunk loop) stays eager, each chunk's elementwise
    product and reduction fused by torch.compile. The cross-entropy fused with the read-out
    (the model's `readout_loss`) keeps its chunk loop eager, so that no chunk's logits outlive their
    iteration whatever Inductor plans, and compiles each chunk's softmax, log-likelihood and gradient
    into one fused function; its matmuls are the same BLAS calls compiled or not. Each piece is
    compiled by its owner's own hook, so the model needs no knowledge of this plan."""
    for block in blocks(model):
        block.compile()
    if model.latent is not None:  # a Free Transformer
        model.latent.mapper.compile_backward()
    model.readout_loss.compile()
    return model


def apply_fsdp(
    model: FreeTransformer, param_dtype: str = "fp32", reduce_dtype: str = "fp32", reshard_after_forward: bool = True
) -> FreeTransformer:
    """Shard `model` in place over the default process group: each block (decoder and encoder), then the root."""
    mp_policy = MixedPrecisionPolicy(param_dtype=torch_dtype(param_dtype), reduce_dtype=torch_dtype(reduce_dtype))
    for block in blocks(model):
        fully_shard(block, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    # FSDP2 keeps the root's parameters (embeddings, read-outs) gathered between forward and backward.
    fully_shard(model, mp_policy=mp_policy)
    return model


def parallelize(model: FreeTransformer, env: ParallelEnv, config) -> nn.Module:
    """The module the training loop calls: `model` itself under fsdp (sharded in place) or none, a
    DDP wrapper around it under ddp. `config` is the run's DistributedConfig. The optimizer is built
    on `model` after this call."""
    if env.strategy == "fsdp":
        return apply_fsdp(model, config.param_dtype, config.reduce_dtype, config.reshard_after_forward)
    if env.strategy == "ddp":
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        # RoPE tables are buffers computed from the config on every rank: nothing to sync at each forward
        # (the option was renamed in recent torch).
        no_sync: dict[str, Any] = (
            {"forward_sync_buffers": False} if "forward_sync_buffers" in _DDP_OPTIONS else {"broadcast_buffers": False}
        )
        return DistributedDataParallel(model, device_ids=device_ids, **no_sync)
    return model


def gradient_sync(runner: nn.Module, enabled: bool):
    """Context for one micro-batch's forward + backward: with enabled=False (all but the last
    micro-batch of a step) gradients accumulate locally, without communication."""
    if isinstance(runner, DistributedDataParallel) and not enabled:
        return runner.no_sync()
    if isinstance(runner, FSDPModule):
        runner.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (over every rank's shards); return it as a () tensor on the
    device, read back only when logged (no host synchronisation per step)."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    if isinstance(norm, DTensor):  # fsdp: the norm of sharded gradients is a partial result
        norm = norm.full_tensor()
    return norm


def grad_norm(parameters) -> torch.Tensor:
    """The global gradient norm (over every rank's shards) as clip_grad_norm computes it, the gradients left
    as they are: a () tensor on the device."""
    grads = [p.grad for p in parameters if p.grad is not None]
    # one kernel per dtype for the per-tensor norms, as clip_grad_norm_ (torch 2.5 has no get_total_norm)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if isinstance(norm, DTensor):  # fsdp: the norm of sharded gradients is a partial result
        norm = norm.full_tensor()
    return norm
