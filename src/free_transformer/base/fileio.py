"""Small file helpers that survive a process killed at any moment, never write through a symbolic
link (a link planted in a run directory must not make a run write, or replace, a file outside it), and read
only regular files (a FIFO in the place of a file would block its reader forever)."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

from .errors import UserError


class SymlinkRefused(UserError, RuntimeError):
    """A file to be written is a symbolic link."""


class NotARegularFile(UserError, ValueError):
    """A file to be read is a FIFO, a device, a socket or a directory."""


def regular_file(path: str | Path) -> Path:
    """`path`, once os.stat (through links) says it is a regular file, before anything opens it: a FIFO would
    block its reader until another process writes, a device never end. FileNotFoundError when it is absent."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
        raise NotARegularFile(f"{path} is {kind}, not a regular file: only regular files are read")
    return Path(path)


def open_no_follow(path: str | Path, flags: int, mode: int = 0o666) -> int:
    """os.open that refuses a symbolic link at `path` (O_NOFOLLOW) with a one-line error."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise SymlinkRefused(f"{path} is a symbolic link: not written through; remove it, then run again") from None


def refuse_links(path: str | Path, root: str | Path) -> Path:
    """`path`, once no component of it below `root` (a run directory, which may itself be a link the
    user made) is a symbolic link: SymlinkRefused names the first one. A planted `RUN/checkpoints` or
    `RUN/eval` link would otherwise take a run's writes, and its checkpoint rotation's deletions,
    outside the run. Components that do not exist yet are created as directories by the caller."""
    path, root = Path(path), Path(root)
    current = root
    for part in path.relative_to(root).parts:
        current = current / part
        if current.is_symlink():
            raise SymlinkRefused(
                f"{current} is a symbolic link: nothing in a run is read or written through "
                "one; remove it, then run again"
            )
        if not current.exists():
            break
    return path


def open_append(path: str | Path):
    """`path` opened to append text (created if missing), never through a symbolic link."""
    return os.fdopen(open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temporary sibling, flush it to disk, then rename over `path`: readers see the old
    file or the new one, never a half-written one. A symbolic link at `path` is refused, not replaced."""
    path = Path(path)
    if path.is_symlink():
        raise SymlinkRefused(f"{path} is a symbolic link: not replaced; remove it, then run again")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)  # a leftover (or a planted link) of an earlier process with this pid
    try:
        with os.fdopen(open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. a full disk: leave no stray temporary file
        raise


def remove_stale_partials(folder: Path, pattern: str) -> None:
    """Delete the files matching `pattern` in `folder` named NAME.partialPID whose process no longer runs
    (one killed by SIGKILL mid-write); those of live processes are theirs."""
    for path in folder.glob(pattern) if folder.is_dir() else []:
        pid = path.suffix.removeprefix(".partial")
        if pid.isdigit() and not _running(int(pid)):
            path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def share_like_umask(path: str | Path) -> None:
    """Give a file or directory tree the permissions an ordinary `open` / `mkdir` would (0666 / 0777 less
    the umask): tempfile.mkdtemp makes 0700 directories and safetensors 0600 files, which other users of a
    shared checkpoint folder could not read."""
    mask = _umask()
    path = Path(path)
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)
