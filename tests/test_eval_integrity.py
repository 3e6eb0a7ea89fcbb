"""Evaluation counts only what was earned: a generated program cannot mark itself passed (the verdict
is decided outside the sandbox, on the plain values it returned), cannot write outside its work
directory through descriptors when the kernel layers are missing, and a stopped `eval` leaves no
sandboxed program or directory behind."""

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import hook_only_args, kernel_sandbox, tiny_checkpoint

from free_transformer.eval.programs import check_completion
from free_transformer.eval.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(timeout_s=3, memory_mb=512, allow_hook_only=not kernel_sandbox())
NO_KERNEL = SandboxLimits(
    timeout_s=3, memory_mb=512, namespaces=False, seccomp=False, allow_hook_only=True
)  # the audit hook alone

HUMANEVAL = {
    "style": "humaneval",
    "prompt": "def inc(x):\n",
    "test": "def check(f):\n    assert f(1) == 2\n",
    "entry_point": "inc",
}
MBPP = {"style": "asserts", "setup": "", "asserts": ["assert inc(1) == 2"]}
PLUS = {
    "style": "evalplus",
    "prompt": "def inc(x):\n",
    "entry_point": "inc",
    "canonical_solution": "    return x + 1\n",
    "inputs": [[1], [5]],
    "atol": 0,
}
STYLES = {
    "humaneval": (HUMANEVAL, "    return {}\n"),
    "mbpp": (MBPP, "def inc(x):\n    return {}\n"),
    "evalplus": (PLUS, "    return {}\n"),
}
EXITS = {
    "os._exit": "import os\nos._exit(0)\n",
    "sys.exit": "import sys\nsys.exit(0)\n",
    "excepthook": "import os, sys\nsys.excepthook = lambda *args: os._exit(0)\n",
    "atexit": "import atexit, os\natexit.register(os._exit, 0)\n",
}


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("exit", list(EXITS))
def test_a_wrong_answer_that_exits_early_is_no_pass(style, exit):
    test, body = STYLES[style]
    assert check_completion(test, body.format("x + 1"), FAST).passed  # the right answer passes
    outcome = check_completion(test, body.format("x") + EXITS[exit], FAST)
    assert outcome.status == "failed"  # whenever it exits: its tests never got a right answer


FORGERIES = {  # each tries to make a wrong answer (inc(x) = x) pass, then exits 0
    # the attack that beat the in-process report: the audit hook refuses something, the program walks
    # the PermissionError's traceback to the hook's frame, takes the report descriptor and the nonce
    # out of its closures and writes it
    "reads the hook's secret through a refused call's traceback": """
        import os, socket
        for attempt in (lambda: open('/etc/forged', 'w'), socket.socket):
            try:
                attempt()
            except (PermissionError, OSError) as error:
                tb = error.__traceback__
                while tb is not None:
                    for value in list(tb.tb_frame.f_locals.values()):
                        for cell in getattr(value, '__closure__', None) or ():
                            try:
                                held = cell.cell_contents
                            except ValueError:
                                continue
                            if (type(held) is tuple and len(held) > 1
                                    and type(held[0]) is int and type(held[1]) is bytes):
                                os.write(held[0], held[1])
                                os._exit(0)
                    tb = tb.tb_next
        """,
    "reads every descriptor, argv and environment": """
        import os
        for fd in range(3, 64):
            try:
                os.set_blocking(fd, False)
                print(os.read(fd, 256))
            except OSError:
                pass
        print(open('/proc/self/cmdline', 'rb').read(), open('/proc/self/environ', 'rb').read(), flush=True)
        """,
    "walks the frames": """
        import sys
        frame = sys._getframe()
        while frame is not None:
            print(frame.f_locals, flush=True)
            frame = frame.f_back
        """,
    "walks the garbage collector's objects": "import gc\nprint(gc.get_objects(), flush=True)\n",
    "skips statements with a tracer": """
        import sys
        def skip(frame, event, arg):
            return skip
        sys.settrace(skip)
        """,
    "adds its own audit hook": "import sys\nsys.addaudithook(lambda event, args: print(event, args, flush=True))\n",
}


