"""`free-transformer study`: the variants it trains, its measures and report, reuse of finished work,
and bad arguments."""

import json

import pytest
from test_unchanged import SMOKE, same_measures

from free_transformer.analysis.measures import honest_bits
from free_transformer.cli import main
from free_transformer.commands.arguments import parse_seeds
from free_transformer.commands.study import parse_kappas
from free_transformer.experiments.study.presets import PRESETS, StudyPlan, variants
from free_transformer.experiments.study.report import summarize


def test_the_plan_trains_both_baselines_and_every_kappa(tmp_path):
    plan = StudyPlan(PRESETS["cpu"], tmp_path, (0, 1), (0.5, 4.0))
    assert [v.slug for v in plan.variants()] == ["baseline", "matched-baseline", "kappa-1-2", "kappa-4"]
    configs = {v.slug: plan.train_config(v, 1, threads=1) for v in plan.variants()}
    free = configs["kappa-1-2"].model
    assert configs["baseline"].model == free.replace(latent_units=0)  # the same decoder, no latent
    assert configs["matched-baseline"].model == free.matched_baseline()
    assert (configs["kappa-1-2"].kappa_bits, configs["kappa-4"].kappa_bits) == (0.5, 4.0)
    assert configs["kappa-4"].post_sampler_init_std == 0.3 and configs["baseline"].seed == 1
    assert plan.run_dir(1, plan.variants()[2]) == tmp_path / "seed-1" / "kappa-1-2"


def _record(slug, seed, honest, free=False, **more):
    measure = "iwae" if free else "exact"
    likelihood = {measure: {"bits_per_byte": honest}}
    if free:
        for name in ("prior_ce", "elbo", "posterior_ce"):
            likelihood[name] = {"bits_per_byte": honest + 0.1}
    return {
        "slug": slug,
        "seed": seed,
        "free": free,
        "params": 10,
        "train_seconds": 1.0,
        "likelihood": likelihood,
        **more,
    }


def test_gaps_are_taken_per_seed_and_collapse_is_counted(tmp_path):
    plan = StudyPlan(PRESETS["smoke"], tmp_path, (0, 1), (0.5,))
    free = {"free": True, "kl_bits": 0.4, "copying": False}
    records = [
        _record("baseline", 0, 2.0),
        _record("baseline", 1, 2.2),
        _record("matched-baseline", 0, 1.9),
        _record("matched-baseline", 1, 2.1),
        _record("kappa-1-2", 0, 2.05, bits_saved=0.2, collapsed=False, **free),
        _record("kappa-1-2", 1, 2.15, bits_saved=0.001, collapsed=True, **free),
    ]
    rows = {row["slug"]: row for row in summarize(plan, records)}
    assert rows["kappa-1-2"]["gap_to_baseline"] == pytest.approx([0.05, -0.05])
    assert rows["kappa-1-2"]["gap_to_matched"] == pytest.approx([0.15, 0.05])
    assert rows["kappa-1-2"]["collapsed"] == [1] and rows["kappa-1-2"]["copying"] == []
    assert rows["matched-baseline"]["gap_to_baseline"] == pytest.approx([-0.1, -0.1])


def test_the_honest_figure_is_the_lower_of_the_two_upper_bounds():
    loose_iwae = {"free": True, "likelihood": {"iwae": {"bits_per_byte": 3.0}, "prior_ce": {"bits_per_byte": 2.8}}}
    tight_iwae = {"free": True, "likelihood": {"iwae": {"bits_per_byte": 2.5}, "prior_ce": {"bits_per_byte": 2.8}}}
    assert honest_bits(loose_iwae) == 2.8 and honest_bits(tight_iwae) == 2.5
    assert honest_bits({"free": False, "likelihood": {"exact": {"bits_per_byte": 2.6}}}) == 2.6


