"""Test programs for generated code: the completion plus the benchmark's tests, as one Python
source that runs to its end exactly when every test passes. They run only in the sandbox, which
counts a pass only when the program ran to its end (an exit status of 0 could come from an exit
before the tests)."""

from __future__ import annotations

import json

from .sandbox import SandboxLimits, SandboxResult, run_python

_EQUAL = '''
import math as _math


def _equal(got, expected, atol):
    """EvalPlus-style comparison: exact, except floats within atol (and a 1e-7 relative margin)."""
    if isinstance(expected, float) or isinstance(got, float):
        try:
            return _math.isclose(got, expected, rel_tol=1e-7, abs_tol=atol) or got == expected
        except TypeError:
            return False
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        return type(got) is type(expected) and len(got) == len(expected) and all(
            _equal(g, e, atol) for g, e in zip(got, expected))
    return got == expected
'''


def build_program(test: dict, completion: str) -> str:
    """The source that checks `completion` against `test` (a benchmark's `test` dict)."""
    style = test["style"]
    if style == "humaneval":  # the completion continues the prompt's function
        return f"{test['prompt']}{completion}\n\n{test['test']}\n\ncheck({test['entry_point']})\n"
    if style == "asserts":  # MBPP: setup, the generated code, then each assert
        asserts = "\n".join(test["asserts"])
        return f"{test.get('setup') or ''}\n{completion}\n\n{asserts}\n"
    if style == "evalplus":  # differential testing against the canonical solution
        reference = test["prompt"] + test["canonical_solution"]
        return (
            f"{test['prompt']}{completion}\n\n"
            f"_candidate = {test['entry_point']}\n"
            f"{_EQUAL}\n"
            "import copy as _copy\nimport json as _json\n"
            f"_reference_ns = {{}}\nexec({reference!r}, _reference_ns)\n"
            f"_reference = _reference_ns[{test['entry_point']!r}]\n"
            f"for _args in _json.loads({json.dumps(test['inputs'])!r}):\n"
            "    _expected = _reference(*_copy.deepcopy(_args))\n"
            "    _got = _candidate(*_copy.deepcopy(_args))\n"
            f"    assert _equal(_got, _expected, {test['atol']!r}), f'wrong output for input {{_args!r}}'\n"
        )
    raise ValueError(f"unknown code test style {style!r}")


def check_completion(test: dict, completion: str, limits: SandboxLimits | None = None) -> SandboxResult:
    return run_python(build_program(test, completion), limits)
