"""Training metrics: metrics.jsonl (one JSON object per logged step), optionally TensorBoard and Weights &
Biases, and the training-curve plot (cross-entropy, KL against kappa and, for a Free Transformer, what
Z saves; in bits per token)."""

from __future__ import annotations

import hashlib
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


def scalars(metrics: dict) -> dict[str, float]:
    """The logged values as named scalars for a dashboard: lists (the KL of each bit) become one scalar
    per item (`val_kl_bits_per_bit/3`); text (a warning) and the step are left out."""
    flat = {}
    for key, value in metrics.items():
        if isinstance(value, list):
            flat.update({f"{key}/{index}": item for index, item in enumerate(value)})
        elif isinstance(value, (int, float)) and key != "step":
            flat[key] = value
    return flat


class TensorBoardWriter:
    def __init__(self, run_dir: Path, resume_step: int):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise UserError("tensorboard=true needs the tensorboard package: pip install tensorboard") from error
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step + 1)

    def write(self, metrics: dict) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, metrics["step"])
        if "latent_warning" in metrics:
            self.writer.add_text("latent_warning", metrics["latent_warning"], metrics["step"])

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    """One W&B run per training run, resumed with it (its id is the run directory's name and a hash of its
    path). WANDB_MODE=offline writes under RUN/wandb for a later `wandb sync`."""

    def __init__(self, run_dir: Path, project: str, config: dict):
        try:
            import wandb
        except ImportError as error:
            raise UserError("wandb=true needs the wandb package: pip install wandb") from error
        run_id = f"{run_dir.name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
        self.run = wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow", config=config,
                              dir=str(run_dir))

    def write(self, metrics: dict) -> None:
        self.run.log(scalars(metrics), step=metrics["step"])

    def close(self) -> None:
        self.run.finish()


class MetricsLog:
    def __init__(self, run_dir: Path, resume_step: int = 0, tensorboard: bool = False,
                 wandb_project: str | None = None, config: dict | None = None):
        """wandb_project: also log to Weights & Biases in this project (None: not)."""
        self.path = run_dir / "metrics.jsonl"
        # A run killed after its last checkpoint logged steps that the resumed run will redo: drop them.
        kept = [m for m in read_metrics(self.path) if m.get("step", 0) <= resume_step]
        atomic_write_text(self.path, "".join(json.dumps(m) + "\n" for m in kept))
        self.handle = open(self.path, "a")  # noqa: SIM115 (open for the run's lifetime; closed by close())
        self.writers = []
        if tensorboard:
            self.writers.append(TensorBoardWriter(run_dir, resume_step))
        if wandb_project is not None:
            self.writers.append(WandbWriter(run_dir, wandb_project, config or {}))

    def write(self, metrics: dict) -> None:
        try:
            self.handle.write(json.dumps(metrics) + "\n")
            self.handle.flush()
        except OSError as error:  # a full disk: the checkpoints are intact, the resumed run rewrites this
            raise UserError(f"cannot write {self.path} ({error}): make room, then continue with --resume") from None
        for writer in self.writers:
            writer.write(metrics)

    def close(self) -> None:
        self.handle.close()
        for writer in self.writers:
            writer.close()

    def plot(self, out_path: Path) -> None:
        plot_training_curves(read_metrics(self.path), out_path)


def plot_training_curves(metrics: list[dict], out_path: Path, title: str | None = None) -> None:
    """Cross-entropy (train, validation; for a Free Transformer also validation with prior Z) and KL against
    kappa; for a Free Transformer a third panel: the bits Z saves per token, and how many bits are dead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not metrics:
        return
    evaluated = [m for m in metrics if "val_cross_entropy_bits" in m]
    free = any("latent_bits_saved" in m for m in evaluated)
    steps = [m["step"] for m in metrics]
    fig, axes = plt.subplots(1, 3 if free else 2, figsize=(15 if free else 10, 3.6))
    ax_ce, ax_kl = axes[0], axes[1]
    ax_ce.plot(steps, [m["cross_entropy_bits"] for m in metrics], label="train (encoder Z)" if free else "train")
    if evaluated:
        ax_ce.plot([m["step"] for m in evaluated], [m["val_cross_entropy_bits"] for m in evaluated], "o-",
                   label="validation (encoder Z)" if free else "validation")
    if free:
        ax_ce.plot([m["step"] for m in evaluated], [m.get("val_prior_cross_entropy_bits") for m in evaluated], "s--",
                   label="validation (prior Z, as generated)")
    ax_ce.set(xlabel="step", ylabel="bits / token", title="cross-entropy")
    ax_ce.legend()
    ax_kl.plot(steps, [m["kl_bits"] for m in metrics], label="KL(Q(Z|S) || uniform)")
    ax_kl.axhline(metrics[-1]["kappa_bits"], color="k", linestyle="--", label="kappa (free bits)")
    ax_kl.set(xlabel="step", ylabel="bits / token", title="KL per token")
    ax_kl.legend()
    if free:
        ax_z = axes[2]
        ax_z.plot([m["step"] for m in evaluated], [m.get("latent_bits_saved") for m in evaluated], "o-",
                  label="bits Z saves (prior - encoder CE)")
        ax_z.axhline(0.0, color="k", linewidth=0.8)
        dead = ax_z.twinx()
        dead.plot([m["step"] for m in evaluated], [m.get("dead_bits") for m in evaluated], "x:", color="tab:red",
                  label="dead bits")
        dead.set_ylabel("bits with KL < 0.01", color="tab:red")
        ax_z.set(xlabel="step", ylabel="bits / token", title="what Z carries (validation)")
        ax_z.legend(loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
