"""Every compatibility shim of the package, each with the release that removes it: the one place to read
(and to empty) when a release drops them. What reads each one is named beside it; tests/test_config.py
fails once the package's version reaches a shim's release. Not here: what lets a checkpoint, an export
or a run written by earlier code load (runs/migrations.py), which no release removes."""

from __future__ import annotations

REMOVED_IN = "0.3"  # the release that stops reading every old spelling below

# Old names of the choice of Z, read with a DeprecationWarning wherever a user names it
# (free_transformer.inference.latents.parse_latents).
DEPRECATED_LATENT_CHOICES = {"posterior": "encoder", "independent": "encoder"}

# Old options of `free-transformer generate`, read with a warning: the option and what replaces it.
DEPRECATED_OPTIONS = {"--prompt-latents": "--latents encoder or --latents prior"}
