"""Training metrics: metrics.jsonl (one JSON object per logged step), optionally TensorBoard and Weights &
Biases, and the training-curve plot (curves.training_panels)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..base.bounded import loads_json
from ..base.errors import UserError
from ..base.fileio import atomic_write_text, open_append
from ..base.install import install_hint
from ..base.plotting import draw, training_panels
from ..runs.migrations import METRIC_RENAMED
from .config import TrainConfig


def tokens_per_step(config: TrainConfig, sequence_length: int) -> int:
    """Tokens of one optimizer step: `batch_size` sequences (every process's rows and micro-batches
    together) of `sequence_length` input tokens (the model's T). The unit of tokens_per_s, of the
    tokens seen in an evaluation record and of a sweep's measure of work."""
    return config.batch_size * sequence_length


# What each field of a logged line holds (train.trainer.step_metrics, train.validation.validate); a line lacks
# none of LOGGED_EVERY_STEP, which every reader of the file reads. A field not named here is not checked.
LOGGED_EVERY_STEP = ("step", "loss", "cross_entropy_bits", "kl_bits", "kappa_bits")
NUMBERS = (
    "loss", "cross_entropy_bits", "kl_bits", "kappa_bits", "lr", "grad_norm", "tokens_per_s",
    "val_cross_entropy_bits", "val_kl_bits", "val_prior_cross_entropy_bits", "latent_bits_saved",
)  # fmt: skip
COUNTS = ("step", "dead_units")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value) -> str:
    """A value as the file holds it (JSON), cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _mistyped(logged: dict, required: tuple[str, ...] = LOGGED_EVERY_STEP) -> str | None:
    """What makes a logged line one this package did not write (a field it always writes, missing; a field of
    another type), in words; None for a line it could have written."""
    for name, value in logged.items():
        if name in COUNTS and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return f"{name} is {_shown(value)}, not an integer >= 0"
        if name in NUMBERS and not _number(value):
            return f"{name} is {_shown(value)}, not a number"
        if name == "val_kl_bits_per_unit" and not (isinstance(value, list) and all(map(_number, value))):
            return f"{name} is {_shown(value)}, not a list of numbers"
        if name == "latent_warning" and not isinstance(value, str):
            return f"{name} is {_shown(value)}, not a text"
    return next((f"it has no {name}" for name in required if name not in logged), None)


def read_metrics(path: str | Path, required: tuple[str, ...] = LOGGED_EVERY_STEP) -> list[dict]:
    """The logged metrics, in today's names (a run written before: runs.migrations.METRIC_RENAMED); a last line
    cut short by a killed process is ignored, and so is a line that is not a JSON object (every reader takes
    each line as a dict). A line that is JSON this package never writes (an integer of more than 4,300
    digits, which Python refuses to read; an object whose fields are `_mistyped`) is a UserError naming the
    file, the line and the field. required: the fields every line holds (a reinforcement-learning run's: its own).
    """
    path = Path(path)
    if not path.exists():
        return []
    metrics = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        try:
            logged = loads_json(line)
        except json.JSONDecodeError:
            continue
        except ValueError as error:  # a number too long to convert
            raise UserError(
                f"{path} line {number} holds a line this package did not write (a number too long to "
                f"read: {str(error).partition(':')[0]}): remove that line, then run again"
            ) from None
        if not isinstance(logged, dict):
            continue
        logged = {METRIC_RENAMED.get(name, name): value for name, value in logged.items()}
        problem = _mistyped(logged, required)
        if problem is not None:
            raise UserError(
                f"{path} holds a line this package did not write (line {number}: {problem}): remove that line, "
                "then run again"
            )
        metrics.append(logged)
    return metrics


def scalars(metrics: dict) -> dict[str, float]:
    """The logged values as named scalars for a dashboard: lists (the KL of each bit) become one scalar
    per item (`val_kl_bits_per_unit/3`); text (a warning) and the step are left out."""
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
            raise UserError(f"tensorboard=true needs the tensorboard package: {install_hint('logging')}") from error
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
            raise UserError(f"wandb=true needs the wandb package: {install_hint('logging')}") from error
        run_id = f"{run_dir.name}-{hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
        self.run = wandb.init(
            project=project, name=run_dir.name, id=run_id, resume="allow", config=config, dir=str(run_dir)
        )

    def write(self, metrics: dict) -> None:
        self.run.log(scalars(metrics), step=metrics["step"])

    def close(self) -> None:
        self.run.finish()


class MetricsLog:
    def __init__(
        self,
        run_dir: Path,
        resume_step: int = 0,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        config: dict | None = None,
        required: tuple[str, ...] = LOGGED_EVERY_STEP,
    ):
        """wandb_project: also log to Weights & Biases in this project (None: not); required: `read_metrics`'s."""
        self.path = run_dir / "metrics.jsonl"
        # A run killed after its last checkpoint logged steps that the resumed run will redo: drop them.
        kept = [m for m in read_metrics(self.path, required) if m.get("step", 0) <= resume_step]
        try:
            atomic_write_text(self.path, "".join(json.dumps(m) + "\n" for m in kept))
            self.handle = open_append(self.path)  # open for the run's lifetime; closed by close()
        except OSError as error:
            raise self._cannot_write(error) from None
        self.writers: list[TensorBoardWriter | WandbWriter] = []  # dashboards beside metrics.jsonl
        if tensorboard:
            self.writers.append(TensorBoardWriter(run_dir, resume_step))
        if wandb_project is not None:
            self.writers.append(WandbWriter(run_dir, wandb_project, config or {}))

    def write(self, metrics: dict) -> None:
        try:
            self.handle.write(json.dumps(metrics) + "\n")
            self.handle.flush()
        except OSError as error:
            raise self._cannot_write(error) from None
        for writer in self.writers:
            writer.write(metrics)

    def _cannot_write(self, error: OSError) -> UserError:
        # a full disk, a quota: the checkpoints are intact, and a resumed run rewrites this file
        return UserError(
            f"cannot write {self.path} ({error.strerror or error}): make room, then continue with --resume"
        )

    def close(self) -> None:
        try:
            self.handle.close()
        except OSError as error:  # the last buffered line
            raise self._cannot_write(error) from None
        finally:
            for writer in self.writers:
                writer.close()

    def plot(self, out_path: Path) -> None:
        plot_training_curves(read_metrics(self.path), out_path)


def plot_training_curves(metrics: list[dict], out_path: Path, title: str | None = None) -> None:
    """training_curves.png: curves.training_panels of the logged metrics (nothing when none are)."""
    if metrics:
        draw(training_panels(metrics), out_path, legend="panels", title=title, dpi=110)
