"""Scores during training: the periodic evaluation inside training (config section `eval`), `eval RUN
--checkpoints`, the record they share (RUN/eval/curve.jsonl), and `compare`'s last-third columns and curves."""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_losses, tiny_run_config

from free_transformer.base.checks import ConfigError
from free_transformer.cli import main
from free_transformer.eval.record import CurveRecord, read_record, record_path
from free_transformer.reports.curves import load_curve
from free_transformer.reports.figures import curve_panels
from free_transformer.runs.checkpoint import load_model
from free_transformer.train.metrics import read_metrics
from free_transformer.train.trainer import train

DATA = Path(__file__).parent / "data"
HELDOUT = str(DATA / "heldout_tiny.txt")
EVAL = [
    "eval.every=2",
    "eval.tasks=arc_easy,boolq",
    "eval.limit=3",
    "eval.latent_samples=2",
    f"eval.heldout={HELDOUT}",
    "eval.heldout_samples=2",
]
# `eval --checkpoints` with the same settings as EVAL: the same record key
EVAL_CLI = [
    "--tasks",
    "arc_easy,boolq",
    "--limit",
    "3",
    "--latent-samples",
    "2",
    "--heldout",
    HELDOUT,
    "--heldout-samples",
    "2",
    "--no-progress",
]
RUN = ["steps=6", "checkpoint_every=2", "keep_checkpoints=10"]


def _trace(run_dir):
    """Everything training logged that does not depend on the clock."""
    return [
        (m["step"], m["loss"], m["cross_entropy_bits"], m["kl_bits"], m["grad_norm"])
        for m in read_metrics(Path(run_dir) / "metrics.jsonl")
    ]