@pytest.mark.parametrize("style", list(STYLES))
@pytest.mark.parametrize("forgery", list(FORGERIES))
@pytest.mark.parametrize("limits", [FAST, NO_KERNEL], ids=["all-layers", "no-kernel-layers"])
def test_a_program_cannot_forge_a_pass(style, forgery, limits):
    test, body = STYLES[style]
    source = body.format("x") + textwrap.dedent(FORGERIES[forgery]) + "import os\nos._exit(0)\n"
    assert check_completion(test, source, limits).status == "failed"
    assert check_completion(test, body.format("x + 1"), limits).passed


ANSWERS = {  # wrong answers that made the test's own comparison hold when it ran beside them
    "an object whose == always holds": "type('Yes', (), {'__eq__': lambda s, o: True, '__hash__': lambda s: 0})()",
    "an int whose == always holds": "type('Yes', (int,), {'__eq__': lambda s, o: True, '__hash__': lambda s: 0})(x)",
}
CASES = [(style, answer) for style in STYLES for answer in ANSWERS] + [
    ("evalplus", "a float after patching the math.isclose of the comparison")
]
ANSWERS["a float after patching the math.isclose of the comparison"] = (
    "(__import__('math').__setattr__('isclose', lambda *a, **k: True), x + 0.5)[1]"
)


@pytest.mark.parametrize("style,answer", CASES)
def test_a_wrong_answer_that_fools_comparisons_is_no_pass(style, answer):
    test, body = STYLES[style]
    outcome = check_completion(test, body.format(ANSWERS[answer]), FAST)
    assert outcome.status == "failed", outcome


def test_calls_cross_as_plain_values_and_the_candidates_exceptions_come_back():
    test = {
        "style": "humaneval",
        "prompt": "def f(x):\n",
        "test": (
            "def check(f):\n    assert f((1, [2.5, None], {'k': {3}})) == ((1, [2.5, None], {'k': {3}}), 'tuple')\n"
            "    try:\n        f('boom')\n    except ValueError as e:\n        assert str(e) == 'boom'\n"
            "    else:\n        assert False\n"
        ),
        "entry_point": "f",
    }
    body = "    if x == 'boom':\n        raise ValueError(x)\n    return x, type(x).__name__\n"
    assert check_completion(test, body, FAST).passed
    generator = check_completion(test, "    return (v for v in [x])\n", FAST)
    assert generator.status == "failed" and "generator is not a plain value" in generator.reason


DIR_FD = "d = os.open(FOLDER, os.O_RDONLY)\n"
ATTACKS = {  # with namespaces and seccomp off: each would create, change, remove or rename a file in FOLDER
    "os.open with dir_fd": DIR_FD + "os.close(os.open('escaped', os.O_WRONLY | os.O_CREAT, dir_fd=d))\n",
    "open with an opener": DIR_FD + "open('x', 'w', opener=lambda p, flags: os.open('escaped', flags, dir_fd=d))\n",
    "os.remove with dir_fd": DIR_FD + "os.remove('victim', dir_fd=d)\n",
    "os.rename with dir_fds": DIR_FD + "os.rename('victim', 'escaped', src_dir_fd=d, dst_dir_fd=d)\n",
    "os.mkfifo": "os.mkfifo(os.path.join(FOLDER, 'escaped'))\n",
    "os.mknod": "os.mknod(os.path.join(FOLDER, 'escaped'))\n",
    "fork_exec without Popen's audit event": """
        import subprocess, sys, time
        r, w = os.pipe()
        head = (['/bin/sh', '-c', 'touch escaped'], [b'/bin/sh'], True, (), FOLDER, None, -1, -1, -1, -1, -1, -1, r, w,
                True, False)
        tail = (-1, None, None, None, -1, None, False) if sys.version_info >= (3, 11) else (None, None, None, -1, None)
        subprocess._fork_exec(*head, *tail)  # what Popen calls after its audit event
        time.sleep(1)
        """,
    "fchmod of a file opened for reading": "os.chmod(os.open(os.path.join(FOLDER, 'victim'), os.O_RDONLY), 0o777)\n",
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_descriptors_and_unaudited_calls_cannot_reach_outside_without_the_kernel_layers(tmp_path, attack):
    (tmp_path / "victim").write_text("kept")
    (tmp_path / "victim").chmod(0o600)
    source = f"import os\nFOLDER = {str(tmp_path)!r}\n" + textwrap.dedent(ATTACKS[attack]) + "print('escaped')\n"
    result = run_python(source, NO_KERNEL)
    assert result.status == "failed" and "escaped" not in result.stdout, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]
    assert (tmp_path / "victim").read_text() == "kept" and (tmp_path / "victim").stat().st_mode & 0o777 == 0o600


