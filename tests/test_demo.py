import json

import pytest

from free_transformer.cli import main
from free_transformer.demo.experiment import VARIANTS, ModelResult, judge_claims
from free_transformer.demo.groups import Groups, group_measures

BLOCK = "KKKKKKKK"


def _body(position, noise=()):
    body = list("_" * position + BLOCK + "_" * (56 - position))
    for i in noise:
        body[i] = "!"
    return "".join(body)


def test_group_measures_tell_shared_decisions_apart():
    blue = [_body(p, [p + 10]) for p in (0, 5, 10, 15)]
    green = [_body(20, [3, 40]) for _ in range(4)]
    measures = group_measures(Groups("K", blue, [green]))
    assert measures["valid"] == 1.0
    assert measures["blue_position_agreement"] == 0.0 and measures["green_position_agreement"] == 1.0
    assert measures["blue_position_near"] == 0.0 and measures["green_position_near"] == 1.0
    roughly = group_measures(Groups("K", [], [[_body(p) for p in (20, 21, 22, 25)]]))  # pairs 1, 2, 5, 1, 4, 3 apart
    assert roughly["green_position_agreement"] == 0.0 and roughly["green_position_near"] == pytest.approx(3 / 6)
    assert measures["blue_noise_jaccard"] == 0.0 and measures["green_noise_jaccard"] == 1.0
    broken = group_measures(Groups("K", ["_" * 64, _body(3)], [["J" * 64]]))
    assert broken["valid"] == pytest.approx(1 / 3) and broken["blue_position_agreement"] is None


def _result(slug, **measures):
    variant = next(v for v in VARIANTS if v.slug == slug)
    return ModelResult(variant, measures, {}, 0.0)


def test_claims_follow_the_paper():
    paper_like = [
        _result("baseline", valid=0.95, val_cross_entropy_bits=0.42),
        _result("kappa-1-64", valid=0.9, green_position_agreement=0.02, green_noise_jaccard=0.04),
        _result("kappa-1-8", valid=0.85, green_position_agreement=0.6, green_noise_jaccard=0.05),
        _result("kappa-1", valid=0.8, green_position_agreement=0.7, green_noise_jaccard=0.5),
        _result("kappa-8", valid=0.1, val_cross_entropy_bits=0.05),
    ]
    assert [c["reproduced"] for c in judge_claims(paper_like)] == [True] * 4
    vanilla_everywhere = [_result(r.variant.slug, valid=0.9, green_position_agreement=0.02, green_noise_jaccard=0.03,
                                  val_cross_entropy_bits=0.42) for r in paper_like]
    assert [c["reproduced"] for c in judge_claims(vanilla_everywhere)] == [True, False, False, False]
    missing = [_result(r.variant.slug) for r in paper_like]  # nothing valid to measure: no claim holds
    assert not any(c["reproduced"] for c in judge_claims(missing))


def test_demo_smoke_run_writes_the_report(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--preset", "smoke", "--workers", "1", "--out", str(out)]) == 0
    assert "report:" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert [m["slug"] for m in results["models"]] == [v.slug for v in VARIANTS]
    assert len(results["claims"]) == 4
    html = (out / "report.html").read_text()
    assert "class='blue'" in html and "class='green'" in html and "κ = 1/8 bit" in html
    assert (out / "report.png").stat().st_size > 10_000
    first = (out / "kappa-1" / "metrics.jsonl").read_text()
    assert main(["demo", "--preset", "smoke", "--workers", "1", "--out", str(out)]) == 0  # reuses finished runs
    assert (out / "kappa-1" / "metrics.jsonl").read_text() == first
