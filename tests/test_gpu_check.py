"""scripts/gpu-check.sh on a machine without a GPU: its plan fits the budget with the targets' figures first,
every target of docs/gpu.md has a step that reads it, and the budgeted run (with stand-in steps) limits,
cuts and skips steps and writes the targets' table as it goes."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
from targets import TARGETS, read_figures, write_figure  # noqa: E402

# the figures the issue of a budgeted check puts first: the compiled training step, then compiled decoding
FIRST = {
    "train-base-mfu",
    "train-peak",
    "train-free-per-flop",
    "decode-b1-roof",
    "decode-b16-tokens",
    "decode-b1-free-base",
    "decode-b16-free-base",
}


def test_the_default_plan_runs_the_targets_figures_first_and_in_full_within_the_budget():
    rows = gpu_check.plan(gpu_check.STEPS, gpu_check.DEFAULT_BUDGET)
    assert sum(limit or 0 for _, limit, _ in rows) <= gpu_check.DEFAULT_BUDGET
    read_first = set()
    for step, limit, _ in rows:
        if read_first >= FIRST:
            break
        assert limit == step.most, f"{step.name} would not get its whole limit"
        read_first |= set(step.reads)
    assert read_first >= FIRST
    # the kernel profile of the compiled B=1 decoding step first in the decode part, with its whole limit
    assert [step.name for step, _, _ in rows[:5]] == [
        "train-compiled",
        "profile-decode",
        "decode-compiled",
        "pytest",
        "demo-paper",
    ]
    assert rows[3][1] is not None  # the test suite has a limit even when every step before it runs to its own


def test_every_target_is_read_by_exactly_one_step_and_docs_gpu_md_lists_each_threshold():
    readers = [target for step in gpu_check.STEPS for target in step.reads]
    assert sorted(readers) == sorted(TARGETS)
    table = (ROOT / "docs" / "gpu.md").read_text()
    listed = set(re.findall(r"^\| `([a-z0-9-]+)` \|", table, flags=re.M))
    with_threshold = {name for name, target in TARGETS.items() if target.threshold() != "-"}
    assert listed == with_threshold


def test_plan_from_the_script_on_a_machine_without_a_gpu():
    out = subprocess.run(
        ["bash", "scripts/gpu-check.sh", "--plan"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "budget 480 s" in lines[0]
    assert [line.split()[:2] for line in lines[2:5]] == [
        ["train-compiled", "120"],
        ["profile-decode", "90"],
        ["decode-compiled", "200"],
    ]
    assert re.search(r"^\s+(\d+) s in all", lines[-1]) and int(lines[-1].split()[0]) <= 480


def test_smoke_finds_every_steps_script_and_fails_on_a_renamed_one(monkeypatch, capsys):
    assert gpu_check.main(["--smoke"]) == 0
    renamed = gpu_check.Step("renamed", 60, 30, ("{python}", "bench/renamed.py"))
    monkeypatch.setattr(gpu_check, "STEPS", (*gpu_check.STEPS, renamed))
    assert gpu_check.main(["--smoke"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "gpu-check: steps run scripts that are not in the checkout: bench/renamed.py"
    )


def test_a_budget_that_is_not_positive_or_an_unknown_step_is_one_line_and_exit_2(capsys):
    for argv in (["--budget", "0", "--plan"], ["--only", "nope", "--plan"]):
        with pytest.raises(SystemExit) as stop:
            gpu_check.main(argv)
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("scripts/gpu-check.sh: error:")


def test_the_budgeted_run_limits_cuts_and_skips_steps_and_keeps_every_figure_it_reached(tmp_path):
    python = sys.executable
    figures = tmp_path / "figures.jsonl"
    write = f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); from targets import write_figure; "
    steps = (
        gpu_check.Step(
            "first",
            20,
            1,
            (
                "{python}",
                "-c",
                write + "write_figure(sys.argv[1], 'train-base-mfu', 0.7); print('mfu written')",
                "{figures}",
            ),
            reads=("train-base-mfu", "train-peak"),
            timed="demo-paper-seconds",
        ),
        gpu_check.Step(
            "slow",
            1,
            1,
            (
                "{python}",
                "-c",
                write + "write_figure(sys.argv[1], 'decode-b1-roof', 0.4); "
                "print('roof written', flush=True); import time; time.sleep(60)",
                "{figures}",
            ),
            reads=("decode-b1-roof", "decode-b16-tokens"),
        ),
        gpu_check.Step("too-long", 20, 10_000, ("{python}", "-c", "print('never')"), reads=("mapper-matmul-x",)),
        gpu_check.Step("missing", 20, 1, ("{python}", "-c", "print('never')"), needs="no_such_module_here"),
        gpu_check.Step("failing", 20, 1, ("{python}", "-c", "import sys; sys.exit(3)"), timed="mapper-matmul-x"),
    )
    check = gpu_check.Check(str(tmp_path), budget=30, python=python, steps=steps, header="# test")
    assert check.run() == 1
    status = {o.step.name: o.status for o in check.outcomes}
    assert status["first"] == "ok"
    assert status["slow"] == "cut at its limit, 1 s"
    assert status["too-long"].startswith("not run (") and "needs 10000" in status["too-long"]
    assert status["missing"] == "skipped (no_such_module_here does not import)"
    assert status["failing"] == "FAILED (exit 3)"
    rows = {row["id"]: row for row in json.loads((tmp_path / "targets.json").read_text())["targets"]}
    assert (rows["train-base-mfu"]["value"], rows["train-base-mfu"]["verdict"]) == (0.7, "PASS")
    assert rows["train-peak"]["verdict"] == "ok" and rows["train-peak"]["value"] is None  # ran, wrote no figure
    assert (rows["decode-b1-roof"]["value"], rows["decode-b1-roof"]["verdict"]) == (0.4, "FAIL")  # before the cut
    assert rows["decode-b16-tokens"]["verdict"] == "cut at its limit, 1 s"
    assert rows["mapper-matmul-x"]["verdict"].startswith("not run")
    report = (tmp_path / "gpu-report.md").read_text()
    assert report.index("## Targets") < report.index("## Steps") < report.index("roof written")
    assert "| `train-base-mfu` | baseline training MFU, compiled | >= 60.0% | 70.0% | PASS | first |" in report
    assert (tmp_path / "01-first.log").read_text() == "mfu written\n"
    written = read_figures(str(figures))  # a step's own wall time, when it succeeded
    assert 0 < written["demo-paper-seconds"]["value"] < 30 and "mapper-matmul-x" not in written


def test_a_figure_records_its_threshold_and_verdict(tmp_path):
    path = tmp_path / "f.jsonl"
    write_figure(str(path), "train-peak", 52.7, "H=16")
    write_figure(str(path), "decode-compile-cold", 61.0)
    write_figure(None, "train-peak", 1.0)  # no path: nothing written
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert first == {
        "id": "train-peak",
        "value": 52.7,
        "unit": "GiB",
        "target": "<= 45.0 GiB",
        "passed": False,
        "note": "H=16",
    }
    assert (second["target"], second["passed"]) == ("-", None)


def test_a_log_reads_as_a_terminal_shows_it(tmp_path):
    log = tmp_path / "log"
    log.write_bytes(b"start\n\rbar 0%\rbar 50%\rbar 100%\nnext line\r\nend")
    assert gpu_check.read_log(str(log)) == "start\nbar 100%\nnext line\nend"
