"""Runs inside the sandbox's child process (standard library only): confines the process, then
executes the untrusted program. Started by sandbox.py as `python -I -S -B sandbox_guard.py CONFIG`.

Layers, each applied when the kernel allows it and reported as one JSON object on the report
descriptor (CONFIG's `report_fd`), which the guard closes before the program runs: no program can
write a report, whatever it prints or however it exits:
1. namespaces: a new user + mount + network + PID namespace; inside, the program is an ordinary user
   (uid and gid SANDBOX_ID, no capabilities), the whole file tree is remounted read-only except the
   work directory, /proc shows the namespace's processes only, and the network namespace has no
   usable interface (loopback down). In its PID namespace the program sees, and so can signal, limit
   or renice, no process but its own: the guard forks the namespace's init, which forks the program
   and hands its exit status back (as bubblewrap and nsjail do);
2. resource limits: CPU seconds, address space, file size, open files, no core dumps, processes;
3. seccomp: no new processes (threads allowed), no exec, no sockets, no mount / namespace / ptrace
   / io_uring calls, and no call that names another process: signals, rlimits, priorities, CPU
   affinity, scheduling, I/O priority and page moves only for itself (so without namespaces too);
4. a Python audit hook: refuses sockets, subprocesses, ctypes, tracing, directory descriptors,
   rlimits of other processes, and writes outside the work directory (paths resolved against their
   dir_fd); calls without an audit event (mkfifo, mknod, fork_exec, pidfd_send_signal, pidfd_open,
   setpriority, sched_setaffinity, sched_setscheduler, sched_setparam) are replaced by a refusal.
The layers CONFIG requires (namespaces, seccomp) must be in force, or the program never runs (exit
REFUSED). The guard also dies with the process that started it (PR_SET_PDEATHSIG).

With `serve` in CONFIG, once the program has run the guard answers calls of its functions: each
request is one line (`plain.encode(("call", name, args))`) on one descriptor, each answer one line
(`("value", v)`, `("raised", type name, message)` or `("not plain", why)`) on another. Nothing here decides whether the
program is right: the evaluating process does, from the plain values it gets back.
"""

import json
import os
import resource
import select
import signal
import stat
import sys

SANDBOX_ID = 1000
"""The program's uid and gid inside its user namespace: an ordinary user, not the caller's identity."""


def enter_namespaces(work: str) -> dict:
    """User + mount + network + PID namespaces (PID only where the kernel allows it); everything
    read-only except `work`. The PID namespace applies to the children forked after (island())."""
    import ctypes  # only here: the program gets no ready-made ctypes (main() unloads it)

    libc = ctypes.CDLL(None, use_errno=True)
    report: dict[str, bool | str] = {"network_namespace": False, "read_only_fs": False, "pid_namespace": False}
    uid, gid = os.getuid(), os.getgid()
    CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x00020000, 0x10000000, 0x40000000, 0x20000000
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET
    if libc.unshare(flags | CLONE_NEWPID) == 0:
        report["pid_namespace"] = True
    elif libc.unshare(flags) != 0:
        report["error"] = f"unshare: {os.strerror(ctypes.get_errno())}"
        return report
    try:  # the caller's ids seen as SANDBOX_ID inside: files keep their owners outside
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{SANDBOX_ID} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{SANDBOX_ID} {gid} 1")
    except OSError as error:
        report["error"] = f"id maps: {error}"
    report["network_namespace"] = True
    MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
    AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY, SYS_MOUNT_SETATTR = -100, 0x8000, 0x1, 442

    class MountAttr(ctypes.Structure):
        _fields_ = [
            ("attr_set", ctypes.c_uint64),
            ("attr_clr", ctypes.c_uint64),
            ("propagation", ctypes.c_uint64),
            ("userns_fd", ctypes.c_uint64),
        ]

    def check(result, what):
        if result != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    try:  # private first: nothing done here may propagate to the host's mounts
        check(libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        check(libc.mount(work.encode(), work.encode(), None, MS_BIND | MS_REC, None), "bind work dir")
        read_only, writable = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0), MountAttr(0, MOUNT_ATTR_RDONLY, 0, 0)
        syscall = libc.syscall
        check(
            syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(read_only), ctypes.sizeof(read_only)),
            "read-only /",
        )
        check(
            syscall(SYS_MOUNT_SETATTR, AT_FDCWD, work.encode(), 0, ctypes.byref(writable), ctypes.sizeof(writable)),
            "writable work dir",
        )
        report["read_only_fs"] = True
    except OSError as error:
        report["error"] = str(error)
    return report


