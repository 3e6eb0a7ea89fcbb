"""The names of the model's tensors in every layout a checkpoint may hold, and the one migration
between them.

Two older layouts are read: the latent path as loose attributes (`encoder.*`, `zeta`, ...: renamed
by `LEGACY_LATENT_NAMES`; tests/data/legacy-run holds such a run), and separate q/k/v and gate/up
projections (checkpoints of that run, and Llama's weights: stacked by rows into the fused `qkv_proj`
and `gate_up_proj`, `FUSED_PROJECTIONS`). `upgrade_state_dict` brings any of them to the current names;
`split_state_dict` is its inverse for the projections (Llama's layout, for exports)."""

from __future__ import annotations

import re

import torch

from .config import ModelConfig
from .layers import qkv_rows

# The latent path's tensors as loose attributes of the model, old prefix -> the module's name.
LEGACY_LATENT_NAMES = {
    "encoder.": "latent.encoder.0.",
    "zeta": "latent.zeta",
    "encoder_norm.": "latent.norm.",
    "encoder_readout.": "latent.readout.",
    "post_sampler.weight": "latent.mapper.weight",
}

# Each block's fused input projections and the separate ones they stack by rows, in order: older
# checkpoints, and Llama's weights, hold the parts.
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def _stem(name: str, suffix: str) -> str | None:
    """`name` less `suffix` when `name` is `suffix` under some module prefix ("layers.3."), else None."""
    if name == suffix or name.endswith("." + suffix):
        return name[: -len(suffix)]
    return None


def fused_name(name: str) -> str | None:
    """The fused tensor that `name` (a separate q/k/v or gate/up weight) is one part of, else None."""
    for fused, parts in FUSED_PROJECTIONS.items():
        for part in parts:
            if (stem := _stem(name, part)) is not None:
                return stem + fused
    return None


def part_names(fused: str) -> list[str] | None:
    """The separate weights stacked, in this order, into the fused tensor named `fused`; None when
    `fused` is not a fused projection."""
    for suffix, parts in FUSED_PROJECTIONS.items():
        if (stem := _stem(fused, suffix)) is not None:
            return [stem + part for part in parts]
    return None


def part_rows(config: ModelConfig) -> dict[str, list[int]]:
    """The rows of each part of a fused projection, keyed and ordered as FUSED_PROJECTIONS."""
    return {
        "self_attn.qkv_proj.weight": list(qkv_rows(config)),
        "mlp.gate_up_proj.weight": [config.ffn_hidden, config.ffn_hidden],
    }


def legacy_latent_key_mapping(prefix: str = "") -> dict[str, str]:
    """LEGACY_LATENT_NAMES under `prefix` as regular expressions -> replacements (the form of Hugging
    Face's from_pretrained `key_mapping`)."""
    return {rf"^{re.escape(prefix + old)}": prefix + new for old, new in LEGACY_LATENT_NAMES.items()}


def upgrade_state_dict(state: dict, prefix: str = "") -> dict:
    """Upgrade, in place, the tensors under `prefix` of a state dict in an older layout: the latent
    path's loose names (LEGACY_LATENT_NAMES) renamed, separate q/k/v and gate/up weights concatenated by
    rows into their fused projection. What is already current is kept; a fused projection with a part
    missing is left as its parts (load_state_dict then names what is missing). Returns `state`."""
    for name in [n for n in state if n.startswith(prefix)]:
        local = name[len(prefix) :]
        for old, new in LEGACY_LATENT_NAMES.items():
            if local.startswith(old):
                state[prefix + new + local[len(old) :]] = state.pop(name)
                break
    for fused in {fused_name(n) for n in state if n.startswith(prefix)} - {None}:
        parts = part_names(fused)
        if all(part in state for part in parts):
            state[fused] = torch.cat([state.pop(part) for part in parts], dim=0)
    return state


def split_state_dict(state: dict, config: ModelConfig) -> dict:
    """A copy of `state` with every fused projection split back into its separate weights (Llama's
    layout): the inverse of `upgrade_state_dict`'s concatenation."""
    sizes = part_rows(config)
    out = {}
    for name, tensor in state.items():
        fused = next((f for f in FUSED_PROJECTIONS if _stem(name, f) is not None), None)
        if fused is None:
            out[name] = tensor
            continue
        for part, piece in zip(part_names(name), tensor.split(sizes[fused], dim=0), strict=True):
            out[part] = piece
    return out
