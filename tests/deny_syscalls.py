"""Runs a command where the kernel refuses namespaces or seccomp, as on machines without them:
`python deny_syscalls.py namespaces|seccomp -- COMMAND...` installs a seccomp filter that makes
unshare(2) fail with EPERM (namespaces), or prctl(PR_SET_SECCOMP) and seccomp(2) fail with EINVAL
(seccomp), then execs COMMAND, which inherits the filter. Exits 99 where no filter can be installed."""

import ctypes
import os
import sys

CALLS = {"x86_64": (0xC000003E, dict(unshare=272, prctl=157, seccomp=317)),
         "aarch64": (0xC00000B7, dict(unshare=97, prctl=167, seccomp=277))}


def main() -> None:
    what, _, command = sys.argv[1], sys.argv[2], sys.argv[3:]
    machine = os.uname().machine
    if machine not in CALLS:
        sys.exit(99)
    arch, nr = CALLS[machine]
    LD, JEQ, RET, ALLOW, ERRNO, EPERM, EINVAL = 0x20, 0x15, 0x06, 0x7FFF0000, 0x00050000, 1, 22
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, ALLOW), (LD, 0, 0, 0)]
    if what == "namespaces":
        prog += [(JEQ, 0, 1, nr["unshare"]), (RET, 0, 0, ERRNO | EPERM)]
    else:  # prctl(PR_SET_SECCOMP = 22, ...) and seccomp(2)
        prog += [(JEQ, 0, 1, nr["seccomp"]), (RET, 0, 0, ERRNO | EINVAL),
                 (JEQ, 0, 3, nr["prctl"]), (LD, 0, 0, 16), (JEQ, 0, 1, 22), (RET, 0, 0, ERRNO | EINVAL)]
    prog += [(RET, 0, 0, ALLOW)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(prog))(*[Filter(*ins) for ins in prog])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(Program(len(prog), filters)), 0, 0) != 0:
        sys.exit(99)  # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP with SECCOMP_MODE_FILTER
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
