"""The run configuration: nested dataclasses, loaded from dataclass defaults, then a YAML file, then
`section.field=value` overrides from the command line (base/settings.py reads and writes them). The
resolved config is saved with the run. Besides the fields: `model.size=NAME` (a named model size, its
fields under the other model fields given)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..base import settings
from ..base.checks import ConfigError, check_range
from ..base.devices import Precision
from ..base.latent_choice import LatentChoice
from ..base.units import bits_to_nats
from ..data.config import DataConfig
from ..eval.settings import EvalConfig
from ..model.config import NAMED_CONFIGS, LatentConfig, ModelConfig, named_config
from ..runs.saved_config import upgrade_saved_train_config
from ..runs.steps import MAX_STEP

DEFAULT_SIZE = "cpu-small"  # the model of a config that names no size


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    latent_lr_scale: float = 1.0
    """Multiplier of the learning rate for the encoder block, zeta, read-out and post-sampler."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's (beta1, beta2)."""
    weight_decay: float = 0.1
    """Applied to matrices of the blocks and read-outs; never to norms, biases, embeddings, zeta or the post-sampler
    table."""
    warmup_steps: int = 200
    """Steps of linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """cosine (warmup then cosine decay) or constant (warmup then constant)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""

    def validate(self) -> None:
        for name in ("lr", "latent_lr_scale", "weight_decay", "warmup_steps", "grad_clip"):
            check_range(f"optim.{name}", getattr(self, name))
        check_range("optim.min_lr_ratio", self.min_lr_ratio, 0, 1, high_closed=True)
        for beta in self.betas:
            check_range("optim.betas", beta, 0, 1)


