"""Checking generated code against a benchmark's tests, with the verdict decided here, outside the
sandbox. The generated code (with the prompt it continues, or MBPP's setup) runs only in a sandboxed
process; the benchmark's tests (trusted data) run in a process forked from this one, and each of their
calls of the candidate crosses into the sandbox with its arguments and comes back as a plain value
(`plain.py`). So nothing the program does (exiting early, writing to a descriptor, patching builtins,
returning an object whose `==` always holds) can make a wrong answer pass: a test passes only when the
plain values it was given satisfy it. The tests run under the program's own deadline: a comparison
the answers make slow (a set of colliding ints, a huge int multiplied) is one C call that no signal
interrupts, so the forked process that runs it is killed at the deadline instead. What this cannot
check: a test that needs a callable, a generator or another object back, or an argument the candidate
mutates (only the result comes back).
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import hashlib
import importlib
import json
import math
import os
import select
import signal
import time

from . import plain
from .sandbox import Broken, Sandbox, SandboxLimits, SandboxResult, Timeout


class _Remote:
    """A function of the sandboxed program, called from the trusted tests."""

    def __init__(self, box: Sandbox, name: str):
        self.box, self.name, self.__name__ = box, name, name

    def __call__(self, *args):
        return self.box.call(self.name, *args)


def _judge(source: str, names: list[str], limits: SandboxLimits | None, tests) -> tuple[SandboxResult, object]:
    """Runs `source` in a sandbox, then `tests(box)` under its deadline (`_verdict`): passed only when
    they raise nothing and every call came back as a plain value in time (`box.failure` keeps what a
    test might catch); with the plain value `tests` returned when they passed."""
    with Sandbox(source, limits, names) as box:
        status, reason, value = _verdict(box, tests)
        return box.result(status, reason), value


def _verdict(box: Sandbox, tests) -> tuple[str, str, object]:
    """(status, reason, value) of `tests(box)`, run in a process forked from this one and killed at the
    program's deadline."""
    verdict_r, verdict_w = os.pipe()
    judge = os.fork()
    if judge == 0:  # the judge: it never returns
        _judge_in_child(box, tests, verdict_w)
    os.close(verdict_w)
    text = b""
    try:
        while True:
            remaining = box.deadline - time.monotonic()
            if remaining <= 0 or not select.select([verdict_r], [], [], remaining)[0]:
                return "timeout", "its tests ran past its time limit", None
            chunk = os.read(verdict_r, 1 << 20)
            if not chunk:
                break
            text += chunk
    finally:
        os.close(verdict_r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(judge, signal.SIGKILL)
        os.waitpid(judge, 0)
    try:
        status, reason, value = plain.decode(text, box.deadline)
    except plain.Overdue:
        return "timeout", "its tests ran past its time limit", None
    except (ValueError, TypeError):
        return "failed", "its tests ended without a verdict", None
    return status, reason, value


def _judge_in_child(box: Sandbox, tests, verdict_w: int) -> None:
    """In the forked process: run `tests(box)`, write (status, reason, value) on `verdict_w`, and exit
    (os._exit: nothing of the evaluator's runs here, no atexit handler, no buffer flushed twice)."""
    try:
        for number in (signal.SIGINT, signal.SIGTERM):  # the evaluator's handlers are not this process's
            signal.signal(number, signal.SIG_DFL)
        keep = sorted({verdict_w, *box.channel})
        start = 3  # descriptors of other threads' sandboxes would delay their end-of-file: closed
        for fd in keep:
            os.closerange(start, fd)
            start = fd + 1
        os.closerange(start, 1 << 20)
        try:
            outcome: tuple = ("passed", "", tests(box))
        except Timeout:
            outcome = ("timeout", "ran past its time limit", None)
        except Exception as error:  # an assertion of the tests, the candidate's exception, a broken program
            outcome = ("failed", f"{type(error).__name__}: {error}"[:2000], None)
        if box.failure:
            outcome = (*box.failure, None)
        try:
            text = plain.encode(outcome).encode()
        except plain.NotPlain as error:
            text = plain.encode(("failed", f"the tests gave back no plain value: {error}", None)).encode()
        while text:
            text = text[os.write(verdict_w, text) :]
    finally:
        os._exit(0)


def _trusted_namespace(source: str) -> dict:
    namespace: dict = {"__name__": "__benchmark__"}
    exec(compile(source, "<benchmark>", "exec"), namespace)
    return namespace


PURE_MODULES = frozenset(
    {
        "math",
        "cmath",
        "re",
        "collections",
        "itertools",
        "functools",
        "heapq",
        "bisect",
        "string",
        "operator",
        "statistics",
        "fractions",
        "decimal",
        "datetime",
        "copy",
        "json",
        "array",
        "numbers",
        "typing",
        "random",
        "unicodedata",
        "textwrap",
        "calendar",
    }
)
"""Standard modules a test may name without importing them (as the original harness let it use the
program's imports): the evaluator imports its own (importing them runs nothing else: `antigravity`
would open a browser here)."""


def _bind(namespace: dict, box: Sandbox, candidates: list[str], names: list[str]) -> None:
    """The test's free `names`: the candidates (functions of the program) as _Remote, PURE_MODULES as
    the evaluator's own modules. Nothing else of the program's crosses: a builtin the test calls
    (`set`, `sorted`, `len`) is the real one whatever the program defines."""
    for name in candidates:
        if box.names.get(name) == ("callable",):
            namespace[name] = _Remote(box, name)
    for name in names:
        if name in PURE_MODULES and name not in namespace:
            namespace[name] = importlib.import_module(name)


def _definitions(prompt: str) -> str:
    """The prompt as a module (its helpers, which a test may call): it ends with the signature and
    docstring of the function to write, a valid body when there is a docstring."""
    for source in (prompt, prompt.rstrip() + "\n    pass\n"):
        try:
            ast.parse(source)
            return source
        except SyntaxError:
            continue
    return ""


def _humaneval(test: dict, completion: str, limits) -> SandboxResult:
    entry = test["entry_point"]

    def tests(box):
        namespace = _trusted_namespace(_definitions(test["prompt"]) + "\n" + test["test"])
        if box.names.get(entry) != ("callable",):
            raise NameError(f"the program defines no function {entry}")
        namespace[entry] = _Remote(box, entry)  # as in the original harness, where a test may name it
        namespace["check"](namespace[entry])

    return _judge(test["prompt"] + completion, [entry], limits, tests)[0]


def _calls(source: str) -> list[str]:
    """The names `source` calls (`name(...)`), outermost first (breadth first)."""
    return [
        node.func.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]


def named_function(code: str, asserts: list[str]) -> str | None:
    """The function an asserts-style task names: the first one its reference `code` defines at the top
    level that the asserts call; None when there is none (or the code does not parse)."""
    try:
        defined = [node.name for node in ast.parse(code).body if isinstance(node, ast.FunctionDef)]
    except SyntaxError:
        return None
    called = {name for line in asserts for name in _calls(line)}
    return next((name for name in defined if name in called), None)


def _free_names(asserts: list[str], setup: str, entry: str | None = None) -> tuple[list[str], list[str]]:
    """(candidates, free names) of asserts-style tests: the names the asserts use that the setup does
    not define, and among them the candidates, the functions the asserts call that no builtin
    provides, and the function the task names (`entry`, which may have a builtin's name: MBPP's `sum`).
    A builtin the tests call around it stays the evaluator's own (`round(sum(x))` crosses for `sum`
    only). A task naming none, whose asserts call builtins' names only, has for candidate the call
    nested deepest in its first assert."""
    used, bound = set(), set()
    for line in asserts:
        used |= {node.id for node in ast.walk(ast.parse(line)) if isinstance(node, ast.Name)}
    for node in ast.walk(ast.parse(setup)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).partition(".")[0] for alias in node.names}
    free = [name for line in asserts for name in _calls(line) if name not in bound]
    candidates = {name for name in free if not hasattr(builtins, name)} | ({entry} if entry else set())
    if not candidates and asserts:  # breadth first: the last call is nested deepest
        candidates = set([name for name in _calls(asserts[0]) if name not in bound][-1:])
    return sorted(candidates), sorted(used - bound)


