import numpy as np
import pytest

from free_transformer.eval import task_metrics as metrics
from free_transformer.reports.comparison import paper_colour


def test_exact_match_normalises_like_squad():
    assert metrics.exact_match("The Eiffel Tower.", ["eiffel tower"])
    assert metrics.exact_match(" December 1972", ["14 December 1972 UTC", "December 1972"])
    assert not metrics.exact_match("Paris, France", ["Paris"])


def test_gsm8k_answer_extraction():
    assert metrics.gsm8k_answer("She has 3 + 4 = 7. So the answer is 1,234.") == "1234"
    assert metrics.gsm8k_answer("first 3 then $18.") == "18"
    assert metrics.gsm8k_answer("no digits") is None
    assert metrics.numbers_equal("18.0", "18") and not metrics.numbers_equal("17", "18")


def test_choose_normalises_by_length():
    # raw log-probs prefer choice 0; per unit of length choice 1 is better
    assert metrics.choose([-4.0, -6.0], [1, 1]) == 0
    assert metrics.choose([-4.0, -6.0], [2, 6]) == 1


def test_macro_average_weights_groups_equally():
    scores, groups = [1, 1, 1, 0], ["a", "a", "a", "b"]
    assert metrics.aggregate(scores) == 0.75
    assert metrics.aggregate(scores, groups) == 0.5


def test_paired_bootstrap_interval_covers_the_difference_and_shrinks_with_n():
    rng = np.random.default_rng(0)
    small_a, small_b = rng.random(40) < 0.5, rng.random(40) < 0.6
    big_a, big_b = rng.random(4000) < 0.5, rng.random(4000) < 0.6
    small = metrics.paired_bootstrap(small_a, small_b, samples=500)
    big = metrics.paired_bootstrap(big_a, big_b, samples=500)
    assert small["low"] <= small_b.mean() - small_a.mean() <= small["high"]
    assert big["high"] - big["low"] < (small["high"] - small["low"]) / 4
    assert big["low"] > 0  # a real 10-point gain on 4000 questions is not noise
    same = metrics.paired_bootstrap(small_a, small_a, samples=200)
    assert same["low"] == same["high"] == 0.0
    with pytest.raises(ValueError):
        metrics.paired_bootstrap([1.0], [1.0, 0.0])


@pytest.mark.parametrize(
    "change,colour",
    [  # values and colours read from the paper's Table 1
        (0.92, "white"),
        (-0.82, "white"),
        (1.06, "green!25"),
        (-1.05, "red!10"),
        (9.87, "green!25"),
        (-9.56, "red!10"),
        (10.07, "green"),
        (-10.33, "red!80"),
        (44.44, "green"),
        (0.0, "white"),
    ],
)
def test_paper_colours(change, colour):
    assert paper_colour(change) == colour


def test_lower_is_better_flips_colours():
    assert paper_colour(-12.0, higher_is_better=False) == "green"
    assert paper_colour(3.0, higher_is_better=False) == "red!10"


def _run(scores, label):
    per_doc = [{"id": str(i), "score": float(s), "group": None} for i, s in enumerate(scores)]
    task = {
        "metric": "acc_char",
        "value": float(np.mean(scores)),
        "n": len(scores),
        "paper_name": "piqa",
        "category": "Multi-choice general knowledge / common sense",
        "per_doc": per_doc,
    }
    return {"label": label, "tasks": {"piqa": task}}


def test_comparison_rows_stars_only_intervals_on_enough_documents():
    from free_transformer.reports.comparison import build_rows, to_markdown

    many = build_rows([_run([0, 1] * 30, "base"), _run([1, 1] * 30, "free")], samples=300)
    cell = many[0].others[0]
    assert cell.relative == pytest.approx(100.0) and cell.colour == "green" and cell.ci["low"] > 0
    assert " * |" in to_markdown(many, ["base", "free"])
    few = build_rows([_run([0, 1, 0], "base"), _run([1, 1, 1], "free")], samples=300)
    assert "too few" in to_markdown(few, ["base", "free"]) and " * |" not in to_markdown(few, ["base", "free"])
