import html
import itertools
import math
import re

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


def _pass_at_k_by_subsets(n: int, correct: int, k: int) -> float:
    """pass@k by its definition: the share of the k-subsets of n samples that hold at least one pass."""
    outcomes = [True] * correct + [False] * (n - correct)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_pass(n):
    for correct in range(n + 1):
        for k in range(1, n + 1):
            assert metrics.pass_at_k(n, correct, k) == pytest.approx(_pass_at_k_by_subsets(n, correct, k))
    # and the closed form of Chen et al. at a size where enumeration is out of reach
    assert metrics.pass_at_k(200, 13, 10) == pytest.approx(1 - math.comb(187, 10) / math.comb(200, 10))


def test_pass_at_k_refuses_counts_it_cannot_estimate():
    for n, correct, k in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            metrics.pass_at_k(n, correct, k)


def test_majority_vote_ties_go_to_the_answer_given_first_and_no_answer_does_not_vote():
    assert metrics.majority_vote(["b", "a", "a", "b"]) == 0  # 2-2: "b" came first
    assert metrics.majority_vote(["a", "b", "b", "a"]) == 0
    assert metrics.majority_vote([None, None, "c"]) == 2  # two non-answers do not outvote one answer
    assert metrics.majority_vote([None, None]) is None


def test_majority_at_k_averages_the_vote_over_k_subsets():
    answers, correct = ["7", "7", "3", None], [True, True, False, False]
    assert metrics.majority_at_k(answers, correct, 1) == pytest.approx(2 / 4)  # pass@1: each sample alone
    # k=2: {7,7} 7; {7,3} tie to the first (7) twice: 7,3 -> "7"; {3, 7} never (order kept); {x, None} the answer
    # subsets: (0,1) 7 ok, (0,2) 7 ok, (0,3) 7 ok, (1,2) 7 ok, (1,3) 7 ok, (2,3) 3 wrong
    assert metrics.majority_at_k(answers, correct, 2) == pytest.approx(5 / 6)
    assert metrics.majority_at_k(answers, correct, 4) == 1.0
    assert metrics.majority_at_k(["3", "7", "7"], [False, True, True], 2) == pytest.approx(1 / 3)


def test_majority_at_k_past_the_exact_limit_is_a_seeded_estimate_near_the_exact_one():
    answers = ["1"] * 12 + ["2"] * 8  # C(20, 10) = 184,756 subsets: estimated from random ones
    correct = [True] * 12 + [False] * 8
    estimate = metrics.majority_at_k(answers, correct, 10, seed=3)
    assert estimate == metrics.majority_at_k(answers, correct, 10, seed=3)
    # exact: "1" wins with >= 6 of 10, and every 5-5 tie too, since every "1" was given before every "2"
    exact = sum(math.comb(12, a) * math.comb(8, 10 - a) for a in range(5, 11)) / math.comb(20, 10)
    assert estimate == pytest.approx(exact, abs=0.03)


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_documents():
    small = metrics.bootstrap_interval([0, 1] * 10)
    large = metrics.bootstrap_interval([0, 1] * 1000)
    for interval in (small, large):
        assert interval["low"] < interval["value"] == 0.5 < interval["high"]
    assert large["high"] - large["low"] < (small["high"] - small["low"]) / 5


def test_sample_measures_give_every_k_with_intervals_and_per_document_estimates():
    from free_transformer.eval.runner import sample_measures

    per_doc = [
        {"correct": [True, False, False, False], "answers": ["4", "5", "5", None]},
        {"correct": [False, False, False, False], "answers": ["1", "2", "3", "1"]},
        {"correct": [True, True, True, False], "answers": ["9", "9", "9.0", "8"]},
    ]
    measures = sample_measures(per_doc, vote=True)
    assert set(measures) == {"pass@k", "maj@k"} and set(measures["pass@k"]) == {"1", "2", "3", "4"}
    expected = [(metrics.pass_at_k(4, 1, 2) + 0 + metrics.pass_at_k(4, 3, 2)) / 3]
    assert measures["pass@k"]["2"]["value"] == pytest.approx(expected[0])
    assert measures["pass@k"]["1"]["value"] == pytest.approx((1 / 4 + 0 + 3 / 4) / 3)
    assert measures["maj@k"]["4"]["value"] == pytest.approx((0 + 0 + 1) / 3)  # "5" outvotes "4"; three "9"s win
    for interval in measures["pass@k"].values():
        assert interval["low"] <= interval["value"] <= interval["high"]
    assert per_doc[0]["pass@k"]["4"] == 1.0 and per_doc[0]["maj@k"]["4"] == 0.0
    assert "maj@k" not in sample_measures([dict(d) for d in per_doc], vote=False)


