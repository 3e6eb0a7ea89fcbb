"""README's and the docs' commands, run as a user runs them: every shell block of README.md and docs/*.md, in a
fresh directory that holds this checkout's configs/, scripts/ and tests/golden/, with `free-transformer` and
`python` on PATH. Quick commands run as written. Long ones (training to convergence, the demo, the study) run
through their --dry-run, which checks the whole configuration, data included (DRY_RUN); a few run on fewer
documents or steps (SMALLER); what cannot run on a CPU without the network is skipped (SKIPPED). Each entry
says why, and a command that none matches runs as written: a new block is tested by default.

A run that a block uses but that an earlier block trains (only checked here) is one tiny trained run, copied
where the block expects it (RUNS)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from documented_kind import documented_kind_source

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = ("bash", "sh", "shell")

# (pattern at the start of a command, why): commands that are not run here
SKIPPED = [
    (
        r"python3 -m venv|\.venv/bin/pip|pip install",
        "installs packages from the network (tests/test_install.py checks what the install hints say)",
    ),
    (r"\.venv/bin/(python -m pytest|ruff|mypy)", "the checks and tests themselves (test_readme_names_ci_and_...)"),
    (r"source \.venv/bin/activate", "the environment the tests run in is set up"),
    (r"pip wheel", "builds the checkout's wheel (tests/test_install.py builds it)"),
    (r"torchrun --nnodes", "several machines"),
    (r"torchrun", "many processes training a real corpus (tests/test_distributed.py runs torchrun on a CPU)"),
    (r"free-transformer (study|demo) .*--launcher slurm", "a Slurm cluster (tests/test_slurm.py)"),
    (r"free-transformer (demo|eval|serve) .*--device cuda", "a GPU"),
    (r"bash scripts/gpu-check\.sh|PYTHON=", "a GPU (tests/test_gpu_check.py runs its --plan, which needs none)"),
    (
        r"free-transformer consolidate",
        "a sharded (DCP) checkpoint, written by torchrun (tests/test_distributed.py consolidates one)",
    ),
    (r"free-transformer generate runs/x --prompt", "the run consolidated above"),
    (r"free-transformer serve", "a server that runs until stopped (tests/test_serve.py runs it with real clients)"),
    (r"curl ", "asks the server of the block above"),
    (
        r"lm_eval --model local-completions",
        "asks the server of the line above (tests/test_serve_clients.py runs this lm_eval against a real serve)",
    ),
    (r"free-transformer generate \S+ --interactive", "waits for a person's input (tests/test_sampling.py drives it)"),
    (
        r"free-transformer convert /models/|free-transformer convert runs/tinyllama|free-transformer train --config "
        r"configs/tinyllama",
        "TinyLlama's 1.1B weights, downloaded (tests/test_hf_conversion.py converts a tiny Llama)",
    ),
    (r"free-transformer eval runs/\S+-8b", "the paper's 8B models and the RACE and HumanEval+ files"),
    (r"free-transformer compare runs/baseline-8b", "the 8B models' evaluations above"),
    (
        r"free-transformer train .*data\.text\.path=/data/|free-transformer train .*data\.text\.path=notes\.jsonl\.gz",
        "the user's own corpus (tests/test_readers.py reads each format)",
    ),
    (
        r"python -m free_transformer\.eval\.lm_eval_adapter run .*--tasks my_task",
        "the user's own lm-eval task (tests/test_eval_lm_eval.py runs one)",
    ),
    (
        r"python - <<'PY'\nimport time, torch\nfrom free_transformer\.eval\.likelihood import _nll_rows",
        "a timing of a 4 x 256 x 50257 softmax (bench/ holds the benchmarks)",
    ),
    (r"python scripts/compare_losses\.py runs/a ", "runs of the reader's own"),
    (r"python scripts/compare_losses\.py runs/golden --save-golden", "rewrites the checkout's golden file"),
]
# (pattern, why): long commands, run with --dry-run (everything checked, nothing trained)
DRY_RUN = [
    (r"free-transformer demo", "the demo trains for 12 minutes and more"),
    (r"free-transformer study", "the study trains for 49 minutes and more"),
    (r"free-transformer train --config configs/(?!shakespeare-short)", "trains a real corpus to convergence"),
    (r"free-transformer train --out runs/try data\.kind=letters .*steps=2000", "2,000 steps"),
    (r"free-transformer train -c configs/letters-free\.yaml", "the letters to convergence"),
]
# (pattern, replacement, why): commands run smaller than written
SMALLER = [
    (
        r"(free-transformer train --config configs/shakespeare-short\.yaml .*)$",
        r"\1 steps=2",
        "2 of the short recipe's 100 steps: GPT-2's tokenizer and the plays, installed, train",
    ),
    (
        r"(free-transformer train --out runs/notes model\.size=cpu-small data\.kind=text .*) steps=200$",
        r"\1 steps=2",
        "2 of its 200 steps: the user's text trains",
    ),
    (r"(free-transformer train --out runs/gauss .*)$", r"\1 steps=2", "2 of its 1,000 steps: a Gaussian Z trains"),
    (r"(free-transformer train --out runs/cat .*)$", r"\1 steps=2", "2 of its 1,000 steps: a categorical Z trains"),
    (r"(free-transformer train --out runs/notes --resume) steps=300", r"\1 steps=4", "2 more steps, not 100"),
    (
        r"(free-transformer train --config runs/x\.yaml --out runs/x)$",
        r"\1 steps=2",
        "2 of its 1,000 steps: the printed config trains",
    ),
    (r"--limit (200|50|5)\b", "--limit 2", "2 documents of each benchmark"),
    (r"(free-transformer eval .*--heldout \S+)", r"\1 --heldout-windows 2", "2 windows of the held-out text"),
    (r"\bsteps=120 (.*)checkpoint_every=20", r"steps=4 \1checkpoint_every=2", "4 of the 120 steps"),
    (r"eval\.every=20 (.*)eval\.limit=20", r"eval.every=2 \1eval.limit=2", "benchmarks every 2 steps, on 2 documents"),
    (r"eval\.heldout_windows=20", "eval.heldout_windows=2", "2 windows of the held-out text"),
]
# (page, pattern that one of a block's commands starts with, why): blocks marked `slow`, run by .ci/run's slow step
# (each 5-16 s of the default suite on a 2-core CPU)
SLOW = [
    ("docs/study.md", r"free-transformer study --preset cpu --out runs/study$", "three studies' dry runs"),
    ("docs/test-time-search.md", r"free-transformer rl runs/k1 --learned-prior", "six RL runs and their generation"),
    ("docs/evaluation.md", r"free-transformer eval runs/baseline --limit", "every benchmark, scored twice"),
    ("docs/evaluation.md", r"free-transformer train --out runs/curves-baseline", "two trainings with benchmarks"),
    ("docs/latent-variants.md", r"free-transformer train --out runs/ternary ", "a plugin kind trained and resumed"),
    ("docs/latent-variants.md", r"free-transformer train --out runs/cat ", "a categorical Z trained and sampled"),
    ("docs/huggingface.md", r"free-transformer convert \S+ runs/hf/kappa-1-chat", "a chat export through pipeline"),
]
# Runs a block uses, trained by a block that is only checked here: a copy of one tiny run stands in for each.
RUNS = [
    "runs/demo/seed-0/kappa-1",
    "runs/shake",
    "runs/ctrl",
    "runs/k1",
    "runs/x",
    "runs/baseline",
    "runs/free-half-bit",
    "runs/curves-free",
    "runs/curves-baseline",
    "runs/shakespeare-baseline",
    "runs/shakespeare-free",
    "runs/my-run",
]
# Files a block reads that the reader brings: made here.
FILES = {
    "notes.txt": "\n\n".join(
        f"Note {i}: the free bits keep the KL of each token under kappa; the encoder sees the "
        f"whole sequence, and the decoder reads Z in its middle block."
        for i in range(300)
    ),
    "heldout.txt": "ROMEO: But soft, what light through yonder window breaks?\n" * 40,
    "prompts.txt": "K>\nOnce upon a time\n",
    "race_tiny.jsonl": (Path(__file__).parent / "data" / "race_tiny.jsonl").read_text(),  # docs/serving.md's
    "ternary_kind.py": documented_kind_source(),  # docs/latent-variants.md's kind, saved as the page says
}


@dataclass
class Command:
    page: str
    line: int
    text: str  # one shell command, continuation lines joined, its trailing comment dropped


def shell_blocks(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each fenced block tagged as shell."""
    text = path.read_text()
    return [
        (text[: m.start()].count("\n") + 2, m.group(2))
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
        if m.group(1) in SHELL
    ]


