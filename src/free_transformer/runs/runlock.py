"""One writer per run directory: an advisory lock (`fcntl.flock`) on RUN/.lock, held by whatever writes to
the run (`train`, rank 0 under torchrun). The kernel releases it when its process dies, so a SIGKILLed
run leaves no stale lock; readers (`generate`, `inspect`, `compare`) never take it.

A lock lives on its file's inode: deleting RUN/.lock would let a second writer lock a new file. The holder
therefore checks, at each step (`check`), that RUN/.lock is still the file it locked, and stops if not.
The lock file is never opened through a symbolic link."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..base.errors import UserError
from ..base.fileio import open_no_follow

LOCK_FILE = ".lock"


class RunInUse(UserError, RuntimeError):
    """Another process is writing to this run directory, or it cannot be written at all."""


class RunLock:
    """`with RunLock(run_dir, "train"):` holds the run's lock, or raises RunInUse naming the holder. A run
    directory that the lock had to create and that holds nothing else on exit is removed again, so that
    a start that fails leaves no empty run behind. enabled=False (ranks other than 0) does nothing."""

    def __init__(self, run_dir: str | Path, command: str, *, enabled: bool = True):
        self.run_dir, self.command, self.enabled = Path(run_dir), command, enabled
        self.fd: int | None = None
        self.created = False

    def __enter__(self) -> RunLock:
        if not self.enabled:
            return self
        self.created = not self.run_dir.exists()
        try:  # an unwritable place fails here, before any work
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = open_no_follow(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise RunInUse(f"cannot write to {self.run_dir}: {error.strerror or error}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunInUse(
                f"{self.run_dir} is in use by another process ({holder}): wait for it to end, or stop "
                "it first (a stopped run keeps its checkpoints; continue it with --resume)"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"PID {os.getpid()}, {self.command}\n".encode(), 0)
        self.fd = fd
        return self

    def held(self) -> bool:
        """Whether RUN/.lock is still the file this lock holds (not deleted, not replaced)."""
        try:
            now = os.stat(self.run_dir / LOCK_FILE, follow_symlinks=False)
        except FileNotFoundError:
            return False
        assert self.fd is not None, "held() of a lock not acquired"
        mine = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)

    def check(self) -> None:
        """Raise RunInUse if RUN/.lock was deleted or replaced: another process may be writing to the run."""
        if self.fd is not None and not self.held():
            raise RunInUse(
                f"{self.run_dir / LOCK_FILE} was deleted or replaced while {self.command} wrote to "
                f"{self.run_dir}, so another process may be writing to it: stopped; once no other "
                "process writes there, continue with --resume"
            )

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        if self.created and self.held() and [p.name for p in self.run_dir.iterdir()] == [LOCK_FILE]:
            (self.run_dir / LOCK_FILE).unlink()
            self.run_dir.rmdir()
        os.close(self.fd)  # releases the lock
        self.fd = None
