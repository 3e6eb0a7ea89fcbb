"""A sandboxed program reaches no process but its own. An evaluating process (a child of the test) runs a
program that tries one call against it, against an unrelated process of the same user that the test
started, and against its own parent; the evaluator must write its verdict, and neither process may
change (rlimits, nice, CPU affinity, scheduling policy, I/O priority) or die. Each call is tried under
every layer that should refuse it on its own: the PID namespace, the seccomp filter without it (the
fallback where the kernel refuses namespaces, forced here by `namespaces=False`), and the audit hook."""

import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import kernel_sandbox

from free_transformer.eval.sandbox import SandboxLimits, isolation_report

NUMBERS = {  # system calls without a Python wrapper, per architecture
    "x86_64": dict(
        ioprio_get=252,
        kill=62,
        tkill=200,
        tgkill=234,
        rt_sigqueueinfo=129,
        rt_tgsigqueueinfo=297,
        pidfd_open=434,
        pidfd_send_signal=424,
        prlimit64=302,
        setpriority=141,
        sched_setaffinity=203,
        sched_setscheduler=144,
        sched_setparam=142,
        sched_setattr=314,
        ioprio_set=251,
        migrate_pages=256,
        move_pages=279,
        process_vm_readv=310,
        process_vm_writev=311,
        ptrace=101,
        kcmp=312,
    ),
    "aarch64": dict(
        ioprio_get=31,
        kill=129,
        tkill=130,
        tgkill=131,
        rt_sigqueueinfo=138,
        rt_tgsigqueueinfo=240,
        pidfd_open=434,
        pidfd_send_signal=424,
        prlimit64=261,
        setpriority=140,
        sched_setaffinity=122,
        sched_setscheduler=119,
        sched_setparam=118,
        sched_setattr=274,
        ioprio_set=30,
        migrate_pages=238,
        move_pages=239,
        process_vm_readv=270,
        process_vm_writev=271,
        ptrace=117,
        kcmp=272,
    ),
}
NR = NUMBERS.get(os.uname().machine, {})
CPU = max(os.sched_getaffinity(0))  # a set of CPUs that differs from the targets' where there are several

# Calls through Python's own functions (the audit hook sees these), each against process `t`
PYTHON_CALLS = {
    "prlimit": "resource.prlimit(t, resource.RLIMIT_NOFILE, (55, 55))\n"
    "resource.prlimit(t, resource.RLIMIT_FSIZE, (0, 0))\nresource.prlimit(t, resource.RLIMIT_CPU, (1, 2))",
    "setpriority": "os.setpriority(os.PRIO_PROCESS, t, 19)",
    "setpriority-pgrp": "os.setpriority(os.PRIO_PGRP, t, 19)",  # the targets lead their process groups
    "sched_setaffinity": f"os.sched_setaffinity(t, {{{CPU}}})",
    "sched_setscheduler": "os.sched_setscheduler(t, os.SCHED_IDLE, os.sched_param(0))",
    "sched_setparam": "os.sched_setparam(t, os.sched_param(0))",
}
# Raw system calls through ctypes (the audit hook off: the kernel layers alone must refuse them)
SIGINFO = "(ctypes.c_int * 32)(signal.SIGTERM, 0, -1)"  # si_signo, si_errno, si_code SI_QUEUE
# one byte between a buffer here and address 0x1000 there (never mapped: at worst EFAULT)
VM = "buffer = ctypes.create_string_buffer(1)\ncall('{}', t, (ctypes.c_uint64 * 2)(ctypes.addressof(buffer), 1), 1, "
VM += "(ctypes.c_uint64 * 2)(0x1000, 1), 1, 0)"
SYSCALLS = {
    "kill": "call('kill', t, signal.SIGTERM)",
    "tkill": "call('tkill', t, signal.SIGTERM)",
    "tgkill": "call('tgkill', t, t, signal.SIGTERM)",
    "rt_sigqueueinfo": f"call('rt_sigqueueinfo', t, signal.SIGTERM, {SIGINFO})",
    "rt_tgsigqueueinfo": f"call('rt_tgsigqueueinfo', t, t, signal.SIGTERM, {SIGINFO})",
    "pidfd_send_signal": "call('pidfd_send_signal', call('pidfd_open', t, 0), signal.SIGTERM, None, 0)",
    "prlimit64": "call('prlimit64', t, resource.RLIMIT_NOFILE, (ctypes.c_uint64 * 2)(55, 55), None)",
    "setpriority": "call('setpriority', os.PRIO_PROCESS, t, 19)",
    "sched_setaffinity": f"call('sched_setaffinity', t, 8, ctypes.byref(ctypes.c_uint64(1 << {CPU})))",
    "sched_setscheduler": "call('sched_setscheduler', t, os.SCHED_IDLE, ctypes.byref(ctypes.c_int(0)))",
    "sched_setparam": "call('sched_setparam', t, ctypes.byref(ctypes.c_int(0)))",
    # struct sched_attr: size 48, policy SCHED_IDLE, then zeros
    "sched_setattr": "call('sched_setattr', t, (ctypes.c_uint32 * 12)(48, os.SCHED_IDLE), 0)",
    "ioprio_set": "call('ioprio_set', 1, t, 3 << 13)",  # IOPRIO_WHO_PROCESS, the idle class
    "migrate_pages": "call('migrate_pages', t, 0, None, None)",
    "move_pages": "call('move_pages', t, 0, None, None, None, 0)",
    "process_vm_readv": VM.format("process_vm_readv"),
    "process_vm_writev": VM.format("process_vm_writev"),
    "ptrace": "call('ptrace', 0x4206, t, None, None)",  # PTRACE_SEIZE: attaches without stopping
    "kcmp": "call('kcmp', os.getpid(), t, 0, 0, 0)",
}
PROGRAM = """
import errno, os, resource, signal
def call(name, *args):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    args = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    result = libc.syscall(ctypes.c_long({numbers}[name]), *args)
    if result == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result
def attempt(t):
{body}
for who, t in [*{targets}, ('parent', os.getppid())]:
    try:
        attempt(t)
    except (PermissionError, ProcessLookupError) as error:  # EPERM, or no such process where it looks
        print('refused', who, t, error)
    except OSError as error:  # the kernel got past its permission checks
        print('reached', who, t, error)
    else:
        print('reached', who, t)
"""