@dataclass
class DistributedConfig:
    """How `torchrun` processes share the work (docs/distributed.md). Without torchrun, ddp and fsdp run
    as a world of one process."""

    strategy: Literal["none", "ddp", "fsdp"] = "none"
    """none (one process, no process group), ddp (replicated weights, all-reduced gradients) or fsdp
    (FSDP2: fully_shard on each block and the encoder block, then the root)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto (nccl on cuda, gloo on cpu), nccl or gloo."""
    param_dtype: Precision = "fp32"
    """fsdp mixed precision: dtype of the all-gathered parameters that forward and backward use (fp32 or
    bf16); the sharded master weights and the optimizer state stay fp32."""
    reduce_dtype: Precision = "fp32"
    """fsdp mixed precision: dtype in which gradients are reduce-scattered (fp32 or bf16)."""
    reshard_after_forward: bool = True
    """fsdp: free each block's gathered parameters after its forward (gathered again for backward)."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=lambda: named_config("cpu-small"))
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    kappa_bits: float = 0.5
    """Free-bits threshold kappa of the KL term, in bits per token (the paper: 1/64 ... 8)."""
    kappa_start_bits: float | None = None
    """If set, kappa starts here and moves linearly to kappa_bits over kappa_anneal_steps (not in the
    paper, which keeps kappa fixed: a larger early budget lets the decoder learn to read Z first)."""
    kappa_anneal_steps: int = 0
    """Steps over which kappa moves from kappa_start_bits to kappa_bits."""
    post_sampler_init_std: float = 0.02
    """Standard deviation of the post-sampler table's rows at initialisation (a larger R makes the
    decoder read Z from the start)."""
    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 64
    """Sequences per optimizer step (split into grad_accum micro-batches)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (the same step with less activation memory)."""
    seed: int = 0
    """Seed of the weights' initialisation, the data order and the latent noise."""
    latent_noise: Literal["global", "row"] = "global"
    """Noise of the posterior sampling of Z: global (the torch RNG stream seeded by `seed`; under ddp /
    fsdp each rank's stream is reseeded every step from (seed, step, rank)) or row (one generator
    per batch row seeded from (seed, step, row): the same Z whatever the number of processes or
    grad_accum)."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda, cuda:1, ..."""
    precision: Precision = "fp32"
    """fp32, or bf16 (autocast; weights and optimizer stay fp32)."""
    compile: bool = False
    """torch.compile each decoder block and the encoder block (in place: parameter names and checkpoints
    are unchanged), and the per-chunk bodies of the mapper's backward and of the fused read-out loss,
    whose chunk loops stay eager. Same losses and gradients as eager
    up to float rounding; the first steps pay the compilation (tens of seconds on CPU)."""
    activation_checkpointing: bool = False
    """Keep only each block's input in forward and recompute the block in backward (torch.utils.checkpoint,
    non-reentrant): activation memory of about one block instead of L + 1, for about one more forward of
    compute. Results are unchanged (Z is sampled outside the blocks, and the RNG state is restored)."""
    threads: int = 0
    """CPU threads for torch (0: torch's default)."""
    log_every: int = 10
    """Log the training measures every N steps."""
    validate_every: int = 0
    """Validation measures every N steps (0: never): cross-entropy and KL and, for a Free Transformer, the
    cross-entropy with prior Z, the bits Z saves, the KL of each bit, and a warning when Z is unused or
    carries the tokens (train/validation.py)."""
    validation_batches: int = 4
    """Held-out batches of each validation (the same ones every time)."""
    checkpoint_every: int = 500
    """Save a checkpoint every N steps (and at the last one)."""
    keep_checkpoints: int = 3
    """Keep the newest N checkpoints."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the tensorboard package)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package; WANDB_MODE=offline keeps it on disk)."""
    wandb_project: str = "free-transformer"
    """The Weights & Biases project of the run."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self):
        self.data = self.data.fitted_to(self.model.max_seq_len)  # data that names no length fits the model

    def kappa_nats(self, step: int) -> float:
        """kappa at optimizer step `step` (0-based), in nats per token."""
        if self.kappa_start_bits is None or step >= self.kappa_anneal_steps:
            return bits_to_nats(self.kappa_bits)
        progress = step / self.kappa_anneal_steps
        return bits_to_nats(self.kappa_start_bits + progress * (self.kappa_bits - self.kappa_start_bits))

    def validate(self) -> TrainConfig:
        self.data = self.data.fitted_to(self.model.max_seq_len)
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ConfigError("steps, batch_size and grad_accum must be >= 1")
        check_range("steps", self.steps, 1, MAX_STEP, high_closed=True)  # every step's checkpoint must be nameable
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"grad_accum ({self.grad_accum}) must divide batch_size ({self.batch_size})")
        for name in ("kappa_bits", "kappa_start_bits", "post_sampler_init_std", "kappa_anneal_steps", "validate_every"):
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name))
        check_range("validation_batches", self.validation_batches, 1)
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0: torch's default), got {self.threads}")
        if self.kappa_start_bits is not None and self.kappa_anneal_steps < 1:
            raise ConfigError("kappa_start_bits needs kappa_anneal_steps >= 1")
        settings.check_choices(self)  # the closed sets (Literal): build() checks what is read, this what code set
        self.optim.validate()
        dist = self.distributed
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(dist, name)
            if value != "fp32" and dist.strategy != "fsdp":
                raise ConfigError(f"distributed.{name}={value} needs strategy fsdp (use precision=bf16 otherwise)")
        if self.checkpoint_every < 1 or self.log_every < 1:
            raise ConfigError("checkpoint_every and log_every must be >= 1")
        if self.eval.every and dist.strategy != "none":
            raise ConfigError(
                f"eval.every runs on one process, not under distributed.strategy={dist.strategy}: "
                "score the checkpoints afterwards with `free-transformer eval RUN --checkpoints all`"
            )
        self.eval.validate()
        if (
            self.eval.every
            and self.eval.latents == LatentChoice.POLICY
            and self.model.is_free
            and not self.model.latent.policy
        ):
            raise ConfigError(
                "eval.latents=policy needs a model with a learned prior or policy over Z (model.latent.policy: "
                "free-transformer rl trains one); this model has none"
            )
        # last: the kinds' registry imports torch, the checks above do not; the kind's settings filled in
        self.model = self.model.check_latent_kind()
        return self

    def to_dict(self) -> dict:
        return settings.to_dict(self)


def _sized(model: dict, base: dict) -> dict:
    """The model section with `size` resolved: the named size's fields, then the section's other fields;
    without a size, `base`'s fields, then the section's."""
    if "size" not in model:
        return {**base, **model}
    size, fields = model["size"], {key: value for key, value in model.items() if key != "size"}
    return {**named_config(str(size)).to_dict(), **fields}


def read_config_file(path: str | Path) -> dict:
    """A YAML config file as a mapping; every way it can be wrong is a one-line ConfigError."""
    return settings.read_yaml(path)


def load_train_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, periodic_eval: bool = True
) -> TrainConfig:
    """Defaults, then the YAML file, then the overrides. periodic_eval=False turns the `eval` section off
    (eval.every = 0), for a reader of a run that does not train it."""
    saved = upgrade_saved_train_config(read_config_file(path)) if path is not None else {}  # 0.3's layout: today's
    layers = [saved, settings.parse_overrides(overrides or [])]
    values = settings.merge(*layers)
    model = values.get("model", {})
    if isinstance(model, dict):  # the fields given override the default size's
        values["model"] = _sized(model, named_config(DEFAULT_SIZE).to_dict())
    config = settings.build(TrainConfig, values)
    if not periodic_eval:
        config.eval.every = 0
    return config.validate()


def check_overrides(overrides: list[str]) -> None:
    """The names and values of `overrides` checked one by one, before the configs they apply to are known (a
    sweep's, whose presets may need torch to choose): a mistyped setting is refused without building a config."""
    values = settings.parse_overrides(overrides)
    model = values.get("model")
    if isinstance(model, dict) and "size" in model:
        named_config(str(model.pop("size")))  # a named size, or its ConfigError
    settings.check_names_and_types(TrainConfig, values)


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """`config` with `section.field=value` overrides (a command line's) on top. `model.size=NAME` takes
    that named size's fields, keeps the config's latent_units (a baseline stays one), then the override's
    other model fields."""
    if not overrides:
        return config
    update = settings.parse_overrides(overrides)
    base = config.to_dict()
    if _latent_kind_named(update) not in (None, config.model.latent.kind):  # the replaced kind's settings go too
        base["model"]["latent"].pop(config.model.latent.kind, None)
    values = settings.merge(base, update)
    model = update.get("model")
    if isinstance(model, dict) and "size" in model:
        values["model"] = _sized({"latent_units": config.model.latent_units, **model}, {})
    return settings.build(TrainConfig, values).validate()


def _latent_kind_named(values: dict):
    """The latent kind a mapping of settings names (model.latent.kind), or None."""
    model = values.get("model")
    latent = model.get("latent") if isinstance(model, dict) else None
    return latent.get("kind") if isinstance(latent, dict) else None


def overrides_of(config: TrainConfig) -> list[str]:
    """The `section.field=value` overrides that give `config` from the defaults (`free-transformer train`'s
    command line for it): what a report shows of each run's settings."""
    return settings.overrides_of(config, TrainConfig())


def save_train_config(config: TrainConfig, path: str | Path) -> None:
    settings.write_yaml(config, path)


def config_yaml(config: TrainConfig) -> str:
    """The config as `save_train_config` writes it (`train -c` reads it back), with the meaning of values such as
    `threads: 0` as comments."""
    return settings.to_yaml(config, explained=True)


def changed_settings(before: TrainConfig, after: TrainConfig) -> dict[str, list]:
    """{"section.field": [before, after]} of the settings that differ."""
    return settings.changed(before, after)


def settings_help(latent_kind: str | None = None) -> str:
    """Every setting with its default, type and docstring, by section, the top-level ones (the most used)
    first (`train --help`). The latent kind's own settings are those of `latent_kind` (`train
    model.latent.kind=NAME --help`): that asks the kinds' registry, which loads the kinds (and torch), so the
    plain help, of the default kind, leaves them and the kinds' names to that."""
    config, kinds = TrainConfig(), "model.latent.kind=NAME --help: the latent kinds registered, and NAME's own settings"
    described = settings.describe(config)
    if latent_kind is not None:
        from ..model.latent import LATENT_KINDS

        latent = settings.resolve_kind_sections(LatentConfig(latent_kind))  # an unknown kind: a ConfigError
        config.model = config.model.replace(latent=latent)
        kinds = f"latent kinds registered: {', '.join(sorted(LATENT_KINDS))}"
        described = [  # the kind, a name of the registry: its choices, as a closed set shows them
            dataclasses.replace(item, type=" | ".join(sorted(LATENT_KINDS)))
            if item.path == "model.latent.kind"
            else item
            for item in settings.describe(config)
        ]
    size = settings.Setting(
        "model.size",
        " | ".join(NAMED_CONFIGS),
        DEFAULT_SIZE,
        "A named model size: its fields, under the other model fields given.",
    )
    top = [item for item in described if "." not in item.path]
    sections = [item for item in described if "." in item.path]
    first_model = next(i for i, item in enumerate(sections) if item.path.startswith("model."))
    sections.insert(first_model, size)
    return (
        "settings (section.field=value, after the config file; the defaults below):\n"
        f"{settings.help_text(top + sections)}\n\n{kinds}"
    )
