"""Runs a command where the kernel refuses namespaces or seccomp, as on machines without them:
`python deny_syscalls.py namespaces|seccomp -- COMMAND...` installs a seccomp filter that makes
unshare(2) fail with EPERM (namespaces), or prctl(PR_SET_SECCOMP) and seccomp(2) fail with EINVAL
(seccomp), then execs COMMAND, which inherits the filter. Exits 99 where no filter can be installed."""

import os
import sys

from free_transformer.eval.sandbox_guard import install_filter  # the guard's installer, for this other filter

CALLS = {
    "x86_64": (0xC000003E, dict(unshare=272, prctl=157, seccomp=317)),
    "aarch64": (0xC00000B7, dict(unshare=97, prctl=167, seccomp=277)),
}


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
        prog += [
            (JEQ, 0, 1, nr["seccomp"]),
            (RET, 0, 0, ERRNO | EINVAL),
            (JEQ, 0, 3, nr["prctl"]),
            (LD, 0, 0, 16),
            (JEQ, 0, 1, 22),
            (RET, 0, 0, ERRNO | EINVAL),
        ]
    prog += [(RET, 0, 0, ALLOW)]
    if install_filter(prog) is not None:
        sys.exit(99)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
