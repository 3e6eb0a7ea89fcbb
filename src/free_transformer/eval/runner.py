"""Scoring one model: `score` under EvalSettings (the harness's entry point: benchmarks and held-out
likelihoods), `evaluate` on a list of benchmarks (prompts -> log-probabilities or generations -> the
paper's measure, with every per-document score kept for the comparison's bootstrap)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

from tqdm.auto import tqdm

from . import task_metrics
from .checker import check_generation
from .likelihood import heldout_likelihood
from .prepare import PreparedTask, prepare
from .sandbox import isolation_report, weaker_layers
from .scoring import continuation_logprobs, generate_texts, generation_steps, log_mean_exp
from .settings import EvalSettings
from .task_data import DataUnavailable
from .tasks import GenerationDoc, MultipleChoiceDoc

FEWSHOT_SEED = 1234  # picks each task's few-shot examples


def evaluate(
    model, tokenizer, settings: EvalSettings, *, progress: bool = True, on_task: Callable[[dict], None] | None = None
) -> dict:
    """{"tasks": {name: result}, "unavailable": {name: reason}, "latents": ...} for the model on the
    settings' tasks. on_task: called with the results so far after each task."""
    settings.check_model(model)
    results, unavailable = {}, {}
    shots, data_files = dict(settings.num_fewshot), dict(settings.data)  # per task; "*" for every task
    for name in settings.tasks:
        try:
            task = prepare(
                name,
                num_fewshot=shots.get(name, shots.get("*")),
                limit=settings.limit,
                data_file=data_files.get(name),
                seed=FEWSHOT_SEED,
            )
        except DataUnavailable as error:
            unavailable[name] = str(error)
            continue
        started = time.monotonic()
        if task.benchmark.kind == "mc":
            result = _multiple_choice(model, tokenizer, task, settings, progress)
        else:
            result = _generative(model, tokenizer, task, settings, progress)
        result["seconds"] = round(time.monotonic() - started, 2)
        results[name] = result
        if on_task is not None:
            on_task({"tasks": results, "unavailable": unavailable})
    return {"tasks": results, "unavailable": unavailable, "latents": settings.describe_latents(model)}


def _base_result(task: PreparedTask, value: float, per_doc: list[dict]) -> dict:
    bench = task.benchmark
    return {
        "metric": bench.metric,
        "value": value,
        "n": len(per_doc),
        "num_fewshot": task.num_fewshot,
        "paper_name": bench.paper_name,
        "category": bench.category,
        "source": task.source,
        "per_doc": per_doc,
    }


def _multiple_choice(model, tokenizer, task: PreparedTask, settings: EvalSettings, progress: bool) -> dict:
    docs: list[MultipleChoiceDoc] = task.docs  # type: ignore[assignment]  # an mc task builds only these
    requests = [[(tokenizer.encode(c), tokenizer.encode(t)) for c, t in zip(d.contexts, d.continuations)] for d in docs]
    keys = [f"{task.benchmark.name}/{d.doc_id}" for d in docs]
    rows = sum(len(r) for r in requests) * settings.latent_draws(model)
    with tqdm(total=rows, desc=task.benchmark.name, unit="seq", disable=not progress, leave=False) as bar:
        draws = continuation_logprobs(model, requests, keys, settings, progress=bar.update)
    per_doc: list[dict] = []
    for doc, request, scores in zip(docs, requests, draws):
        logprobs = log_mean_exp(scores).tolist()  # (choices,)
        by_token = task_metrics.choose(logprobs, [len(t) for _, t in request])
        by_char = task_metrics.choose(logprobs, [len(t) for t in doc.continuations])
        raw = task_metrics.choose(logprobs, [1] * len(logprobs))
        per_doc.append(
            {
                "id": doc.doc_id,
                "group": doc.group,
                "gold": doc.gold,
                "acc_completion": float(by_token == doc.gold),
                "acc_char": float(by_char == doc.gold),
                "acc_raw": float(raw == doc.gold),
                "logprobs": [round(x, 4) for x in logprobs],
            }
        )
    primary = "acc_char" if task.benchmark.metric.endswith("acc_char") else "acc_completion"
    groups = [d["group"] for d in per_doc]
    for record in per_doc:
        record["score"] = record[primary]
    result = _base_result(task, task_metrics.aggregate([d["score"] for d in per_doc], groups), per_doc)
    result["also"] = {
        m: task_metrics.aggregate([d[m] for d in per_doc], groups)
        for m in ("acc_completion", "acc_char", "acc_raw")
        if m != primary
    }
    # What fit_window cuts to fit the model's context: the context's start (usually harmless), or, when an
    # answer alone is longer than the context, the answer's start (its choices may then score alike)
    max_len = model.config.max_seq_len
    result["truncated_contexts"] = sum(any(len(c) + len(t) > max_len + 1 for c, t in r) for r in requests)
    result["truncated_answers"] = sum(any(len(t) > max_len for _, t in r) for r in requests)
    return result