def state(pid: int) -> dict:
    """What a program could change of process `pid`."""
    import ctypes
    import os
    import resource

    limits = {name: resource.prlimit(pid, getattr(resource, name)) for name in dir(resource) if name[:7] == "RLIMIT_"}
    ioprio = ctypes.CDLL(None).syscall(ctypes.c_long(IOPRIO_GET), ctypes.c_long(1), ctypes.c_long(pid))
    return {
        "limits": {name: list(value) for name, value in limits.items()},
        "nice": os.getpriority(os.PRIO_PROCESS, pid),
        "affinity": sorted(os.sched_getaffinity(pid)),
        "policy": os.sched_getscheduler(pid),
        "ioprio": ioprio,
    }


IOPRIO_GET = NR.get("ioprio_get", 0)
EVALUATOR = (
    f"IOPRIO_GET = {IOPRIO_GET}\n"
    + inspect.getsource(state)
    + """
import json, os, sys
from free_transformer.eval.sandbox import SandboxLimits, run_python
before = state(os.getpid())
runs = []
for mode, fields in json.loads(sys.argv[2]):
    result = run_python(sys.argv[3].replace("EVALUATOR", str(os.getpid())), SandboxLimits(**fields))
    runs.append([mode, result.status, result.stdout, result.stderr[-2000:], result.isolation])
with open(sys.argv[1], "w") as out:
    json.dump({"before": before, "after": state(os.getpid()), "runs": runs}, out)
"""
)

HOOK_ONLY = not kernel_sandbox()
LAYERS = isolation_report(SandboxLimits(allow_hook_only=True))
SECCOMP = bool(LAYERS.get("seccomp"))
PID_NAMESPACE = bool(LAYERS.get("pid_namespace"))
FAST = dict(timeout_s=3, memory_mb=512)
MODES = {  # layer -> SandboxLimits fields that leave it on its own (with the resource limits)
    "all-layers": dict(FAST, allow_hook_only=HOOK_ONLY),
    "pid-namespace": dict(FAST, seccomp=False, audit_hook=False, allow_hook_only=True),
    "seccomp-fallback": dict(FAST, namespaces=False, audit_hook=False, allow_hook_only=True),
    "audit-hook": dict(FAST, namespaces=False, seccomp=False, allow_hook_only=True),
}