def untagged_commands(path: Path) -> list[int]:
    """Lines of untagged blocks that start like a command: they must be tagged bash (and so run)."""
    text = path.read_text()
    return [
        text[: m.start()].count("\n") + 1
        for m in re.finditer(r"^```\n(.*?)^```", text, re.S | re.M)
        if re.match(r"(free-transformer|python|pip|torchrun|bash|curl) ", m.group(1))
    ]


def commands(block: str) -> list[str]:
    """The block's commands: lines joined across a trailing backslash, across open quotes and through a
    here-document; comments dropped."""
    out, current, quote, heredoc = [], "", None, None
    for line in block.splitlines():
        if heredoc is not None:
            current += "\n" + line
            if line.strip() == heredoc:
                out.append(current)
                current, heredoc = "", None
            continue
        text = line if not current else current + ("\n" if quote else " ") + line.strip()
        cut = None
        for i, char in enumerate(line):
            if quote:
                quote = None if char == quote else quote
            elif char in "'\"":
                quote = char
            elif char == "#" and (i == 0 or line[i - 1].isspace()):
                cut = i
                break
        if cut is not None:
            text = text[: len(text) - (len(line) - cut)]
        scanned = text.rstrip()
        if quote is None and scanned.endswith("\\"):
            current = scanned[:-1].rstrip()
            continue
        if quote is not None:
            current = scanned
            continue
        if (marker := re.search(r"<<'?(\w+)'?", scanned)) is not None:
            current, heredoc = scanned, marker.group(1)
            continue
        if scanned.strip():
            out.append(scanned.strip())
        current = ""
    return out