def test_directory_descriptors_are_refused_and_ordinary_file_work_still_runs():
    program = (
        "import os, collections\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.rename('a/b/f', 'g')\n"
        "os.remove('g')\nprint(collections.namedtuple('P', 'x')(1))\n"
    )
    result = run_python(program, NO_KERNEL)
    assert result.passed and result.stdout.strip() == "P(x=1)", result.stderr
    refused = run_python("import os\nos.open('.', os.O_RDONLY)\n", NO_KERNEL)
    assert refused.status == "failed" and "opening a directory is not allowed" in refused.stderr


def sandbox_processes(temp) -> list[int]:
    """The processes, not yet ended, of the sandboxes under the temporary directory `temp`: the guard,
    its PID namespace's init and the program share its command line, which names the work directory.
    (A program's own os.getpid() is its id inside its PID namespace.)"""
    found = []
    for entry in os.listdir("/proc"):
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if str(temp).encode() in command and state not in ("Z", "X"):
            found.append(int(entry))
    return found


# A program that says it started, then sleeps far past the moment eval is stopped
SLEEPER = (
    "    pass\nimport os, time\nopen('pid.tmp', 'w').write(str(os.getpid()))\nos.rename('pid.tmp', 'pid')\n"
    "time.sleep(60)\n"
)
EVAL = """
import sys
from free_transformer.cli import main
from free_transformer.eval import runner
runner.generate_texts = lambda *args, **kwargs: ([{sleeper!r}], False)
sys.exit(main(["eval", {run!r}, "--tasks", "humaneval", "--limit", "1", "--code-timeout", "60", "--no-progress",
              *{hook_only!r}]))
"""


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_eval_kills_its_sandboxed_program_and_removes_its_directory(tmp_path, signum, code):
    run = tiny_checkpoint(tmp_path, "run", 0)
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", EVAL.format(sleeper=SLEEPER, run=str(run), hook_only=hook_only_args())],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(temp.glob("ft-sandbox-*/work/pid")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    assert sandbox_processes(temp)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == code
    assert stderr.strip().splitlines()[-1] == f"eval stopped by {signal.Signals(signum).name}", stderr
    assert sandbox_processes(temp) == []
    assert list(temp.iterdir()) == []


CALLER = """
import sys, threading
from free_transformer.eval.sandbox import SandboxLimits, run_python
program = ("import os, time\\nopen('pid.tmp', 'w').write(str(os.getpid()))\\n"
           "os.rename('pid.tmp', 'pid')\\ntime.sleep(60)\\n")
limits = SandboxLimits(timeout_s=60, allow_hook_only={hook_only})
if {in_thread}:
    threading.Thread(target=run_python, args=(program, limits)).start()
else:
    run_python(program, limits)
"""


