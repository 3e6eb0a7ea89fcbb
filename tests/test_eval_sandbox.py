"""The sandbox against hostile programs. Each run is a fresh interpreter (~0.2 s); limits are small."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import kernel_sandbox, tiny_checkpoint

from free_transformer.eval.programs import check_completion
from free_transformer.eval.sandbox import SandboxLimits, isolation_report, run_python

HOOK_ONLY = not kernel_sandbox()  # where the kernel gives no layers, the tests run what remains
FAST = SandboxLimits(timeout_s=1.5, memory_mb=512, allow_hook_only=HOOK_ONLY)
KERNEL_ONLY = SandboxLimits(
    timeout_s=1.5, memory_mb=512, audit_hook=False, allow_hook_only=HOOK_ONLY
)  # the kernel layers on their own
LAYERS = isolation_report(FAST)


def test_plain_program_runs_with_a_stripped_environment():
    result = run_python("import os, sys\nprint(sorted(os.environ), sys.flags.isolated)\n", FAST)
    assert result.passed, result.stderr
    assert result.stdout.strip() == "['HOME', 'LANG', 'PATH', 'TMPDIR'] 1"
    assert result.isolation["audit_hook"] is True


def test_infinite_loop_is_killed_at_the_timeout():
    result = run_python("while True:\n    pass\n", SandboxLimits(timeout_s=1.0, allow_hook_only=HOOK_ONLY))
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
    program = (
        f"import os\ntry:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError as e:\n    print('blocked', e)\n"
        f"fd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\n"
    )
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
        result = run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')\n", limits
        )
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
    result = run_python(
        "import sys\nsys.stdout.write('x' * (8 * 2**20))\n",
        SandboxLimits(timeout_s=3, file_size_mb=1, allow_hook_only=HOOK_ONLY),
    )
    assert result.status == "failed" and len(result.stdout) <= 4000


def test_code_checkers_pass_the_reference_and_fail_a_wrong_answer():
    humaneval = {
        "style": "humaneval",
        "prompt": "def inc(x):\n",
        "test": "def check(f):\n    assert f(1) == 2\n",
        "entry_point": "inc",
    }
    assert check_completion(humaneval, "    return x + 1\n", FAST).passed
    assert not check_completion(humaneval, "    return x\n", FAST).passed
    mbpp = {"style": "asserts", "setup": "", "asserts": ["assert double(3) == 6"]}
    assert check_completion(mbpp, "def double(x):\n    return 2 * x", FAST).passed
    plus = {
        "style": "evalplus",
        "prompt": "def third(x):\n",
        "entry_point": "third",
        "canonical_solution": "    return x / 3\n",
        "inputs": [[1], [2.5], [-9]],
        "atol": 1e-12,
    }
    assert check_completion(plus, "    return x * (1 / 3)\n", FAST).passed  # equal within the tolerance
    assert not check_completion(plus, "    return x // 3\n", FAST).passed


def test_cpu_limit_counts_as_the_timeout(monkeypatch):
    """RLIMIT_CPU (derived from the timeout) can stop a busy loop just before the wall clock does:
    that is a timeout too, not a failure. Here the CPU limit is forced to come first."""
    limits = SandboxLimits(timeout_s=10.0, memory_mb=512, allow_hook_only=HOOK_ONLY)
    monkeypatch.setattr(SandboxLimits, "rlimits", lambda self: {"RLIMIT_CPU": 1, "RLIMIT_AS": 512 * 2**20})
    result = run_python("while True:\n    pass\n", limits)
    assert result.status == "timeout" and result.duration_s < 8


DENY = Path(__file__).with_name("deny_syscalls.py")
LIBRARY = (
    "from free_transformer.eval.programs import check_completion\n"
    "from free_transformer.eval.sandbox import SandboxLimits, SandboxUnavailable\n"
    "test = {'style': 'asserts', 'setup': '', 'asserts': ['assert f() == 1']}\n"
    "try:\n    check_completion(test, 'def f():\\n    return 1\\n')\nexcept SandboxUnavailable as e:\n"
    "    print('refused:', e)\n"
    "result = check_completion(test, 'def f():\\n    return 1\\n', SandboxLimits(allow_hook_only=True))\n"
    "print(result.status, result.isolation['seccomp'], result.isolation['network_namespace'])\n"
)


@pytest.mark.parametrize("layer", ["namespaces", "seccomp"])
def test_without_a_kernel_layer_generated_code_runs_only_when_hook_only_is_asked_for(tmp_path, layer):
    """Where the kernel refuses user namespaces (or seccomp), as a seccomp filter of this test makes it
    do, generated code is refused with one line saying why and what enables the layer, and runs when
    hook-only mode is asked for; `eval` refuses code tasks before any scoring."""
    prefix = [sys.executable, str(DENY), layer, "--"]
    if subprocess.run(prefix + ["/bin/true"]).returncode == 99:  # no filter can be installed: no seccomp here
        assert not kernel_sandbox()
        prefix, layer = [], "seccomp"
    library = subprocess.run(prefix + [sys.executable, "-c", LIBRARY], capture_output=True, text=True)
    refusal, outcome = library.stdout.strip().splitlines()
    assert refusal.startswith("refused: generated code is not run without kernel isolation"), library.stderr
    assert f"gives no {layer} (" in refusal and "enable " in refusal and "--sandbox-hook-only" in refusal
    assert outcome.startswith("passed") and "False" in outcome
    if layer == "namespaces":
        run = tiny_checkpoint(tmp_path, "run", 0)
        command = [
            sys.executable,
            "-m",
            "free_transformer.cli",
            "eval",
            str(run),
            "--tasks",
            "humaneval",
            "--limit",
            "1",
            "--no-progress",
            "--device",
            "cpu",
        ]
        refused = subprocess.run(prefix + command, capture_output=True, text=True)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith("error: generated code is not run without kernel isolation")
        assert not (run / "eval").exists() or not list((run / "eval").iterdir())  # nothing scored


def test_the_canonical_solutions_pass_their_checkers():
    """docs/evaluation.md's command, on the first problems of each benchmark (all of them: 164/164,
    499/500 and 164/164, as before the verdict moved out of the sandbox)."""
    script = Path(__file__).parents[1] / "scripts" / "canonical_pass.py"
    result = subprocess.run([sys.executable, str(script), "--limit", "3"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["humaneval", "mbpp", "evalplus"]
    assert all("pass@1 1.0000 (3/3)" in line for line in lines), result.stdout


def test_a_weaker_sandbox_is_named_layer_by_layer():
    """What eval says on the console when the kernel refused a PID namespace or a private /proc (the results file
    records the report; the console said nothing)."""
    from free_transformer.eval.sandbox import WEAKER_WITHOUT, weaker_layers

    assert weaker_layers({"pid_namespace": True, "own_proc": True, "audit_hook": True}) == []
    assert weaker_layers({"pid_namespace": False, "own_proc": True}) == [WEAKER_WITHOUT["pid_namespace"]]
    assert weaker_layers({"pid_namespace": False, "own_proc": False}) == list(WEAKER_WITHOUT.values())
    assert weaker_layers(LAYERS) == [WEAKER_WITHOUT[k] for k in WEAKER_WITHOUT if k in LAYERS and not LAYERS[k]]