def test_compare_shows_pass_at_k_and_maj_at_k_after_their_task_with_paired_intervals():
    from free_transformer.eval.runner import sample_measures
    from free_transformer.reports.comparison import build_rows

    def run(correct_rate: float, seed: int) -> dict:
        rng = np.random.default_rng(seed)
        per_doc = []
        for doc in range(30):
            correct = [bool(c) for c in rng.random(4) < correct_rate]
            answers = ["right" if c else f"wrong{rng.integers(3)}" for c in correct]
            per_doc.append({"id": str(doc), "score": float(np.mean(correct)), "correct": correct, "answers": answers})
        task = {"metric": "em", "value": float(np.mean([d["score"] for d in per_doc])), "n": 30, "per_doc": per_doc}
        task.update(sample_measures(per_doc, vote=True))
        return {"tasks": {"gsm8k": task}}

    rows = build_rows([run(0.2, 0), run(0.6, 1)], samples=200)
    assert [r.name for r in rows] == ["gsm8k", "gsm8k maj@2", "gsm8k maj@4", "gsm8k pass@2", "gsm8k pass@4"]
    pass4 = rows[-1]
    assert pass4.label.endswith("(pass@4)") and pass4.others[0].ci["low"] > 0  # 0.6 per sample beats 0.2


def _sampled_task(n_docs: int, samples: int, rate: float, seed: int, metric: str = "em") -> dict:
    from free_transformer.eval.runner import sample_measures

    rng = np.random.default_rng(seed)
    per_doc = []
    for doc in range(n_docs):
        correct = [bool(c) for c in rng.random(samples) < rate]
        answers = ["right" if c else f"wrong{rng.integers(3)}" for c in correct]
        per_doc.append({"id": str(doc), "score": float(np.mean(correct)), "correct": correct, "answers": answers})
    task = {"metric": metric, "value": float(np.mean([d["score"] for d in per_doc])), "n": n_docs}
    task.update(per_doc=per_doc, num_fewshot=0, **sample_measures(per_doc, vote=metric == "em"))
    return task


def test_eval_table_prints_pass_at_k_and_maj_at_k_with_intervals_and_what_they_mean():
    from free_transformer.reports.results import format_table

    latents = {"latents": "context Z: prior", "mc_estimator": "log mean_k P(...) over K=4 draws"}
    task = _sampled_task(5, 4, 0.4, 0)
    table = format_table({"checkpoint": "c", "latents": latents, "tasks": {"nq": task}})
    for measure in ("pass@1", "pass@2", "pass@4", "maj@1", "maj@2", "maj@4"):
        m = task[measure[:-1] + "k"][measure[-1]]
        row = next(line for line in table.splitlines() if line.split()[:2] == ["nq", measure])
        assert row.split()[2] == f"{m['value']:.3f}" and row.endswith(f"[{m['low']:.3f}, {m['high']:.3f}]")
    assert not any(line.split()[1:2] == ["pass@3"] for line in table.splitlines())  # k = 1, 2, 4, ... n
    for kind in ("em: ", "pass@k: ", "maj@k: "):  # one line says what each kind of row is
        assert sum(line.startswith(kind) for line in table.splitlines()) == 1, table
    assert "mean over each prompt's samples" in table
    assert "multiple choice" not in table and "generations per prompt: 4" in table  # no such task ran
    mc = {"metric": "acc_char", "value": 0.5, "n": 5, "num_fewshot": 0, "per_doc": []}
    table = format_table({"latents": latents, "tasks": {"arc_easy": mc}})
    assert "multiple choice: log mean_k" in table and "generations" not in table and "pass@" not in table
    single = _sampled_task(5, 1, 0.4, 0)  # one sample per prompt: its value is all there is
    assert "pass@" not in format_table({"latents": latents, "tasks": {"nq": single}})


def test_compare_explains_each_row_kind_and_writes_beside_the_runs_not_in_the_current_directory(
    tmp_path, monkeypatch, capsys
):
    import json

    from free_transformer.cli import main

    for name, rate in (("base", 0.2), ("free", 0.6)):
        results = tmp_path / "runs" / name / "eval" / "step_1.json"
        results.parent.mkdir(parents=True)
        results.write_text(json.dumps({"tasks": {"gsm8k": _sampled_task(30, 4, rate, 0)}}))
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "runs/base", "runs/free", "--bootstrap", "100"]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing in the current directory
    md, page = (tmp_path / "runs" / "comparison.md").read_text(), (tmp_path / "runs" / "comparison.html").read_text()
    page = html.unescape(page)
    assert "wrote runs/comparison.md, runs/comparison.html" in printed
    table = printed.split("Compared:")[0]  # the table, then what it rests on
    for text in (table, md, page):
        for kind in ("em: ", "pass@k: ", "maj@k: "):  # one line for each kind of row
            assert sum(re.sub("^(- |<li>)", "", line).startswith(kind) for line in text.splitlines()) == 1, kind
        assert "mean over each prompt's samples" in text and "at least one of k samples" in text
    assert main(["compare", "runs/free/eval/step_1.json", "runs/base", "--bootstrap", "100"]) == 2  # runs/ again
    assert "runs/comparison.md already exists" in capsys.readouterr().err