def set_limits(limits: dict) -> dict:
    applied = {}
    for name, value in limits.items():
        which = getattr(resource, name)
        try:
            hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU first, then SIGKILL
            resource.setrlimit(which, (value, hard))
            applied[name] = value
        except (ValueError, OSError) as error:
            applied[name] = f"failed: {error}"
    return applied


def island(passed: list) -> dict:
    """In a new PID namespace (after enter_namespaces): fork the namespace's init, which forks the
    program's process; returns only there. The guard (outside the namespace) and init hold none of the
    `passed` descriptors, wait, and end as the program ended (its exit status or its signal); when init
    ends, the kernel kills whatever is left in the namespace."""
    status_r, status_w = os.pipe()  # init -> guard: the program's wait status
    alive_r, alive_w = os.pipe()  # EOF in init once the guard is gone
    init = os.fork()
    if init:
        for fd in [*passed, status_w, alive_r]:
            os.close(fd)
        os.waitpid(init, 0)
        text = os.read(status_r, 64)
        end_as(int(text) if text.strip().isdigit() else 1 << 8)  # init killed before it said: exit code 1
    os.close(status_r)
    os.close(alive_w)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if select.select([alive_r], [], [], 0)[0]:  # the guard died before the setting
        os._exit(REFUSED)
    os.close(alive_r)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no process of the user reads or writes init's memory
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
    proc = libc.mount(b"proc", b"/proc", b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0
    report: dict = {"own_proc": proc}
    if not proc:  # (a container may forbid it) the host's /proc stays, read-only
        report["proc_error"] = os.strerror(ctypes.get_errno())
    program = os.fork()
    if program == 0:
        os.close(status_w)
        return report
    for fd in passed:
        os.close(fd)
    while True:  # init reaps every child; the program is the one that counts
        pid, status = os.wait()
        if pid == program:
            break
    os.write(status_w, str(status).encode())
    os._exit(0)


def end_as(status: int) -> None:
    """Exit as a child with wait status `status` did: with its exit code, or killed by its signal."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def drop_capabilities() -> bool:
    """Empty effective, permitted and inheritable capability sets (the creator of a user namespace has
    them all inside it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    return libc.capset(header, data) == 0


# Denied system calls per architecture: (audit arch, {name: number}).
_ARCHES = {
    "x86_64": (
        0xC000003E,
        dict(
            socket=41,
            socketpair=53,
            fork=57,
            vfork=58,
            execve=59,
            execveat=322,
            ptrace=101,
            chroot=161,
            mount=165,
            umount2=166,
            pivot_root=155,
            tkill=200,
            add_key=248,
            request_key=249,
            keyctl=250,
            unshare=272,
            perf_event_open=298,
            setns=308,
            process_vm_readv=310,
            process_vm_writev=311,
            bpf=321,
            userfaultfd=323,
            kexec_load=246,
            open_by_handle_at=304,
            name_to_handle_at=303,
            kcmp=312,
        ),
    ),
    "aarch64": (
        0xC00000B7,
        dict(
            socket=198,
            socketpair=199,
            execve=221,
            execveat=281,
            ptrace=117,
            chroot=51,
            mount=40,
            umount2=39,
            pivot_root=41,
            tkill=130,
            add_key=217,
            request_key=218,
            keyctl=219,
            unshare=97,
            perf_event_open=241,
            setns=268,
            process_vm_readv=270,
            process_vm_writev=271,
            bpf=280,
            userfaultfd=282,
            kexec_load=104,
            open_by_handle_at=265,
            name_to_handle_at=264,
            kcmp=272,
        ),
    ),
}
# Calls that name a process (its id in their first argument), allowed for this process only.
_ARCH_CALLS = {
    "x86_64": dict(
        clone=56,
        kill=62,
        tgkill=234,
        rt_sigqueueinfo=129,
        rt_tgsigqueueinfo=297,
        prlimit64=302,
        setpriority=141,
        sched_setaffinity=203,
        sched_setscheduler=144,
        sched_setparam=142,
        sched_setattr=314,
        ioprio_set=251,
        migrate_pages=256,
        move_pages=279,
    ),
    "aarch64": dict(
        clone=220,
        kill=129,
        tgkill=131,
        rt_sigqueueinfo=138,
        rt_tgsigqueueinfo=240,
        prlimit64=261,
        setpriority=140,
        sched_setaffinity=122,
        sched_setscheduler=119,
        sched_setparam=118,
        sched_setattr=274,
        ioprio_set=30,
        migrate_pages=238,
        move_pages=239,
    ),
}
# Numbers shared by every architecture since Linux 5.1.
_COMMON_DENIED = dict(
    pidfd_send_signal=424,
    io_uring_setup=425,
    io_uring_enter=426,
    io_uring_register=427,
    open_tree=428,
    move_mount=429,
    fsopen=430,
    fsconfig=431,
    fsmount=432,
    fspick=433,
    pidfd_open=434,
    pidfd_getfd=438,
    process_madvise=440,
    process_mrelease=448,
    mount_setattr=442,
)
CLONE3 = 435


def own_process_rules(pid: int) -> dict:
    """For each call of _ARCH_CALLS but clone: the (argument index, allowed values) pairs that keep it
    to process `pid` itself (its id, or 0 where 0 means the caller). Signals go to `pid` only: 0 would
    reach its process group, which the guard outside the PID namespace shares."""
    itself, own = {pid}, {0, pid}
    PRIO_PROCESS, IOPRIO_WHO_PROCESS = 0, 1
    rules = {name: [(0, own)] for name in ("prlimit64", "sched_setaffinity", "sched_setscheduler")}
    rules.update({name: [(0, own)] for name in ("sched_setparam", "sched_setattr", "migrate_pages", "move_pages")})
    rules.update({name: [(0, itself)] for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")})
    rules["setpriority"] = [(0, {PRIO_PROCESS}), (1, own)]  # not a process group, not a user
    rules["ioprio_set"] = [(0, {IOPRIO_WHO_PROCESS}), (1, own)]
    return rules


def install_seccomp() -> dict:
    machine = os.uname().machine
    if machine not in _ARCHES:
        return {"seccomp": False, "error": f"no filter for architecture {machine}"}
    audit_arch, denied = _ARCHES[machine]
    calls = _ARCH_CALLS[machine]
    denied = {**denied, **_COMMON_DENIED}
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, KILL = 0x7FFF0000, 0x80000000
    ERRNO = 0x00050000
    EPERM, EAGAIN, ENOSYS = 1, 11, 38
    CLONE_THREAD = 0x00010000
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, audit_arch), (RET, 0, 0, KILL), (LD, 0, 0, 0)]
    if machine == "x86_64":  # the x32 ABI's numbers alias ours with bit 30 set
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, ERRNO | EPERM)]
    for nr in denied.values():
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, ERRNO | EPERM)]
    prog += [(JEQ, 0, 1, CLONE3), (RET, 0, 0, ERRNO | ENOSYS)]  # libc falls back to clone
    # clone: only threads (CLONE_THREAD in the flags, args[0]), no new process
    prog += [
        (JEQ, 0, 4, calls["clone"]),
        (LD, 0, 0, 16),
        (JSET, 0, 1, CLONE_THREAD),
        (RET, 0, 0, ALLOW),
        (RET, 0, 0, ERRNO | EAGAIN),
    ]
    for name, conditions in own_process_rules(os.getpid()).items():
        # each condition: load the argument's low 32 bits (args[i] at 16 + 8 i; the kernel reads these
        # ids as 32-bit ints), a match among its values skips to the next condition, no match refuses
        block = []
        for arg, values in conditions:
            block.append((LD, 0, 0, 16 + 8 * arg))
            block += [(JEQ, len(values) - i, 0, value) for i, value in enumerate(sorted(values))]
            block.append((RET, 0, 0, ERRNO | EPERM))
        block.append((RET, 0, 0, ALLOW))
        prog += [(JEQ, 0, len(block), calls[name])] + block  # other calls skip it, their number still loaded
    prog += [(RET, 0, 0, ALLOW)]
    error = install_filter(prog)
    return {"seccomp": False, "error": error} if error else {"seccomp": True}