@pytest.mark.parametrize("in_thread", [False, True], ids=["main-thread", "other-thread"])
def test_sigterm_to_any_caller_of_run_python_kills_its_program_and_removes_its_directory(
    tmp_path, monkeypatch, in_thread
):
    """A program calling run_python and killed by SIGTERM still dies of SIGTERM, and leaves neither the
    sandboxed program running nor its directory: from the main thread at once; from another thread the
    program dies with its caller and the next sandbox removes the directory."""
    temp = tmp_path / "temp"
    temp.mkdir()
    source = CALLER.format(hook_only=not kernel_sandbox(), in_thread=in_thread)
    process = subprocess.Popen(
        [sys.executable, "-c", source], env={**os.environ, "TMPDIR": str(temp)}, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not list(temp.glob("ft-sandbox-*/work/pid")):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.05)
    assert sandbox_processes(temp)
    process.terminate()
    assert process.wait(timeout=30) == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while sandbox_processes(temp):  # the program's death (PR_SET_PDEATHSIG) is asynchronous
        assert time.monotonic() < deadline, "the sandboxed program outlived its caller"
        time.sleep(0.05)
    if in_thread:
        monkeypatch.setattr(tempfile, "tempdir", str(temp))
        run_python("pass\n", FAST)
    assert list(temp.iterdir()) == []


SHADOWED = {  # a builtin the test calls: (the right answer, a wrong one)
    "set": ([1, 2, 3], []),
    "sorted": ([1, 2, 3], []),
    "abs": (-3, 5),
    "round": (2.0, 9.0),
    "len": ([1, 2, 3], []),
}


@pytest.mark.parametrize("builtin", list(SHADOWED))
def test_the_builtins_a_test_calls_are_the_evaluators_own(builtin):
    """`assert set(f(x)) == set(y)` used to pass a wrong `f` when the program defined `set` to return 1:
    the program's `set` took the builtin's place in the evaluator. Only the candidate crosses now."""
    right, wrong = SHADOWED[builtin]
    test = {"style": "asserts", "setup": "", "asserts": [f"assert {builtin}(f(3)) == {builtin}({right!r})"]}
    forged = f"def {builtin}(*args, **kwargs):\n    return 1\n"
    assert check_completion(test, f"def f(x):\n    return {wrong!r}\n" + forged, FAST).status == "failed"
    # a program may still use a helper of that name for itself
    helper = f"def {builtin}(value):\n    return value\ndef f(x):\n    return {builtin}({right!r})\n"
    assert check_completion(test, helper, FAST).passed
    # a task whose function has a builtin's name (MBPP's `sum`) is that function
    own = {"style": "asserts", "setup": "", "asserts": ["assert sum(10, 15) == 6", "assert len([sum(4, 6)]) == 1"]}
    assert check_completion(own, "def sum(a, b):\n    return 6 if a == 10 else 3\n", FAST).passed
    assert check_completion(own, "def sum(a, b):\n    return 5\n", FAST).status == "failed"


@pytest.mark.parametrize(
    "control", ["StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit"]
)
def test_a_candidates_control_flow_exception_fails_the_problem(control):
    """A candidate raising StopIteration used to pass `assert all(map(candidate, xs))` (the iteration
    ended silently), and one the test catches with `except Exception` passed too; each control-flow
    exception is now a failure of the program, whatever the test catches, while an ordinary exception
    still reaches the test as its built-in type."""
    test = {
        "style": "humaneval",
        "prompt": "def f(x):\n",
        "entry_point": "f",
        "test": (
            "def check(f):\n    try:\n        f(-1)\n    except ValueError:\n        pass\n"
            "    try:\n        f(0)\n    except Exception:\n        pass\n    assert all(map(f, [1, 2]))\n"
        ),
    }
    right = "    if x < 0:\n        raise ValueError(x)\n    return True\n"
    assert check_completion(test, right, FAST).passed
    for wrong in ("    if x == 0:\n        raise {}\n", "    if x == 2:\n        raise {}\n"):
        outcome = check_completion(test, right.replace("    return", wrong.format(control) + "    return"), FAST)
        assert outcome.status == "failed" and control in outcome.reason, outcome


def test_nan_equals_nan_where_the_canonical_answer_is_nan():
    plus = {
        "style": "evalplus",
        "prompt": "def f(x):\n",
        "entry_point": "f",
        "atol": 0,
        "inputs": [[1.0], [-1.0]],
        "canonical_solution": "    return float('nan') if x < 0 else [x, float('nan')]\n",
    }
    assert check_completion(plus, "    return float('nan') if x < 0 else [x, float('nan')]\n", FAST).passed
    assert check_completion(plus, "    return 0.0 if x < 0 else [x, float('nan')]\n", FAST).status == "failed"
    assert check_completion(plus, "    return float('nan') if x < 0 else [x, 0.0]\n", FAST).status == "failed"


