"""The package version: CHANGELOG.md has an entry for it; pyproject.toml reads it from here."""

__version__ = "0.4.0"
