"""Training data: the paper's synthetic letters, the coin-flip example, and the user's own text."""

from .config import DataConfig
from .datasets import DataError, build_dataset

__all__ = ["DataConfig", "DataError", "build_dataset"]
