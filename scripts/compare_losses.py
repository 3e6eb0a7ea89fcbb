#!/usr/bin/env python3
"""Compare the per-step losses of two training runs, or of a run and a golden loss file.

    python scripts/compare_losses.py RUN_A RUN_B --atol 1e-5
    python scripts/compare_losses.py RUN tests/golden/debug-free.json --atol 1e-5
    python scripts/compare_losses.py RUN --save-golden tests/golden/new.json --command "free-transformer train ..."

A and B are run directories (their metrics.jsonl), metrics.jsonl files, or golden JSON files
({"command": ..., "steps": [{"step": 1, "loss": ...}, ...]}). Every step logged in both is compared;
the steps must be the same. Prints one line per step and the largest absolute difference per key; exits
0 when every |a - b| <= atol + rtol * |b|, 1 otherwise, 2 on unreadable input. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

KEYS = ("loss", "cross_entropy_bits", "kl_bits")


def read_losses(path: str | Path) -> dict[int, dict]:
    """step -> logged values, from a run directory, a metrics.jsonl file or a golden JSON file."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    text = path.read_text()
    if path.suffix == ".json":
        rows = json.loads(text)["steps"]
    else:  # JSON lines; a last line cut short by a killed run is ignored
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return {int(row["step"]): row for row in rows}


def compare(a: dict[int, dict], b: dict[int, dict], keys=("loss",), atol: float = 0.0, rtol: float = 0.0):
    """(ok, lines, max_abs_diff per key) comparing the steps of a and b."""
    if sorted(a) != sorted(b):
        return False, [f"steps differ: {sorted(a)} vs {sorted(b)}"], {}
    worst = dict.fromkeys(keys, 0.0)
    lines, ok = [], True
    for step in sorted(a):
        cells = []
        for key in keys:
            x, y = float(a[step][key]), float(b[step][key])
            diff = abs(x - y)
            worst[key] = max(worst[key], diff)
            bad = not diff <= atol + rtol * abs(y)  # NaN fails
            ok &= not bad
            cells.append(f"{key} {x:.9g} {y:.9g} |diff| {diff:.3g}{' FAIL' if bad else ''}")
        lines.append(f"step {step:5d}  " + "  ".join(cells))
    return ok, lines, worst


def save_golden(run: dict[int, dict], out: Path, command: str, note: str) -> None:
    steps = [{"step": step, **{k: run[step][k] for k in KEYS if k in run[step]}} for step in sorted(run)]
    golden = {"note": note, "command": command, "python": platform.python_version()}
    try:  # the torch version that produced it, when torch is at hand
        import torch

        golden["torch"] = torch.__version__
    except ImportError:
        pass
    header = json.dumps(golden, indent=1)[:-2]  # without the closing brace: the steps go last, one a line
    rows = ",\n".join("  " + json.dumps(row) for row in steps)
    out.write_text(f'{header},\n "steps": [\n{rows}\n ]\n}}\n')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="run directory, metrics.jsonl or golden JSON")
    parser.add_argument("b", nargs="?", help="run directory, metrics.jsonl or golden JSON")
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: bit-identical)")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance, times |b|")
    parser.add_argument("--keys", default="loss", help=f"comma-separated logged values to compare ({','.join(KEYS)})")
    parser.add_argument("--quiet", "-q", action="store_true", help="print only the summary")
    parser.add_argument("--save-golden", metavar="OUT", help="write A's losses as a golden file instead of comparing")
    parser.add_argument("--command", default="", help="with --save-golden: the command that produced A")
    parser.add_argument("--note", default="", help="with --save-golden: what the golden file is for")
    args = parser.parse_args(argv)
    try:
        a = read_losses(args.a)
        if args.save_golden:
            save_golden(a, Path(args.save_golden), args.command, args.note)
            print(f"wrote {args.save_golden} ({len(a)} steps)")
            return 0
        if args.b is None:
            parser.error("B is required unless --save-golden is given")
        b = read_losses(args.b)
        keys = tuple(k for k in args.keys.split(",") if k)
        ok, lines, worst = compare(a, b, keys, args.atol, args.rtol)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"error: cannot read losses: {error!r}", file=sys.stderr)
        return 2
    if not args.quiet:
        print("\n".join(lines))
    summary = ", ".join(f"max |diff| {key} {value:.3g}" for key, value in worst.items())
    print(f"{'OK' if ok else 'MISMATCH'}: {len(a)} steps, {summary} (atol {args.atol:g}, rtol {args.rtol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
