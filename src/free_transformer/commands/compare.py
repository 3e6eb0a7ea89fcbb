"""`free-transformer compare`: the paper's baseline-vs-Free table from eval results, with bootstrap
confidence intervals of every difference."""

from __future__ import annotations

from pathlib import Path

NAME = "compare"
HELP = "compare eval results (baseline first) in the paper's table form, as markdown + HTML, with bootstrap CIs"


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="eval results JSON files or run directories (newest RUN/eval/*.json); the first is "
                             "the baseline")
    parser.add_argument("--labels", default=None, help="comma-separated column labels (default: run names)")
    parser.add_argument("--output", default="comparison", help="writes OUTPUT.md and OUTPUT.html (default: comparison)")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples per difference")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from ..eval.compare import (
        build_rows,
        heldout_mismatch,
        load_results,
        to_html,
        to_markdown,
        to_text,
    )

    if len(args.runs) < 2:
        raise ValueError("compare needs a baseline and at least one other run")
    if args.bootstrap < 100:
        raise ValueError("--bootstrap needs at least 100 resamples")
    runs = [load_results(r) for r in args.runs]
    labels = [r["label"] for r in runs] if args.labels is None else [s.strip() for s in args.labels.split(",")]
    if len(labels) != len(runs):
        raise ValueError(f"--labels has {len(labels)} names for {len(runs)} runs")
    rows = build_rows(runs, samples=args.bootstrap, seed=args.seed)
    notes = []
    for label, r in zip(labels, runs):
        notes.append(f"{label}: {r.get('latents', {}).get('latents', '?')}")
    note = "Latents: " + "; ".join(notes)
    base_like = runs[0].get("likelihood")
    for label, r in zip(labels[1:], runs[1:]):
        why = base_like and r.get("likelihood") and heldout_mismatch(base_like, r["likelihood"])
        if why:
            note += (f". Held-out likelihood of {label} was measured on other text than {labels[0]}'s ({why}): "
                     "its change is not shown")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    md, page = output.with_suffix(".md"), output.with_suffix(".html")
    md.write_text(to_markdown(rows, labels, note))
    page.write_text(to_html(rows, labels, note))
    print(to_text(rows, labels))
    print(note)
    print(f"wrote {md} and {page}")
    return 0
