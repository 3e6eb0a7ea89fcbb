"""Checkpoints of ddp / fsdp runs with torch.distributed.checkpoint (DCP), and their consolidation.

    run_dir/checkpoints/step_00000500/
        config.json         as in every checkpoint: {"model", "step", "tokenizer", "train"}
        SHA256SUMS          the digests of config.json and of every file in dcp/, as in every checkpoint
        dcp/                DCP: .metadata + one __<rank>_0.distcp file per rank; model and optimizer
                            state under their parameter names ("model.layers.0.self_attn.qkv_proj.weight")
        model.safetensors   only once consolidated: then it is an ordinary checkpoint too (and in SHA256SUMS)

Every rank writes its own shards; DCP's metadata records which slice of which tensor each holds, so a
load on any number of processes (or on none: `consolidate`) reads back whatever slices it needs. What
DCP would unpickle is data, never code: .metadata is checked against DCP's own records first, and
entries stored as bytes are read with weights_only=True (`_PlainValuesLoadPlanner`). The
step directory is written as `.tmp_step_N` and renamed by rank 0 once complete, like `save_checkpoint`.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..base.fileio import refuse_links, share_like_umask
from ..model.config import ModelConfig
from ..model.transformer import FreeTransformer
from ..runs.checkpoint import (
    CHECKSUMS,
    CheckpointError,
    check_dcp_metadata,
    check_step,
    checkpoint_dirs,
    checksums,
    fsync_dir,
    load_training_state,
    optimizer_param_names,
    read_checkpoint_config,
    remove_checkpoint,
    verify_checkpoint,
)
from ..runs.memory import build_model
from ..runs.migrations import fused_name, upgrade_named_optimizer_state, upgrade_optimizer_state, upgrade_state_dict
from .env import ParallelEnv

DCP_DIR = "dcp"


def is_sharded(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / DCP_DIR / ".metadata").is_file()


def save_sharded(
    run_dir: str | Path,
    step: int,
    model: FreeTransformer,
    optimizer: torch.optim.Optimizer,
    metadata: dict,
    env: ParallelEnv,
    keep: int = 3,
) -> Path:
    """Collective: every rank calls it. Writes step_N with DCP shards and config.json; keeps the newest `keep`."""
    check_step(step)
    root = refuse_links(Path(run_dir) / "checkpoints", run_dir)
    final, tmp = refuse_links(root / f"step_{step:08d}", run_dir), refuse_links(root / f".tmp_step_{step:08d}", run_dir)
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    env.barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp / DCP_DIR)  # files fsynced
    env.barrier()  # every rank's shards are on disk
    if env.is_main:
        config = {"model": model.config.to_dict(), "step": step, **metadata}
        with open(tmp / "config.json", "w") as handle:
            handle.write(json.dumps(config, indent=2))
            handle.flush()
            os.fsync(handle.fileno())
        fsync_dir(tmp / DCP_DIR)
        # the same integrity record as a single-file checkpoint: --resume then moves a damaged one aside
        files = [tmp / "config.json", *sorted((tmp / DCP_DIR).iterdir())]
        with open(tmp / CHECKSUMS, "w") as handle:
            handle.write(checksums(tmp, files))
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():
            remove_checkpoint(final)
        os.replace(tmp, final)
        fsync_dir(root)
        for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
            remove_checkpoint(old)
    env.barrier()  # no rank goes on (and possibly writes the next checkpoint) before the rename
    return final


class _PlainValuesLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, except for entries stored as bytes (DCP pickles every value that is not a
    tensor: the optimizer's lr, betas...). DCP's own load_bytes unpickles them with
    torch.load(weights_only=False), which runs whatever a crafted shard asks; here they are unpickled with
    weights_only=True (tensors and plain values only), and one where a tensor is expected is refused."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        name = read_item.dest_index.fqn
        if isinstance(self.state_dict.get(name), torch.Tensor):
            raise CheckpointError(f"entry {name} is stored as bytes where a tensor is expected (refused, not read)")
        try:
            plain = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as error:  # "Weights only load failed", or a truncated or garbled entry
            raise CheckpointError(
                f"entry {name} asks to unpickle something other than tensors and plain values (refused, not run)"
            ) from error
        checked = io.BytesIO()  # DCP's own bookkeeping stores the value, from bytes this process wrote
        torch.save(plain, checked)
        checked.seek(0)
        super().load_bytes(read_item, checked)


def _dcp_load(state: dict, checkpoint: Path) -> None:
    """dcp.load in place into `state`; without a process group, in this process alone. Nothing in the
    checkpoint is unpickled beyond DCP's own records (.metadata) and tensors and plain values (entries)."""
    check_dcp_metadata(checkpoint)  # DCP unpickles it with pickle.load: nothing but its own records may run
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                state,
                checkpoint_id=checkpoint / DCP_DIR,
                planner=_PlainValuesLoadPlanner(),
                no_dist=not dist.is_initialized(),
            )
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        # a CheckpointException's text holds each rank's traceback: its last line is the cause
        cause = ([line.strip() for line in str(error).splitlines() if line.strip()][-1:] or [type(error).__name__])[0]
        cause = cause.removeprefix(f"{CheckpointError.__module__}.{CheckpointError.__name__}: ")  # raised above
        raise CheckpointError(f"cannot load the sharded checkpoint {checkpoint}: {cause}") from error


