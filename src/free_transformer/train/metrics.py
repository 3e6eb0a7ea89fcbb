"""Training metrics: metrics.jsonl (one JSON object per logged step), optional TensorBoard, and the
training-curve plot (cross-entropy and KL against kappa, in bits per token)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from ..fileio import atomic_write_text


def read_metrics(path: str | Path) -> list[dict]:
    """The logged metrics; a last line cut short by a killed process is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    metrics = []
    for line in path.read_text().splitlines():
        try:
            metrics.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return metrics


class MetricsLog:
    def __init__(self, run_dir: Path, resume_step: int = 0, tensorboard: bool = False):
        self.path = run_dir / "metrics.jsonl"
        # A run killed after its last checkpoint logged steps that the resumed run will redo: drop them.
        kept = [m for m in read_metrics(self.path) if m.get("step", 0) <= resume_step]
        atomic_write_text(self.path, "".join(json.dumps(m) + "\n" for m in kept))
        self.handle = open(self.path, "a")
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError("tensorboard=true needs the tensorboard package: pip install tensorboard") from error
            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def write(self, metrics: dict) -> None:
        try:
            self.handle.write(json.dumps(metrics) + "\n")
            self.handle.flush()
        except OSError as error:  # a full disk: the checkpoints are intact, the resumed run rewrites this
            raise UserError(f"cannot write {self.path} ({error}): make room, then continue with --resume") from None
        if self.writer is not None:
            for key, value in metrics.items():
                if key != "step":
                    self.writer.add_scalar(key, value, metrics["step"])

    def close(self) -> None:
        self.handle.close()
        if self.writer is not None:
            self.writer.close()

    def plot(self, out_path: Path) -> None:
        plot_training_curves(read_metrics(self.path), out_path)


def plot_training_curves(metrics: list[dict], out_path: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not metrics:
        return
    steps = [m["step"] for m in metrics]
    fig, (ax_ce, ax_kl) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_ce.plot(steps, [m["cross_entropy_bits"] for m in metrics], label="train")
    if any("val_cross_entropy_bits" in m for m in metrics):
        val = [(m["step"], m["val_cross_entropy_bits"]) for m in metrics if "val_cross_entropy_bits" in m]
        ax_ce.plot(*zip(*val), "o-", label="validation")
    ax_ce.set(xlabel="step", ylabel="bits / token", title="cross-entropy")
    ax_ce.legend()
    ax_kl.plot(steps, [m["kl_bits"] for m in metrics], label="KL(Q(Z|S) || uniform)")
    ax_kl.axhline(metrics[-1]["kappa_bits"], color="k", linestyle="--", label="kappa (free bits)")
    ax_kl.set(xlabel="step", ylabel="bits / token", title="KL per token")
    ax_kl.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
