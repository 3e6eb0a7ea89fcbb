"""The error of a training that cannot start or go on: torch-free, so that the command raises it before the
trainer is imported."""

from __future__ import annotations

from ..base.errors import UserError


class TrainingError(UserError, RuntimeError):
    """Training cannot start or cannot go on (existing run, diverged loss)."""
