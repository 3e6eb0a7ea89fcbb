"""The comparison table of the paper (Tables 1-3): per benchmark the baseline's value, each Free
Transformer's value and its relative change, coloured as the paper does, plus what the paper does
not give: a paired bootstrap confidence interval of each difference, so that at small scale a
reader sees which differences are noise."""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..base.bounded import loads_json
from ..base.units import LN2
from ..eval import task_metrics
from ..eval.catalog import all_tasks

# The paper's colours: |change| < 1% none, 1-10% light, >= 10% strong (LaTeX xcolor names).
COLOURS = {"up": ("green!25", "green"), "down": ("red!10", "red!80")}
HTML_COLOURS = {"green!25": "#bfffbf", "green": "#00ff00", "red!10": "#ffe6e6", "red!80": "#ff3333", "white": "#ffffff"}
MIN_DOCS_FOR_SIGNIFICANCE = 20  # below this a bootstrap interval says little; no star is given
CATEGORY_ORDER = [
    "Generative code/math",
    "Multi-choice general knowledge / common sense",
    "Multi-choice text understanding",
    "Culture",
    "Held-out likelihood",
]


def paper_colour(relative_percent: float | None, higher_is_better: bool = True) -> str:
    if relative_percent is None or math.isnan(relative_percent):
        return "white"
    gain = relative_percent if higher_is_better else -relative_percent
    if abs(gain) < 1:
        return "white"
    light, strong = COLOURS["up" if gain > 0 else "down"]
    return strong if abs(gain) >= 10 else light


