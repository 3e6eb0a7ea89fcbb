#!/usr/bin/env python3
"""Whether two `free-transformer study` output folders hold the same report: report.md and results.json equal
except for wall-clock times (the minutes of "This invocation", wall_seconds, train_seconds), which no two
invocations share. What scripts/slurm-check.sh asks of a study run through Slurm and the same one run locally.

    python scripts/same_study_report.py OUT_A OUT_B

Prints the first difference; exits 0 when equal, 1 when not, 2 on unreadable input. Standard library only.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TIMES = ("wall_seconds", "train_seconds")


def without_times(value):
    """results.json with every wall-clock time removed."""
    if isinstance(value, dict):
        return {key: without_times(item) for key, item in value.items() if key not in TIMES}
    if isinstance(value, list):
        return [without_times(item) for item in value]
    return value


def first_difference(a, b, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = first_difference(a.get(key), b.get(key), f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{where}[{index}]")
            if found:
                return found
        return None
    return None if a == b else f"{where or 'results'}: {a!r} vs {b!r}"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    a, b = (Path(path) for path in argv)
    try:
        reports = [
            re.sub(r"This invocation: [0-9.]+ min wall", "This invocation: N min wall", (out / "report.md").read_text())
            for out in (a, b)
        ]
        results = [without_times(json.loads((out / "results.json").read_text())) for out in (a, b)]
    except (OSError, ValueError) as error:
        print(f"error: cannot read a report: {error}", file=sys.stderr)
        return 2
    different = first_difference(*results)
    if different is None and reports[0] != reports[1]:
        lines = [pair for pair in zip(*(report.splitlines() for report in reports)) if pair[0] != pair[1]]
        different = f"report.md: {lines[0][0]!r} vs {lines[0][1]!r}" if lines else "report.md: lengths differ"
    if different:
        print(f"the reports of {a} and {b} differ: {different}")
        return 1
    print(f"the reports of {a} and {b} are the same (wall-clock times aside)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
