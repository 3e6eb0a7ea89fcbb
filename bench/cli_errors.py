"""How long `free-transformer` takes to refuse a mistyped setting, a missing run or checkpoint and a prompt past
the model's context, beside `--help`: each command a whole process, the commands interleaved, the median of
`--rounds` runs each. The settings, the run's saved config and the prompts are checked before torch is imported,
so a one-line error should cost about what the help costs. Target (bench/README.md): each refused in under 2 s.

    PYTHONPATH=src python bench/cli_errors.py [--rounds 5]
    PYTHONPATH=src python bench/cli_errors.py --smoke     # one round: checks that the commands run
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 2.0
COMMANDS = {
    "train --help": (["train", "--help"], 0),
    "train stepz=5": (["train", "stepz=5"], 2),
    "train --out x optim.lr=-1": (["train", "--out", "x", "optim.lr=-1"], 2),
    "demo stepz=5": (["demo", "stepz=5"], 2),
    "generate x --temperature -1": (["generate", "x", "--prompt", "a", "--temperature", "-1"], 2),
    "generate no-such-run": (["generate", "no-such-run", "--prompt", "a"], 2),
    "generate RUN-without-checkpoint": (["generate", "{empty}", "--prompt", "a"], 2),
    "generate RUN, prompt past context": (["generate", "{run}", "--prompt", "K" * 100], 2),
}


def tiny_run(folder: Path) -> Path:
    """A run directory with one checkpoint of the debug model (byte tokens, a 64-token context)."""
    from free_transformer import FreeTransformer, named_config
    from free_transformer.runs.checkpoint import save_checkpoint

    run = folder / "run"
    save_checkpoint(run, 1, FreeTransformer(named_config("debug", max_seq_len=64)), {"tokenizer": "byte"})
    return run


def seconds(argv: list[str], code: int) -> float:
    """The wall time of one `free-transformer ARGV` process, which must exit with `code` (an error: one line)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "free_transformer.cli", *argv], capture_output=True, text=True, timeout=300
    )
    elapsed = time.perf_counter() - started
    if done.returncode != code or (code and len(done.stderr.strip().splitlines()) != 1):
        raise SystemExit(f"free-transformer {' '.join(argv)}: exit {done.returncode}, stderr {done.stderr[-500:]!r}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("--smoke", action="store_true", help="one round, to check that the commands run")
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    with tempfile.TemporaryDirectory() as folder:
        paths = {"run": str(tiny_run(Path(folder))), "empty": str(Path(folder) / "empty")}
        Path(paths["empty"]).mkdir()
        for _ in range(rounds):  # interleaved: a change of the machine's load falls on every command alike
            for name, (argv, code) in COMMANDS.items():
                times[name].append(seconds([word.format(**paths) for word in argv], code))
    print(f"{'command':<36} {'median s':>9}  (of {rounds})")
    for name, values in times.items():
        print(f"{name:<36} {statistics.median(values):>9.2f}")
    worst = max(statistics.median(values) for name, values in times.items() if "--help" not in name)
    print(f"slowest error {worst:.2f} s: {'meets' if worst < TARGET_S else 'misses'} the target < {TARGET_S:.0f} s")


if __name__ == "__main__":
    main()
