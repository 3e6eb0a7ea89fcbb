"""Checkpoints of ddp / fsdp runs with torch.distributed.checkpoint (DCP), and their consolidation.

    run_dir/checkpoints/step_00000500/
        config.json         as in every checkpoint: {"model", "step", "tokenizer", "train"}
        SHA256SUMS          the digests of config.json and of every file in dcp/, as in every checkpoint
        dcp/                DCP: .metadata + one __<rank>_0.distcp file per rank; model and optimizer
                            state under their parameter names ("model.layers.0.attention.q_proj.weight")
        model.safetensors   only once consolidated: then it is an ordinary checkpoint too

Every rank writes its own shards; DCP's metadata records which slice of which tensor each holds, so a
load on any number of processes (or on none: `consolidate`) reads back whatever slices it needs. The
step directory is written as `.tmp_step_N` and renamed by rank 0 once complete, like `save_checkpoint`.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..checkpoint import (
    CHECKSUMS,
    CheckpointError,
    check_dcp_metadata,
    checkpoint_dirs,
    fsync_dir,
    load_training_state,
    read_checkpoint_config,
    remove_checkpoint,
)
from ..config import ModelConfig
from ..fileio import sha256_file, share_like_umask
from ..model import FreeTransformer, upgrade_state_dict
from .env import ParallelEnv

DCP_DIR = "dcp"


def is_sharded(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / DCP_DIR / ".metadata").is_file()


def save_sharded(run_dir: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 metadata: dict, env: ParallelEnv, keep: int = 3) -> Path:
    """Collective: every rank calls it. Writes step_N with DCP shards and config.json; keeps the newest `keep`."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
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
            handle.write("".join(f"{sha256_file(f)}  {f.relative_to(tmp)}\n" for f in files))
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


def _dcp_load(state: dict, checkpoint: Path) -> None:
    """dcp.load in place into `state`; without a process group, in this process alone."""
    check_dcp_metadata(checkpoint)  # DCP unpickles it with pickle.load: nothing but its own records may run
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=checkpoint / DCP_DIR, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
        # a CheckpointException's text holds each rank's traceback: its last line is the cause
        cause = [line for line in str(error).splitlines() if line.strip()][-1:] or [type(error).__name__]
        raise CheckpointError(f"cannot load the sharded checkpoint {checkpoint}: {cause[0].strip()}") from error


def load_sharded(checkpoint: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load model and optimizer state from a DCP checkpoint, whatever number of processes wrote it and
    whatever number (one included, without a process group) reads it. Returns the checkpoint's step."""
    checkpoint = Path(checkpoint)
    model_state, optim_state = get_state_dict(model, optimizer)  # this run's layout: what to read
    state = {"model": model_state, "optim": optim_state}
    _dcp_load(state, checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(read_checkpoint_config(checkpoint)["step"])


def load_single_file(checkpoint: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Continue a one-process (strategy none) checkpoint on several processes: model.safetensors and
    the optimizer state of state.pt, whose parameters are numbered in optimizer order, renamed by
    parameter name so that every rank takes its own shards. Returns the checkpoint's step."""
    checkpoint = Path(checkpoint)
    weights = upgrade_state_dict(load_file(checkpoint / "model.safetensors"))  # 0.1 latent-path names
    state = load_training_state(checkpoint)
    names = {id(param): name for name, param in model.named_parameters()}
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    saved = state["optimizer"]
    optim_state = {
        "state": {order[index]: value for index, value in saved["state"].items()},
        "param_groups": [{**group, "params": [order[index] for index in group["params"]]}
                         for group in saved["param_groups"]],
    }
    set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))
    return int(state["step"])


def sharded_checkpoint_dir(path: str | Path) -> Path:
    """A sharded step directory, or a run directory's newest checkpoint."""
    path = Path(path)
    if is_sharded(path):
        return path
    found = checkpoint_dirs(path)
    if found and is_sharded(found[-1]):
        return found[-1]
    raise CheckpointError(f"no sharded (DCP) checkpoint at {path}: expected a step_* directory holding "
                          f"{DCP_DIR}/ or a run directory whose newest checkpoint does")


def consolidate(path: str | Path, out: str | Path | None = None) -> Path:
    """Gather a DCP checkpoint's model weights into model.safetensors, in one process without a process
    group: next to dcp/ in the step directory (which then `load_model` reads), or in a new checkpoint
    directory `out` (model.safetensors + config.json). Returns the directory written."""
    checkpoint = sharded_checkpoint_dir(path)
    config = read_checkpoint_config(checkpoint)
    model = FreeTransformer(ModelConfig.from_dict(config["model"]))
    weights = model.state_dict()  # the model's own tensors, filled in place
    _dcp_load({"model": weights}, checkpoint)
    target = checkpoint if out is None else Path(out)
    if out is not None and any((target / name).exists() for name in ("model.safetensors", "config.json")):
        raise CheckpointError(f"{target} already holds a checkpoint: choose another --out (nothing was written)")
    target.mkdir(parents=True, exist_ok=True)
    tmp = target / ".model.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp, metadata={"format": "pt"})
    share_like_umask(tmp)  # safetensors writes 0600
    fsync_dir(tmp)
    if out is not None:
        (target / "config.json").write_text(json.dumps(config, indent=2))
    os.replace(tmp, target / "model.safetensors")
    return target
