"""Training data: the paper's synthetic letters, the coin-flip example, documents in files of many
formats or a named corpus (text), and pre-tokenized shards (tokens).

The names below are imported on first use (PEP 562): the data settings (`data.config`) are read without
loading torch, as a command's --help does."""

import importlib

_EXPORTS = {
    "DataConfig": "config",
    "DATA_KINDS": "datasets",
    "DataError": "datasets",
    "build_dataset": "datasets",
    "register_data_kind": "datasets",
}
__all__ = sorted(_EXPORTS)  # noqa: PLE0605 (the names below are imported on first use)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'free_transformer.data' has no attribute {name!r}")
    if _EXPORTS[name] == "datasets":  # the kinds defined in modules of their own register on import
        from . import shards, text  # noqa: F401
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
