"""Running untrusted generated code: a confined, time- and memory-limited child process.

Every program runs as `python -I -S -B` (isolated mode: no user site, no PYTHON* variables, no
site-packages) in a new session, with stdin closed, a minimal environment (PATH=/usr/bin:/bin and
nothing else of the user's), and a fresh temporary working directory that is deleted afterwards.
A wall-clock timeout kills the whole process group. Inside the child, `sandbox_guard.py` adds a
read-only file tree except the work directory, no network, and no other process in sight (user,
mount, network and PID namespaces, as an ordinary user without capabilities), resource limits (CPU,
memory, file size, open files, processes), a seccomp filter (no fork, exec, sockets, mounts, ptrace;
signals, rlimits, priorities, affinity and scheduling for the program's own process only), and a
Python audit hook (no sockets, subprocesses, ctypes, tracing, other processes' limits, or writes
outside the work directory). Where the kernel gives no namespaces or
seccomp, nothing runs (SandboxUnavailable) unless `allow_hook_only` says so.
`SandboxResult.isolation` says which layers were in force, as the guard reported them on a pipe of its
own that it closes before the program runs (so no program's output or exit status can forge a report
or a refusal); docs/evaluation.md states what this does and does not guarantee.

`Sandbox` keeps the program running and calls its functions: arguments go in and results come back
as plain values (`plain.py`), so whoever calls can judge them without running any of its code.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..base.errors import UserError
from . import plain
from .plain import NotPlain

GUARD = Path(__file__).with_name("sandbox_guard.py")
CODEC = Path(plain.__file__)
PREFIX = "ft-sandbox-"
ENABLE = {  # what gives each kernel layer to an unprivileged process
    "namespaces": (
        "unprivileged user namespaces (sysctl user.max_user_namespaces > 0; "
        "kernel.unprivileged_userns_clone=1 where it exists; kernel.apparmor_restrict_unprivileged_userns=0 "
        "on Ubuntu 23.10+; a container whose seccomp profile allows unshare)"
    ),
    "seccomp": "a kernel with CONFIG_SECCOMP_FILTER (and a container that allows nested seccomp filters)",
}


class SandboxUnavailable(UserError):
    """The kernel layers generated code needs are missing and hook-only mode was not asked for."""


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
    """Try user + mount + network + PID namespaces (read-only files, no network, no other process)."""
    seccomp: bool = True
    """Try the seccomp filter."""

    audit_hook: bool = True
    """Install the Python audit hook (turned off only to test the kernel layers on their own)."""
    allow_hook_only: bool = False
    """Run generated code even where the kernel gives no namespaces or seccomp (or they are turned
    off above), with the resource limits and the Python audit hook alone. The hook is no security
    boundary (PEP 578): a program can undo it (re-import `posix`, `_posixsubprocess`, race a rename),
    write anywhere the user can and reach the network. Only for code you would run anyway."""
    reply_mb: int = 64
    """Largest answer (one call's result, as text) read back from the program."""

    def check(self) -> SandboxLimits:
        """A one-line ValueError, naming the field, for a limit that would fail every program (pass@1 = 0)."""
        if not 0 < self.timeout_s < math.inf:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")
        for name in ("memory_mb", "file_size_mb", "open_files", "processes", "output_chars", "reply_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        return self

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
    status: str  # "passed", "failed" or "timeout"; run_python: "passed" means exit status 0, nothing more
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolation: dict = field(default_factory=dict)  # layers reported by the guard
    reason: str = ""  # why it failed, when it did (check_completion)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _tail(path: Path, limit: int) -> str:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        handle.seek(max(0, size - limit))
        return handle.read().decode("utf-8", errors="replace")


class Timeout(Exception):
    """The program ran past its wall-clock limit."""


class Broken(Exception):
    """The program stopped answering (it exited or closed its descriptors) or sent what is no answer."""


# Live sandboxes of this process, cleaned up by the SIGTERM handler below
_LIVE: set = set()
_LIVE_LOCK = threading.RLock()  # re-entered when the handler runs in a thread holding it
_DEFAULT_HANDLER: list = []  # the SIGTERM handler to restore, while ours is installed


def _on_sigterm(signum, frame) -> None:
    """SIGTERM while sandboxes run and the caller kept the default action: kill them and remove their
    directories, then die of SIGTERM as the default action would."""
    for box in list(_LIVE):
        box.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _track(box, alive: bool) -> None:
    """Keep `box` in _LIVE; in the main thread, with SIGTERM at its default action, catch it while any
    box is live. (In other threads, a killed caller's program dies with it (PR_SET_PDEATHSIG) and the
    next sandbox removes the directory of a process that no longer runs.)"""
    with _LIVE_LOCK:
        (_LIVE.add if alive else _LIVE.discard)(box)
        if threading.current_thread() is not threading.main_thread():
            return
        if alive and not _DEFAULT_HANDLER and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            _DEFAULT_HANDLER.append(signal.signal(signal.SIGTERM, _on_sigterm))
        elif not _LIVE and _DEFAULT_HANDLER and signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, _DEFAULT_HANDLER.pop())


def _remove_orphans() -> None:
    """Directories of sandboxes whose process died before it could remove them (named by its PID)."""
    for path in Path(tempfile.gettempdir()).glob(PREFIX + "*-*"):
        pid = path.name[len(PREFIX) :].partition("-")[0]
        try:
            if not pid.isdigit() or path.lstat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


class Sandbox:
    """One confined run of `source`. With `names`, the program stays alive once it has run and
    `call(name, *args)` calls its function `name`; `names` maps each of those names that the
    program defines to ("callable",), ("module", module name) or ("value", plain value).

        with Sandbox(source, limits, names=["f"]) as box:
            box.call("f", 1, 2)     # a plain value, or the program's exception raised again here
            result = box.result("passed")   # "failed" / "timeout" instead when a call went wrong
    """

    def __init__(self, source: str, limits: SandboxLimits | None = None, names: list[str] | None = None):
        self.limits = limits or SandboxLimits()
        self.source, self.wanted = source, names
        self.names: dict = {}
        self.isolation: dict = {}  # the guard's report of the layers in force
        self.failure: tuple[str, str] | None = None  # (status, reason) of the first call that went wrong
        self.proc: subprocess.Popen[bytes] | None = None  # the guard's process, once started
        self.root: Path | None = None  # the run's temporary directory, once made
        self._buffer = b""
        self._closed = False

    def __enter__(self) -> Sandbox:
        _remove_orphans()
        _track(self, True)
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        limits = self.limits
        self.root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        work = self.root / "work"
        work.mkdir()
        program = self.root / "program.py"  # outside the writable directory
        program.write_text(self.source, encoding="utf-8")
        config = {
            "work_dir": str(work),
            "program": str(program),
            "limits": limits.rlimits(),
            "namespaces": limits.namespaces,
            "seccomp": limits.seccomp,
            "audit_hook": limits.audit_hook,
            "require": [] if limits.allow_hook_only else ["namespaces", "seccomp"],
            "parent": os.getpid(),
        }
        report_r, report_w = os.pipe()
        passed = [report_w]
        config["report_fd"] = report_w
        if self.wanted is not None:
            requests_r, self._requests = os.pipe()
            self._replies, replies_w = os.pipe()
            passed += [requests_r, replies_w]
            config.update(serve=True, codec=str(CODEC), names=self.wanted, requests_fd=requests_r, replies_fd=replies_w)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}
        self.started = time.monotonic()
        self.deadline = self.started + limits.timeout_s
        try:
            with open(self.root / "stdout", "wb") as out, open(self.root / "stderr", "wb") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-B", str(GUARD), json.dumps(config)],
                    cwd=work,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=passed,
                )
        finally:
            for fd in passed:
                os.close(fd)
        try:
            report = self._report(report_r)
        finally:
            os.close(report_r)
        if report is None:
            return self._fail("timeout", f"the sandbox was not ready within the time limit of {limits.timeout_s} s")
        self.isolation = report
        if report.get("missing"):
            enable = " and ".join(ENABLE[m.partition(" ")[0]] for m in report["missing"])
            raise SandboxUnavailable(
                f"generated code is not run without kernel isolation, and this machine gives no "
                f"{' and no '.join(report['missing'])}: enable {enable}; or accept the Python audit hook alone, which "
                "is no security boundary (eval --sandbox-hook-only, SandboxLimits(allow_hook_only=True))"
            )
        if self.wanted is not None:
            os.set_blocking(self._requests, False)
            try:
                reply = self._reply()
            except Timeout:
                return self._fail("timeout", f"the program ran past the time limit of {limits.timeout_s} s")
            except Broken as error:
                return self._fail("failed", str(error))
            if reply is None or reply[0] != "names":
                return self._fail("failed", "the program ended before any call (an exception, or an exit)")
            self.names = reply[1]

    def _report(self, fd: int) -> dict | None:
        """The guard's report, read until the guard closes its end (before the program runs); {} when the
        guard ended without one, None past the deadline."""
        text = b""
        while True:
            try:
                self._wait(fd, False)
            except Timeout:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk or len(text) > 1 << 20:
                break
            text += chunk
        try:
            report = json.loads(text)
        except ValueError:
            return {}
        return report if isinstance(report, dict) else {}

    def _wait(self, fd: int, writing: bool) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise Timeout()
        ready = select.select([], [fd], [], remaining) if writing else select.select([fd], [], [], remaining)
        if not any(ready):
            raise Timeout()

    def _reply(self):
        """The next answer line, decoded; None at the end of the program's answers."""
        limit = self.limits.reply_mb * 2**20
        while b"\n" not in self._buffer:
            self._wait(self._replies, False)
            chunk = os.read(self._replies, 2**20)
            if not chunk:
                return None
            self._buffer += chunk
            if len(self._buffer) > limit:
                raise Broken(f"an answer longer than {self.limits.reply_mb} MB")
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            reply = plain.decode(line, self.deadline)
        except plain.Overdue:
            raise Timeout() from None
        except ValueError as error:
            raise Broken(f"an answer that is not a plain value: {error}") from None
        shapes = {"names": (dict,), "value": (object,), "raised": (str, str), "not plain": (str,)}
        kind = reply[0] if type(reply) is tuple and reply else None
        if (
            kind not in shapes
            or len(reply) != 1 + len(shapes[kind])
            or not all(isinstance(x, t) for x, t in zip(reply[1:], shapes[kind]))
        ):
            raise Broken("an answer of another shape")
        return reply

    @property
    def channel(self) -> tuple[int, ...]:
        """The descriptors of the calls (requests written, replies read), which a process forked to go on
        calling keeps."""
        return tuple(fd for fd in (getattr(self, "_requests", None), getattr(self, "_replies", None)) if fd is not None)

    def call(self, name: str, *args):
        """The program's `name(*args)` as a plain value. Raises the program's exception (candidate_error),
        NotPlain (arguments or a result that are not plain values), Timeout or Broken; the first of the
        last three is also kept in `failure` (a test may catch what it raises)."""
        try:
            return self._call(name, args)
        except Timeout:
            self._fail("timeout", f"{name} ran past the time limit of {self.limits.timeout_s} s")
            raise
        except (Broken, NotPlain) as error:
            self._fail("failed", f"{name}: {error}")
            raise

    def _fail(self, status: str, reason: str) -> None:
        self.failure = self.failure or (status, reason)

    def _call(self, name: str, args: tuple):
        if self.failure:
            raise Broken(self.failure[1])
        request = (plain.encode(("call", name, args)) + "\n").encode()
        try:
            while request:
                self._wait(self._requests, True)
                request = request[os.write(self._requests, request) :]
        except OSError:
            raise Broken("the program stopped taking calls") from None
        reply = self._reply()
        if reply is None:
            raise Broken(f"the program ended during its call of {name}")
        if reply[0] == "value":
            return reply[1]
        if reply[0] == "raised":
            if reply[1] in CONTROL_FLOW:
                raise Broken(f"it raised {reply[1]}, which would steer the test's own control flow")
            raise candidate_error(reply[1], reply[2])
        raise NotPlain(f"it returned a {reply[1]}")

    def wait(self) -> int | None:
        """The program's exit status once it ends by itself; None when it ran past the time limit."""
        assert self.proc is not None, "wait() inside `with Sandbox(...)` only"
        try:
            return self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def result(self, status: str, reason: str = "") -> SandboxResult:
        """Stops the program; its output, the layers in force, and `status` (or the `failure` of a call)."""
        assert self.proc is not None and self.root is not None, "result() inside `with Sandbox(...)` only"
        status, reason = self.failure or (status, reason)
        self._kill()
        return SandboxResult(
            status,
            self.proc.returncode,
            _tail(self.root / "stdout", self.limits.output_chars),
            _tail(self.root / "stderr", self.limits.output_chars),
            time.monotonic() - self.started,
            self.isolation,
            reason,
        )

    def _kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the whole group: what it started goes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        """Kill the program's process group and remove its directory (also from a signal handler)."""
        if self._closed:
            return
        self._closed = True
        self._kill()
        for fd in (getattr(self, "_requests", None), getattr(self, "_replies", None)):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        _track(self, False)


