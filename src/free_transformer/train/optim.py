"""AdamW with the usual parameter groups, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from ..distributed.parallelize import clip_grad_norm, grad_norm
from ..model.transformer import FreeTransformer
from .config import OptimConfig


def parameter_groups(model: FreeTransformer, config: OptimConfig) -> list[dict]:
    """Weight decay on matrices of the blocks and read-outs only (never on norms, biases, zeta, the token
    embeddings or the latent mapper); the latent path (model.latent) may get its own lr."""
    latent = {id(p) for p in model.latent.parameters()} if model.latent is not None else set()
    never_decayed = {id(p) for p in model.embed_tokens.parameters()}
    if model.latent is not None:  # a Free Transformer
        never_decayed |= {id(p) for p in model.latent.mapper.parameters()}
    groups: dict[tuple[bool, bool], list] = {}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        no_decay = param.dim() < 2 or id(param) in never_decayed
        groups.setdefault((no_decay, id(param) in latent), []).append(param)
    return [
        {
            "params": params,
            "weight_decay": 0.0 if no_decay else config.weight_decay,
            "lr_scale": config.latent_lr_scale if is_latent else 1.0,
        }
        for (no_decay, is_latent), params in sorted(groups.items())
    ]


def build_optimizer(model: FreeTransformer, config: OptimConfig) -> torch.optim.AdamW:
    groups = parameter_groups(model, config)
    for group in groups:
        group["lr"] = config.lr * group["lr_scale"]
    device_type = next(model.parameters()).device.type
    # fused AdamW: one kernel over all tensors (the 2^H x D post-sampler table makes a plain loop slow)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, fused=device_type in ("cpu", "cuda"))


def clip_gradients(optimizer: torch.optim.Optimizer, parameters, max_norm: float) -> torch.Tensor:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)) before the next optimizer step, as
    torch.nn.utils.clip_grad_norm_ does, and return their global norm (a () tensor on the device). A fused
    AdamW applies the scale as it reads the gradients in its step (its `grad_scale` divides them), which
    saves a pass of its own over every gradient; any other optimizer gets them scaled here. max_norm = inf:
    nothing is scaled."""
    if not optimizer.defaults.get("fused"):
        return clip_grad_norm(parameters, max_norm)
    norm = grad_norm(parameters)
    # clip_grad_norm_'s factor, inverted (a non-finite norm gives a non-finite scale: the trainer skips that step)
    scale = None if math.isinf(max_norm) else torch.clamp((norm + 1e-6) / max_norm, min=1).float()
    optimizer.grad_scale = scale  # type: ignore[attr-defined]  # read by torch's fused step (GradScaler sets it so)
    return norm


def lr_factor(step: int, total_steps: int, config: OptimConfig) -> float:
    """Multiplier of the peak learning rate at `step` (0-based): linear warmup, then cosine or constant."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, peak_lr: float, factor: float) -> float:
    for group in optimizer.param_groups:
        group["lr"] = peak_lr * factor * group["lr_scale"]
    return peak_lr * factor