def _generative(model, tokenizer, task: PreparedTask, settings: EvalSettings, progress: bool) -> dict:
    bench = task.benchmark
    docs: list[GenerationDoc] = task.docs  # type: ignore[assignment]  # a generative task builds only these
    budget = settings.max_new_tokens or bench.max_new_tokens
    per_doc: list[dict] = []
    truncated = 0
    for doc in tqdm(docs, desc=bench.name, unit="doc", disable=not progress, leave=False):
        texts, cut = generate_texts(
            model, tokenizer, doc.prompt, f"{bench.name}/{doc.doc_id}", settings, max_new_tokens=budget, stop=bench.stop
        )
        truncated += cut
        verdicts = [check_generation(bench, doc, text, settings.sandbox) for text in texts]
        correct = [v.correct for v in verdicts]
        detail: dict[str, list] = (
            {"status": [v.status for v in verdicts]}
            if bench.kind == "code"
            else {"answers": [v.answer for v in verdicts]}
        )
        per_doc.append(
            {
                "id": doc.doc_id,
                "group": doc.group,
                "score": statistics.fmean(map(float, correct)),
                "correct": correct,
                "generations": texts,
                **detail,
            }
        )
    result = _base_result(task, task_metrics.aggregate([d["score"] for d in per_doc]), per_doc)
    result.update(sample_measures(per_doc, vote=bench.kind != "code", seed=settings.seed))
    result["max_new_tokens"] = generation_steps(budget, model.config.max_seq_len)
    result["truncated_prompts"] = truncated
    if bench.kind == "code":
        result["sandbox"] = isolation_report(settings.sandbox)
        if weaker := weaker_layers(result["sandbox"]):  # the results file records it; the console says it too
            tqdm.write(f"note: {task}: generated code ran in a weaker sandbox: {'; '.join(weaker)}", file=sys.stderr)
    return result


def sample_measures(per_doc: list[dict], *, vote: bool, seed: int = 0) -> dict:
    """pass@k for every k up to the samples per prompt n, and (`vote`: em tasks) maj@k, each the mean over
    documents of its per-document estimate, with a bootstrap interval over documents: {"pass@k": {k: {value,
    low, high, confidence}}, "maj@k": ...}. Each per-document record gains its estimates too."""
    n = min(len(doc["correct"]) for doc in per_doc) if per_doc else 0
    measures: dict[str, dict[str, dict[str, float]]] = {"pass@k": {}}
    if vote:
        measures["maj@k"] = {}
    for doc in per_doc:
        doc["pass@k"] = {str(k): task_metrics.pass_at_k(n, sum(doc["correct"][:n]), k) for k in range(1, n + 1)}
        if vote:
            doc["maj@k"] = {
                str(k): task_metrics.majority_at_k(doc["answers"][:n], doc["correct"][:n], k, seed=seed)
                for k in range(1, n + 1)
            }
    for name, by_k in measures.items():
        for k in range(1, n + 1):
            by_k[str(k)] = task_metrics.bootstrap_interval([doc[name][str(k)] for doc in per_doc], seed=seed)
    return measures


def score(
    model, tokenizer, settings: EvalSettings, *, progress: bool = False, on_task: Callable[[dict], None] | None = None
) -> dict:
    """The model's results under `settings` (their sandbox limits included): {"tasks", "unavailable",
    "latents"} (runner.evaluate) and, with held-out text, "likelihood". Leaves the model in eval mode.
    on_task: called with the results so far after each task (to keep them if the evaluation is stopped)."""
    model.eval()
    results = evaluate(model, tokenizer, settings, progress=progress, on_task=on_task)
    if settings.heldout:
        with tqdm(desc="held-out", unit="window", disable=not progress, leave=False) as bar:
            results["likelihood"] = heldout_likelihood(
                model,
                tokenizer,
                settings.heldout_text(),
                samples=settings.heldout_samples,
                seed=settings.seed,
                max_windows=settings.heldout_windows,
                progress=bar.update,
            )
        results["likelihood"]["files"] = list(settings.heldout)
    return results
