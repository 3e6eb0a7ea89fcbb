"""Running untrusted generated code: a confined, time- and memory-limited child process.

Every program runs as `python -I -S -B` (isolated mode: no user site, no PYTHON* variables, no
site-packages) in a new session, with stdin closed, a minimal environment (PATH=/usr/bin:/bin and
nothing else of the user's), and a fresh temporary working directory that is deleted afterwards.
A wall-clock timeout kills the whole process group. Inside the child, `sandbox_guard.py` adds, where
the kernel allows: a read-only file tree except the work directory and no network (user, mount and
network namespaces), resource limits (CPU, memory, file size, open files, processes), a seccomp
filter (no fork, exec, sockets, mounts, ptrace, signals to others), and a Python audit hook (no
sockets, subprocesses, ctypes, tracing, or writes outside the work directory). `SandboxResult.isolation`
says which layers were in force; docs/evaluation.md states what this does and does not guarantee.
A program passes only when it ran to its end: the guard then reports a nonce the program never sees.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .sandbox_guard import REPORT_PREFIX

GUARD = Path(__file__).with_name("sandbox_guard.py")


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    """Wall-clock seconds before the process group is killed."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) of the program."""
    file_size_mb: int = 16
    """Largest file the program may write, its stdout and stderr included (RLIMIT_FSIZE)."""
    open_files: int = 64
    """RLIMIT_NOFILE."""
    processes: int = 1
    """RLIMIT_NPROC (counts the user's processes; not enforced for root, where seccomp stops fork)."""
    output_chars: int = 4000
    """How much of stdout / stderr is kept in the result."""
    namespaces: bool = True
    """Try user + mount + network namespaces (read-only files, no network)."""
    seccomp: bool = True
    """Try the seccomp filter."""

    def check(self) -> SandboxLimits:
        """A one-line ValueError, naming the field, for a limit that would fail every program (pass@1 = 0)."""
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        for name in ("memory_mb", "file_size_mb", "open_files", "processes", "output_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        return self
    audit_hook: bool = True
    """Install the Python audit hook (turned off only to test the kernel layers on their own)."""

    def rlimits(self) -> dict:
        return {
            "RLIMIT_CPU": max(1, math.ceil(self.timeout_s)),
            "RLIMIT_AS": self.memory_mb * 2**20,
            "RLIMIT_FSIZE": self.file_size_mb * 2**20,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_CORE": 0,
            "RLIMIT_NPROC": self.processes,
        }


@dataclass
class SandboxResult:
    status: str  # "passed" (ran to its end, exit 0), "failed" (anything else), "timeout"
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolation: dict = field(default_factory=dict)  # layers reported by the guard

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _tail(path: Path, limit: int) -> str:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        handle.seek(max(0, size - limit))
        return handle.read().decode("utf-8", errors="replace")


def run_python(source: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run a Python program confined as described above; never raises for anything the program does."""
    limits = limits or SandboxLimits()
    root = Path(tempfile.mkdtemp(prefix="ft-sandbox-"))
    try:
        work = root / "work"
        work.mkdir()
        program = root / "program.py"  # outside the writable directory
        program.write_text(source, encoding="utf-8")
        # A program passes only when the guard reports that it ran to its end: an exit status of 0
        # alone could come from the program exiting before its tests. The report is a nonce the
        # program cannot know: it travels through a pipe the guard reads and closes first.
        nonce = secrets.token_hex(16).encode()
        nonce_fd, nonce_writer = os.pipe()
        os.write(nonce_writer, nonce)
        os.close(nonce_writer)
        started = time.monotonic()
        with (open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err,
              open(root / "report", "wb") as report):
            config = {"work_dir": str(work), "program": str(program), "limits": limits.rlimits(),
                      "namespaces": limits.namespaces, "seccomp": limits.seccomp, "audit_hook": limits.audit_hook,
                      "nonce_fd": nonce_fd, "report_fd": report.fileno()}
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", str(GUARD), json.dumps(config)],
                    cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    start_new_session=True, close_fds=True, pass_fds=(nonce_fd, report.fileno()),
                )
            finally:
                os.close(nonce_fd)
            timed_out, returncode = False, None
            try:
                returncode = proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:  # also when this process is stopped (eval's SIGTERM / SIGINT): no child outlives it
                try:  # the whole group: anything the program managed to start goes too
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        duration = time.monotonic() - started
        stderr = _tail(root / "stderr", limits.output_chars + 4096)
        isolation = {}
        first, _, rest = stderr.partition("\n")
        if first.startswith(REPORT_PREFIX):
            isolation, stderr = json.loads(first[len(REPORT_PREFIX) :]), rest
        # RLIMIT_CPU is derived from the timeout: a CPU-bound program can reach it (SIGXCPU) a moment
        # before the wall clock does, and that is the same verdict.
        timed_out = timed_out or returncode == -signal.SIGXCPU
        finished = (root / "report").read_bytes() == nonce
        status = "timeout" if timed_out else ("passed" if returncode == 0 and finished else "failed")
        return SandboxResult(status, returncode, _tail(root / "stdout", limits.output_chars),
                             stderr[-limits.output_chars :], duration, isolation)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def isolation_report(limits: SandboxLimits | None = None) -> dict:
    """The layers a sandboxed program gets on this machine, probed with an empty program."""
    return run_python("pass\n", limits).isolation