def every_command() -> list[Command]:
    found = []
    for path in PAGES:
        for line, block in shell_blocks(path):
            for text in commands(block):
                found.append(Command(str(path.relative_to(ROOT)), line, text))
    return found


def settings_and_command(text: str) -> tuple[str, str]:
    """The command's environment settings (`OMP_NUM_THREADS=1 `) and the command after them."""
    settings = re.match(r"(?:[A-Z_]+=\S* )*", text).group(0)
    return settings, text[len(settings) :]


def plan(text: str) -> tuple[str | None, str]:
    """(the command to run, or None; why it differs from the text, or ''). The rules read the command after its
    environment settings (`OMP_NUM_THREADS=1 free-transformer ...`), which it keeps."""
    settings, text = settings_and_command(text)
    for pattern, why in SKIPPED:
        if re.match(pattern, text):
            return None, f"skipped: {why}"
    for pattern, why in DRY_RUN:
        if re.match(pattern, text):
            background = text.endswith("&")
            return settings + text.rstrip("& ") + " --dry-run" + (" &" if background else ""), f"dry run: {why}"
    command, reasons = text, []
    for pattern, replacement, why in SMALLER:
        if re.search(pattern, command):
            command, reasons = re.sub(pattern, replacement, command), reasons + [why]
    return settings + command, "; ".join(reasons)


BLOCKS = {}  # the docs' blocks, each run on its own; README's run in order (test_readme_runs_in_order)
for _command in every_command():
    if _command.page != "README.md":
        BLOCKS.setdefault((_command.page, _command.line), []).append(_command.text)