def _same_weights(a, b):
    first, _ = load_model(a)
    second, _ = load_model(b)
    return all(torch.equal(x, y) for x, y in zip(first.state_dict().values(), second.state_dict().values()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny baseline and a tiny Free Transformer trained with periodic evaluation, and the Free one without."""
    root = tmp_path_factory.mktemp("curves")
    train(tiny_run_config(*RUN, *EVAL, "model.latent_units=0"), root / "baseline")
    train(tiny_run_config(*RUN, *EVAL), root / "free")
    train(tiny_run_config(*RUN), root / "plain")
    return root


def test_periodic_evaluation_leaves_training_bit_identical(runs):
    assert _trace(runs / "free") == _trace(runs / "plain") and _trace(runs / "free")
    assert _same_weights(runs / "free", runs / "plain")
    entries = read_record(record_path(runs / "free"))
    assert [(e["step"], e["tokens"], e["source"]) for e in entries] == [
        (2, 2 * 4 * 65, "training"),
        (4, 4 * 4 * 65, "training"),
        (6, 6 * 4 * 65, "training"),
    ]
    assert entries[0]["checkpoint"] == "step_00000002" and len({e["settings_key"] for e in entries}) == 1
    assert set(entries[-1]["tasks"]) == {"arc_easy", "boolq"} and entries[-1]["tasks"]["boolq"]["n"] == 3
    assert {"iwae", "prior_ce"} <= set(entries[-1]["likelihood"])
    assert not (runs / "plain" / "eval").exists()


def test_a_resumed_run_keeps_its_losses_and_does_not_score_a_step_twice(runs, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(runs / "free", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")  # killed after evaluating 6, before its checkpoint
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    train(tiny_run_config(*RUN, *EVAL), resumed, resume=True)  # redoes steps 3-6, whose 4 and 6 are scored
    assert run_losses(resumed) == run_losses(runs / "free")
    assert _same_weights(resumed, runs / "free")
    assert [e["step"] for e in read_record(record_path(resumed))] == [2, 4, 6]


def test_resume_scores_a_due_step_left_unscored(tmp_path):
    train(tiny_run_config("steps=4", "checkpoint_every=4"), tmp_path)  # no evaluation yet (as after a stop signal)
    train(tiny_run_config("steps=6", "checkpoint_every=4", *EVAL), tmp_path, resume=True)
    assert [(e["step"], e["checkpoint"]) for e in read_record(record_path(tmp_path))] == [
        (4, "step_00000004"),
        (6, "step_00000006"),
    ]


def test_training_is_untouched_whatever_the_evaluation_draws(runs, tmp_path, monkeypatch):
    """An evaluation that draws from every RNG stream and leaves the model in eval mode changes nothing."""
    calls = []

    def greedy_evaluation(model, tokenizer, settings, **kwargs):
        calls.append(model.training)
        torch.rand(100), random.random(), np.random.rand(3)
        model.eval()
        return {"tasks": {}, "unavailable": {}, "latents": {}}

    monkeypatch.setattr("free_transformer.eval.record.score", greedy_evaluation)
    train(tiny_run_config(*RUN, *EVAL), tmp_path / "run")
    assert calls == [True] * 3  # in train mode at every evaluation: the one before was undone
    assert _trace(tmp_path / "run") == _trace(runs / "plain")


def test_eval_checkpoints_scores_each_once_in_the_record_training_shares(runs, tmp_path, capsys):
    run = tmp_path / "free"
    shutil.copytree(runs / "free", run)
    train(tiny_run_config("steps=8", "checkpoint_every=2", "keep_checkpoints=10"), run, resume=True)  # unscored 8
    capsys.readouterr()
    assert main(["eval", str(run), "--checkpoints", "last-third", *EVAL_CLI]) == 0  # steps >= 2/3 of 8
    printed = capsys.readouterr().out
    assert "step 6: already scored" in printed and "step 8: arc_easy" in printed
    assert main(["eval", str(run), "--checkpoints", "every:4", *EVAL_CLI]) == 0  # nothing left to do
    assert "step 8: already scored" in capsys.readouterr().out
    entries = read_record(record_path(run))
    assert [(e["step"], e["source"]) for e in entries] == [
        (2, "training"),
        (4, "training"),
        (6, "training"),
        (8, "checkpoint"),
    ]
    assert entries[-1]["tokens"] == 8 * 4 * 65 and entries[-1]["checkpoint"] == "step_00000008"
    # other settings: a curve of their own; the same weights score the same as the live model did
    assert (
        main(
            [
                "eval",
                str(run),
                "--checkpoints",
                "every:2",
                "--tasks",
                "arc_easy",
                "--limit",
                "3",
                "--latent-samples",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    assert len(read_record(record_path(run))) == 8
    curve = load_curve(run)
    assert [e["step"] for e in curve.entries] == [2, 4, 6, 8]
    other = next(iter(curve.others.values()))
    assert [e["tasks"]["arc_easy"]["per_doc"] for e in other][:3] == [
        e["tasks"]["arc_easy"]["per_doc"] for e in curve.entries[:3]
    ]


def test_a_record_line_cut_short_is_skipped_and_appends_go_on(tmp_path):
    record = CurveRecord(tmp_path)
    record.append({"step": 1, "settings_key": "k"})
    with open(record.path, "a") as handle:
        handle.write('{"step": 2, "settings_key": "k", "tas')  # a writer killed mid-line
    record = CurveRecord(tmp_path)
    assert record.done == {(1, "k")}
    record.append({"step": 2, "settings_key": "k"})
    assert [e["step"] for e in read_record(record.path)] == [1, 2]


# ---- the last third and compare's table -----------------------------------------------------------------------


def _task(values: list[float], groups=None) -> dict:
    per_doc = [{"id": str(i), "group": None if groups is None else groups[i], "score": v} for i, v in enumerate(values)]
    from free_transformer.eval.task_metrics import aggregate

    return {
        "metric": "acc_completion",
        "paper_name": "arc_easy",
        "category": "Multi-choice general knowledge / common sense",
        "value": aggregate(values, groups),
        "n": len(values),
        "per_doc": per_doc,
    }


def _synthetic_run(root: Path, name: str, scores: dict[int, list[float]], latents: str) -> Path:
    """A run directory whose record holds arc_easy (4 documents) and a two-subject macro average at each step."""
    record = CurveRecord(root / name)
    for step, values in scores.items():
        mmlu = _task(values, groups=["a", "a", "a", "b"])
        mmlu.update(metric="macro_avg/acc_char", paper_name="mmlu")
        record.append(
            {
                "step": step,
                "tokens": 100 * step,
                "settings_key": "s",
                "settings": {"limit": 4},
                "tasks": {"arc_easy": _task(values), "mmlu": mmlu},
                "unavailable": {},
                "latents": {"model": latents, "latents": latents},
            }
        )
    return root / name


def test_last_third_average_equals_a_hand_computation(tmp_path, capsys):
    base = _synthetic_run(
        tmp_path,
        "base",
        {2: [0, 0, 0, 0], 4: [1, 0, 0, 0], 6: [0, 1, 0, 0], 8: [1, 1, 0, 0], 10: [1, 1, 1, 0], 12: [1, 1, 1, 1]},
        "baseline",
    )
    free = _synthetic_run(
        tmp_path, "free", {2: [1, 0, 0, 0], 4: [0, 0, 0, 0], 8: [1, 1, 1, 0], 12: [1, 0, 1, 1]}, "free"
    )
    curve = load_curve(base)
    assert [e["step"] for e in curve.last_third()] == [8, 10, 12]  # 3 s >= 2 x 12
    average = curve.last_third_average()
    assert average["tasks"]["arc_easy"]["value"] == pytest.approx((2 / 4 + 3 / 4 + 4 / 4) / 3)
    # macro average over subjects a (3 documents) and b (1): (mean of a + b) / 2 at each step, then averaged
    assert average["tasks"]["mmlu"]["value"] == pytest.approx(((2 / 3 + 0) / 2 + (1 + 0) / 2 + (1 + 1) / 2) / 3)
    assert [d["score"] for d in average["tasks"]["arc_easy"]["per_doc"]] == pytest.approx([1, 1, 2 / 3, 1 / 3])
    assert [e["step"] for e in load_curve(free).last_third()] == [8, 12]

    out = tmp_path / "table"
    assert (
        main(["compare", str(base), str(free), "--labels", "Base,Free", "--output", str(out), "--bootstrap", "200"])
        == 0
    )
    md = out.with_suffix(".md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| arc_easy"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    free_final, free_third = 3 / 4, (3 / 4 + 3 / 4) / 2
    base_final, base_third = 1.0, 0.75
    change = f"{100 * (free_final - base_final):+.2f}% (red!80)"  # -25%: strong red, as in the paper
    assert cells[1:4] == [f"{base_final:.3f}", f"{free_final:.3f}", change]
    assert cells[5:8] == [f"{base_third:.3f}", f"{free_third:.3f}", "+0.00%"]
    assert cells[4].startswith("[") and cells[8].startswith("[")  # an interval for each
    assert (
        "Base (baseline) [final]" in md
        and "Base (baseline) [last third]" in md
        and "![scores during training](table.png)" in md
    )
    page = out.with_suffix(".html").read_text()
    assert "Average (last third)" in page and "data:image/png;base64," in page
    assert "last third: steps 8-12 (3)" in capsys.readouterr().out
    # a baseline given as one eval results file: no last third of its own, the other run keeps its colour
    (tmp_path / "base.json").write_text(json.dumps(load_curve(base).final()))
    before = out.with_suffix(".md").read_text()
    assert main(["compare", str(tmp_path / "base.json"), str(free), "--output", str(out), "--bootstrap", "100"]) == 2
    assert "already exists" in capsys.readouterr().err and out.with_suffix(".md").read_text() == before  # kept
    assert (
        main(
            [
                "compare",
                str(tmp_path / "base.json"),
                str(free),
                "--output",
                str(out),
                "--bootstrap",
                "100",
                "--overwrite",
            ]
        )
        == 0
    )
    row = next(line for line in out.with_suffix(".md").read_text().splitlines() if line.startswith("| arc_easy"))
    assert [c.strip() for c in row.strip("|").split("|")][5:8] == ["—", f"{free_third:.3f}", "—"]
    panel = curve_panels([None, load_curve(free)])[0]
    assert [line.run for line in panel.lines] == [1] and panel.span is None


def test_curves_contain_every_scored_step(runs, tmp_path):
    curves = [load_curve(runs / "baseline"), load_curve(runs / "free")]
    panels = {p.title: p for p in curve_panels(curves)}
    assert list(panels) == [
        "arc_easy (acc_completion)",
        "boolq (acc_completion)",
        "held-out bits/byte (Free: IWAE, dashed: prior CE)",
        "training cross-entropy",
        "KL per token (dashed: kappa)",
    ]
    for title in ("arc_easy (acc_completion)", "boolq (acc_completion)"):
        assert [(line.label, line.xs) for line in panels[title].lines] == [("baseline", [2, 4, 6]), ("free", [2, 4, 6])]
    assert [line.xs for line in curve_panels(curves, "tokens")[0].lines] == [[520, 1040, 1560]] * 2
    like = panels["held-out bits/byte (Free: IWAE, dashed: prior CE)"].lines
    assert [(line.label, line.dashed) for line in like] == [("baseline", False), ("free", False), ("free", True)]
    assert panels["training cross-entropy"].lines[0].xs == [1, 2, 3, 4, 5, 6]
    assert panels["arc_easy (acc_completion)"].span == (4, 6)


def test_compare_of_two_trained_runs_has_final_and_last_third_columns_and_a_curve_per_benchmark(runs, tmp_path, capsys):
    out = tmp_path / "comparison"
    assert (
        main(
            [
                "compare",
                str(runs / "baseline"),
                str(runs / "free"),
                "--labels",
                "Baseline,Free 1/4 bit",
                "--output",
                str(out),
                "--bootstrap",
                "100",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "Baseline [final]" in printed and "Free 1/4 bit [last third]" in printed
    assert "boolq (acc_completion)" in printed and "held-out bits/byte" in printed
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert (
        main(
            [
                "compare",
                str(runs / "baseline"),
                str(runs / "free"),
                "--output",
                str(out),
                "--overwrite",
                "--x",
                "tokens",
                "--bootstrap",
                "100",
            ]
        )
        == 0
    )


def test_settings_of_the_periodic_evaluation_are_checked_before_training(tmp_path, capsys):
    for overrides, message in (
        (["eval.every=-1"], "eval.every"),
        (["eval.every=2", "eval.tasks=nope"], "unknown task"),
        (["eval.every=2", "eval.tasks=none"], "nothing to evaluate"),
        (["eval.every=2", "eval.heldout=missing.txt"], "held-out text not found"),
        (["eval.every=2", "eval.data=race_high"], "TASK=PATH"),
        (["eval.every=2", "distributed.strategy=ddp"], "--checkpoints all"),
        (["eval.every=2", "eval.latents=policy"], "eval.latents=policy needs a model with a learned prior"),
    ):
        with pytest.raises(ConfigError, match=message):
            tiny_run_config(*overrides)
    assert main(["train", "--out", str(tmp_path / "r"), "model.size=debug", "eval.every=2", "eval.tasks=nope"]) == 2
    assert not (tmp_path / "r").exists()
    assert tiny_run_config("eval.limit=3").eval.every == 0  # a section whose every is 0 does nothing


def test_eval_checkpoints_errors_are_one_line(runs, tmp_path, capsys):
    run = str(runs / "free")
    assert main(["eval", run, "--checkpoints", "every:0", "--tasks", "arc_easy"]) == 2
    assert main(["eval", run, "--checkpoints", "all", "--tasks", "arc_easy", "--output", str(tmp_path / "o.json")]) == 2
    assert main(["eval", run + "/checkpoints/step_00000002", "--checkpoints", "all", "--tasks", "arc_easy"]) == 2
    assert main(["compare", run, run, "--settings", "nope"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(errors) == 4 and all(line.startswith("error: ") for line in errors)
    assert "every:K" in errors[0] and "--output" in errors[1] and "run directory" in errors[2] and "nope" in errors[3]
