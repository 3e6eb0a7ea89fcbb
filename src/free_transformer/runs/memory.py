"""The model that a user's sizes describe (a command line's, a checkpoint's or an export's config), or one
line saying it does not fit this machine's memory: the entry points build models through `build_model`,
so that the allocator's trace never reaches the user, and check a KV cache that a user's numbers size
(`check_cache_fits`) before it is allocated. The model itself checks nothing of the machine."""

from __future__ import annotations

import contextlib
import math
import os

import torch

from ..base.checks import ConfigError
from ..model.config import ModelConfig
from ..model.transformer import FreeTransformer


def _too_large(config: ModelConfig, what: str) -> ConfigError:
    params = config.num_params()
    return ConfigError(
        f"a model of {params:,} parameters ({what}) does not fit in this machine's memory: choose a smaller model"
    )


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes, what they are) that an allocation on `device` can take at most: the host's physical memory for
    the CPU (and MPS, which shares it), a CUDA device's free memory. On the meta device a model is built before
    it is placed (Hugging Face's from_pretrained, then on the CPU or a GPU): the most that any memory of this
    machine holds. None for another device (nothing is checked)."""
    if device.type in ("cpu", "mps"):
        return _host_memory(), "of memory"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    if device.type == "meta":
        gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
        return max([_host_memory(), *gpus]), "in this machine's largest memory"
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
    memory, _ = found
    elements = config.num_params() + 4 * config.max_seq_len * config.head_dim  # RoPE: cos, sin and two temporaries
    size = elements * torch.get_default_dtype().itemsize
    if size > memory:
        dtype = str(torch.get_default_dtype()).removeprefix("torch.")
        raise _too_large(
            config,
            f"{size / 2**30:,.1f} GiB in {dtype} with RoPE tables for max_seq_len "
            f"{config.max_seq_len:,}, of {memory / 2**30:,.1f} GiB",
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
def memory_for(config: ModelConfig):
    """A model too large for the machine is one line that says its size, not the allocator's trace."""
    try:
        yield
    except RuntimeError as error:  # DefaultCPUAllocator: can't allocate memory; CUDA out of memory
        if "allocate" not in str(error):
            raise
        raise _too_large(config, f"{4 * config.num_params() / 2**30:,.1f} GiB of parameters in float32") from None


def build_model(config: ModelConfig) -> FreeTransformer:
    """`FreeTransformer(config)`, refused with a ConfigError (one line, the model's size) when it cannot fit:
    before anything is allocated (`check_fits_memory`, also under the meta device, whose model is placed
    afterwards), else when the allocator fails."""
    check_fits_memory(config)
    with memory_for(config):
        return FreeTransformer(config)