def _asserts(test: dict, completion: str, limits) -> SandboxResult:
    setup = test.get("setup") or ""
    asserts = list(test["asserts"])
    candidates, names = _free_names(asserts, setup, test.get("entry_point"))

    def tests(box):
        namespace = _trusted_namespace(setup)
        _bind(namespace, box, candidates, names)
        for line in asserts:
            exec(compile(line, "<benchmark test>", "exec"), namespace)

    return _judge(f"{setup}\n{completion}\n", candidates, limits, tests)[0]


def equal(got, expected, atol: float) -> bool:
    """EvalPlus's comparison: exact (`==`, so 3.0 is 3), except that a float answer may also be a float
    within atol (1e-6 where the task gives 0, as EvalPlus enforces) and a 1e-7 relative margin of it;
    an int answer is never approximated (3.0000002 is not 3). NaN equals NaN (a canonical answer may
    be NaN)."""
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(got, float) and math.isnan(got)
    if isinstance(expected, float):
        close = type(got) is float and math.isclose(got, expected, rel_tol=1e-7, abs_tol=atol or 1e-6)
        return close or got == expected
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        return (
            type(got) is type(expected)
            and len(got) == len(expected)
            and all(equal(g, e, atol) for g, e in zip(got, expected))
        )
    return got == expected


