"""`free-transformer generate` over prompts of many lengths against prompts of one length, on the CPU: the
decoding engine batches rows of any lengths together, so a prompt file of mixed lengths (every real one)
should decode about as fast as one of equal lengths.

A random cpu-small model (byte vocabulary) saved as a checkpoint; two prompt files of 96 prompts each, one with
48 different lengths (2 to 96 bytes, each twice) and one with every prompt of the same length (49 bytes, the
mean); one sample each, 48 new tokens, --batch-size 64. Each file's command is timed as a whole process
(the commands interleaved, `--rounds` times), beside a start-up command (one prompt, one new token) whose
time is taken off both. Target (bench/README.md): decoding the mixed lengths at >= 0.75x the speed of one
length.

    PYTHONPATH=src python bench/prompt_lengths.py [--rounds 2] [--threads T]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import add_smoke_argument

from free_transformer.model.config import named_config
from free_transformer.model.transformer import FreeTransformer
from free_transformer.runs.checkpoint import save_checkpoint

TARGET = 0.75
PROMPTS, NEW_TOKENS = 96, 48


def prompt_files(directory: Path, prompts: int) -> dict[str, Path]:
    letters = "abcdefghijklmnopqrstuvwxyz" * (prompts // 26 + 1)
    mixed = [letters[: 2 * (k // 2 + 1)] for k in range(prompts)]  # prompts / 2 lengths, 2..prompts, each twice
    same = [letters[: prompts // 2 + 1]] * prompts  # their mean
    files = {"mixed": directory / "mixed.txt", "same": directory / "same.txt", "start-up": directory / "one.txt"}
    for name, lines in (("mixed", mixed), ("same", same), ("start-up", ["ab"])):
        files[name].write_text("\n".join(lines) + "\n")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the commands (default: torch's)")
    add_smoke_argument(parser)
    args = parser.parse_args()
    prompts, new_tokens = (8, 4) if args.smoke else (PROMPTS, NEW_TOKENS)
    args.rounds = 1 if args.smoke else args.rounds
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        torch.manual_seed(0)
        save_checkpoint(
            directory / "model", 1, FreeTransformer(named_config("cpu-small", max_seq_len=256)), {"tokenizer": "byte"}
        )
        files = prompt_files(directory, prompts)
        times: dict[str, list[float]] = {name: [] for name in files}
        for _ in range(args.rounds):
            for name, path in files.items():
                new = 1 if name == "start-up" else new_tokens
                command = [
                    sys.executable,
                    "-m",
                    "free_transformer.cli",
                    "generate",
                    str(directory / "model"),
                    "--prompts-file",
                    str(path),
                    "-n",
                    "1",
                    "--max-new-tokens",
                    str(new),
                    "--batch-size",
                    "64",
                    "--device",
                    "cpu",
                ]
                started = time.perf_counter()
                subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
                times[name].append(time.perf_counter() - started)
    start_up = statistics.median(times["start-up"])
    decode = {name: statistics.median(times[name]) - start_up for name in ("mixed", "same")}
    ratio = decode["same"] / decode["mixed"]
    for name in files:
        print(f"{name:>8}: {statistics.median(times[name]):6.2f} s a run (median of {args.rounds})")
    print(
        f"decoding alone (start-up taken off): mixed {decode['mixed']:.2f} s, same {decode['same']:.2f} s; "
        f"mixed lengths at {ratio:.2f}x the speed of one length; target >= {TARGET}: "
        f"{'PASS' if ratio >= TARGET else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
