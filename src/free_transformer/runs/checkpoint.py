"""Checkpoints: one directory per step, written atomically.

    run_dir/checkpoints/step_00001000/
        model.safetensors   weights (safetensors: no pickle, memory-mappable)
        config.json         {"model": ModelConfig, "train": ..., "tokenizer": name, "step": N}
        state.pt            optimizer, RNG streams and step (training only), plain tensors and Python values
        SHA256SUMS          the other files' digests (`sha256sum -c SHA256SUMS` checks them by hand); every
                            file a loader reads must be listed, so an emptied or cut SHA256SUMS is damage too

A checkpoint is written into a temporary sibling directory and renamed into place once complete, so a
killed process never leaves a partial `step_*` directory; only the newest `keep` are kept. A checkpoint
damaged afterwards (a truncated copy, a flipped bit, a file left out of SHA256SUMS) or whose files match
their digests but not their schema (a config.json or state.pt of the wrong shape) fails
`verify_checkpoint`; `--resume` then moves it aside as step_N.damaged and continues from the newest
intact one, and every other command that loads a checkpoint (`load_model`, `load_verified_weights`)
refuses it with one line.

Nothing read from a checkpoint can run code: weights are safetensors, and state.pt is read with
`torch.load(weights_only=True)`, which unpickles tensors and plain Python values only. Older state.pt
files hold numpy's RNG state as an ndarray; the numpy names that rebuild one (`LEGACY_STATE_GLOBALS`)
are the only others allowed.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..base.checks import ConfigError
from ..base.fileio import refuse_links, sha256_file, share_like_umask
from ..model.config import ModelConfig
from ..model.transformer import FreeTransformer
from .locate import CheckpointError, check_step, checkpoint_dirs, read_checkpoint_config, resolve_checkpoint
from .memory import build_model
from .migrations import upgrade_state_dict

CHECKSUMS = "SHA256SUMS"
# The files of a checkpoint that loaders read (besides every file under dcp/): each must be in SHA256SUMS.
READ_FILES = ("config.json", "model.safetensors", "state.pt")
# What the numpy RNG state of an older state.pt needs to unpickle (an ndarray of uint32), under the names
# numpy 2 and numpy 1 pickled it with; nothing else beyond tensors and plain values is ever unpickled.
LEGACY_STATE_GLOBALS: list[Callable[..., Any] | tuple[Callable[..., Any], str]] = [
    np.dtype,
    np.ndarray,
    type(np.dtype(np.uint32)),
    (np._core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),  # type: ignore[attr-defined]  # private: not in numpy's stubs
    (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),  # type: ignore[attr-defined]  # private: not in numpy's stubs
]


def checksums(directory: Path, files) -> str:
    """SHA256SUMS lines (`sha256sum` format) of `files`, named relative to the checkpoint `directory`."""
    return "".join(f"{sha256_file(f)}  {Path(f).relative_to(directory).as_posix()}\n" for f in files)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, new files) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_checkpoint(path: Path) -> None:
    """Rename a step directory out of the step_* namespace (atomic), then delete it: a process killed
    mid-delete leaves a .tmp_step_* directory (removed when training starts), never a partial step_*."""
    trash = refuse_links(path.with_name(f".tmp_{path.name}_removed"), path.parent)  # a planted link: one line
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: FreeTransformer,
    metadata: dict,
    training_state: dict | None = None,
    keep: int = 3,
) -> Path:
    """Write weights + config (+ training state) for `step` atomically; keep the newest `keep`."""
    check_step(step)
    root = refuse_links(Path(run_dir) / "checkpoints", run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = refuse_links(root / f"step_{step:08d}", run_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp_step_{step:08d}_", dir=root))
    try:
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        config = {"model": model.config.to_dict(), "step": step, **metadata}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if training_state is not None:
            torch.save(training_state, tmp / "state.pt")
        (tmp / CHECKSUMS).write_text(checksums(tmp, sorted(tmp.iterdir())))
        share_like_umask(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as handle:
                os.fsync(handle.fileno())
        if final.exists():  # re-saving the same step: move the old one aside only once the new is complete
            remove_checkpoint(final)
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, (OSError, RuntimeError, SafetensorError)):  # a full disk, a file-size or quota limit
            raise CheckpointError(
                f"cannot write the checkpoint of step {step} in {root}: is the disk full, or a quota or file-size "
                f"limit reached? ({error}); nothing partial was left and the checkpoints already there are intact: "
                "make room, then continue with --resume"
            ) from error
        raise
    for old in checkpoint_dirs(run_dir)[:-keep] if keep > 0 else []:
        remove_checkpoint(old)
    return final


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[FreeTransformer, dict]:
    """(model in eval mode, checkpoint config dict) from a checkpoint or run directory, verified first."""
    ckpt = resolve_checkpoint(path)
    config = read_checkpoint_config(ckpt)
    if not (ckpt / "model.safetensors").exists() and (ckpt / "dcp").is_dir():
        raise CheckpointError(f"{ckpt} is a sharded checkpoint: run `free-transformer consolidate {ckpt}` first")
    try:  # sizes too large for the machine (max_seq_len 2**40: RoPE tables of 4 TiB) refused before allocating
        model = build_model(ModelConfig.from_dict(config["model"]))
    except ConfigError as error:
        raise ConfigError(f"{ckpt / 'config.json'}: {error}") from None
    weights = load_verified_weights(ckpt)
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        raise CheckpointError(f"corrupt checkpoint weights {ckpt / 'model.safetensors'}: {error}") from error
    return model.to(device).eval(), config


def load_weights(ckpt: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """model.safetensors of a checkpoint directory, in this version's tensor names and layout (older
    checkpoints are migrated on the way in: runs.migrations.upgrade_state_dict, outside the model); a
    missing or unreadable file is a CheckpointError."""
    try:
        return upgrade_state_dict(load_file(ckpt / "model.safetensors", device=device))
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"corrupt checkpoint weights {ckpt / 'model.safetensors'}: {error}") from error


def load_verified_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """`load_weights` of a checkpoint that `verify_checkpoint` passes, else a CheckpointError naming
    what is wrong: a damaged checkpoint is never used silently."""
    problem = verify_checkpoint(ckpt, read_weights=False)  # load_weights reads (and checks) them once
    if problem is not None:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: {' '.join(problem.split())}")
    return load_weights(ckpt)


def load_training_state(path: str | Path) -> dict:
    """state.pt of a checkpoint, unpickled with weights_only=True (tensors and plain values only: a file
    that asks for anything else is refused, never run), then checked against its schema."""
    ckpt = resolve_checkpoint(path)
    try:
        with torch.serialization.safe_globals(LEGACY_STATE_GLOBALS):
            state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=True)
        _check_training_state(state)
    except Exception as error:  # torch.load raises many types on a truncated, garbled or unsafe file
        reason = (
            str(error).split("\n")[0]
            if "Weights only load failed" not in str(error)
            else "it asks to unpickle something other than tensors and plain values (refused, not run)"
        )
        raise CheckpointError(f"corrupt, unsafe or missing training state {ckpt / 'state.pt'}: {reason}") from error
    return state


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each parameter group's parameter names, in optimizer order."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]


def _check_training_state(state) -> None:
    """What the trainer saves: {"step", "optimizer": an optimizer state_dict, "rng": every RNG stream}. Each
    RNG state is set on a throwaway generator, which checks it as setting the real one would."""
    if not isinstance(state, dict) or not {"step", "optimizer", "rng"} <= set(state):
        raise ValueError("expected an object with step, optimizer and rng")
    check_step(state["step"], ValueError)
    optimizer = state["optimizer"]
    if not (
        isinstance(optimizer, dict)
        and isinstance(optimizer.get("state"), dict)
        and isinstance(optimizer.get("param_groups"), list)
        and all(
            isinstance(group, dict) and isinstance(group.get("params"), list) for group in optimizer["param_groups"]
        )
    ):
        raise ValueError("optimizer is not an optimizer state (state and param_groups)")
    rng = state["rng"]
    if not isinstance(rng, dict) or not {"torch", "python", "numpy"} <= set(rng):
        raise ValueError("rng must hold the torch, python and numpy states")
    try:
        torch.Generator().set_state(rng["torch"])
        random.Random().setstate(rng["python"])
        name, key, position, has_gauss, cached_gaussian = rng["numpy"]
        np.random.RandomState().set_state(
            (name, np.asarray(key).astype(np.uint32), position, has_gauss, cached_gaussian)
        )
        if "cuda" in rng and not (isinstance(rng["cuda"], torch.Tensor) and rng["cuda"].dtype == torch.uint8):
            raise TypeError("not a byte tensor")
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"rng is not a valid RNG state ({' '.join(str(error).split())})") from None


# What a DCP `.metadata` pickle names (torch.distributed.checkpoint's own records, and the torch types in them).
# DCP reads it with pickle.load, so a crafted one could run code: it is checked against this list first.
DCP_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    *(
        ("torch", str(dtype).removeprefix("torch."))
        for dtype in (
            torch.float64,
            torch.float32,
            torch.bfloat16,
            torch.float16,
            torch.int64,
            torch.int32,
            torch.int16,
            torch.int8,
            torch.uint8,
            torch.bool,
        )
    ),
}


class _DcpMetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in DCP_METADATA_GLOBALS:
            raise CheckpointError(f"it asks to unpickle {module}.{name} (refused, not run)")
        return super().find_class(module, name)


def check_dcp_metadata(checkpoint: Path) -> None:
    """Unpickle dcp/.metadata allowing only DCP_METADATA_GLOBALS, or raise CheckpointError: run before
    DCP itself reads it with pickle.load."""
    path = checkpoint / "dcp" / ".metadata"
    try:
        with open(path, "rb") as handle:
            metadata = _DcpMetadataUnpickler(handle).load()
    except CheckpointError as error:
        raise CheckpointError(f"unsafe sharded checkpoint metadata {path}: {error}") from None
    except Exception as error:  # truncated or garbled
        raise CheckpointError(f"corrupt sharded checkpoint metadata {path}: {type(error).__name__}: {error}") from None
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or "/" in name or "\\" in name or name in (".", "..") or not (checkpoint / "dcp" / name).is_file():
            raise CheckpointError(
                f"unsafe sharded checkpoint metadata {path}: its storage path {name!r} is not a "
                "file of the checkpoint's dcp/ folder (DCP would read it)"
            )


def verify_checkpoint(path: str | Path, read_weights: bool = True) -> str | None:
    """None if the checkpoint directory is intact, else what is wrong with it (one line). Reads every
    file: the recorded digests, config.json, the safetensors header and tensors (unless read_weights is
    False: a caller about to load them reads them once), state.pt."""
    path = Path(path)
    links = [f for f in path.rglob("*") if f.is_symlink()] if path.is_dir() else []
    if links:  # a checkpoint's files are read only from inside it
        return f"{links[0].relative_to(path).as_posix()} is a symbolic link (a checkpoint's files must be its own)"
    try:
        problem = _check_digests(path) if (path / CHECKSUMS).is_file() else None  # absent: written before it existed
        if problem is not None:
            return problem
        read_checkpoint_config(path)
        if (path / "dcp").is_dir() and not (path / "model.safetensors").exists():
            if not (path / "dcp" / ".metadata").is_file():
                return "dcp/.metadata is missing"
            check_dcp_metadata(path)
            return None  # the shards are covered by SHA256SUMS, and read (and reported) at load time
        if read_weights:
            load_file(path / "model.safetensors")
        if (path / "state.pt").exists():
            load_training_state(path)
    except CheckpointError as error:
        return str(error)
    except (OSError, SafetensorError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _check_digests(path: Path) -> str | None:
    """What is wrong with a checkpoint's files against its SHA256SUMS, or None: a listed file missing or
    changed, or a file that loaders read (READ_FILES, everything under dcp/) not listed (an emptied or cut
    SHA256SUMS, or a file put there afterwards)."""
    listed = set()
    for line in (path / CHECKSUMS).read_text().splitlines():
        digest, _, name = line.partition("  ")
        if not name:
            return f"{CHECKSUMS} holds a line that names no file"
        if not (path / name).is_file():
            return f"{name} is missing"
        if sha256_file(path / name) != digest:
            return f"{name} does not match its SHA-256 in {CHECKSUMS}"
        listed.add(name)
    read = [path / name for name in READ_FILES if (path / name).exists()]
    read += sorted(f for f in (path / "dcp").rglob("*") if not f.is_dir()) if (path / "dcp").is_dir() else []
    unlisted = [name for name in (f.relative_to(path).as_posix() for f in read) if name not in listed]
    if unlisted:
        return f"{unlisted[0]} is not in {CHECKSUMS} (it lists every file of an intact checkpoint)"
    return None


def newest_intact_checkpoint(run_dir: str | Path, report=print) -> Path | None:
    """The newest checkpoint of a run that `verify_checkpoint` passes, or None. Each damaged one on the
    way is reported and renamed step_N.damaged (kept for inspection, out of the way of new saves)."""
    for checkpoint in reversed(checkpoint_dirs(run_dir)):
        problem = verify_checkpoint(checkpoint)
        if problem is None:
            return checkpoint
        aside, n = checkpoint.with_name(checkpoint.name + ".damaged"), 2
        while aside.exists():
            aside, n = checkpoint.with_name(f"{checkpoint.name}.damaged{n}"), n + 1
        os.replace(checkpoint, aside)
        report(
            f"warning: checkpoint {checkpoint} is damaged ({' '.join(problem.split())}); "
            f"moved to {aside.name}, trying the previous one"
        )
    return None


def _checkpoint_choice(spec: str):
    """--checkpoints as a test of (step, newest checkpoint's step): all, every:K (multiples of K), or
    last-third (steps at or after 2/3 of the newest: the steps that the last-third average covers)."""
    if spec == "all":
        return lambda step, newest: True
    if spec == "last-third":
        return lambda step, newest: 3 * step >= 2 * newest
    kind, _, every = spec.partition(":")
    if kind == "every" and every.isdigit() and int(every) > 0:
        return lambda step, newest: step % int(every) == 0
    raise ValueError(f"--checkpoints expects all, every:K (K >= 1) or last-third, got {spec!r}")


def chosen_checkpoints(run_dir: str | Path, spec: str) -> list[tuple[int, Path]]:
    """(step, directory) of the run's checkpoints that `spec` (all, every:K, last-third) chooses."""
    choose = _checkpoint_choice(spec)
    found = [(int(c.name.removeprefix("step_")), c) for c in checkpoint_dirs(run_dir)]  # STEP_DIR's names
    if not found:
        raise ValueError(f"{run_dir} holds no checkpoints/step_*: --checkpoints needs a run directory")
    return [(step, c) for step, c in found if choose(step, found[-1][0])]