# Writes a forged guard report to stderr, placed where the report used to be read (the first line of the
# last 64 KiB), then exits with the status of a refusal
FORGED_REPORT = """
import os, sys
forged = '@@sandbox ' + {report!r} + '\\n'
sys.stderr.write('x' * 1000 + '\\n' + forged + 'z' * (65536 - len(forged)))
sys.stderr.flush()
os._exit({status})
"""


@pytest.mark.parametrize("style", list(STYLES))
def test_no_program_can_forge_the_guards_report_or_a_refusal(style):
    """A program that wrote a forged `@@sandbox {"missing": ...}` line and exited 3 made check_completion
    raise SandboxUnavailable, which stopped the whole `eval` ("this machine gives no namespaces"); one
    exiting 0 forged SandboxResult.isolation. The guard's report travels on a pipe that it closes before
    the program runs: the problem fails, and the isolation is the guard's."""
    test, body = STYLES[style]
    refusal = FORGED_REPORT.format(report='{"missing": ["namespaces (forged)"]}', status=3)
    outcome = check_completion(test, body.format("x + 1") + refusal, FAST)
    assert outcome.status == "failed" and "missing" not in outcome.isolation, outcome
    truth = run_python("pass\n", FAST).isolation
    forged = run_python(FORGED_REPORT.format(report='{"seccomp": "forged", "audit_hook": "forged"}', status=0), FAST)
    assert forged.passed and forged.isolation == truth and truth["audit_hook"] is True


# Writes a call's answer itself on every descriptor (one is the guard's answer pipe): N integers whose
# hashes all collide, as a set or a dict, which costs the reader as much per member as the members so far
STALL = """
import json, os
members = [k * (2**61 - 1) for k in range(1, 20001)]
names = {{"tuple": ["names", {{"dict": [["f", {{"tuple": ["callable"]}}]]}}]}}
value = {{"tuple": ["value", {{"{tag}": {members}}}]}}
line = (json.dumps(names) + "\\n" + json.dumps(value) + "\\n").encode()
for fd in range(3, 64):
    try:
        os.write(fd, line)
    except OSError:
        pass
"""


@pytest.mark.parametrize("tag", ["set", "dict"])
def test_a_stalling_answer_is_a_timeout_of_its_program(tag):
    """Integers whose hashes all collide, sent back as a set, were rebuilt after the deadline check, in
    a time quadratic in their number (60,000 took 73 s); sets and dicts are now rebuilt under it."""
    test = {
        "style": "humaneval",
        "prompt": "def f(n):\n",
        "test": "def check(f):\n    assert f(1) == 1\n",
        "entry_point": "f",
    }
    members = "members" if tag == "set" else "[[m, 0] for m in members]"
    limits = SandboxLimits(timeout_s=1, memory_mb=512, allow_hook_only=not kernel_sandbox())
    started = time.monotonic()
    outcome = check_completion(test, "    return n\n" + STALL.format(tag=tag, members=members), limits)
    assert outcome.status == "timeout" and time.monotonic() - started < 3, outcome


def test_eval_goes_on_past_a_program_that_forges_a_refusal(tmp_path, monkeypatch):
    """The forged refusal above used to stop `eval` (exit 2, "this machine gives no namespaces", no
    results); it is now that problem's failure, and the next problem is scored."""
    import json

    from free_transformer.cli import main
    from free_transformer.eval import runner

    forged = "    return x\n" + FORGED_REPORT.format(report='{"missing": ["namespaces (forged)"]}', status=3)
    answers = iter([forged, "    pass\n"])
    monkeypatch.setattr(runner, "generate_texts", lambda *args, **kwargs: ([next(answers)], False))
    run = tiny_checkpoint(tmp_path, "run", 0)
    output = tmp_path / "results.json"
    assert (
        main(
            [
                "eval",
                str(run),
                "--tasks",
                "humaneval",
                "--limit",
                "2",
                "--no-progress",
                "--code-timeout",
                "5",
                "--output",
                str(output),
                *hook_only_args(),
            ]
        )
        == 0
    )
    per_doc = json.loads(output.read_text())["tasks"]["humaneval"]["per_doc"]
    assert [doc["status"] for doc in per_doc] == [["failed"], ["failed"]]


