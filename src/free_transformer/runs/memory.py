"""The model that a user's sizes describe (a command line's, a checkpoint's or an export's config), or one
line saying it does not fit this machine's memory: the entry points build models through `build_model`,
so that the allocator's trace never reaches the user, and check a KV cache that a user's numbers size
(`check_cache_fits`) before it is allocated. The model itself checks nothing of the machine."""

from __future__ import annotations

import contextlib
import math
import os
import resource
from pathlib import Path

import torch

from ..base.checks import ConfigError
from ..model.config import ModelConfig
from ..model.transformer import FreeTransformer


def _too_large(config: ModelConfig, what: str) -> ConfigError:
    params = config.num_params()
    return ConfigError(
        f"a model of {params:,} parameters ({what}) does not fit in this machine's memory: choose a smaller model"
    )


def host_memory() -> tuple[int, str]:
    """(bytes, what bounds them) that this process may still allocate on the host: the least of the machine's
    physical memory, what its address-space and data limits leave above what it maps now (`prlimit --as`,
    RLIMIT_DATA), and what its cgroup's memory limit leaves above the group's use (a container's limit)."""
    page = os.sysconf("SC_PAGE_SIZE")
    bounds = [(page * os.sysconf("SC_PHYS_PAGES"), "of memory")]
    try:
        with open("/proc/self/statm") as statm:
            fields = [int(value) * page for value in statm.read().split()]
        mapped = {"RLIMIT_AS": fields[0], "RLIMIT_DATA": fields[5]}  # the address space; data and stack
    except (OSError, ValueError, IndexError):
        mapped = {}
    for name, used in mapped.items():
        limit, _ = resource.getrlimit(getattr(resource, name))
        if limit != resource.RLIM_INFINITY:
            bounds.append((max(0, limit - used), f"left under this process's {name}"))
    if (cgroup := _cgroup_room()) is not None:
        bounds.append((cgroup, "left under its cgroup's memory limit"))
    return min(bounds)


def _cgroup_room() -> int | None:
    """Bytes the process's memory cgroup may still take (its limit less its use), None without a limit: cgroup v2
    (memory.max, memory.current) or v1 (memory.limit_in_bytes, memory.usage_in_bytes), read where the process's
    group is mounted (a container sees its own group at the mount's root)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            mount, files = Path("/sys/fs/cgroup"), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            mount, files = Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for folder in (mount / path.lstrip("/"), mount):
            try:
                limit, used = ((folder / name).read_text().strip() for name in files)
            except OSError:
                continue
            if limit.isdigit() and used.isdigit() and int(limit) < 2**60:  # "max", or v1's "no limit" of ~2**63
                return max(0, int(limit) - int(used))
            break
    return None


def device_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes, what they are) that an allocation on `device` can take at most: what this process may take of the
    host's memory for the CPU (and MPS, which shares it: `host_memory`), a CUDA device's free memory. On the
    meta device a model is built before it is placed (Hugging Face's from_pretrained, then on the CPU or a GPU):
    the most that any memory of this machine holds. None for another device (nothing is checked)."""
    if device.type in ("cpu", "mps"):
        return host_memory()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    if device.type == "meta":
        gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
        host, where = host_memory()
        return (host, where) if host >= max(gpus, default=0) else (max(gpus), "in this machine's largest memory")
    return None


def check_fits_memory(config: ModelConfig, device: torch.device | None = None) -> None:
    """Refuse, before anything is allocated, a model whose parameters and RoPE tables (with the
    temporaries that compute them) exceed the memory of `device` (default: the one models are built on now;
    `device_memory`), in the default dtype. Its latent kind's range is checked first: counting the parameters
    of a latent space out of range would build one."""
    config.check_latent_kind()
    found = device_memory(device or torch.get_default_device())
    if found is None:
        return
    memory, where = found
    elements = config.num_params() + 4 * config.max_seq_len * config.head_dim  # RoPE: cos, sin and two temporaries
    size = elements * torch.get_default_dtype().itemsize
    if size > memory:
        dtype = str(torch.get_default_dtype()).removeprefix("torch.")
        raise _too_large(
            config,
            f"{size / 2**30:,.1f} GiB in {dtype} with RoPE tables for max_seq_len "
            f"{config.max_seq_len:,}, of {memory / 2**30:,.1f} GiB {where}",
        )


def cache_bytes(config: ModelConfig, rows: int, positions: int, dtype: torch.dtype) -> int:
    """Bytes of a KV cache of `rows` rows of `positions` positions in `dtype`: keys and values of every layer,
    and for a Free Transformer the Z fed at every position (what a decoding engine holds per row and
    position)."""
    per_position = 2 * config.n_layers * config.n_kv_heads * config.head_dim * dtype.itemsize
    if config.is_free:
        space = config.latent_space_on_meta()
        per_position += math.prod(space.value_shape) * space.value_dtype.itemsize
    return rows * positions * per_position


def check_cache_fits(
    config: ModelConfig,
    rows: int,
    positions: int,
    dtype: torch.dtype,
    device: torch.device,
    hint: str = "decode fewer rows at once",
) -> None:
    """Refuse, in one line ending in `hint` (how to ask for less), a KV cache (`cache_bytes`) larger than what
    `device` can take (`device_memory`), before it is allocated. The latent kind's range is checked first."""
    config.check_latent_kind()
    found = device_memory(device)
    if found is None:
        return
    memory, where = found
    size = cache_bytes(config, rows, positions, dtype)
    if size > memory:
        name = str(dtype).removeprefix("torch.")
        raise ConfigError(
            f"a KV cache of {rows:,} rows of {positions:,} positions ({size / 2**30:,.1f} GiB in {name}) does not "
            f"fit in the {memory / 2**30:,.1f} GiB {where}: {hint}"
        )


@contextlib.contextmanager
def allocating(what: str):
    """An allocation that the checks passed but the allocator refuses (the machine's memory taken meanwhile, a
    limit no check reads) is one line, a ConfigError that says `what` was allocated, not the allocator's trace."""
    try:
        yield
    except (MemoryError, RuntimeError) as error:
        if not _out_of_memory(error):
            raise
        raise ConfigError(f"{what} does not fit in the memory this process may use") from None


def _out_of_memory(error: Exception) -> bool:
    """Whether `error` is an allocator's refusal: a MemoryError, DefaultCPUAllocator's "can't allocate memory",
    CUDA's "out of memory" (torch.OutOfMemoryError, a RuntimeError, says "Tried to allocate")."""
    return isinstance(error, MemoryError) or "allocate" in str(error)


@contextlib.contextmanager
def memory_for(config: ModelConfig):
    """A model too large for the machine is one line that says its size, not the allocator's trace."""
    try:
        yield
    except (MemoryError, RuntimeError) as error:  # DefaultCPUAllocator: can't allocate memory; CUDA out of memory
        if not _out_of_memory(error):
            raise
        raise _too_large(config, f"{4 * config.num_params() / 2**30:,.1f} GiB of parameters in float32") from None


def build_model(config: ModelConfig) -> FreeTransformer:
    """`FreeTransformer(config)`, refused with a ConfigError (one line, the model's size) when it cannot fit:
    before anything is allocated (`check_fits_memory`, also under the meta device, whose model is placed
    afterwards), else when the allocator fails."""
    check_fits_memory(config)
    with memory_for(config):
        return FreeTransformer(config)
