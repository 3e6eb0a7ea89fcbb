"""Where a checkpoint is, and what its config.json says, read without torch: a command finds a missing run, a
missing checkpoint or a prompt past the model's context in one line before it imports torch (runs/checkpoint.py
loads the weights)."""

from __future__ import annotations

import json
from pathlib import Path

from ..base.bounded import loads_json
from ..base.checks import ConfigError
from ..base.errors import UserError
from ..base.fileio import refuse_links
from ..model.config import ModelConfig
from .saved_config import upgrade_saved_model_config
from .steps import MAX_STEP, STEP_DIR


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, incomplete or corrupt."""


def check_step(step: object, error: type[Exception] = CheckpointError) -> None:
    """A step that names a checkpoint directory loaders find (step_ and 8 digits), else `error` (a ValueError
    where a file's schema is checked: the checkpoint is then damaged)."""
    if not (isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP):
        raise error(f"a checkpoint's step must be an integer in [0, {MAX_STEP}], got {step!r}")


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints under run_dir/checkpoints, oldest first."""
    root = refuse_links(Path(run_dir) / "checkpoints", run_dir)
    if not root.is_dir():
        return []
    found = sorted(p for p in root.iterdir() if STEP_DIR.match(p.name) and (p.is_symlink() or p.is_dir()))
    for path in found:  # a step_N link would make loads read, and rotation delete, outside the run
        refuse_links(path, run_dir)
    return found


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its newest checkpoint)."""
    path = Path(path)
    if (path / "config.json").is_file() and ((path / "model.safetensors").is_file() or (path / "dcp").is_dir()):
        return path  # dcp/: a sharded checkpoint of a ddp / fsdp run (free_transformer.distributed)
    found = checkpoint_dirs(path)
    if found:
        return found[-1]
    raise CheckpointError(f"no checkpoint found at {path} (expected a step_* directory or a run directory)")


def read_checkpoint_config(path: str | Path) -> dict:
    """config.json of a checkpoint, its model config in today's field names (runs.migrations), checked
    against its schema: a file that matches its digest may still hold values of the wrong type, which would
    fail far from here."""
    ckpt = resolve_checkpoint(path)
    try:
        config = loads_json((ckpt / "config.json").read_text())
        _check_config_schema(config)
        config["model"] = upgrade_saved_model_config(config["model"])  # older field names: today's
        ModelConfig.from_dict(config["model"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError, ConfigError) as error:
        raise CheckpointError(f"corrupt checkpoint config {ckpt / 'config.json'}: {error}") from error
    return config


def _check_config_schema(config) -> None:
    """The types of what save_checkpoint writes into config.json; a ValueError names the first field amiss."""
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ValueError('expected an object with a "model" object')
    check_step(config.get("step"), ValueError)
    if not isinstance(config.get("tokenizer"), (str, type(None))):
        raise ValueError(f"tokenizer must be a name or null, got {config['tokenizer']!r}")
    for key in ("train", "token_ids", "converted_from"):
        if not isinstance(config.get(key, {}), dict):
            raise ValueError(f"{key} must be an object, got {config[key]!r}")
