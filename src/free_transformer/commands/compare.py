"""`free-transformer compare`: the paper's baseline-vs-Free table from eval results, with bootstrap
confidence intervals of every difference; for runs with an evaluation record (RUN/eval/curve.jsonl),
also the last-third averages (Table 3) and the scores during training (the appendix figures)."""

from __future__ import annotations

from pathlib import Path

NAME = "compare"
HELP = (
    "compare eval results (baseline first) in the paper's table form, as markdown + HTML, with bootstrap CIs; "
    "with evaluation records, last-third averages and curves during training (PNG)"
)


def add_arguments(parser) -> None:
    parser.add_argument(
        "runs",
        nargs="+",
        metavar="RUN",
        help="run directories or eval results JSON files; the first is the baseline. A run "
        "directory with an evaluation record (RUN/eval/curve.jsonl, written by training's "
        "eval section or `eval --checkpoints`) is read as its curve: final and last-third "
        "columns, and curves; otherwise its newest RUN/eval/*.json",
    )
    parser.add_argument("--labels", default=None, help="comma-separated column labels (default: run names)")
    parser.add_argument(
        "--output",
        default=None,
        help="writes OUTPUT.md and OUTPUT.html, and OUTPUT.png with curves (default: comparison beside the "
        "baseline run, in its parent directory: runs/comparison for runs/ctrl)",
    )
    parser.add_argument(
        "--settings",
        default=None,
        metavar="KEY[,KEY...]",
        help="the evaluation settings whose curve is read from each record (one key for all runs, "
        "or one per run); default: those of each record's newest evaluation",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUTPUT.md / .html / .png if they exist (else that is an error and nothing is written)",
    )
    parser.add_argument(
        "--x",
        dest="axis",
        choices=["step", "tokens"],
        default="step",
        help="x axis of the curves: optimizer steps or tokens seen",
    )
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples per difference")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from ..reports.comparison import build_rows, load_results, shares_nothing, to_html, to_markdown, to_text
    from ..reports.curves import has_curve, load_curve

    if len(args.runs) < 2:
        raise ValueError("compare needs a baseline and at least one other run")
    if args.bootstrap < 100:
        raise ValueError("--bootstrap needs at least 100 resamples")
    labels = None if args.labels is None else [s.strip() for s in args.labels.split(",")]
    if labels is not None and len(labels) != len(args.runs):
        raise ValueError(f"--labels has {len(labels)} names for {len(args.runs)} runs")
    keys = [None] * len(args.runs) if args.settings is None else [k.strip() for k in args.settings.split(",")]
    if len(keys) == 1:
        keys *= len(args.runs)
    if len(keys) != len(args.runs):
        raise ValueError(f"--settings has {len(keys)} keys for {len(args.runs)} runs (give one, or one per run)")
    curves = [load_curve(r, key) if has_curve(r) else None for r, key in zip(args.runs, keys)]
    runs = [c.final() if c is not None else load_results(r) for c, r in zip(curves, args.runs)]
    labels = labels or [r["label"] for r in runs]
    for curve, label in zip(curves, labels):
        if curve is not None:
            curve.label = label
    sources = [_source(run, curve) for run, curve in zip(runs, curves)]
    for label, run, source in zip(labels[1:], runs[1:], sources[1:]):
        if shares_nothing(runs[0], run):
            raise ValueError(
                f"{label} ({source}: {_tasks(run)}) shares no task with {labels[0]} ({sources[0]}: "
                f"{_tasks(runs[0])}): give results of the same tasks (a results file as RUN, or "
                "`eval --tasks` on both)"
            )
    rows = build_rows(runs, samples=args.bootstrap, seed=args.seed)
    averaged = None
    if any(curves):
        averages = [c.last_third_average() if c is not None else {"tasks": {}} for c in curves]
        averaged = build_rows(averages, samples=args.bootstrap, seed=args.seed)
    note = "Compared: " + "; ".join(f"{label}: {source}" for label, source in zip(labels, sources))
    note += ". " + _note(labels, runs, curves)
    output = Path(args.output) if args.output else default_output(args.runs[0])
    md, page, figure = output.with_suffix(".md"), output.with_suffix(".html"), None
    existing = [path for path in (md, page, output.with_suffix(".png")) if path.exists()]
    if existing and not args.overwrite:
        raise ValueError(f"{existing[0]} already exists: choose another --output, or pass --overwrite to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    if any(curves):
        from ..base.plotting import draw
        from ..reports.figures import curve_panels

        figure = output.with_suffix(".png")
        draw(curve_panels(curves, args.axis), figure, xlabel="tokens" if args.axis == "tokens" else "step")
    md.write_text(
        to_markdown(rows, labels, note, averaged) + (f"\n![scores during training]({figure.name})\n" if figure else "")
    )
    page.write_text(to_html(rows, labels, note, averaged, figure))
    print(to_text(rows, labels, averaged))
    print(note)
    print(f"wrote {md}, {page}" + (f" and {figure}" if figure else ""))
    return 0


def default_output(baseline: str) -> Path:
    """`comparison` in the folder that holds the baseline run: runs/ctrl and runs/ctrl/eval/x.json give
    runs/comparison; a results file elsewhere, its own folder."""
    path = Path(baseline)
    if path.is_file():
        run = path.parent.parent if path.parent.name == "eval" else path
    else:
        run = path if path.name not in ("", "..") else path.resolve()  # `compare . OTHER`: the folder above
    return run.parent / "comparison"


def _source(run: dict, curve) -> str:
    """Where a column's scores come from: a results file, or an evaluation of a run's record."""
    if curve is None:
        return run["results_file"]
    from ..eval.record import record_path

    return f"{record_path(curve.run_dir)} step {run['step']}, settings {curve.settings_key}"


def _tasks(run: dict) -> str:
    """A results' tasks, and its held-out likelihood, as a short list."""
    names = [*sorted(run["tasks"]), *(["held-out likelihood"] if run.get("likelihood") else [])]
    return ", ".join(names) or "nothing scored"


def _note(labels: list[str], runs: list[dict], curves: list) -> str:
    """What the table rests on: each run's latents, the evaluations of each curve, and what is not compared."""
    from ..reports.comparison import heldout_mismatch
    from ..reports.curves import LATENT_SETTINGS, settings_difference

    note = "Latents: " + "; ".join(
        f"{label}: {r.get('latents', {}).get('latents', '?')}" for label, r in zip(labels, runs)
    )
    base_like = runs[0].get("likelihood")
    for label, r in zip(labels[1:], runs[1:]):
        why = base_like and r.get("likelihood") and heldout_mismatch(base_like, r["likelihood"])
        if why:
            note += (
                f". Held-out likelihood of {label} was measured on other text than {labels[0]}'s ({why}): "
                "its change is not shown"
            )
    for label, curve in zip(labels, curves):
        if curve is None:
            continue
        steps = [e["step"] for e in curve.entries]
        third = [e["step"] for e in curve.last_third()]
        note += (
            f". {label}: {len(steps)} evaluations at steps {steps[0]}-{steps[-1]} under settings "
            f"{curve.settings_key}, last third: steps {third[0]}-{third[-1]} ({len(third)})"
        )
        difference = settings_difference(curve.settings, next(c for c in curves if c).settings, LATENT_SETTINGS)
        if difference:
            note += f"; its settings differ from the first curve's: {difference}"
        for key, entries in curve.others.items():
            note += (
                f"; its record also holds {len(entries)} evaluation(s) under settings {key} ("
                f"{settings_difference(entries[-1]['settings'], curve.settings)}), not mixed in: "
                f"--settings {key} shows them"
            )
    return note