def install_filter(prog: list[tuple[int, int, int, int]]) -> str | None:
    """Install the seccomp BPF program `prog` ((code, jt, jf, k) instructions) on this process, which its
    children and exec'd programs inherit, after no_new_privs; None, or why the kernel refused."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(prog))(*[SockFilter(*ins) for ins in prog])
    fprog = SockFprog(len(prog), filters)
    PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"no_new_privs: {os.strerror(ctypes.get_errno())}"
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        return f"seccomp: {os.strerror(ctypes.get_errno())}"
    return None


_BLOCKED_EVENTS = {
    "socket.__new__",
    "socket.connect",
    "socket.bind",
    "socket.getaddrinfo",
    "socket.sendto",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "os.kill",
    "os.killpg",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.call_function",
    "ctypes.cdata",
    "ctypes.addressof",
    "os.chroot",
    "pty.spawn",
    "webbrowser.open",
    # tracing and object-graph walks could reach into the hook and the guard
    "sys.settrace",
    "sys.setprofile",
    "sys.monitoring.register_callback",
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
}
# event -> (path argument, its dir_fd argument or None) pairs; each path must lie inside the work directory
_PATH_EVENTS = {
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),),
    "os.truncate": ((0, None),),
    "os.utime": ((0, 3),),
    "shutil.rmtree": ((0, 1),),
    "os.chflags": ((0, None),),
    "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
    "sqlite3.connect": ((0, None),),
}
# Calls that raise no audit event, replaced by _refused before the program runs (module -> names)
_OTHER_PROCESSES = ("pidfd_open", "setpriority", "sched_setaffinity", "sched_setscheduler", "sched_setparam")
_UNAUDITED = {
    "os": ("mkfifo", "mknod", *_OTHER_PROCESSES),
    "posix": ("mkfifo", "mknod", *_OTHER_PROCESSES),
    "signal": ("pidfd_send_signal",),
    "_posixsubprocess": ("fork_exec",),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DIRECTORY_FLAGS = os.O_DIRECTORY | getattr(os, "O_PATH", 0)
REFUSED = 3  # the exit status when a required layer is missing: the program did not run


def _refused(*args, **kwargs):
    raise PermissionError("sandbox: this call is not allowed")


def refuse_unaudited() -> None:
    import importlib

    for module, names in _UNAUDITED.items():
        loaded = importlib.import_module(module)
        for name in names:
            if hasattr(loaded, name):
                setattr(loaded, name, _refused)


def install_audit_hook(work: str) -> None:
    """Refuse what _BLOCKED_EVENTS lists and writes outside `work`.

    Everything the hook calls is bound here, built-in functions only: the program cannot change what
    the hook does by patching builtins or modules, nor run its own code inside the hook (paths must
    be str or bytes, not objects whose __fspath__ could answer differently each time)."""
    lstat, stat_, readlink, getcwd = os.lstat, os.stat, os.readlink, os.getcwd
    is_link, is_dir = stat.S_ISLNK, stat.S_ISDIR
    denied, error, halt, str_, bytes_, int_, type_ = PermissionError, OSError, RuntimeError, str, bytes, int, type
    decode, any_, len_ = bytes.decode, any, len
    blocked, path_events, write_flags, directory_flags = (
        frozenset(_BLOCKED_EVENTS),
        dict(_PATH_EVENTS),
        _WRITE_FLAGS,
        _DIRECTORY_FLAGS,
    )

    def resolve(path: str, base: str) -> str:
        """os.path.realpath(base/path), with built-in calls only."""
        todo = (path if path[:1] == "/" else base + "/" + path).split("/")[::-1]  # a stack of components
        parts: list[str] = []
        links = 0
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                parts = parts[:-1]
                continue
            current = "/" + "/".join(parts + [part])
            try:
                mode = lstat(current).st_mode
            except error:
                mode = 0
            if is_link(mode):
                links += 1
                if links > 40:
                    raise denied("sandbox: too many levels of symbolic links")
                target = readlink(current)
                parts = [] if target[:1] == "/" else parts
                todo += target.split("/")[::-1]
            else:
                parts = parts + [part]
        return "/" + "/".join(parts)

    def where(path, dir_fd=None) -> str | None:
        """The absolute resolved path that `path` (relative to dir_fd, a descriptor when an int) names;
        None for a descriptor that is no file (a pipe)."""
        if type_(path) is int_:
            target = readlink(f"/proc/self/fd/{path}")
            return resolve(target, "/") if target[:1] == "/" else None
        if type_(path) is bytes_:
            path = decode(path, "utf-8", "surrogateescape")
        elif type_(path) is not str_:
            raise denied(f"sandbox: give paths as str or bytes, not {type_(path).__name__}")
        if dir_fd is None or (type_(dir_fd) is int_ and dir_fd < 0):  # AT_FDCWD
            base = getcwd()
        elif type_(dir_fd) is int_:
            base = readlink(f"/proc/self/fd/{dir_fd}")
        else:
            raise denied("sandbox: dir_fd must be an int")
        return resolve(path, base)

    root = resolve(work, "/")
    own = (0, os.getpid())

    def check(path, dir_fd, event) -> None:
        full = where(path, dir_fd)
        if full is not None and full != root and full[: len_(root) + 1] != root + "/" and full != "/dev/null":
            raise denied(f"sandbox: {event} outside the work directory: {path!r}")

    def hook(event, args):
        if event in blocked:
            raise denied(f"sandbox: {event} is not allowed")
        if event == "sys.addaudithook":  # a hook of the program's would run inside this one
            raise halt("sandbox: sys.addaudithook is not allowed")
        if event == "resource.prlimit" and args[0] not in own:  # (pid, resource, limits)
            raise denied("sandbox: the limits of another process are out of reach")
        if event == "open":
            path, mode, flags = args
            if path is None or type_(path) is int_:  # a descriptor, opened under these rules
                return
            # os.open's event does not say its dir_fd: no descriptor of a directory may exist, so that
            # a relative path is always relative to the working directory
            full = where(path)
            assert full is not None  # a path, not a descriptor (returned above)
            try:
                directory = is_dir(stat_(full).st_mode)
            except error:
                directory = False
            if directory or (flags or 0) & directory_flags:
                raise denied(f"sandbox: opening a directory is not allowed: {path!r}")
            if (flags or 0) & write_flags or (type_(mode) is str_ and any_(c in mode for c in "wax+")):
                check(path, None, "writing")
        elif event in path_events:
            for i, fd_index in path_events[event]:
                dir_fd = args[fd_index] if fd_index is not None and fd_index < len_(args) else None
                if i < len_(args) and args[i] is not None:
                    check(args[i], dir_fd, event)

    sys.addaudithook(hook)


def die_with_parent(parent: int) -> dict:
    """SIGKILL when the process that started the guard dies (set after the namespaces: entering them
    clears it)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG, SIGKILL = 1, 9
    if libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0:
        return {"dies_with_parent": False}
    if os.getppid() != parent:  # it died before the setting
        os._exit(REFUSED)
    return {"dies_with_parent": True}


