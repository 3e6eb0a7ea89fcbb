"""The paper's appendix figures: per benchmark, the score against training steps (or tokens) of every run,
the baseline in black; held-out bits per byte; and, from each run's metrics.jsonl, the training
cross-entropy and the KL against kappa (the exploratory section: the KL goes under kappa and stays there).

`curve_panels` computes what is drawn (testable without a picture), curves.draw draws it."""

from __future__ import annotations

from ..base.plotting import Line, Panel
from ..eval.catalog import all_tasks
from ..train.metrics import read_metrics
from .curves import Curve


def curve_panels(runs: list[Curve | None], axis: str = "step") -> list[Panel]:
    """One panel per benchmark scored in any curve (in the paper's order), one for held-out bits per byte
    when measured, and the training cross-entropy and KL when the runs logged them. runs[0] is the
    baseline (black, its last third shaded); a run without a curve (None) keeps its colour unused."""
    curves = [c for c in runs if c is not None]
    names = [t for t in all_tasks() if any(t in e["tasks"] for c in curves for e in c.entries)]
    names += sorted({t for c in curves for e in c.entries for t in e["tasks"]} - set(names))
    panels = []
    for name in names:
        ref = next(e["tasks"][name] for c in curves for e in c.entries if name in e["tasks"])
        panel = Panel(f"{ref.get('paper_name', name)} ({ref['metric']})", ref["metric"])
        for run, curve in _present(runs):
            scored = [e for e in curve.entries if name in e["tasks"]]
            if scored:
                panel.lines.append(
                    Line(
                        run,
                        curve.label,
                        [curve.x(e, axis) for e in scored],
                        [e["tasks"][name]["value"] for e in scored],
                    )
                )
        panels.append(panel)
    if any("likelihood" in e for c in curves for e in c.entries):
        panels.append(_likelihood_panel(runs, axis))
    panels += _training_panels(runs, axis)
    if runs[0] is not None:
        span = _last_third_span(runs[0], axis)
        for panel in panels:
            panel.span = span
    return panels


def _present(runs: list[Curve | None]):
    return [(run, curve) for run, curve in enumerate(runs) if curve is not None]


def _last_third_span(curve: Curve, axis: str) -> tuple[float, float]:
    xs = [curve.x(e, axis) for e in curve.last_third()]
    return min(xs), max(xs)


def _likelihood_panel(runs: list[Curve | None], axis: str) -> Panel:
    """Bits per byte: a baseline's exact value; a Free model's IWAE bound (solid) and prior
    cross-entropy (dashed), as in compare's rows."""
    panel = Panel("held-out bits/byte (Free: IWAE, dashed: prior CE)", "bits / byte")
    for run, curve in _present(runs):
        scored = [e for e in curve.entries if "likelihood" in e]
        for measure, dashed in (("exact", False), ("iwae", False), ("prior_ce", True)):
            points = [
                (curve.x(e, axis), e["likelihood"][measure]["bits_per_byte"])
                for e in scored
                if measure in e["likelihood"]
            ]
            if points:
                xs, ys = [x for x, _ in points], [y for _, y in points]
                panel.lines.append(Line(run, curve.label, xs, ys, dashed=dashed))
    return panel


def _training_panels(runs: list[Curve | None], axis: str) -> list[Panel]:
    """Training cross-entropy and KL (bits per token) from each run's metrics.jsonl, kappa dashed."""
    ce = Panel("training cross-entropy", "bits / token")
    kl = Panel("KL per token (dashed: kappa)", "bits / token")
    for run, curve in _present(runs):
        logged = read_metrics(curve.run_dir / "metrics.jsonl")
        if not logged:
            continue
        scale = 1.0 if axis == "step" else curve.x(curve.entries[-1], axis) / curve.entries[-1]["step"]
        xs = [m["step"] * scale for m in logged]
        ce.lines.append(Line(run, curve.label, xs, [m["cross_entropy_bits"] for m in logged]))
        if curve.entries[-1]["latents"].get("model") == "free":
            kl.lines.append(Line(run, curve.label, xs, [m["kl_bits"] for m in logged]))
            kl.lines.append(Line(run, f"{curve.label} kappa", xs, [m["kappa_bits"] for m in logged], dashed=True))
    return [p for p in (ce, kl) if p.lines]
