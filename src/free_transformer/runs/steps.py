"""How a checkpoint's step names its directory, step_ and 8 digits: torch-free, so that a config's check of
`steps` reads it before anything heavy is imported."""

from __future__ import annotations

import re

STEP_DIR = re.compile(r"^step_(\d{8})$")
MAX_STEP = 10**8 - 1  # the largest step whose directory STEP_DIR matches