def missing_layers(report: dict, required: list) -> list:
    """The required layers (namespaces, seccomp) not in force, each with the kernel's reason."""
    errors = report.get("errors", {})
    missing = []
    if "namespaces" in required and not (report.get("network_namespace") and report.get("read_only_fs")):
        missing.append(f"namespaces ({errors.get('namespaces', 'not tried')})")
    if "seccomp" in required and not report.get("seccomp"):
        missing.append(f"seccomp ({errors.get('seccomp', 'not tried')})")
    return missing


def load_codec(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_sandbox_plain", path)
    assert spec is not None and spec.loader is not None  # sandbox.py names plain.py, a Python source file
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(namespace: dict, plain, requests, replies, names: list) -> None:
    """Describe `names` of the program's globals, then answer calls until the requests end."""

    def answer(value) -> None:
        replies.write(plain.encode(value).encode() + b"\n")
        replies.flush()

    described: dict[str, tuple[object, ...]] = {}
    for name in names:
        value = namespace.get(name, serve)  # serve: a marker no program can name
        if value is serve:
            continue
        if isinstance(value, type(os)):
            described[name] = ("module", str(value.__name__))
        elif callable(value):
            described[name] = ("callable",)
        else:
            try:
                plain.encode(value)
                described[name] = ("value", value)
            except Exception:
                pass
    answer(("names", described))
    for line in requests:
        try:
            _, name, args = plain.decode(line)
            result = namespace[name](*args)
            try:
                plain.encode(result)
            except plain.NotPlain as error:
                answer(("not plain", str(error)))
                continue
            answer(("value", result))
        except BaseException as error:  # SystemExit and the like too: the evaluator fails the program for them
            try:
                answer(("raised", type(error).__name__, str(error)[:2000]))
            except Exception:
                answer(("raised", "Exception", "an exception that could not be described"))


def main() -> None:
    config = json.loads(sys.argv[1])
    work = config["work_dir"]
    errors: dict[str, str] = {}  # layer -> why the kernel refused it
    report: dict[str, object] = {"errors": errors}
    if config.get("namespaces", True):
        layer = enter_namespaces(work)
        if "error" in layer:
            errors["namespaces"] = layer.pop("error")
        report.update(layer)
    report.update(die_with_parent(config["parent"]))
    if report.get("pid_namespace"):  # from here on, in the program's process inside the namespace
        passed = [config[key] for key in ("report_fd", "requests_fd", "replies_fd") if key in config]
        report.update(island(passed))
    os.chdir(work)
    report["limits"] = set_limits(config["limits"])
    report["capabilities_dropped"] = drop_capabilities()
    if config.get("seccomp", True):
        layer = install_seccomp()
        if "error" in layer:
            errors["seccomp"] = layer.pop("error")
        report.update(layer)
    hooked = config.get("audit_hook", True)
    report["audit_hook"] = hooked
    missing = missing_layers(report, config.get("require", []))
    if missing:
        report["missing"] = missing
    if not errors:
        del report["errors"]
    with os.fdopen(config["report_fd"], "w", encoding="utf-8") as channel:  # closed before the program runs
        channel.write(json.dumps(report))
    if missing:
        os._exit(REFUSED)
    serving = config.get("serve")
    if serving:
        plain = load_codec(config["codec"])
        requests = os.fdopen(config["requests_fd"], "rb")
        replies = os.fdopen(config["replies_fd"], "wb")
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]  # the program gets no ready-made ctypes
    import gc

    gc.collect()
    if hooked:
        refuse_unaudited()
        install_audit_hook(work)
    with open(config["program"], encoding="utf-8") as handle:
        source = handle.read()
    sys.argv = [config["program"]]
    namespace = {"__name__": "__main__", "__file__": config["program"], "__builtins__": __builtins__}
    exec(compile(source, "program.py", "exec"), namespace)
    if serving:
        serve(namespace, plain, requests, replies, config["names"])


if __name__ == "__main__":
    main()