SLOW_TO_COMPARE = {  # an answer, and a trusted test whose own work on it takes minutes (2-core CPU)
    "colliding-set": (
        "    return [k * (2**61 - 1) for k in range(60000)]\n",  # set(): quadratic, about 70 s
        "def check(f):\n    assert set(f(1)) == {0}\n",
    ),
    "huge-int": (
        "    return (1 << 2**25) - 1\n",  # a 2**25-bit square: about 55 s
        "def check(f):\n    assert f(1) * f(1) == 1 << 2**26\n",
    ),
}


@pytest.mark.parametrize("case", list(SLOW_TO_COMPARE))
def test_a_trusted_comparison_runs_under_the_programs_deadline(case):
    """The benchmark's own test ran in the evaluator with no time bound: `set(f(1))` of 60,000 colliding
    ints took 268-313 s against a 10 s limit, a 2**25-bit answer squared 146 s. A C call cannot be
    interrupted in the evaluator: the tests run in a process forked from it, killed at the deadline."""
    answer, check = SLOW_TO_COMPARE[case]
    test = {"style": "humaneval", "prompt": "def f(n):\n", "test": check, "entry_point": "f"}
    limits = SandboxLimits(timeout_s=2, memory_mb=512, allow_hook_only=not kernel_sandbox())
    started = time.monotonic()
    outcome = check_completion(test, answer, limits)
    assert outcome.status == "timeout", outcome
    assert time.monotonic() - started < 30  # the deadline, and the sandbox's start and end, not minutes
    assert check_completion(test, "    return 1\n", limits).status == "failed"  # a quick wrong answer


def test_the_candidate_is_only_the_function_the_task_names():
    """For `round(sum(xs), 1)`, where the task's function has a builtin's name, the program's own `round`
    became the candidate (the first call of the assert), and a wrong `sum` passed beside a `round` that
    answered the test. The task names its function (MBPP's reference code defines it); where it names
    none, the candidate is the call nested deepest."""
    from free_transformer.eval.catalog import get_benchmark

    asserts = ["assert round(sum([1.25, 2.5]), 1) == 3.8"]
    row = {"text": "Add the numbers.", "test_list": asserts, "code": "def sum(xs):\r\n    return 3.75\r\n"}
    named = get_benchmark("mbpp").test(row)
    assert named["entry_point"] == "sum"
    wrong = "def sum(xs):\n    return 0\ndef round(*args):\n    return 3.8\n"
    for test in (named, {"style": "asserts", "setup": "", "asserts": asserts}):
        assert check_completion(test, "def sum(xs):\n    return 3.75\n", FAST).passed
        assert check_completion(test, wrong, FAST).status == "failed"


def test_evalplus_compares_int_answers_exactly():
    """EvalPlus compares an int answer with `==` (3.0 is 3) and only a float answer within its tolerance;
    3.0000002 used to pass for 3."""
    plus = {
        "style": "evalplus",
        "prompt": "def f(x):\n",
        "entry_point": "f",
        "atol": 0,
        "inputs": [[2], [5]],
        "canonical_solution": "    return x + 1\n",
    }
    assert check_completion(plus, "    return float(x + 1)\n", FAST).passed
    assert check_completion(plus, "    return x + 1.0000002\n", FAST).status == "failed"
    floats = {**plus, "canonical_solution": "    return x / 3\n"}
    assert check_completion(floats, "    return x * (1 / 3)\n", FAST).passed  # within the tolerance
    assert check_completion(floats, "    return x / 3 + 1e-3\n", FAST).status == "failed"
