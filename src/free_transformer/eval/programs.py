"""Checking generated code against a benchmark's tests, with the verdict decided here, outside the
sandbox. The generated code (with the prompt it continues, or MBPP's setup) runs only in a sandboxed
process; the benchmark's tests (trusted data) run in this process, and each of their calls of the
candidate crosses into the sandbox with its arguments and comes back as a plain value (`plain.py`).
So nothing the program does (exiting early, writing to a descriptor, patching builtins, returning an
object whose `==` always holds) can make a wrong answer pass: a test passes only when the plain
values it was given satisfy it. What this cannot check: a test that needs a callable, a generator or
another object back, or an argument the candidate mutates (only the result comes back).
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import importlib
import json
import math

from .sandbox import Broken, Sandbox, SandboxLimits, SandboxResult, Timeout


class _Remote:
    """A function of the sandboxed program, called from the trusted tests."""

    def __init__(self, box: Sandbox, name: str):
        self.box, self.name, self.__name__ = box, name, name

    def __call__(self, *args):
        return self.box.call(self.name, *args)


def _judge(source: str, names: list[str], limits: SandboxLimits | None, tests) -> SandboxResult:
    """Runs `source` in a sandbox, then `tests(box)` here: passed only when they raise nothing and
    every call came back as a plain value in time (`box.failure` keeps what a test might catch)."""
    with Sandbox(source, limits, names) as box:
        try:
            tests(box)
        except Timeout:
            return box.result("timeout", "ran past its time limit")
        except Exception as error:  # an assertion of the tests, the candidate's exception, a broken program
            return box.result("failed", f"{type(error).__name__}: {error}"[:2000])
        return box.result("passed")


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

    return _judge(test["prompt"] + completion, [entry], limits, tests)


def _free_names(asserts: list[str], setup: str) -> tuple[list[str], list[str]]:
    """(candidates, free names) of asserts-style tests: the names the asserts use that the setup does
    not define, and among them the candidates, the functions the asserts call that no builtin
    provides. A task whose function has a builtin's name (MBPP's `sum`) has none such: its candidate
    is then the function that its first assert calls first."""
    used, called, bound = set(), [], set()
    for line in asserts:
        for node in ast.walk(ast.parse(line)):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                called.append(node.func.id)
    for node in ast.walk(ast.parse(setup)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).partition(".")[0] for alias in node.names}
    free = [name for name in called if name not in bound]
    candidates = sorted({name for name in free if not hasattr(builtins, name)}) or free[:1]
    return candidates, sorted(used - bound)


def _asserts(test: dict, completion: str, limits) -> SandboxResult:
    setup = test.get("setup") or ""
    asserts = list(test["asserts"])
    candidates, names = _free_names(asserts, setup)

    def tests(box):
        namespace = _trusted_namespace(setup)
        _bind(namespace, box, candidates, names)
        for line in asserts:
            exec(compile(line, "<benchmark test>", "exec"), namespace)

    return _judge(f"{setup}\n{completion}\n", candidates, limits, tests)


def equal(got, expected, atol: float) -> bool:
    """EvalPlus-style comparison: exact, except floats within atol (and a 1e-7 relative margin); NaN
    equals NaN (a canonical answer may be NaN)."""
    if isinstance(expected, float) and math.isnan(expected):
        return isinstance(got, float) and math.isnan(got)
    if isinstance(expected, float) or isinstance(got, float):
        try:
            return math.isclose(got, expected, rel_tol=1e-7, abs_tol=atol) or got == expected
        except TypeError:
            return False
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
        outputs = []

        def run(box):
            for args in test["inputs"]:
                try:
                    outputs.append(("value", box.call(test["entry_point"], *args)))
                except (Timeout, Broken):
                    raise
                except Exception as error:
                    outputs.append(("raised", f"{type(error).__name__}: {error}"))

        result = _judge(test["prompt"] + test["canonical_solution"], [test["entry_point"]], limits, run)
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

    return _judge(test["prompt"] + completion, [entry], limits, tests)


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
