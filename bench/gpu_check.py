"""Check a GPU machine within a time budget: the figures of docs/gpu.md's targets first, then the test suite on
the GPU, then the demo, then the rest, each step limited to what is left of the budget.

    python bench/gpu_check.py [OUT_DIR] [--budget SECONDS] [--only STEP ...] [--plan]

(scripts/gpu-check.sh runs this with $PYTHON.) Steps run in the order of STEPS. A step starts only when at
least its `least` seconds are left, and runs for at most min(its `most`, what is left); one that cannot
start is listed as not run, and later, shorter steps may still run. A step past its limit is stopped
(SIGTERM to its process group, SIGKILL 10 s later) and reported as cut, with its output so far.

OUT_DIR/gpu-report.md opens with one table, target against measured, PASS or FAIL per row, and
OUT_DIR/targets.json holds the same; both are rewritten after every step (and when this process is
stopped), so a run cut short still gives every figure it reached. The benchmarks write each figure as
soon as they have it (bench/targets.py: write_figure, to OUT_DIR/figures.jsonl). Each step's whole output
is in OUT_DIR/NN-name.log and in the report.

Inductor's caches (compiled code, Triton kernels, tuned configurations) go to .gpu-cache/inductor in the
checkout unless TORCHINDUCTOR_CACHE_DIR is set: a later run on the same GPU kind and torch version reads
them (docs/gpu.md says how to bring the folder along). The report says whether the run started cold.

Exits 2 with one line when no CUDA device is visible (except --plan, which runs anywhere); otherwise 0
when every step that ran succeeded, 1 when one failed or was cut. A missed target is not a failure of
the check: the table is where targets are read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from targets import TARGETS, format_value, read_figures, write_figure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BUDGET = 480
KILL_AFTER_S = 10  # after SIGTERM, before SIGKILL
CACHE_DIR = os.path.join(ROOT, ".gpu-cache", "inductor")
PAPER = ("--size", "paper-1.5b", "--dtype", "bf16")


@dataclass(frozen=True)
class Step:
    name: str
    most: int  # seconds: its limit when the budget has that much left
    least: int  # seconds: it does not start with less left
    command: tuple[str, ...]  # "{python}", "{figures}" and "{out}" are filled in at run time
    reads: tuple[str, ...] = ()  # the ids of bench/targets.py whose figures it writes
    needs: str | None = None  # a module that must import, else the step is skipped
    timed: str | None = None  # the id of bench/targets.py that its own wall time is, written when it succeeds
    what: str = ""


STEPS: tuple[Step, ...] = (
    Step(
        "train-compiled",
        120,
        60,
        ("{python}", "bench/step.py", *PAPER, "--bits", "16", "--compile", "--memory-here", "--figures", "{figures}"),
        reads=("train-base-mfu", "train-peak", "train-free-per-flop"),
        what="the training step, every block compiled (compile=true), Free H=16 and the baseline, B=4, T=2048",
    ),
    Step(
        "profile-decode",
        90,
        60,
        (
            "{python}",
            "bench/profile_steps.py",
            *PAPER,
            "--parts",
            "decode",
            "--decode-batch",
            "1",
            "--new-tokens",
            "64",
            "--untuned",
            "--top",
            "30",
        ),
        what="where the compiled B=1 decoding step's GPU time goes (the decode-b1-roof target): generate(compile=True) "
        "as decode-compiled calls it, compiled untuned; first in the decode part, it leaves Inductor's cache warm "
        "for decode-compiled",
    ),
    Step(
        "decode-compiled",
        200,
        120,
        (
            "{python}",
            "bench/generate.py",
            *PAPER,
            "--batch",
            "1",
            "16",
            "--new-tokens",
            "64",
            "--parts",
            "a",
            "--rounds",
            "5",
            "--compile",
            "--untuned",
            "--figures",
            "{figures}",
        ),
        reads=(
            "decode-b1-roof",
            "decode-b1-free-base",
            "decode-b16-tokens",
            "decode-b16-free-base",
            "decode-compile-cold",
            "decode-compile-warm",
        ),
        what="generate(compile=True), Free and baseline, two instances each, B=1 and 16, 64 new tokens; the step "
        "compiled without coordinate-descent tuning (its compile time is bounded; decode-tuned times it)",
    ),
    Step(
        "pytest",
        240,
        60,
        # -n 0: in one process, as the suite's GPU figures were measured (not one process a core on one GPU)
        ("{python}", "-m", "pytest", "--device", "cuda", "-n", "0", "-q", "-rs", "-p", "no:cacheprovider"),
        what="the tests that take the device fixture, on the GPU, and tests/test_cuda.py",
    ),
    Step(
        "demo-paper",
        300,
        150,
        (
            "{python}",
            "-m",
            "free_transformer.cli",
            "demo",
            "--preset",
            "paper",
            "--seeds",
            "3",
            "--device",
            "cuda",
            "--out",
            "{out}/demo-paper",
        ),
        reads=("demo-paper-seconds",),
        timed="demo-paper-seconds",
        what="the paper's synthetic recipe, 18 models sharing the GPU",
    ),
    Step(
        "serve",
        240,
        120,
        (
            "{python}",
            "bench/serve.py",
            *PAPER,
            "--device",
            "cuda",
            "--compile",
            "--clients",
            "16",
            "--max-batch",
            "16",
            "--tokens",
            "64",
            "--context",
            "256",
            "--rounds",
            "2",
            "--long-tokens",
            "128",
            "--queued",
            "4",
            "16",
            "--figures",
            "{figures}",
        ),
        reads=("serve-b16-vs-offline",),
        what="serve --compile (each bucket compiled and captured at start-up), 16 concurrent clients against "
        "offline generate(compile=True) at B=16, 64 tokens each",
    ),
    Step(
        "engine",
        90,
        45,
        (
            "{python}",
            "bench/engine.py",
            "--device",
            "cuda",
            "--presets",
            "cpu-small",
            "paper-1.5b",
            "--dtype",
            "bf16",
            "--batch",
            "1",
            "16",
            "--rounds",
            "3",
            "--figures",
            "{figures}",
        ),
        reads=("engine-b1-vs-bare", "engine-b16-vs-bare"),
        what="eager generate() against a bare loop of the model's forwards, B=1 and 16, 96 new tokens: the host "
        "time a decoding step spends outside the model",
    ),
    Step(
        "policy",
        90,
        45,
        (
            "{python}",
            "bench/engine.py",
            "--policy",
            "--device",
            "cuda",
            "--presets",
            "paper-1.5b",
            "--dtype",
            "bf16",
            "--batch",
            "1",
            "16",
            "--rounds",
            "3",
            "--figures",
            "{figures}",
        ),
        reads=("policy-b1-vs-prior", "policy-b16-vs-prior"),
        what="eager generate() with Z from a policy head (drawn in the step) against Z from the prior, B=1 and 16",
    ),
    Step(
        "decode-tuned",
        300,
        120,
        (
            "{python}",
            "bench/generate.py",
            *PAPER,
            "--parts",
            "d",
            "--batch",
            "1",
            "--new-tokens",
            "64",
            "--step-rounds",
            "5",
            "--figures",
            "{figures}",
        ),
        reads=("decode-step-b1-roof-tuned", "decode-step-b1-roof-untuned"),
        what="the B=1 decoding step alone: CUDA graph, compiled with coordinate-descent tuning (generate's default) "
        "and without; tuning may take minutes, so it runs here, cut with its time so far if need be",
    ),
    Step(
        "profile",
        240,
        120,
        (
            "{python}",
            "bench/profile_steps.py",
            *PAPER,
            "--new-tokens",
            "64",
            "--decode-batch",
            "16",
            "--untuned",
            "--top",
            "25",
        ),
        what="where an eager training step and the compiled B=16 decoding step spend their GPU time",
    ),
    Step(
        "profile-compiled",
        240,
        120,
        ("{python}", "bench/profile_steps.py", *PAPER, "--compile", "--parts", "train", "--top", "25"),
        what="where the compiled training step's GPU time goes (the MFU target)",
    ),
    Step(
        "mapper",
        120,
        60,
        ("{python}", "bench/mapper.py", "--quick", "--dtype", "bf16", "--figures", "{figures}"),
        reads=("mapper-matmul-x",),
        what="the Binary Mapper at N=8192, D=1536, H 8 and 16",
    ),
    Step(
        "step-eager",
        180,
        90,
        ("{python}", "bench/step.py", *PAPER, "--bits", "16", "--memory-here", "--figures", "{figures}"),
        reads=("train-free-per-flop-eager",),
        what="the training step, eager",
    ),
    Step(
        "generate-eager",
        180,
        90,
        (
            "{python}",
            "bench/generate.py",
            *PAPER,
            "--batch",
            "1",
            "16",
            "--new-tokens",
            "64",
            "--parts",
            "a",
            "--rounds",
            "5",
        ),
        what="eager decoding, Free and baseline",
    ),
    *(
        Step(
            f"peers-{dtype}",
            150,
            90,
            (
                "{python}",
                "bench/peers.py",
                "--layers",
                "16",
                "--dim",
                "1024",
                "--heads",
                "16",
                "--kv-heads",
                "4",
                "--ffn",
                "2816",
                "--vocab",
                "32000",
                "--seq-len",
                "1024",
                "--batch",
                "8",
                "--rounds",
                "3",
                "--dtype",
                dtype,
                "--figures",
                "{figures}",
            ),
            reads=tuple(f"peers-{dtype}-h{bits}-{what}" for bits in (16, 8) for what in ("time", "memory")),
            needs="x_transformers.free_transformer",
            what="against x-transformers 2.31.10 (pip install x-transformers==2.31.10)",
        )
        for dtype in ("bf16", "fp32")
    ),
    Step(
        "latent-kinds",
        120,
        60,
        ("{python}", "bench/latent_kinds.py", "--rounds", "5"),
        what="the latent variants at cpu-small sizes",
    ),
)


def plan(steps, budget: int) -> list[tuple[Step, int | None, int]]:
    """(step, its limit or None when it would not start, its latest start) for each step, each taking its
    whole limit: the worst case, so that whatever runs is within the budget."""
    rows, used = [], 0
    for step in steps:
        left = budget - used
        if left >= step.least:
            limit = min(step.most, left)
            rows.append((step, limit, used))
            used += limit
        else:
            rows.append((step, None, used))
    return rows


def print_plan(steps, budget: int) -> None:
    print(
        f"gpu-check plan: budget {budget} s, each step's limit what is left of it, at most its own "
        "(the worst case: every step using its whole limit)"
    )
    print(f"{'step':<17} {'limit s':>7} {'starts by s':>11}  reads")
    for step, limit, start in plan(steps, budget):
        limit_text = f"{limit:>7}" if limit is not None else f"{'not run':>7}"
        print(f"{step.name:<17} {limit_text} {start:>11}  {', '.join(step.reads) or '-'}")
    print(
        f"{'':<17} {sum(limit or 0 for _, limit, _ in plan(steps, budget)):>7} s in all; steps that end early "
        "leave their time to the later ones"
    )


@dataclass
class Outcome:
    step: Step
    status: str = "not run"  # ok, FAILED (exit N), cut at N s, not run (...), skipped (...)
    seconds: float = 0.0
    limit: int | None = None
    log: str = ""
    command: str = ""


@dataclass
class Check:
    out: str
    budget: int
    python: str
    steps: tuple[Step, ...]
    started: float = field(default_factory=time.monotonic)
    header: str = ""
    outcomes: list[Outcome] = field(default_factory=list)
    running: subprocess.Popen | None = None

    @property
    def figures_path(self) -> str:
        return os.path.join(self.out, "figures.jsonl")

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def run_step(self, number: int, step: Step) -> Outcome:
        outcome = Outcome(step)
        left = self.left()
        if step.needs and subprocess.run([self.python, "-c", f"import {step.needs}"], capture_output=True).returncode:
            outcome.status = f"skipped ({step.needs} does not import)"
            return outcome
        if left < step.least:
            outcome.status = f"not run ({left:.0f} s left, needs {step.least})"
            return outcome
        outcome.limit = int(min(step.most, left))
        command = [part.format(python=self.python, figures=self.figures_path, out=self.out) for part in step.command]
        outcome.command = shlex.join(command)
        log_path = os.path.join(self.out, f"{number:02d}-{step.name}.log")
        print(f"[gpu-check] {step.name} (limit {outcome.limit} s): {outcome.command}", file=sys.stderr, flush=True)
        began = time.monotonic()
        with open(log_path, "w") as log:
            self.running = subprocess.Popen(
                command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = self.running.wait(timeout=outcome.limit)
                outcome.status = "ok" if rc == 0 else f"FAILED (exit {rc})"
            except subprocess.TimeoutExpired:
                stop_group(self.running)
                outcome.status = f"cut at its limit, {outcome.limit} s"
            finally:
                self.running = None
        outcome.seconds = time.monotonic() - began
        outcome.log = read_log(log_path)
        if step.timed and outcome.status == "ok":
            write_figure(self.figures_path, step.timed, outcome.seconds, "wall time of the step")
        print(f"[gpu-check] {step.name}: {outcome.status}, {outcome.seconds:.0f} s", file=sys.stderr, flush=True)
        return outcome

    def run(self) -> int:
        self.write_report()
        for number, step in enumerate(self.steps, 1):
            self.outcomes.append(Outcome(step, status="running"))
            self.outcomes[-1] = self.run_step(number, step)
            self.write_report()
        failed = [o for o in self.outcomes if o.status.startswith(("FAILED", "cut"))]
        return 1 if failed else 0

    def write_report(self, stopped: bool = False) -> None:
        figures = read_figures(self.figures_path)
        rows = target_rows(figures, self.outcomes, self.steps)
        with open(os.path.join(self.out, "targets.json"), "w") as f:
            json.dump(
                {
                    "budget_s": self.budget,
                    "elapsed_s": round(time.monotonic() - self.started),
                    "stopped": stopped,
                    "targets": rows,
                },
                f,
                indent=1,
            )
        lines = [
            self.header,
            "",
            "## Targets",
            "",
            "| target | what | threshold | measured | verdict | step |",
            "|---|---|---|---|---|---|",
        ]
        for row in rows:
            measured = format_value(row["value"], row["unit"]) if row["value"] is not None else "-"
            note = f" ({row['note']})" if row.get("note") else ""
            lines.append(
                f"| `{row['id']}` | {row['what']}{note} | {row['target']} | {measured} | {row['verdict']} | "
                f"{row['step']} |"
            )
        lines += [
            "",
            f"## Steps (budget {self.budget} s, {time.monotonic() - self.started:.0f} s elapsed"
            f"{', stopped from outside' if stopped else ''})",
            "",
            "| step | status | seconds | limit |",
            "|---|---|---|---|",
        ]
        for outcome in self.outcomes:
            lines.append(
                f"| {outcome.step.name} | {outcome.status} | {outcome.seconds:.0f} | "
                f"{outcome.limit if outcome.limit is not None else '-'} |"
            )
        for outcome in self.outcomes:
            if outcome.command:
                lines += [
                    "",
                    f"## {outcome.step.name}: {outcome.status}, {outcome.seconds:.0f} s",
                    "",
                    outcome.step.what,
                    "",
                    f"`{outcome.command}`",
                    "",
                    "```",
                    outcome.log.rstrip(),
                    "```",
                ]
        with open(os.path.join(self.out, "gpu-report.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


def target_rows(figures: dict[str, dict], outcomes: list[Outcome], steps) -> list[dict]:
    """One row per target of bench/targets.py, in the order of the steps that read them."""
    status = {o.step.name: o.status for o in outcomes}
    rows = []
    for step in steps:
        for target_id in step.reads:
            target, figure = TARGETS[target_id], figures.get(target_id)
            if figure is not None:
                verdict = {True: "PASS", False: "FAIL", None: "-"}[figure["passed"]]
                value, note = figure["value"], figure.get("note", "")
            else:
                verdict, value, note = status.get(step.name, "not run"), None, ""
            rows.append(
                {
                    "id": target_id,
                    "what": target.what,
                    "target": target.threshold(),
                    "unit": target.unit,
                    "value": value,
                    "verdict": verdict,
                    "step": step.name,
                    "note": note,
                }
            )
    return rows


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the step's process group (a step's own children included), SIGKILL after KILL_AFTER_S."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def read_log(path: str) -> str:
    """The log as a terminal shows it: a progress bar rewrites its line after each carriage return, so each
    line keeps its last non-empty state."""
    with open(path, errors="replace", newline="") as f:
        lines = f.read().split("\n")
    return "\n".join(next((part for part in reversed(line.split("\r")) if part.strip()), "") for line in lines)


def header(python: str, budget: int, cache_files: int) -> str:
    versions = subprocess.run(
        [
            python,
            "-c",
            "import platform, torch; print('python', platform.python_version(), '| torch', torch.__version__, "
            "'CUDA', torch.version.cuda, '| device', torch.cuda.get_device_name(0))",
        ],
        capture_output=True,
        text=True,
    ).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = commit.returncode == 0 and subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=ROOT).returncode != 0
    smi = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        if _has("nvidia-smi")
        else "nvidia-smi not found"
    )
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR", CACHE_DIR)
    return "\n".join(
        [
            f"# GPU check, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
            "",
            f"commit {commit.stdout.strip() or 'unknown (no git repository)'}"
            f"{' (with uncommitted changes)' if dirty else ''}, host "
            f"{platform.node()}; {versions}; {smi}",
            "",
            f"Inductor cache {os.path.relpath(cache, ROOT)}: "
            f"{f'warm, {cache_files} files at the start' if cache_files else 'cold (empty at the start)'}.",
        ]
    )


def _has(command: str) -> bool:
    return any(os.access(os.path.join(d, command), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))


def scripts_here() -> list[str]:
    """The scripts of bench/, as a step's command names them."""
    return [f"bench/{name}" for name in os.listdir(os.path.join(ROOT, "bench")) if name.endswith(".py")]