def _stored_metadata(checkpoint: Path):
    check_dcp_metadata(checkpoint)  # read_metadata unpickles it: nothing but DCP's own records may run
    try:
        return dcp.FileSystemReader(checkpoint / DCP_DIR).read_metadata()
    except Exception as error:
        raise CheckpointError(f"cannot read the sharded checkpoint {checkpoint}: {error}") from error


def _has_separate_projections(checkpoint: Path) -> bool:
    """Whether the checkpoint was written before the input projections were fused (separate q/k/v and
    gate/up weights): DCP reads by the reader's names, so such a checkpoint is read in its own layout."""
    stored = _stored_metadata(checkpoint).state_dict_metadata
    return any(name.startswith("model.") and fused_name(name) is not None for name in stored)


def _dcp_load_as_stored(checkpoint: Path, tops: tuple[str, ...]) -> dict:
    """Every entry under the top-level keys `tops` ("model", "optim"), whole, as the checkpoint stores
    them (its names and shapes, on the CPU), nested as they were saved."""
    metadata = _stored_metadata(checkpoint)
    flat = {
        name: torch.empty(entry.size, dtype=entry.properties.dtype)
        if isinstance(entry, TensorStorageMetadata)
        else None  # bytes: replaced by the stored value
        for name, entry in metadata.state_dict_metadata.items()
        if name.split(".", 1)[0] in tops
    }
    _dcp_load(flat, checkpoint)
    mapping = {name: path for name, path in metadata.planner_data.items() if name in flat}
    return unflatten_state_dict(flat, mapping)


