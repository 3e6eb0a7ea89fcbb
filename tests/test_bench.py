"""Every script of bench/ runs: each one found there (a file with a `__main__` block) is run with --smoke, a tiny
size and one round, so that a renamed setting or module breaks a test rather than the next person's
measurement. A new script is run by default; one without --smoke fails here.

The runs are slow to start (torch, and some spawn processes or a server), so they run side by side, as many at
once as the machine has cores, started when the first of these tests asks; each test reads its own script's.
Every test that runs a script is marked `slow` (80 s of the default suite on a 2-core CPU): they guard the
measurements' tools, not the package, and .ci/run runs them in its slow step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MAIN_BLOCK = re.compile(r"^if __name__ == .__main__.:", re.M)
SCRIPTS = sorted(path.name for path in (ROOT / "bench").glob("*.py") if MAIN_BLOCK.search(path.read_text("utf-8")))
# (script, extra options, why): smoke runs beyond each script's plain --smoke
EXTRA = [
    ("generate.py", ("--parts", "d"), "part (d) compiles the decoding step with Inductor: 10-60 s on a CPU"),
    ("engine.py", ("--policy", "--steps"), "compiles the step of the prior and of the policy with Inductor: 35 s"),
]
TIMEOUT_S = 600


def smoke(script: str, *options: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, str(ROOT / "bench" / script), "--smoke", *options]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def smoke_runs(request):
    """{script: its --smoke run}, the scripts of the selected tests started at once on a pool of the machine's
    cores."""
    selected = [
        item.callspec.params["script"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_every_bench_script_runs_at_a_tiny_size"
    ]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        yield {script: pool.submit(smoke, script) for script in selected}


def check(run: subprocess.CompletedProcess, script: str) -> None:
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", run.stderr)
    if run.returncode and missing and missing.group(1).partition(".")[0] not in ("free_transformer", "common"):
        pytest.skip(f"bench/{script} needs {missing.group(1)} (pip install -e '.[bench]')")
    output = f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    assert run.returncode == 0, f"bench/{script} --smoke exited {run.returncode}:\n{output}"


def test_bench_holds_scripts_and_each_script_is_found():
    assert {"engine.py", "generate.py", "peers.py", "serve.py"} <= set(SCRIPTS)
    assert "common.py" not in SCRIPTS  # a module the scripts import, run through them


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_runs_at_a_tiny_size(script: str, smoke_runs: dict[str, Future]):
    check(smoke_runs[script].result(), script)


@pytest.mark.slow
@pytest.mark.parametrize(("script", "options", "why"), EXTRA, ids=[f"{s}{' '.join(o)}" for s, o, _ in EXTRA])
def test_the_slow_parts_of_a_bench_script_run_at_a_tiny_size(script: str, options: tuple[str, ...], why: str):
    check(smoke(script, *options), script)


@pytest.mark.slow
def test_the_engine_bench_measures_another_checkout_beside_this_one(tmp_path):
    run = smoke("engine.py", "--baseline-src", str(ROOT / "src"))  # this checkout against itself, in two workers
    check(run, "engine.py")
    assert f"other code: {ROOT / 'src' / 'free_transformer'}" in run.stdout
    rows = [line for line in run.stdout.splitlines() if line.split()[:1] == ["debug"]]
    assert len(rows) == 2 and all(line.endswith("x") and line.count("|") == 4 for line in rows), run.stdout
    missing = smoke("engine.py", "--baseline-src", str(tmp_path))
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [f"--baseline-src {tmp_path}: no free_transformer package there"]


@pytest.mark.slow
def test_the_engine_bench_measures_a_row_leaving_against_a_step():
    run = smoke("engine.py", "--leave-at", "2048")  # --smoke: 16 positions, B = 2
    check(run, "engine.py")
    assert "a row leaving at 16 positions against a step" in run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] == ["debug"]]
    assert len(rows) == 1 and rows[0][1] == "2" and rows[0][-2].endswith("x") and rows[0][-1].endswith("%"), run.stdout


@pytest.mark.slow
def test_the_engine_bench_times_the_host_work_alone(monkeypatch):
    """--host-only runs (this checkout against itself), and its stub runs the model for a prefill and once per
    batch size for one token, every later one-token call returning that first output."""
    run = smoke("engine.py", "--host-only", "--baseline-src", str(ROOT / "src"))
    check(run, "engine.py")
    assert [line.split()[:2] for line in run.stdout.splitlines() if line.split()[:1] == ["debug"]] == [
        ["debug", "1"],
        ["debug", "2"],
    ], run.stdout
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from engine import stub_steps

    from free_transformer import FreeTransformer, named_config

    model = FreeTransformer(named_config("debug"))
    calls = []
    forward = model.forward
    model.forward = lambda tokens, *args, **kwargs: calls.append(tuple(tokens.shape)) or forward(tokens, **kwargs)
    stub_steps(model)
    with torch.inference_mode():
        prefill = model(torch.ones(2, 3, dtype=torch.int64))
        steps = [model(torch.ones(B, 1, dtype=torch.int64), latents="prior") for B in (2, 2, 1, 2, 1)]
    assert calls == [(2, 3), (2, 1), (1, 1)] and prefill.logits.shape == (2, 3, 256)
    assert steps[0] is steps[1] is steps[3] and steps[2] is steps[4] and steps[2].logits.shape == (1, 1, 256)


@pytest.mark.slow
def test_the_engine_bench_measures_z_from_a_policy_against_the_prior_here_and_in_another_checkout():
    run = smoke("engine.py", "--policy", "--baseline-src", str(ROOT / "src"))  # this checkout against itself
    check(run, "engine.py --policy")
    assert "policy/prior" in run.stdout and f"other code: {ROOT / 'src' / 'free_transformer'}" in run.stdout
    rows = [line for line in run.stdout.splitlines() if line.split()[:1] == ["debug"]]
    assert len(rows) == 2 and all(line.endswith("x") and line.count("x |") == 2 for line in rows), run.stdout
    refused = smoke("engine.py", "--policy", "--steps", "--baseline-src", str(ROOT / "src"))
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