# README's commands, each part of an `a && b` line on its own: the demo after its setup runs, as a dry run
README = [part for command in every_command() if command.page == "README.md" for part in command.text.split(" && ")]


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """The directory a reader works in (a checkout's configs/, scripts/, tests/golden/), the PATH and
    environment of the commands, and one tiny trained Free Transformer that stands in for the RUNS.
    `free-transformer` is served by command_server.py: the package and torch are imported once."""
    root = tmp_path_factory.mktemp("docs")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "XDG_CACHE_HOME": str(root / "cache"),
        "PYTHONUNBUFFERED": "1",
    }
    server_script, socket_path = Path(__file__).parent / "command_server.py", root / "cli.sock"
    server = subprocess.Popen(
        [sys.executable, str(server_script), str(socket_path)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout.readline().strip() == "ready"
        for name, command in (
            ("free-transformer", f"{sys.executable} -S {server_script} --client {socket_path}"),
            ("python", sys.executable),
        ):
            (bin_dir / name).write_text(f'#!/bin/sh\nexec {command} "$@"\n')
            (bin_dir / name).chmod(0o755)
        run = root / "tiny-run"
        subprocess.run(
            [
                "free-transformer",
                "train",
                "--out",
                str(run),
                "model.size=debug",
                "model.max_seq_len=72",
                "batch_size=8",
                "steps=4",
                "checkpoint_every=2",
                "progress=false",
            ],
            env=env,
            check=True,
            capture_output=True,
        )
        yield root, env, run
    finally:
        server.kill()
        server.wait()


def block_dir(workspace, name: str, files: bool = True) -> Path:
    """A checkout's folders, and (files) the files the docs' blocks read that a reader brings."""
    root, _, run = workspace
    where = root / "blocks" / re.sub(r"\W+", "-", name)
    where.mkdir(parents=True)
    for folder in ("configs", "scripts", "docs"):
        (where / folder).symlink_to(ROOT / folder)
    (where / "tests").mkdir()
    (where / "tests" / "golden").symlink_to(ROOT / "tests" / "golden")
    for name, text in FILES.items() if files else ():
        (where / name).write_text(text)
    return where


def place_runs(where: Path, run: Path, block: list[str]) -> None:
    """A copy of the tiny run for each of RUNS the block reads and trains nowhere."""
    text = "\n".join(block)
    for path in RUNS:
        if re.search(rf"(?<![\w/-]){re.escape(path)}(?![\w-])", text) and f"--out {path}" not in text:
            shutil.copytree(run, where / path)


def stand_in(command: str, why: str) -> str:
    """A dry run of a training that a later command reads is followed by a copy of the tiny run in its --out (the
    demo's: one of the runs it trains)."""
    out = re.search(r"--out (\S+)", command)
    trained = out.group(1) if out else "runs/demo/seed-0/kappa-1" if "free-transformer demo" in command else None
    if not why.startswith("dry run") or trained not in RUNS:
        return command
    return f'{command}\nmkdir -p "$(dirname {trained})" && cp -R "$TINY_RUN" {trained}'


def test_untagged_blocks_hold_no_commands():
    untagged = [f"{path.relative_to(ROOT)}:{line}" for path in PAGES for line in untagged_commands(path)]
    assert not untagged, f"tag these blocks ```bash so that this file runs them: {untagged}"


def test_every_rule_matches_a_command():
    """A rule that no longer matches anything is stale: remove it. Each is matched as plan() matches it: on the
    commands as they are planned (README's `a && b` parts each on its own), a skipped or dry-run one from its
    start after its settings, a smaller one anywhere in it."""
    texts = [text for block in BLOCKS.values() for text in block] + README
    for pattern, *_ in SKIPPED + DRY_RUN:
        assert any(re.match(pattern, settings_and_command(t)[1]) for t in texts), pattern
    for pattern, *_ in SMALLER:
        assert any(re.search(pattern, t) for t in texts), pattern
    for rule in SLOW:
        assert sum(rule in slow_rules(where) for where in BLOCKS) == 1, f"{rule[:2]} must match one block"


def run_script(script: list[str], directory: Path, env: dict, run: Path, name: str, timeout: int) -> None:
    """The commands in one bash (errors end it), in `directory`, the tiny run at $TINY_RUN; an assertion naming
    `name`, with the script and the ends of its output, when it fails."""
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(script)],
        cwd=directory,
        env={**env, "TINY_RUN": str(run)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (
        f"{name} failed ({result.returncode}):\n"
        + "\n".join(script)
        + f"\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )


def slow_rules(where: tuple[str, int]) -> list[tuple[str, str, str]]:
    """The SLOW rules that the block at `where` (page, line) matches."""
    return [rule for rule in SLOW if rule[0] == where[0] and any(re.match(rule[1], text) for text in BLOCKS[where])]


@pytest.mark.parametrize(
    "where",
    [pytest.param(where, marks=[pytest.mark.slow] if slow_rules(where) else []) for where in BLOCKS],
    ids=[f"{page}:{line}" for page, line in BLOCKS],
)
def test_the_block_runs(workspace, where):
    _, env, run = workspace
    planned = [plan(text) for text in BLOCKS[where]]
    script = [stand_in(command, why) for command, why in planned if command is not None]
    if not script:
        pytest.skip("; ".join(sorted({why for _, why in planned})))
    directory = block_dir(workspace, f"{where[0]}-{where[1]}")
    place_runs(directory, run, BLOCKS[where])
    run_script(script, directory, env, run, f"{where[0]}:{where[1]}", timeout=300)


@pytest.mark.slow
def test_readme_runs_in_order(workspace):
    """README's commands as a reader pastes them: in order, in one directory that holds only the checkout's
    folders, each using what the ones before it made (a file that no block makes fails here). Long ones run up to
    their validation or on fewer steps (DRY_RUN, SMALLER); a dry-run training leaves the tiny run where a later
    command reads it. What they write lies under runs/, which git ignores."""
    _, env, run = workspace
    script = [stand_in(command, why) for command, why in map(plan, README) if command is not None]
    directory = block_dir(workspace, "README-in-order", files=False)
    run_script(script, directory, env, run, "README.md", timeout=1200)
    left = sorted(p.name for p in directory.iterdir() if p.name not in ("configs", "scripts", "docs", "tests", "runs"))
    assert left == [], f"README's commands wrote {left} outside runs/: git status would list them"


def written_paths(command: str) -> list[str]:
    """Where a command writes (its redirections, --out / --output, convert's destination, compare's default)."""
    from free_transformer.commands.compare import default_output

    text = re.sub(r"\"[^\"]*\"|'[^']*'", "''", command.split("\n")[0])  # quoted text writes nothing
    paths = re.findall(r"(?:(?<![0-9&])>|--out|--output|-o|\btee)\s+(\S+)", text)
    if convert := re.search(r"free-transformer convert\s+\S+\s+(\S+)", text):
        paths.append(convert.group(1))
    if (compare := re.search(r"free-transformer compare\s+(\S+)", text)) and "--output" not in text:
        paths.append(str(default_output(compare.group(1))))
    return paths


def test_documented_commands_write_under_runs():
    """Following README and the docs leaves a checkout's `git status` clean: what their commands write goes under
    runs/ (which .gitignore names) or outside the checkout."""
    assert "/runs/" in (ROOT / ".gitignore").read_text().splitlines()
    outside = [
        f"{c.page}:{c.line}: {path}"
        for c in every_command()
        for path in written_paths(c.text)
        if not path.startswith(("runs/", "/"))
    ]
    assert outside == []


def test_readme_names_ci_and_test_files_that_exist():
    """README's test command is the first line of .ci/run, which runs the slow tests after it; the quick subset
    names test files that exist; README stays a guide (at most 220 lines)."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    first = next(line for line in ci if line.startswith("python3 -m venv .venv "))
    assert f"```bash\n{first}\n```" in readme
    assert any(re.fullmatch(r"\.venv/bin/python -m pytest -m slow\b.*", line) for line in ci)
    quick = next(c for c in README if c.startswith(".venv/bin/python -m pytest tests/"))
    files = [word for word in quick.split() if word.startswith("tests/")]
    assert len(files) >= 3 and all((ROOT / f).is_file() for f in files)
    assert len(readme.splitlines()) <= 220


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


def test_readmes_python_api_block_samples_the_model_it_loads(workspace, tmp_path, monkeypatch):
    """The block runs as pasted, beside the run it names, and its samples are the loaded model's: the same
    weights, and the tokens that model draws with the block's seeds and shared Z."""
    from free_transformer import GenerationConfig, generate, load_model

    _, _, run = workspace
    block = next(b for b in python_blocks(ROOT / "README.md") if "load_model(" in b)
    shutil.copytree(run, tmp_path / "runs" / "demo" / "seed-0" / "kappa-1")
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(block, "README.md", "exec"), names)
    loaded, _ = load_model(tmp_path / "runs" / "demo" / "seed-0" / "kappa-1")
    weights = names["model"].state_dict()
    assert all(torch.equal(weights[key], value) for key, value in loaded.state_dict().items())
    again = generate(
        loaded,
        names["prompts"],
        GenerationConfig(max_new_tokens=64, temperature=1.0),
        seeds=range(8),
        latents=names["shared"],
    )
    assert names["green"].tokens == again.tokens and len(again.tokens) == 8


def test_every_link_of_readme_and_the_docs_leads_somewhere():
    """A relative link names a file of the checkout, and its #anchor a heading of that file (GitHub's slugs)."""

    def slugs(path: Path) -> set[str]:
        headings = re.findall(r"^#+ (.*)$", path.read_text(), re.M)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}

    broken = []
    for page in [*PAGES, ROOT / "CHANGELOG.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in slugs(path):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_the_python_api_pages_blocks_run(workspace, tmp_path, monkeypatch):
    """docs/python-api.md's blocks, as pasted, beside the run they name."""
    from free_transformer.inference.kept_engines import _engines

    _, _, run = workspace
    shutil.copytree(run, tmp_path / "runs" / "demo" / "seed-0" / "kappa-1")
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(ROOT / "docs" / "python-api.md")
    assert len(blocks) == 3
    spaces = []
    for block in blocks:
        names: dict = {}
        exec(compile(block, "docs/python-api.md", "exec"), names)
        spaces.append(names)
    _, trained, kept = spaces
    assert trained["out"].loss.grad_fn is not None and trained["fresh"].embed_tokens.weight.grad is not None
    assert kept["model"] not in _engines and len(kept["again"].tokens) == 4  # released
