"""The model that a user's sizes describe (a command line's, a checkpoint's or an export's config), or one
line saying it does not fit this machine's memory: the entry points build models through `build_model`,
so that the allocator's trace never reaches the user. The model itself checks nothing of the machine."""

from __future__ import annotations

import contextlib
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


def check_fits_memory(config: ModelConfig) -> None:
    """Refuse, before anything is allocated, a model whose parameters and RoPE tables (with the
    temporaries that compute them) exceed this machine's physical memory, in the default dtype."""
    elements = config.num_params() + 4 * config.max_seq_len * config.head_dim  # RoPE: cos, sin and two temporaries
    size = elements * torch.get_default_dtype().itemsize
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size > memory:
        dtype = str(torch.get_default_dtype()).removeprefix("torch.")
        raise _too_large(
            config,
            f"{size / 2**30:,.1f} GiB in {dtype} with RoPE tables for max_seq_len "
            f"{config.max_seq_len:,}, of {memory / 2**30:,.1f} GiB",
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
    before anything is allocated on the CPU (`check_fits_memory`), else when the allocator fails. Under the
    meta device nothing is allocated and nothing is checked."""
    if torch.get_default_device().type == "cpu":
        check_fits_memory(config)
    with memory_for(config):
        return FreeTransformer(config)
