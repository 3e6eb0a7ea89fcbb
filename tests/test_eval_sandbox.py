"""The sandbox against hostile programs. Each run is a fresh interpreter (~0.2 s); limits are small."""

import os
import socket

import pytest

from free_transformer.eval.programs import check_completion
from free_transformer.eval.sandbox import SandboxLimits, isolation_report, run_python

FAST = SandboxLimits(timeout_s=1.5, memory_mb=512)
KERNEL_ONLY = SandboxLimits(timeout_s=1.5, memory_mb=512, audit_hook=False)  # the kernel layers on their own
LAYERS = isolation_report(FAST)


def test_plain_program_runs_with_a_stripped_environment():
    result = run_python("import os, sys\nprint(sorted(os.environ), sys.flags.isolated)\n", FAST)
    assert result.passed, result.stderr
    assert result.stdout.strip() == "['HOME', 'LANG', 'PATH', 'TMPDIR'] 1"
    assert result.isolation["audit_hook"] is True


def test_infinite_loop_is_killed_at_the_timeout():
    result = run_python("while True:\n    pass\n", SandboxLimits(timeout_s=1.0))
    assert result.status == "timeout" and result.duration_s < 5


def test_huge_allocation_fails_inside_the_program():
    result = run_python("x = bytearray(4 * 2**30)\nprint('allocated')\n", FAST)
    assert result.status == "failed" and "allocated" not in result.stdout
    assert "MemoryError" in result.stderr


@pytest.mark.parametrize("limits", [FAST, KERNEL_ONLY], ids=["all-layers", "kernel-only"])
def test_fork_bomb_cannot_start_processes(limits):
    if limits is KERNEL_ONLY and not LAYERS.get("seccomp"):
        pytest.skip("no seccomp on this machine; the audit hook is the only fork guard")
    bomb = "import os\nfor _ in range(64):\n    os.fork()\nprint('forked')\n"
    result = run_python(bomb, limits)
    assert result.status == "failed" and "forked" not in result.stdout
    spawn = "import subprocess\nsubprocess.run(['true'])\nprint('spawned')\n"
    assert "spawned" not in run_python(spawn, limits).stdout


@pytest.mark.parametrize("limits", [FAST, KERNEL_ONLY], ids=["all-layers", "kernel-only"])
def test_writing_outside_the_work_directory_fails(tmp_path, limits):
    if limits is KERNEL_ONLY and not LAYERS.get("read_only_fs"):
        pytest.skip("no mount namespace on this machine; the audit hook is the only write guard")
    target = tmp_path / "escaped.txt"
    program = (f"import os\ntry:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError as e:\n    print('blocked', e)\n"
               f"fd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\n")
    result = run_python(program, limits)
    assert result.status == "failed" and "blocked" in result.stdout
    assert not target.exists()
    inside = run_python("open('note.txt', 'w').write('ok')\nprint(open('note.txt').read())\n", limits)
    assert inside.passed and inside.stdout.strip() == "ok"


@pytest.mark.parametrize("limits", [FAST, KERNEL_ONLY], ids=["all-layers", "kernel-only"])
def test_no_network_even_to_localhost(limits):
    if limits is KERNEL_ONLY and not (LAYERS.get("seccomp") or LAYERS.get("network_namespace")):
        pytest.skip("no kernel network isolation on this machine")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    try:
        result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')\n",
                            limits)
        assert result.status == "failed" and "connected" not in result.stdout
        with pytest.raises(OSError):
            server.accept()
    finally:
        server.close()


def test_cannot_signal_the_evaluating_process():
    program = f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)\n"
    for limits in (FAST, KERNEL_ONLY):
        assert run_python(program, limits).status == "failed"  # and we are still alive to check it


def test_output_and_file_sizes_are_bounded():
    result = run_python("import sys\nsys.stdout.write('x' * (8 * 2**20))\n", SandboxLimits(timeout_s=3, file_size_mb=1))
    assert result.status == "failed" and len(result.stdout) <= 4000


def test_code_checkers_pass_the_reference_and_fail_a_wrong_answer():
    humaneval = {"style": "humaneval", "prompt": "def inc(x):\n", "test": "def check(f):\n    assert f(1) == 2\n",
                 "entry_point": "inc"}
    assert check_completion(humaneval, "    return x + 1\n", FAST).passed
    assert not check_completion(humaneval, "    return x\n", FAST).passed
    mbpp = {"style": "asserts", "setup": "", "asserts": ["assert double(3) == 6"]}
    assert check_completion(mbpp, "def double(x):\n    return 2 * x", FAST).passed
    plus = {"style": "evalplus", "prompt": "def third(x):\n", "entry_point": "third", "canonical_solution": "    return x / 3\n",
            "inputs": [[1], [2.5], [-9]], "atol": 1e-12}
    assert check_completion(plus, "    return x * (1 / 3)\n", FAST).passed  # equal within the tolerance
    assert not check_completion(plus, "    return x // 3\n", FAST).passed


def test_cpu_limit_counts_as_the_timeout(monkeypatch):
    """RLIMIT_CPU (derived from the timeout) can stop a busy loop just before the wall clock does:
    that is a timeout too, not a failure. Here the CPU limit is forced to come first."""
    limits = SandboxLimits(timeout_s=10.0, memory_mb=512)
    monkeypatch.setattr(SandboxLimits, "rlimits", lambda self: {"RLIMIT_CPU": 1, "RLIMIT_AS": 512 * 2**20})
    result = run_python("while True:\n    pass\n", limits)
    assert result.status == "timeout" and result.duration_s < 8