@pytest.mark.slow  # a smoke study: every model trained and scored, 14 s
def test_a_smoke_study_reports_every_run_and_reuses_them(tmp_path, monkeypatch):
    """On a fresh machine too: with an empty token cache the corpus is tokenized (in worker processes) before
    the pool of runs starts, as a pool's daemonic worker may not start them ("daemonic processes are not
    allowed to have children"), which failed README's real-text command the first time anyone ran it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    out = tmp_path / "study"
    args = [
        "study",
        "--preset",
        "smoke",
        "--out",
        str(out),
        "--seeds",
        "1",
        "--kappas",
        "4",
        "--workers",
        "2",
        "--device",
        "cpu",
    ]
    assert main(args) == 0
    assert list((tmp_path / "empty-cache" / "free-transformer" / "tokens").glob("*.bin"))
    results = json.loads((out / "results.json").read_text())
    assert [(r["seed"], r["slug"]) for r in results["runs"]] == [
        (0, "baseline"),
        (0, "matched-baseline"),
        (0, "kappa-4"),
    ]
    same_measures(results["runs"], SMOKE["study"], "runs")  # the measures of 0.2, recorded before
    free = results["runs"][2]
    assert free["likelihood"]["iwae"]["bits_per_byte"] > 0 and "bits_saved" in free and free["curves"][-1]["step"] == 4
    assert results["runs"][1]["params"] > results["runs"][0]["params"]
    report = (out / "report.md").read_text()
    assert "| matched baseline |" in report and "| Free, κ = 4 bits |" in report
    assert (out / "report.png").stat().st_size > 0 and (out / "curves.png").stat().st_size > 0
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("study-measures.json")}
    assert main(args) == 0  # nothing trained or measured again
    assert {p: p.stat().st_mtime_ns for p in out.rglob("study-measures.json")} == stamps


@pytest.mark.slow  # a third smoke study; the demo's latent-kind test stays in the default suite
def test_the_study_takes_the_latent_kind(tmp_path):
    out = tmp_path / "study"
    assert (
        main(
            [
                "study",
                "--preset",
                "smoke",
                "--out",
                str(out),
                "--seeds",
                "1",
                "--kappas",
                "4",
                "--workers",
                "1",
                "--device",
                "cpu",
                "model.latent.kind=gaussian",
            ]
        )
        == 0
    )
    free = json.loads((out / "results.json").read_text())["runs"][2]
    assert free["slug"] == "kappa-4" and 0 < free["likelihood"]["iwae"]["bits_per_byte"] < float("inf")
    assert "Latent kind gaussian (model.latent.kind)" in (out / "report.md").read_text()


def test_a_study_without_a_corpus_is_one_line_before_any_training(tmp_path, capsys):
    out = tmp_path / "study"
    args = ["study", "--preset", "smoke", "--out", str(out), "--seeds", "1", "--kappas", "4", "data.text.path=null"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "data.text.path" in err
    assert not list(out.rglob("metrics.jsonl"))


@pytest.mark.parametrize(
    "parse, text",
    [
        (parse_seeds, "0,0"),
        (parse_seeds, "x"),
        (parse_seeds, "0"),
        (parse_kappas, "0.5,-1"),
        (parse_kappas, "a"),
        (parse_kappas, "1,1"),
    ],
)
def test_bad_seeds_and_kappas_are_clear_errors(parse, text):
    with pytest.raises(ValueError, match="--seeds|--kappas"):
        parse(text, 2)


def test_seeds_and_kappas_parse():
    assert parse_seeds("3", 2) == (0, 1, 2) and parse_seeds("4,7", 2) == (4, 7) and parse_seeds(None, 2) == (0, 1)
    assert parse_kappas("2,0.5", (1.0,)) == (0.5, 2.0)
    assert [v.label for v in variants([0.125, 1.0, 2.0])][2:] == [
        "Free, κ = 1/8 bit",
        "Free, κ = 1 bit",
        "Free, κ = 2 bits",
    ]
