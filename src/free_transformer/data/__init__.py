"""Training data: the paper's synthetic letters, the coin-flip example, documents in files of many
formats or a named corpus (text), and pre-tokenized shards (tokens)."""

from . import shards, text  # noqa: F401  (each registers its kind of dataset)
from .config import DataConfig
from .datasets import DATA_KINDS, DataError, build_dataset, register_data_kind

__all__ = ["DATA_KINDS", "DataConfig", "DataError", "build_dataset", "register_data_kind"]
