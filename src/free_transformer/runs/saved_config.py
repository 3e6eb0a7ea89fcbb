"""What earlier code wrote into a saved config, read in today's names and layouts (the config half of
runs/migrations.py, without torch: a run's config is read, and checked, before any model work). The checkpoint
and Hugging Face loaders and the run config's reader call it; nothing here is removed by a release.

- older field names: SAVED_MODEL_RENAMED (`latent_bits`, before 0.3);
- 0.3's latent section, which held every latent kind's settings section whatever the kind (LATENT_SECTIONS_0_3):
  since 0.4 it holds the chosen kind's only, and the others are dropped.
"""

from __future__ import annotations

# A saved model config's older field names, old -> today's.
SAVED_MODEL_RENAMED = {"latent_bits": "latent_units"}
# The latent kinds' sections that 0.3 wrote into every model config (`latent.categorical`), the kind chosen or
# not; since 0.4 `latent` holds the chosen kind's section only.
LATENT_SECTIONS_0_3 = ("categorical",)


def upgrade_saved_model_config(values: dict) -> dict:
    """A copy of a saved model config (a checkpoint's, a Hugging Face export's) in today's field names and
    layout, for ModelConfig.from_dict: of 0.3's latent kind sections, only the chosen kind's is kept. A field
    given under both names with two values is a one-line ValueError: neither can be chosen in silence."""
    values = dict(values)
    for old, new in SAVED_MODEL_RENAMED.items():
        if old in values:
            value = values.pop(old)
            if new in values and values[new] != value:
                raise ValueError(
                    f"{old} {value!r} and {new} {values[new]!r} are one field under its old and its new name, "
                    f"with two values: keep {new} alone"
                )
            values.setdefault(new, value)
    return _with_todays_latent_section(values)


def upgrade_saved_train_config(values: dict) -> dict:
    """A copy of a run's config (config.yaml, a `-c` file) whose model's latent section is in today's layout.
    Its settings' names are not upgraded: a setting renamed before 0.3 is refused, by name (base/compat.py)."""
    model = values.get("model")
    return {**values, "model": _with_todays_latent_section(model)} if isinstance(model, dict) else dict(values)


def _with_todays_latent_section(model: dict) -> dict:
    """`model` with, of the latent kinds' sections that 0.3 wrote, only the chosen kind's."""
    latent = model.get("latent")
    if not isinstance(latent, dict):
        return model
    kind = latent.get("kind", "binary_mapper")  # 0.3's default kind
    return {
        **model,
        "latent": {key: item for key, item in latent.items() if key == kind or key not in LATENT_SECTIONS_0_3},
    }
