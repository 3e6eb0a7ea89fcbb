"""What earlier code wrote, read in today's names and layouts: with runs/saved_config.py, its half for
configs, the one adapter between a saved run and today's model. The checkpoint loaders (runs/checkpoint.py,
distributed/sharded_checkpoint.py) and the Hugging Face loaders (hf/: from_pretrained's key_mapping, convert,
the export's config) all call it; the model knows only its own names. Nothing here is removed by a release: a
checkpoint once written stays loadable.

- A saved config (a checkpoint's config.json, an export's, a run's config.yaml) in older field names and
  layouts: runs/saved_config.py, which imports no torch (a config is read before any model work).
- Tensors in two older layouts: the latent path as loose attributes (`encoder.*`, `zeta`, ...: renamed by
  LEGACY_LATENT_NAMES; tests/data/legacy-run holds such a run), and separate q/k/v and gate/up projections
  (checkpoints of that run, and Llama's weights: stacked by rows into the fused `qkv_proj` and
  `gate_up_proj`, model.layers.FUSED_PROJECTIONS). `upgrade_state_dict` brings any of them to today's
  names; `split_state_dict` is its inverse for the projections (Llama's layout, for exports).
- An optimizer state of separate projections: `upgrade_optimizer_state`, as the weights are.
- A run's metrics.jsonl in older metric names: METRIC_RENAMED (train/metrics.read_metrics).
"""

from __future__ import annotations

import re

import torch

from ..model.config import ModelConfig
from ..model.layers import FUSED_PROJECTIONS, part_rows
from .saved_config import SAVED_MODEL_RENAMED, upgrade_saved_model_config  # noqa: F401 (0.3's import path)

# A run's metrics.jsonl in older metric names, old -> today's.
METRIC_RENAMED = {"val_kl_bits_per_bit": "val_kl_bits_per_unit", "dead_bits": "dead_units"}

# The latent path's tensors as loose attributes of the model, old prefix -> the module's name.
LEGACY_LATENT_NAMES = {
    "encoder.": "latent.encoder.0.",
    "zeta": "latent.zeta",
    "encoder_norm.": "latent.norm.",
    "encoder_readout.": "latent.readout.",
    "post_sampler.weight": "latent.mapper.weight",
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
    for fused in {f for f in (fused_name(n) for n in state if n.startswith(prefix)) if f is not None}:
        parts = part_names(fused) or []
        if parts and all(part in state for part in parts):
            state[fused] = torch.cat([state.pop(part) for part in parts], dim=0)
    return state


def split_state_dict(state: dict, config: ModelConfig) -> dict:
    """A copy of `state` with every fused projection split back into its separate weights (Llama's
    layout): the inverse of `upgrade_state_dict`'s concatenation."""
    sizes = part_rows(config)
    out = {}
    for name, tensor in state.items():
        fused = next((f for f in FUSED_PROJECTIONS if _stem(name, f) is not None), None)
        parts = part_names(name)
        if fused is None or parts is None:
            out[name] = tensor
            continue
        for part, piece in zip(parts, tensor.split(sizes[fused], dim=0), strict=True):
            out[part] = piece
    return out


def upgrade_named_optimizer_state(named: dict) -> dict:
    """An optimizer state keyed by parameter name ({"state": {name: ...}, "param_groups": [{"params":
    [names], ...}]}) written before the input projections were fused (separate q/k/v and gate/up
    parameters), for the fused model: each fused parameter's state is its parts' (exp_avg, exp_avg_sq
    concatenated by rows as the weights are; the step, equal in every part, once), in the place of the
    first part. A current state is returned unchanged."""
    state = dict(named["state"])
    groups = []
    for group in named["param_groups"]:
        params = []
        for name in group["params"]:
            fused = fused_name(name)
            if fused is None:
                params.append(name)
                continue
            if fused in params:
                continue
            params.append(fused)
            parts = [state.pop(part) for part in part_names(fused) or [] if part in state]
            if parts:
                state[fused] = {
                    key: torch.cat([part[key] for part in parts], dim=0)
                    if isinstance(value, torch.Tensor) and value.dim()
                    else value
                    for key, value in parts[0].items()
                }
        groups.append({**group, "params": params})
    return {"state": state, "param_groups": groups}


def upgrade_optimizer_state(saved: dict, group_names: list[list[str]]) -> dict:
    """`upgrade_named_optimizer_state` of an optimizer state_dict numbered by optimizer order (state.pt),
    for the optimizer whose groups hold the parameters named `group_names` (runs.checkpoint.optimizer_param_names).
    The saved numbering is read as this optimizer's order with each fused parameter's parts in its
    place (the order the parameters had before). A state that does not fit that layout is returned
    unchanged (the optimizer's load_state_dict then says what differs)."""
    old_groups = [[part for name in names for part in (part_names(name) or [name])] for names in group_names]
    saved_groups = saved["param_groups"]
    if (
        old_groups == group_names
        or len(saved_groups) != len(old_groups)
        or any(len(group["params"]) != len(names) for group, names in zip(saved_groups, old_groups))
    ):
        return saved
    old_name = {
        index: name for group, names in zip(saved_groups, old_groups) for index, name in zip(group["params"], names)
    }
    named = upgrade_named_optimizer_state(
        {
            "state": {old_name[index]: value for index, value in saved["state"].items()},
            "param_groups": [{**group, "params": names} for group, names in zip(saved_groups, old_groups)],
        }
    )
    index = {name: i for i, name in enumerate(name for names in group_names for name in names)}
    return {
        "state": {index[name]: value for name, value in named["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in named["param_groups"]
        ],
    }
