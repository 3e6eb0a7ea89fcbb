"""Curves over training, drawn one way everywhere: a run's training_curves.png, the demo's and the
study's curves, and compare's appendix figures. `training_panels` says what a run's metrics.jsonl
shows (testable without a picture); `draw` draws panels."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .fileio import atomic_write_bytes

if TYPE_CHECKING:
    from matplotlib.artist import Artist

COLOURS = [
    "black",
    "tab:blue",
    "tab:orange",
    "tab:green",
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
]


@dataclass
class Line:
    run: int  # its colour, an index into COLOURS: one per run (or per measure of one run)
    label: str
    xs: list[float]
    ys: list[float | None]  # None: no value at that x (not drawn)
    dashed: bool = False


@dataclass
class Panel:
    title: str
    ylabel: str
    lines: list[Line] = field(default_factory=list)
    span: tuple[float, float] | None = None  # a range of x shaded (compare: the baseline's last third)
    hlines: list[tuple[float, int]] = field(default_factory=list)  # (y, colour), dotted: kappa, zero
    log: bool = False  # logarithmic y axis


def training_panels(metrics: list[dict]) -> list[Panel]:
    """One run's logged metrics: cross-entropy (train and validation; for a Free Transformer also
    validation with prior Z, as generated), KL per token against kappa and, for a Free Transformer, the
    bits Z saves per token and its dead bits (validation)."""
    validated = [m for m in metrics if "val_cross_entropy_bits" in m]
    free = any("latent_bits_saved" in m for m in validated)
    steps, val_steps = [m["step"] for m in metrics], [m["step"] for m in validated]
    ce = Panel(
        "cross-entropy",
        "bits / token",
        [Line(1, "train (encoder Z)" if free else "train", steps, [m["cross_entropy_bits"] for m in metrics])],
    )
    if validated:
        ce.lines.append(
            Line(
                2,
                "validation (encoder Z)" if free else "validation",
                val_steps,
                [m["val_cross_entropy_bits"] for m in validated],
            )
        )
    if free:
        ce.lines.append(
            Line(
                3,
                "validation (prior Z, as generated)",
                val_steps,
                [m.get("val_prior_cross_entropy_bits") for m in validated],
                dashed=True,
            )
        )
    kl = Panel(
        "KL per token (dotted: kappa, the free bits)",
        "bits / token",
        [Line(1, "KL(Q(Z|S) || uniform)", steps, [m["kl_bits"] for m in metrics])],
        hlines=[(metrics[-1]["kappa_bits"], 0)],
    )
    if not free:
        return [ce, kl]
    saved = Panel(
        "bits Z saves (validation, prior - encoder CE)",
        "bits / token",
        [Line(1, "bits Z saves", val_steps, [m.get("latent_bits_saved") for m in validated])],
        hlines=[(0.0, 0)],
    )
    dead = Panel(
        "dead units (KL < 0.01 bit)",
        "units of Z",
        [Line(4, "dead units", val_steps, [m.get("dead_units") for m in validated])],
    )
    return [ce, kl, saved, dead]


def rl_panels(metrics: list[dict]) -> list[Panel]:
    """A reinforcement-learning or learned-prior run's logged metrics (free_transformer.train.rl): the reward
    against the reward calls spent and the KL per token to the uniform prior (GRPO), or the KL of the encoder's
    posterior to the learned prior and to the uniform one (learned prior)."""
    steps = [m["step"] for m in metrics]
    if metrics and "reward" in metrics[0]:
        calls = [m["reward_calls"] for m in metrics]
        reward = Panel(
            "reward (x: reward calls)", "mean reward", [Line(1, "reward", calls, [m["reward"] for m in metrics])]
        )
        kl = Panel(
            "KL per action to the reference",
            "bits / action",
            [
                Line(2, "Z: KL to the uniform prior", steps, [m.get("kl_bits") for m in metrics]),
                Line(3, "KL to the reference", steps, [m.get("kl_ref_bits") for m in metrics], dashed=True),
            ],
        )
        return [reward, kl]
    return [
        Panel(
            "KL(Q(Z|S) || prior) per token",
            "bits / token",
            [
                Line(1, "to the learned prior", steps, [m["kl_encoder_bits"] for m in metrics]),
                Line(2, "to the uniform prior", steps, [m["kl_uniform_bits"] for m in metrics], dashed=True),
            ],
        )
    ]


def draw(
    panels: list[Panel],
    path: str | Path | None = None,
    *,
    columns: int = 4,
    xlabel: str = "step",
    legend: str = "figure",
    title: str | None = None,
    dpi: int = 72,
) -> bytes:
    """The panels in a grid of up to `columns` columns, as a PNG written to `path` (when given) and
    returned. legend: "figure" (one for all, by label; dashed lines left out) or "panels" (one each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    columns = min(columns, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 2.7 * rows + 0.6), squeeze=False)
    handles: dict[str, Artist] = {}  # label -> its line (or patch), for the figure's legend
    for ax, panel in zip(axes.flat, panels):
        if panel.span is not None and panel.span[1] > panel.span[0]:
            ax.axvspan(*panel.span, color="0.92", zorder=0)
        for y, colour in panel.hlines:
            ax.axhline(y, color=COLOURS[colour % len(COLOURS)], linestyle=":", linewidth=1)
        for line in panel.lines:
            (handle,) = ax.plot(
                line.xs,
                line.ys,
                "--" if line.dashed else "o-",
                markersize=3,
                linewidth=1.2,
                color=COLOURS[line.run % len(COLOURS)],
                label=line.label,
            )
            if not line.dashed:
                handles.setdefault(line.label, handle)
        if panel.log:
            ax.set_yscale("log")
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        if legend == "panels" and panel.lines:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    bottom = 0.0
    if legend == "figure":
        if any(p.span is not None for p in panels):
            handles["last third (baseline)"] = Patch(color="0.92")
        fig.legend(
            list(handles.values()),
            list(handles),
            loc="lower center",
            ncol=min(6, len(handles)),
            fontsize=8,
            frameon=False,
        )
        bottom = 0.06 if rows > 1 else 0.1
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    png = buffer.getvalue()
    if path is not None:
        atomic_write_bytes(path, png)  # never through a symbolic link
    return png