def modes(python: bool) -> list:
    chosen = ["all-layers", "audit-hook"] if python else []
    chosen += ["pid-namespace"] if PID_NAMESPACE else []
    chosen += ["seccomp-fallback"] if SECCOMP else []
    return [[mode, MODES[mode]] for mode in chosen]


def attack(tmp_path, body: str, python: bool) -> None:
    """Run `body` (against `t`) from sandboxed programs of an evaluator; check that everything held."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(120)"], start_new_session=True)
    try:
        untouched = state(bystander.pid)
        source = PROGRAM.format(
            numbers=NR,
            body=textwrap.indent(body, "    "),
            targets=f"[('evaluator', EVALUATOR), ('bystander', {bystander.pid})]",
        )
        verdict = tmp_path / "verdict.json"
        evaluator = subprocess.run(
            [sys.executable, "-c", EVALUATOR, str(verdict), json.dumps(modes(python)), source],
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
        )
        assert evaluator.returncode == 0 and verdict.exists(), (evaluator.returncode, evaluator.stderr[-2000:])
        record = json.loads(verdict.read_text())
        assert record["runs"], "no layer to try on this machine"
        for mode, status, stdout, stderr, isolation in record["runs"]:
            lines = stdout.splitlines()
            assert status == "passed" and len(lines) == 3, (mode, status, stdout, stderr, isolation)
            # with the PID namespace alone, the parent is the namespace's init: it holds nothing of the
            # evaluator's and ignores signals; the seccomp filter keeps it out of reach too
            spared = ("reached parent 1 ", "reached parent 1\n") if mode == "pid-namespace" else ()
            assert all(line.startswith("refused") or (line + "\n").startswith(spared) for line in lines), (
                mode,
                stdout,
                isolation,
            )
        assert record["after"] == record["before"]
        assert bystander.poll() is None, "the unrelated process was killed"
        assert state(bystander.pid) == untouched
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.parametrize("call", list(PYTHON_CALLS))
def test_a_program_limits_renices_or_pins_no_other_process(tmp_path, call):
    """`resource.prlimit(os.getppid(), RLIMIT_CPU, (1, 2))` used to kill the evaluator with SIGXCPU (and
    RLIMIT_FSIZE 0 left it unable to write its results), and the evaluator's and any process's nice
    value, CPU affinity and scheduling policy could be changed, with every layer in force."""
    attack(tmp_path, PYTHON_CALLS[call], python=True)


@pytest.mark.skipif(not NR, reason="system call numbers known for x86_64 and aarch64 only")
@pytest.mark.parametrize("call", list(SYSCALLS))
def test_no_system_call_reaches_another_process(tmp_path, call):
    """The same through raw system calls, each kernel layer on its own: rt_sigqueueinfo used to signal
    the evaluator, prlimit64, setpriority, sched_setaffinity / setscheduler / setattr and ioprio_set to
    change it, where only the seccomp filter stood (no PID namespace)."""
    if not (SECCOMP or PID_NAMESPACE):
        pytest.skip("neither a PID namespace nor seccomp on this machine: only the audit hook refuses ctypes")
    attack(tmp_path, "import ctypes\n" + SYSCALLS[call], python=False)


def test_the_program_is_an_ordinary_user_alone_in_its_namespace():
    """Inside its namespaces the program sees its init and itself only, has no capabilities and is not
    the caller's uid (unless the caller's uid is the sandbox's)."""
    if not PID_NAMESPACE:
        pytest.skip("no PID namespace on this machine")
    from free_transformer.eval.sandbox import run_python
    from free_transformer.eval.sandbox_guard import SANDBOX_ID

    program = (
        "import os\nprint(os.getpid(), os.getppid(), os.getuid(), os.getgid())\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])\n"
    )
    result = run_python(program, SandboxLimits(**dict(FAST, audit_hook=False, allow_hook_only=HOOK_ONLY)))
    ids, processes, capabilities = result.stdout.splitlines()
    assert result.passed and ids == f"2 1 {SANDBOX_ID} {SANDBOX_ID}", result.stderr
    if result.isolation.get("own_proc"):
        assert processes == "[1, 2]"
    assert int(capabilities, 16) == 0