_REFERENCE_OUTPUTS: dict[str, tuple] = {}  # digest of a test -> its reference outputs (a few kept)


def _reference_outputs(test: dict, limits) -> tuple:
    """The canonical solution's result on every input, computed in a sandbox of its own (it is code
    too); ("raised", ...) for an input where it raises."""
    key = hashlib.sha256(
        json.dumps([test["prompt"], test["canonical_solution"], test["entry_point"], test["inputs"]]).encode()
    ).hexdigest()
    if key not in _REFERENCE_OUTPUTS:

        def run(box):
            outputs = []
            for args in test["inputs"]:
                try:
                    outputs.append(("value", box.call(test["entry_point"], *args)))
                except (Timeout, Broken):
                    raise
                except Exception as error:
                    outputs.append(("raised", f"{type(error).__name__}: {error}"))
            return outputs

        result, outputs = _judge(test["prompt"] + test["canonical_solution"], [test["entry_point"]], limits, run)
        if not result.passed:
            return ("failed", f"the canonical solution itself: {result.reason}")
        if len(_REFERENCE_OUTPUTS) >= 32:
            _REFERENCE_OUTPUTS.pop(next(iter(_REFERENCE_OUTPUTS)))
        _REFERENCE_OUTPUTS[key] = ("ok", outputs)
    return _REFERENCE_OUTPUTS[key]


def _evalplus(test: dict, completion: str, limits) -> SandboxResult:
    """Differential testing against the canonical solution."""
    entry, atol = test["entry_point"], test["atol"]
    state, expected = _reference_outputs(test, limits)

    def tests(box):
        if state != "ok":
            raise RuntimeError(expected)
        for args, (kind, want) in zip(test["inputs"], expected):
            if kind == "raised":
                raise RuntimeError(f"the canonical solution raised {want} for input {args!r}")
            got = box.call(entry, *args)
            assert equal(got, want, atol), f"wrong output for input {args!r}"

    return _judge(test["prompt"] + completion, [entry], limits, tests)[0]


def check_completion(test: dict, completion: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """The verdict on `completion` for a benchmark's `test` dict (styles "humaneval", "asserts" (MBPP),
    "evalplus"): status "passed" only when every test held on the plain values the program returned."""
    style = test["style"]
    if style == "humaneval":
        return _humaneval(test, completion, limits)
    if style == "asserts":
        return _asserts(test, completion, limits)
    if style == "evalplus":
        return _evalplus(test, completion, limits)
    raise ValueError(f"unknown code test style {style!r}")
