"""Every compatibility shim of the package, each with the release that removes it: the one place to read
(and to empty) when a release drops them. What reads each one is named beside it; tests/test_config.py
fails once the package's version reaches a shim's release."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Renamed:
    """A setting's old name, still read (with a FutureWarning) until the release `until`; the new name may be
    in another section (a flat field moved into its section: data.path -> data.text.path)."""

    old: str  # dotted path, e.g. "eval_every"
    new: str
    until: str


REMOVED_IN = "0.3"  # the release that stops reading every old spelling below

# Settings renamed or moved (train/config.py reads them, with a FutureWarning): a run's config.yaml written
# by 0.1 (tests/data/legacy-run), and command lines that still use the old names.
RENAMED = (
    Renamed("eval_every", "validate_every", until=REMOVED_IN),
    Renamed("eval_batches", "validation_batches", until=REMOVED_IN),
    # data's flat fields, from before each kind of data had its section
    Renamed("data.path", "data.text.path", until=REMOVED_IN),
    Renamed("data.tokenizer", "data.text.tokenizer", until=REMOVED_IN),
    Renamed("data.seq_len", "data.text.seq_len", until=REMOVED_IN),
    Renamed("data.val_fraction", "data.text.val_fraction", until=REMOVED_IN),
    Renamed("data.cache_dir", "data.text.cache_dir", until=REMOVED_IN),
    Renamed("data.coinflip_length", "data.coinflip.length", until=REMOVED_IN),
    Renamed("data.coinflip_epsilon", "data.coinflip.epsilon", until=REMOVED_IN),
    # H counts bits, dimensions or groups, whatever the kind's unit (also ModelConfig(latent_bits=...))
    Renamed("model.latent_bits", "model.latent_units", until=REMOVED_IN),
)

# Old names of the choice of Z, read with a DeprecationWarning wherever a user names it
# (free_transformer.inference.latents.parse_latents).
DEPRECATED_LATENT_CHOICES = {"posterior": "encoder", "independent": "encoder"}

# Old options of `free-transformer generate`, read with a warning: the option and what replaces it.
DEPRECATED_OPTIONS = {"--prompt-latents": "--latents encoder or --latents prior"}
