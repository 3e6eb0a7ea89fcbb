"""The study's report: one table per seed-averaged variant (honest likelihoods, gaps to both baselines,
bits Z saves, KL against kappa, collapse per seed), a figure of those against kappa with every seed shown,
and the validation curves; as report.md, report.png, curves.png and results.json."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ...analysis.measures import honest_bits
from ...base.fileio import atomic_write_text
from ...base.plotting import Line, Panel, draw
from ..launch.sweep import kappa_label
from .presets import PRESETS, StudyPlan


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _spread(values: list[float]) -> str:
    return f"{_mean(values):.4f}" + (f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else "")


def summarize(plan: StudyPlan, records: list[dict]) -> list[dict]:
    """One row per variant: seed means of each measure (per byte, the tokenizer-independent unit)."""
    base = {r["seed"]: honest_bits(r) for r in records if r["slug"] == "baseline"}
    matched = {r["seed"]: honest_bits(r) for r in records if r["slug"] == "matched-baseline"}
    rows = []
    for variant in plan.variants():
        runs = [r for r in records if r["slug"] == variant.slug]
        honest = [honest_bits(r) for r in runs]
        row = {
            "slug": variant.slug,
            "label": variant.label,
            "kappa_bits": variant.kappa_bits,
            "seeds": len(runs),
            "params": runs[0]["params"] if runs else None,
            "honest_bits_per_byte": honest,
            "gap_to_baseline": [honest_bits(r) - base[r["seed"]] for r in runs if r["seed"] in base],
            "gap_to_matched": [honest_bits(r) - matched[r["seed"]] for r in runs if r["seed"] in matched],
            "train_seconds": [r["train_seconds"] for r in runs],
        }
        if variant.is_free:
            like = [r["likelihood"] for r in runs]
            row.update(
                {
                    "iwae_bits_per_byte": [x["iwae"]["bits_per_byte"] for x in like],
                    "prior_ce_bits_per_byte": [x["prior_ce"]["bits_per_byte"] for x in like],
                    "elbo_bits_per_byte": [x["elbo"]["bits_per_byte"] for x in like],
                    "posterior_ce_bits_per_byte": [x["posterior_ce"]["bits_per_byte"] for x in like],
                    "bits_saved": [r["bits_saved"] for r in runs],
                    "kl_bits": [r["kl_bits"] for r in runs],
                    "collapsed": [r["seed"] for r in runs if r["collapsed"]],
                    "copying": [r["seed"] for r in runs if r["copying"]],
                }
            )
        rows.append(row)
    return rows


def to_markdown(plan: StudyPlan, rows: list[dict], records: list[dict], seconds: float) -> str:
    seeds = ", ".join(map(str, plan.seeds))
    kind = next((plan.train_config(v, plan.seeds[0]).model.latent.kind for v in plan.variants() if v.is_free), None)
    lines = [
        f"# κ study: {plan.preset.name} preset",
        "",
        f"{PRESETS.about(plan.preset.name)}. Latent kind {kind or 'none'} (model.latent.kind). Seeds {seeds}. "
        "This invocation: {seconds / 60:.1f} min wall, "
        f"{sum(r.get('trained_now', True) for r in records)} of {len(records)} runs trained (the others reused "
        f"from an earlier one). Held-out text: "
        f"{plan.preset.heldout_windows} windows at most, K = {plan.preset.heldout_samples} latent samples.",
        "",
        "Honest likelihood of the held-out text, in bits per byte (mean ± standard deviation over seeds): exact "
        "for a baseline; for a Free Transformer the lower of its two upper bounds on -log2 P(x), IWAE(K) and "
        "the prior-Z cross-entropy (both also shown). "
        "Gaps are per seed, then averaged: negative means better than that baseline.",
        "",
        "| model | params | honest bits/byte | vs baseline | vs matched baseline | IWAE | prior-Z CE | ELBO | "
        "encoder-Z CE (not a likelihood) | bits Z saves / token | KL / token (κ) | Z unused | Z copies |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        free = row["kappa_bits"] is not None
        cells = [
            row["label"],
            f"{row['params'] / 1e6:.2f} M" if row["params"] else "",
            _spread(row["honest_bits_per_byte"]),
            _spread(row["gap_to_baseline"]) if row["slug"] != "baseline" else "",
            _spread(row["gap_to_matched"]) if row["slug"] != "matched-baseline" else "",
        ]
        if free:
            cells += [
                _spread(row["iwae_bits_per_byte"]),
                _spread(row["prior_ce_bits_per_byte"]),
                _spread(row["elbo_bits_per_byte"]),
                _spread(row["posterior_ce_bits_per_byte"]),
                _spread(row["bits_saved"]),
                f"{_spread(row['kl_bits'])} ({row['kappa_bits']:g})",
                f"{len(row['collapsed'])}/{row['seeds']}",
                f"{len(row['copying'])}/{row['seeds']}",
            ]
        else:
            cells += [""] * 8
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "*Z unused*: Z saves < 0.01 bit per token on the held-out text (it has collapsed). *Z copies*: "
        "its KL is at κ ≥ 2 bits and it saves at least half of it, so the training loss flatters the model "
        "(measures.py).",
        "",
        "![results](report.png)",
        "",
        "![curves](curves.png)",
        "",
    ]
    return "\n".join(lines)


def plot(plan: StudyPlan, rows: list[dict], records: list[dict], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    free = [row for row in rows if row["kappa_bits"] is not None]
    kappas = [row["kappa_bits"] for row in free]
    fig, (ax_like, ax_saved, ax_kl) = plt.subplots(1, 3, figsize=(15, 4))
    for slug, colour in (("baseline", "k"), ("matched-baseline", "tab:gray")):
        row = next(r for r in rows if r["slug"] == slug)
        ax_like.axhline(_mean(row["honest_bits_per_byte"]), color=colour, linestyle="--", label=row["label"])
    for key, marker, label in (
        ("honest_bits_per_byte", "o", "honest: min(IWAE, prior-Z CE)"),
        ("iwae_bits_per_byte", "v", "IWAE"),
        ("prior_ce_bits_per_byte", "s", "prior-Z CE"),
        ("posterior_ce_bits_per_byte", "^", "encoder-Z CE (not a likelihood)"),
    ):
        ax_like.plot(kappas, [_mean(row[key]) for row in free], marker + "-", label=label)
        for row in free:
            ax_like.scatter([row["kappa_bits"]] * len(row[key]), row[key], s=10, color="k", alpha=0.4)
    ax_like.set(xlabel="κ (bits per token)", ylabel="bits / byte", title="held-out text")
    ax_like.legend(fontsize=8)
    for ax, key, title in ((ax_saved, "bits_saved", "bits Z saves per token"), (ax_kl, "kl_bits", "KL per token")):
        ax.plot(kappas, [_mean(row[key]) for row in free], "o-")
        for row in free:
            ax.scatter([row["kappa_bits"]] * len(row[key]), row[key], s=14, color="k", alpha=0.5)
        ax.set(xlabel="κ (bits per token)", ylabel="bits / token", title=title + " (each seed a dot)")
    ax_kl.plot(kappas, kappas, "k--", linewidth=0.8, label="KL = κ")
    ax_kl.legend()
    for ax in (ax_like, ax_saved, ax_kl):  # κ doubles from point to point: a log axis, ticked at each κ
        ax.set_xscale("log")
        ax.set_xticks(kappas, [kappa_label(k).split()[0] for k in kappas])
        ax.minorticks_off()
    fig.tight_layout()
    fig.savefig(out_dir / "report.png", dpi=100)
    plt.close(fig)

    ce = Panel("validation cross-entropy (Free: prior Z, as generated)", "bits / token")
    saved = Panel("bits Z saves on validation (every seed)", "bits / token", hlines=[(0.0, 0)])
    for index, variant in enumerate(plan.variants()):
        for record in (r for r in records if r["slug"] == variant.slug):
            curve = record["curves"]
            key = "val_prior_cross_entropy_bits" if variant.is_free else "val_cross_entropy_bits"
            label = variant.label if record["seed"] == plan.seeds[0] else f"{variant.label} (seed {record['seed']})"
            ce.lines.append(Line(index + 1, label, [c["step"] for c in curve], [c[key] for c in curve]))
            if variant.is_free:
                saved.lines.append(
                    Line(index + 1, label, [c["step"] for c in curve], [c["latent_bits_saved"] for c in curve])
                )
    draw([ce, saved], out_dir / "curves.png", legend="panels", dpi=100)


def write_report(plan: StudyPlan, records: list[dict], seconds: float) -> Path:
    rows = summarize(plan, records)
    plot(plan, rows, records, plan.out_dir)
    atomic_write_text(
        plan.out_dir / "results.json",
        json.dumps(
            {
                "preset": plan.preset.name,
                "seeds": list(plan.seeds),
                "kappas": list(plan.kappas),
                "extra_overrides": list(plan.extra),
                "wall_seconds": seconds,
                "summary": rows,
                "runs": records,
            },
            indent=1,
        ),
    )
    report = plan.out_dir / "report.md"
    atomic_write_text(report, to_markdown(plan, rows, records, seconds))
    return report
