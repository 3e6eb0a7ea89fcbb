"""What 0.3 stopped reading, kept only so that an error names today's spelling: a release reads today's names
alone, and an old one is refused in one line that gives its replacement. Not here: what lets a checkpoint, an
export or a run's metrics written by earlier code load (runs/migrations.py), which no release removes."""

from __future__ import annotations

# Settings renamed or moved before 0.3 (a YAML config, a command line's section.field=value, a run's
# config.yaml): base/settings.unknown_setting names the new one.
SETTINGS_RENAMED = {
    "eval_every": "validate_every",
    "eval_batches": "validation_batches",
    # data's flat fields, from before each kind of data had its section
    "data.path": "data.text.path",
    "data.tokenizer": "data.text.tokenizer",
    "data.seq_len": "data.text.seq_len",
    "data.val_fraction": "data.text.val_fraction",
    "data.cache_dir": "data.text.cache_dir",
    "data.coinflip_length": "data.coinflip.length",
    "data.coinflip_epsilon": "data.coinflip.epsilon",
    # H counts bits, dimensions or groups, whatever the kind's unit
    "model.latent_bits": "model.latent_units",
}

# Command-line options renamed in 0.4 (cli.parse_args names the new one).
OPTIONS_RENAMED = {"--latent-bits": "--latent-units"}

# Names of the choice of Z read until 0.3 (base/latent_choice.LatentChoice.parse names the new one).
LATENT_CHOICES_RENAMED = {"posterior": "encoder", "independent": "encoder"}