def load_sharded(checkpoint: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load model and optimizer state from a DCP checkpoint, whatever number of processes wrote it and
    whatever number (one included, without a process group) reads it. Returns the checkpoint's step.
    A checkpoint written with separate q/k/v and gate/up weights is read whole on every rank, its
    weights and optimizer state fused, then sharded as this run's layout asks."""
    checkpoint = Path(checkpoint)
    if _has_separate_projections(checkpoint):
        stored = _dcp_load_as_stored(checkpoint, ("model", "optim"))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=upgrade_state_dict(stored["model"]),
            optim_state_dict=upgrade_named_optimizer_state(stored["optim"]),
            options=StateDictOptions(full_state_dict=True),
        )
        return int(read_checkpoint_config(checkpoint)["step"])
    model_state, optim_state = get_state_dict(model, optimizer)  # this run's layout: what to read
    state: dict[str, Any] = {"model": model_state, "optim": optim_state}
    _dcp_load(state, checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(read_checkpoint_config(checkpoint)["step"])


def load_single_file(checkpoint: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Continue a one-process (strategy none) checkpoint on several processes: model.safetensors and
    the optimizer state of state.pt, whose parameters are numbered in optimizer order, renamed by
    parameter name so that every rank takes its own shards. Returns the checkpoint's step."""
    checkpoint = Path(checkpoint)
    weights = upgrade_state_dict(load_file(checkpoint / "model.safetensors"))  # older names and layouts
    state = load_training_state(checkpoint)
    group_names = optimizer_param_names(model, optimizer)
    order = [name for names in group_names for name in names]
    saved = upgrade_optimizer_state(state["optimizer"], group_names)
    optim_state: dict[str, Any] = {
        "state": {order[index]: value for index, value in saved["state"].items()},
        "param_groups": [
            {**group, "params": [order[index] for index in group["params"]]} for group in saved["param_groups"]
        ],
    }
    set_state_dict(
        model,
        optimizer,
        model_state_dict=weights,
        optim_state_dict=optim_state,
        options=StateDictOptions(full_state_dict=True),
    )
    return int(state["step"])


def sharded_checkpoint_dir(path: str | Path) -> Path:
    """A sharded step directory, or a run directory's newest checkpoint."""
    path = Path(path)
    if is_sharded(path):
        return path
    found = checkpoint_dirs(path)
    if found and is_sharded(found[-1]):
        return found[-1]
    raise CheckpointError(
        f"no sharded (DCP) checkpoint at {path}: expected a step_* directory holding "
        f"{DCP_DIR}/ or a run directory whose newest checkpoint does"
    )


def consolidate(path: str | Path, out: str | Path | None = None) -> Path:
    """Gather a DCP checkpoint's model weights into model.safetensors, in one process without a process
    group: next to dcp/ in the step directory (which then `load_model` reads), or in a new checkpoint
    directory `out` (model.safetensors + config.json). Either way SHA256SUMS then lists model.safetensors.
    Nothing is written unless the checkpoint verifies, and a failed write (a full disk) leaves nothing
    behind. Returns the directory written."""
    checkpoint = sharded_checkpoint_dir(path)
    config = read_checkpoint_config(checkpoint)
    model = build_model(ModelConfig.from_dict(config["model"]))
    if _has_separate_projections(checkpoint):  # written before the projections were fused: read as stored
        weights = upgrade_state_dict(_dcp_load_as_stored(checkpoint, ("model",))["model"])
    else:
        weights = model.state_dict()  # the model's own tensors, filled in place
        _dcp_load({"model": weights}, checkpoint)
    problem = verify_checkpoint(checkpoint)  # the sums written below must not bless a damaged checkpoint
    if problem is not None:
        raise CheckpointError(f"checkpoint {checkpoint} is damaged: {' '.join(problem.split())}")
    if out is not None and Path(out).exists() and any(Path(out).iterdir()):
        raise CheckpointError(
            f"{out} already holds a checkpoint or other files: choose another --out (nothing was written)"
        )
    # Written in a temporary directory (inside the step directory, or beside `out`), then renamed into place.
    target = checkpoint if out is None else Path(out)
    if target.is_symlink():
        raise CheckpointError(
            f"{target} is a symbolic link: nothing is written through one; choose another --out (nothing was written)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".consolidating", dir=checkpoint if out is None else target.parent))
    try:
        save_file(
            {k: v.contiguous() for k, v in weights.items()}, staging / "model.safetensors", metadata={"format": "pt"}
        )
        new_sums = checksums(staging, [staging / "model.safetensors"])
        if out is not None:
            (staging / "config.json").write_text(json.dumps(config, indent=2))
            (staging / CHECKSUMS).write_text(checksums(staging, [staging / "config.json"]) + new_sums)
        elif (checkpoint / CHECKSUMS).is_file():  # the sums verified above, with the new file's (absent: none)
            kept = [
                line
                for line in (checkpoint / CHECKSUMS).read_text().splitlines(keepends=True)
                if not line.rstrip("\n").endswith("  model.safetensors")
            ]
            (staging / CHECKSUMS).write_text("".join(kept) + new_sums)
        share_like_umask(staging)  # mkdtemp makes 0700, safetensors 0600
        for f in staging.iterdir():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        if out is not None:
            os.replace(staging, target)  # target is absent or an empty directory
        else:  # the weights first: until the sums follow, the checkpoint reads as damaged, never as wrong
            os.replace(staging / "model.safetensors", target / "model.safetensors")
            if (staging / CHECKSUMS).exists():
                os.replace(staging / CHECKSUMS, target / CHECKSUMS)
        fsync_dir(target)
    except (OSError, SafetensorError) as error:
        raise CheckpointError(
            f"cannot write model.safetensors in {target}: is the disk full, or a quota or "
            f"file-size limit reached? ({' '.join(str(error).split())}); nothing was written, "
            "make room and run consolidate again"
        ) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