def count_files(directory: str) -> int:
    return sum(len(files) for _, _, files in os.walk(directory))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", help="the report's folder (default gpu-check-<date>-<time>)")
    parser.add_argument("--budget", type=int, default=DEFAULT_BUDGET, help=f"seconds in all (default {DEFAULT_BUDGET})")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="STEP",
        help=f"these steps alone, in STEPS' order: {' '.join(s.name for s in STEPS)}",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the steps the budget allows, with their limits, and exit (any machine)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="--plan, then exit 1 unless every script a step runs is in the checkout (any machine)",
    )
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error("--budget must be a positive number of seconds")
    names = {s.name for s in STEPS}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        parser.error(f"unknown step {', '.join(unknown)} (steps: {' '.join(s.name for s in STEPS)})")
    steps = tuple(s for s in STEPS if args.only is None or s.name in args.only)
    if args.plan or args.smoke:
        print_plan(steps, args.budget)
        missing = sorted({part for s in steps for part in s.command if part.endswith(".py")} - set(scripts_here()))
        if args.smoke and missing:
            print(f"gpu-check: steps run scripts that are not in the checkout: {', '.join(missing)}", file=sys.stderr)
            return 1
        return 0
    python = os.environ.get("PYTHON") or sys.executable
    probe = subprocess.run(
        [python, "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"], capture_output=True
    )
    if probe.returncode:
        print(
            f"gpu-check: no CUDA device ({python}: torch missing or torch.cuda.is_available() is False)",
            file=sys.stderr,
        )
        return 2
    out = os.path.abspath(args.out or f"gpu-check-{datetime.now():%Y%m%d-%H%M%S}")
    os.makedirs(out, exist_ok=True)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", CACHE_DIR)
    os.makedirs(os.environ["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH")]))
    check = Check(out, args.budget, python, steps)
    check.header = header(python, args.budget, count_files(os.environ["TORCHINDUCTOR_CACHE_DIR"]))

    def stopped(signum, frame):  # the report keeps what was reached
        if check.running is not None:
            stop_group(check.running)
        check.write_report(stopped=True)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    rc = check.run()
    print(
        f"[gpu-check] report: {os.path.join(out, 'gpu-report.md')} ({time.monotonic() - check.started:.0f} s)",
        file=sys.stderr,
    )
    return rc


if __name__ == "__main__":
    sys.exit(main())