class CandidateError(Exception):
    """An exception of the generated code, raised again in the evaluating process by name and message."""


CONTROL_FLOW = frozenset({"StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit"})
"""Exceptions that steer the caller (an iteration that ends, a generator closed, a process stopped): a
candidate's never reaches the test, where `all(map(candidate, xs))` would take it for the end of `xs`."""


def candidate_error(name: str, message: str) -> Exception:
    """The built-in exception `name` with `message` (a test may expect one); CandidateError otherwise.
    Never one of CONTROL_FLOW (Sandbox.call makes those a failure of the program)."""
    import builtins

    kind = getattr(builtins, name, None)
    if name not in CONTROL_FLOW and isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:
            pass
    return CandidateError(f"{name}: {message}")


def run_python(source: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run a Python program confined as described above; never raises for anything the program does.
    status "passed" means only that it exited with status 0 (a program can exit whenever it likes):
    a verdict on generated code comes from programs.check_completion."""
    with Sandbox(source, limits) as box:
        returncode = box.wait()
        # RLIMIT_CPU is derived from the timeout: a CPU-bound program can reach it (SIGXCPU) a moment
        # before the wall clock does, and that is the same verdict.
        timed_out = returncode is None or returncode == -signal.SIGXCPU
        return box.result("timeout" if timed_out else ("passed" if returncode == 0 else "failed"))


def isolation_report(limits: SandboxLimits | None = None) -> dict:
    """The layers a sandboxed program gets on this machine, probed with an empty program."""
    return run_python("pass\n", limits).isolation


# layers the kernel may refuse while the sandbox still runs: what each one's absence leaves the program
WEAKER_WITHOUT = {
    "pid_namespace": "no PID namespace (the program sees and may signal this user's other processes)",
    "own_proc": "no private /proc (the program reads the host's)",
}


def weaker_layers(report: dict) -> list[str]:
    """What the sandbox of `report` (`isolation_report`) runs without, among the layers the kernel may refuse
    while generated code still runs (WEAKER_WITHOUT): one phrase each, none when every one is in force."""
    return [phrase for layer, phrase in WEAKER_WITHOUT.items() if layer in report and not report[layer]]