def load_results(path: str | Path) -> dict:
    """An eval JSON file, or a run directory (its newest eval/*.json); the file read is its `results_file`."""
    path = Path(path)
    if path.is_dir():
        found = sorted((path / "eval").glob("*.json"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise FileNotFoundError(f"no eval results in {path}/eval/ (run `free-transformer eval` first)")
        path = found[-1]
    if not path.is_file():
        raise FileNotFoundError(f"no eval results at {path}")
    try:
        results = loads_json(path.read_text(encoding="utf-8"))
    except ValueError as error:  # not UTF-8, not JSON
        raise ValueError(f"cannot read {path}: {error}") from None
    if not _is_results(results):
        raise ValueError(
            f"{path} is not an eval results file (a mapping whose tasks map each task to its metric, "
            "value, n and per_doc scores)"
        )
    results.setdefault("label", path.parent.parent.name if path.parent.name == "eval" else path.stem)
    results["results_file"] = str(path)
    return results


def shares_nothing(base: dict, other: dict) -> bool:
    """Two results with no task and no held-out likelihood in common: no row of the table compares them."""
    both_likelihoods = bool(base.get("likelihood")) and bool(other.get("likelihood"))
    return not set(base["tasks"]) & set(other["tasks"]) and not both_likelihoods


def _is_results(results) -> bool:
    """What build_rows reads of each task is there, of the right types."""
    if not isinstance(results, dict) or not isinstance(results.get("tasks"), dict):
        return False
    return all(
        isinstance(task, dict)
        and isinstance(task.get("metric"), str)
        and isinstance(task.get("value"), (int, float))
        and isinstance(task.get("n"), int)
        and isinstance(task.get("per_doc"), list)
        and all(
            isinstance(doc, dict) and "id" in doc and isinstance(doc.get("score"), (int, float))
            for doc in task["per_doc"]
        )
        for task in results["tasks"].values()
    )


@dataclass
class Cell:
    value: float
    relative: float | None = None  # % change against the baseline
    ci: dict | None = None  # bootstrap interval of the difference (absolute and relative)
    colour: str = "white"
    n: int = 0


@dataclass
class Row:
    name: str
    label: str
    category: str
    higher_is_better: bool
    baseline: Cell | None
    others: list[Cell | None] = field(default_factory=list)
    measure: str = ""  # the task's metric (em, pass@4, ...); empty for the held-out likelihood


def _paired_scores(base: dict, other: dict) -> tuple[list, list, list]:
    """Per-document scores of the documents both runs evaluated, in the same order."""
    theirs = {d["id"]: d for d in other["per_doc"]}
    a, b, groups = [], [], []
    for doc in base["per_doc"]:
        if doc["id"] in theirs:
            a.append(doc["score"])
            b.append(theirs[doc["id"]]["score"])
            groups.append(doc.get("group"))
    return a, b, groups


def _relative(base: float, other: float) -> float | None:
    return None if base == 0 else 100.0 * (other - base) / abs(base)


def _interval(a, b, groups, samples, seed, ratio=True) -> dict | None:
    if len(a) < 2:
        return None
    ci = task_metrics.paired_bootstrap(a, b, groups, samples=samples, seed=seed)
    base = task_metrics.aggregate(a, groups)
    if ratio and base:
        ci["relative_low"], ci["relative_high"] = 100 * ci["low"] / abs(base), 100 * ci["high"] / abs(base)
    ci["n"] = len(a)
    return ci


def sample_ks(n: int) -> list[int]:
    """The k of pass@k and maj@k a comparison shows beside a task's own value: powers of 2 from 2, and n."""
    return sorted({2**e for e in range(1, n.bit_length()) if 2**e < n} | ({n} if n > 1 else set()))


def with_sample_tasks(results: dict) -> dict:
    """The results with a task of their own for each pass@k and maj@k (k > 1, sample_ks) of a generative task
    scored from several samples per prompt, its per-document scores the per-document estimates: `TASK pass@k`."""
    tasks = dict(results["tasks"])
    for name, task in results["tasks"].items():
        for measure in ("pass@k", "maj@k"):
            by_k = task.get(measure) or {}
            for k in sample_ks(max(map(int, by_k), default=0)):
                label = measure.replace("k", str(k))
                tasks[f"{name} {label}"] = {
                    **{key: task[key] for key in ("paper_name", "category") if key in task},
                    "metric": label,
                    "value": by_k[str(k)]["value"],
                    "n": task["n"],
                    "per_doc": [
                        {"id": d["id"], "group": d.get("group"), "score": d[measure][str(k)]} for d in task["per_doc"]
                    ],
                }
    return {**results, "tasks": tasks}


def build_rows(runs: list[dict], *, samples: int = 2000, seed: int = 0) -> list[Row]:
    """Rows comparing runs[1:] to runs[0] (the baseline), task by task in the paper's order (a generative
    task scored from several samples per prompt also by its pass@k and maj@k: with_sample_tasks)."""
    runs = [with_sample_tasks(run) for run in runs]
    base_run, others = runs[0], runs[1:]
    every = {t for r in runs for t in r["tasks"]}
    derived = {t for t in every if " " in t}  # `TASK pass@k`: after its task, by k
    names = [t for t in all_tasks() if t in every]
    names += sorted(every - derived - set(names))
    names = [
        row
        for t in names
        for row in [t]
        + sorted((d for d in derived if d.split(" ")[0] == t), key=lambda d: (d.split("@")[0], int(d.split("@")[1])))
    ]
    rows = []
    for name in names:
        ref = next(r["tasks"][name] for r in runs if name in r["tasks"])
        label = f"{ref.get('paper_name', name)} ({ref['metric']})"
        base = base_run["tasks"].get(name)
        baseline = Cell(base["value"], n=base["n"]) if base else None
        row = Row(name, label, ref.get("category", "Other"), True, baseline, measure=ref["metric"])
        for run in others:
            mine = run["tasks"].get(name)
            if mine is None:
                row.others.append(None)
                continue
            cell = Cell(mine["value"], n=mine["n"])
            if base is not None:
                cell.relative = _relative(base["value"], mine["value"])
                a, b, groups = _paired_scores(base, mine)
                cell.ci = _interval(a, b, groups, samples, seed)
                cell.colour = paper_colour(cell.relative if cell.relative is not None else float("nan"))
            row.others.append(cell)
        rows.append(row)
    rows += _likelihood_rows(runs, samples, seed)
    return rows


def heldout_mismatch(base: dict, other: dict) -> str | None:
    """Why two held-out likelihoods were not measured on the same text (None if they were): other
    files, or another number of bytes (e.g. --heldout-windows)."""
    if base.get("files") and other.get("files") and base["files"] != other["files"]:
        return f"files {', '.join(other['files'])} vs {', '.join(base['files'])}"
    if base.get("bytes") != other.get("bytes"):
        return (
            f"{other.get('windows')} windows, {other.get('bytes')} bytes vs "
            f"{base.get('windows')} windows, {base.get('bytes')} bytes"
        )
    return None


def _likelihood_rows(runs: list[dict], samples: int, seed: int) -> list[Row]:
    """Bits per byte on held-out text: the baseline's exact value against each Free model's prior
    cross-entropy and IWAE bound (lower is better)."""
    base = runs[0].get("likelihood")
    if not base or not any(r.get("likelihood") for r in runs[1:]):
        return []
    base_measure = "exact" if "exact" in base else "iwae"
    rows = []
    for measure, title in (("iwae", "IWAE bound"), ("prior_ce", "prior cross-entropy")):
        baseline = Cell(base[base_measure]["bits_per_byte"], n=base["windows"])
        row = Row(f"bpb_{measure}", f"held-out bits/byte (Free: {title})", "Held-out likelihood", False, baseline)
        for run in runs[1:]:
            like = run.get("likelihood")
            if not like or measure not in like:
                row.others.append(None)
                continue
            cell = Cell(like[measure]["bits_per_byte"], n=like["windows"])
            if heldout_mismatch(base, like):  # other text: the values stand, their difference means nothing
                row.others.append(cell)
                continue
            cell.relative = _relative(baseline.value, cell.value)
            cell.colour = paper_colour(cell.relative, higher_is_better=False)
            a_windows, b_windows = base["per_window"], like["per_window"]
            if [w["bytes"] for w in a_windows] == [w["bytes"] for w in b_windows]:  # same windows: pair them
                scale = LN2 * sum(w["bytes"] for w in a_windows) / len(a_windows)
                a = [w[base_measure] / scale for w in a_windows]
                b = [w[measure] / scale for w in b_windows]
                cell.ci = _interval(a, b, None, samples, seed)
            row.others.append(cell)
        rows.append(row)
    return rows


# ---- rendering ---------------------------------------------------------------------------------------


def row_legend(rows: list[Row]) -> list[str]:
    """One line per kind of row the table has: what its measure is (em, pass@k, maj@k, ...)."""
    return task_metrics.measure_legend([row.measure for row in rows if row.measure])


def _fmt_value(cell: Cell | None) -> str:
    return "—" if cell is None else f"{cell.value:.3f}"


def _fmt_change(cell: Cell | None) -> str:
    if cell is None or cell.relative is None:
        return "—"
    return f"{cell.relative:+.2f}%"


def significant(cell: Cell | None) -> bool:
    """The interval excludes 0 and rests on enough documents to mean something."""
    if cell is None or not cell.ci or cell.ci["n"] < MIN_DOCS_FOR_SIGNIFICANCE:
        return False
    return cell.ci["low"] > 0 or cell.ci["high"] < 0


def _fmt_ci(cell: Cell | None) -> str:
    if cell is None or not cell.ci:
        return "—"
    ci = cell.ci
    text = f"[{ci['low']:+.3f}, {ci['high']:+.3f}]"
    if "relative_low" in ci:
        text += f" ({ci['relative_low']:+.1f}%, {ci['relative_high']:+.1f}%)"
    if ci["n"] < MIN_DOCS_FOR_SIGNIFICANCE:
        return text + f" n={ci['n']}, too few"
    return text + (" *" if significant(cell) else "")


def _baseline_header(label: str) -> str:
    return label if "baseline" in label.lower() else f"{label} (baseline)"


def _grouped(rows: list[Row]):
    categories = [c for c in CATEGORY_ORDER if any(r.category == c for r in rows)]
    categories += sorted({r.category for r in rows} - set(categories))
    for category in categories:
        yield category, [r for r in rows if r.category == category]


# Column blocks: the final values, then (given rows of last-third averages) the paper's Table 3 columns.
BLOCKS = {"final": "Final value", "last third": "Average (last third)"}
LAST_THIRD_LEGEND = (
    "Last third: each run's evaluations at steps >= 2/3 of its last scored step, averaged "
    "document by document; its CI bootstraps those per-document averages."
)


def _blocks(rows: list[Row], averaged: list[Row] | None) -> list[tuple[str, dict[str, Row]]]:
    if averaged is None:
        return [("", {r.name: r for r in rows})]
    return [("final", {r.name: r for r in rows}), ("last third", {r.name: r for r in averaged})]


def _block_cells(row: Row, block: dict[str, Row], runs: int) -> tuple[Cell | None, list[Cell | None]]:
    """The baseline's and the other runs' cells of `row` in one block (empty where it lacks the row)."""
    mine = block.get(row.name)
    return (mine.baseline, mine.others) if mine is not None else (None, [None] * (runs - 1))


def _headers(labels: list[str], title: str) -> list[str]:
    suffix = f" [{title}]" if title else ""
    head = [_baseline_header(labels[0]) + suffix]
    for label in labels[1:]:
        head += [label + suffix, "change", "95% CI of difference"]
    return head


def to_markdown(rows: list[Row], labels: list[str], note: str = "", averaged: list[Row] | None = None) -> str:
    blocks = _blocks(rows, averaged)
    head = ["benchmark"] + [h for title, _ in blocks for h in _headers(labels, title)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for category, members in _grouped(rows):
        lines.append("| **" + category + "** |" + " |" * (len(head) - 1))
        for row in members:
            cells = [row.label]
            for _, block in blocks:
                baseline, others = _block_cells(row, block, len(labels))
                cells.append(_fmt_value(baseline))
                for cell in others:
                    change = _fmt_change(cell)
                    if cell is not None and cell.colour != "white":
                        change = f"{change} ({cell.colour})"
                    cells += [_fmt_value(cell), change, _fmt_ci(cell)]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "Change: relative to the baseline; colours as in the paper (|change| < 1%: none, "
        "1-10%: light, >= 10%: strong; green better). CI: paired bootstrap over documents of "
        "(model - baseline), absolute and relative; * marks an interval that excludes 0 "
        f"(given only from {MIN_DOCS_FOR_SIGNIFICANCE} documents on)."
    )
    if averaged is not None:
        lines.append(LAST_THIRD_LEGEND)
    if note:
        lines.append(note)
    kinds = row_legend(rows + (averaged or []))
    lines += [""] + [f"- {line}" for line in kinds] if kinds else []
    return "\n".join(lines) + "\n"


def to_html(
    rows: list[Row], labels: list[str], note: str = "", averaged: list[Row] | None = None, figure: Path | None = None
) -> str:
    esc = html.escape
    blocks = _blocks(rows, averaged)
    head = "<th>benchmark</th>" + "".join(f"<th>{esc(h)}</th>" for title, _ in blocks for h in _headers(labels, title))
    block_width = 1 + 3 * (len(labels) - 1)
    if averaged is not None:
        head = (
            "<th></th>"
            + "".join(f'<th colspan="{block_width}">{BLOCKS[title]}</th>' for title, _ in blocks)
            + "</tr>\n<tr>"
            + head
        )
    body = []
    for category, members in _grouped(rows):
        body.append(f'<tr class="category"><td colspan="{1 + block_width * len(blocks)}">{esc(category)}</td></tr>')
        for row in members:
            cells = f"<td>{esc(row.label)}</td>"
            for _, block in blocks:
                baseline, others = _block_cells(row, block, len(labels))
                cells += f"<td>{_fmt_value(baseline)}</td>"
                for cell in others:
                    colour = HTML_COLOURS[cell.colour] if cell is not None else "#ffffff"
                    change = esc(_fmt_change(cell))
                    change = f"<b>{change}</b>" if significant(cell) else change
                    cells += (
                        f'<td>{_fmt_value(cell)}</td><td style="background:{colour}">{change}</td>'
                        f"<td>{esc(_fmt_ci(cell))}</td>"
                    )
            body.append(f"<tr>{cells}</tr>")
    style = (
        "table{border-collapse:collapse;font-family:sans-serif;font-size:13px}"
        "td,th{border:1px solid #999;padding:3px 8px;text-align:right}"
        "td:first-child{text-align:left}tr.category td{text-align:center;font-style:italic;background:#eee}"
    )
    legend = (
        "Change relative to the baseline, coloured as in the paper (|change| &lt; 1%: none, 1-10%: light, "
        "&ge; 10%: strong; green better). CI: paired bootstrap over documents of (model &minus; baseline); "
        f"bold / * when it excludes 0 (from {MIN_DOCS_FOR_SIGNIFICANCE} documents on)."
    )
    if averaged is not None:
        legend += " " + esc(LAST_THIRD_LEGEND)
    kinds = "\n".join(f"<li>{esc(line)}</li>" for line in row_legend(rows + (averaged or [])))
    image = ""
    if figure is not None:
        data = base64.b64encode(Path(figure).read_bytes()).decode()
        image = f'<p><img alt="scores during training" src="data:image/png;base64,{data}"></p>\n'
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>Baseline vs Free Transformer</title>'
        f"<style>{style}</style></head><body>\n<table>\n<tr>{head}</tr>\n"
        + "\n".join(body)
        + f"\n</table>\n<p>{legend}</p>\n"
        + (f"<ul>\n{kinds}\n</ul>\n" if kinds else "")
        + f"<p>{esc(note)}</p>\n{image}</body></html>\n"
    )


def to_text(rows: list[Row], labels: list[str], averaged: list[Row] | None = None) -> str:
    blocks = _blocks(rows, averaged)
    width = max([len(r.label) for r in rows] + [10])
    head = f"{'benchmark':<{width}}"
    for title, _ in blocks:
        suffix = f" [{title}]" if title else ""
        head += f"  {(labels[0][:12] + suffix):>12}" + "".join(
            f"  {(label[:12] + suffix):>12} {'change':>9}  {'95% CI':<34}" for label in labels[1:]
        )
    lines = [head.rstrip()]
    for category, members in _grouped(rows):
        lines.append(f"-- {category}")
        for row in members:
            line = f"{row.label:<{width}}"
            for _, block in blocks:
                baseline, others = _block_cells(row, block, len(labels))
                line += f"  {_fmt_value(baseline):>12}"
                for cell in others:
                    line += f"  {_fmt_value(cell):>12} {_fmt_change(cell):>9}  {_fmt_ci(cell):<34}"
            lines.append(line.rstrip())
    return "\n".join(lines + row_legend(rows + (averaged or [])))
