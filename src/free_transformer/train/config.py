"""The run configuration: nested dataclasses, loaded from dataclass defaults, then a YAML file, then
`section.field=value` overrides from the command line. The resolved config is saved with the run."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from ..base.checks import ConfigError, check_range
from ..base.fileio import atomic_write_text
from ..base.units import bits_to_nats
from ..data import DataConfig
from ..data.config import nest_flat_fields
from ..model.config import ModelConfig, named_config
from ..runs.checkpoint import MAX_STEP


@dataclass
class OptimConfig:
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    latent_lr_scale: float = 1.0
    """Multiplier of the learning rate for the encoder block, zeta, read-out and post-sampler."""
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    """Applied to matrices of the blocks and read-outs; never to norms, biases, embeddings, zeta or the post-sampler table."""
    warmup_steps: int = 200
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    schedule: str = "cosine"
    """cosine (warmup then cosine decay) or constant (warmup then constant)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables)."""

    def validate(self) -> None:
        for name in ("lr", "latent_lr_scale", "weight_decay", "warmup_steps", "grad_clip"):
            check_range(f"optim.{name}", getattr(self, name))
        check_range("optim.min_lr_ratio", self.min_lr_ratio, 0, 1, high_closed=True)
        for beta in self.betas:
            check_range("optim.betas", beta, 0, 1)
        if self.schedule not in ("cosine", "constant"):
            raise ConfigError(f"optim.schedule must be cosine or constant, got {self.schedule!r}")


@dataclass
class DistributedConfig:
    """How `torchrun` processes share the work (docs/distributed.md). Without torchrun, ddp and fsdp run
    as a world of one process."""

    strategy: str = "none"
    """none (one process, no process group), ddp (replicated weights, all-reduced gradients) or fsdp
    (FSDP2: fully_shard on each block and the encoder block, then the root)."""
    backend: str = "auto"
    """Process-group backend: auto (nccl on cuda, gloo on cpu), nccl or gloo."""
    param_dtype: str = "fp32"
    """fsdp mixed precision: dtype of the all-gathered parameters that forward and backward use (fp32 or
    bf16); the sharded master weights and the optimizer state stay fp32."""
    reduce_dtype: str = "fp32"
    """fsdp mixed precision: dtype in which gradients are reduce-scattered (fp32 or bf16)."""
    reshard_after_forward: bool = True
    """fsdp: free each block's gathered parameters after its forward (gathered again for backward)."""


@dataclass
class BenchmarkEvalConfig:
    """Benchmarks (and held-out likelihoods) scored on the live model during training, one line per
    evaluation appended to RUN/eval/curve.jsonl (docs/evaluation.md). The fields are those of
    `free-transformer eval`; training's losses are unchanged by it."""

    every: int = 0
    """Score every N optimizer steps and at the last step (0: never). One process only: under ddp / fsdp,
    score the checkpoints afterwards with `free-transformer eval RUN --checkpoints all`."""
    tasks: str = "all"
    """Comma-separated task names, or all, paper, mc, generative, none (only the held-out likelihoods)."""
    limit: int | None = None
    """The first N documents of each task (null: all)."""
    latents: Literal["prior", "encoder"] = "prior"
    """Z for the context positions of a Free Transformer: prior or encoder (see `eval --latents`)."""
    latent_samples: int = 4
    """K latent draws per multiple-choice question."""
    generation_samples: int = 1
    seed: int = 0
    """Seed of the latent draws (not training's)."""
    data: str = ""
    """Local data files, comma-separated TASK=PATH (race_high, race_middle, humaneval_plus)."""
    max_new_tokens: int | None = None
    heldout: str = ""
    """Comma-separated held-out text files or corpus:NAME for bits per token and per byte."""
    heldout_samples: int = 8
    heldout_windows: int | None = None

    def settings(self):
        """The section as evaluation settings (the same key as `eval --checkpoints` with equal options)."""
        from ..eval.settings import EvalSettings

        return EvalSettings.from_options(
            tasks=self.tasks, data=self.data.split(","), heldout=self.heldout.split(","), limit=self.limit,
            latents=self.latents, latent_samples=self.latent_samples, generation_samples=self.generation_samples,
            seed=self.seed, max_new_tokens=self.max_new_tokens, heldout_samples=self.heldout_samples,
            heldout_windows=self.heldout_windows)

    def validate(self, strategy: str) -> None:
        if self.every < 0:
            raise ConfigError(f"eval.every must be >= 0, got {self.every}")
        if not self.every:
            return
        if strategy != "none":
            raise ConfigError(f"eval.every runs on one process, not under distributed.strategy={strategy}: score "
                              "the checkpoints afterwards with `free-transformer eval RUN --checkpoints all`")
        try:
            self.settings().check_heldout()
        except ValueError as error:
            raise ConfigError(f"eval: {error}") from None


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=lambda: named_config("cpu-small"))
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    eval: BenchmarkEvalConfig = field(default_factory=BenchmarkEvalConfig)
    kappa_bits: float = 0.5
    """Free-bits threshold kappa of the KL term, in bits per token (the paper: 1/64 ... 8)."""
    kappa_start_bits: float | None = None
    """If set, kappa starts here and moves linearly to kappa_bits over kappa_anneal_steps (not in the
    paper, which keeps kappa fixed: a larger early budget lets the decoder learn to read Z first)."""
    kappa_anneal_steps: int = 0
    post_sampler_init_std: float = 0.02
    """Standard deviation of the post-sampler table's rows at initialisation (a larger R makes the
    decoder read Z from the start)."""
    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 64
    """Sequences per optimizer step (split into grad_accum micro-batches)."""
    grad_accum: int = 1
    seed: int = 0
    latent_noise: str = "global"
    """Noise of the posterior sampling of Z: global (the torch RNG stream seeded by `seed`; under ddp /
    fsdp each rank's stream is reseeded every step from (seed, step, rank)) or row (one generator
    per batch row seeded from (seed, step, row): the same Z whatever the number of processes or
    grad_accum)."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu, cuda, cuda:1, ..."""
    precision: str = "fp32"
    """fp32, or bf16 (autocast; weights and optimizer stay fp32)."""
    compile: bool = False
    """torch.compile each decoder block and the encoder block (in place: parameter names and checkpoints
    are unchanged; the latent path, read-out and loss stay eager). Same losses and gradients as eager
    up to float rounding; the first steps pay the compilation (tens of seconds on CPU)."""
    activation_checkpointing: bool = False
    """Keep only each block's input in forward and recompute the block in backward (torch.utils.checkpoint,
    non-reentrant): activation memory of about one block instead of L + 1, for about one more forward of
    compute. Results are unchanged (Z is sampled outside the blocks, and the RNG state is restored)."""
    threads: int = 0
    """CPU threads for torch (0: torch's default)."""
    log_every: int = 10
    eval_every: int = 0
    """Validation measures every N steps (0: never): cross-entropy and KL and, for a Free Transformer, the
    cross-entropy with prior Z, the bits Z saves, the KL of each bit, and a warning when Z is unused or
    carries the tokens (train/validation.py)."""
    eval_batches: int = 4
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    tensorboard: bool = False
    """Also write TensorBoard events (needs the tensorboard package)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb package; WANDB_MODE=offline keeps it on disk)."""
    wandb_project: str = "free-transformer"
    progress: bool = True
    """Show a progress bar."""

    def kappa_nats(self, step: int) -> float:
        """kappa at optimizer step `step` (0-based), in nats per token."""
        if self.kappa_start_bits is None or step >= self.kappa_anneal_steps:
            return bits_to_nats(self.kappa_bits)
        progress = step / self.kappa_anneal_steps
        return bits_to_nats(self.kappa_start_bits + progress * (self.kappa_bits - self.kappa_start_bits))

    def validate(self) -> TrainConfig:
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ConfigError("steps, batch_size and grad_accum must be >= 1")
        check_range("steps", self.steps, 1, MAX_STEP, high_closed=True)  # every step's checkpoint must be nameable
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"grad_accum ({self.grad_accum}) must divide batch_size ({self.batch_size})")
        for name in ("kappa_bits", "kappa_start_bits", "post_sampler_init_std", "kappa_anneal_steps", "eval_every"):
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name))
        check_range("eval_batches", self.eval_batches, 1)
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0 (0: torch's default), got {self.threads}")
        if self.kappa_start_bits is not None and self.kappa_anneal_steps < 1:
            raise ConfigError("kappa_start_bits needs kappa_anneal_steps >= 1")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"precision must be fp32 or bf16, got {self.precision!r}")
        self.optim.validate()
        if self.latent_noise not in ("global", "row"):
            raise ConfigError(f"latent_noise must be global or row, got {self.latent_noise!r}")
        dist = self.distributed
        if dist.strategy not in ("none", "ddp", "fsdp"):
            raise ConfigError(f"distributed.strategy must be none, ddp or fsdp, got {dist.strategy!r}")
        if dist.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"distributed.backend must be auto, gloo or nccl, got {dist.backend!r}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(dist, name)
            if value not in ("fp32", "bf16"):
                raise ConfigError(f"distributed.{name} must be fp32 or bf16, got {value!r}")
            if value != "fp32" and dist.strategy != "fsdp":
                raise ConfigError(f"distributed.{name}={value} needs strategy fsdp (use precision=bf16 otherwise)")
        if self.checkpoint_every < 1 or self.log_every < 1:
            raise ConfigError("checkpoint_every and log_every must be >= 1")
        self.eval.validate(dist.strategy)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _coerce(value, annotation, where: str):
    """Convert a YAML / command-line value to the field's declared type, or raise ConfigError."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: cannot read {value!r} as {annotation}")
    if origin is typing.Literal:
        if value not in typing.get_args(annotation):
            raise ConfigError(f"{where}: {value!r} is not one of {typing.get_args(annotation)}")
        return value
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v]
        items = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)) or len(value) != len(items):
            raise ConfigError(f"{where}: expected {len(items)} values, got {value!r}")
        return tuple(_coerce(v, t, where) for v, t in zip(value, items))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if annotation in (int, float, str):
        if isinstance(value, bool) or (annotation is not str and isinstance(value, (list, dict))):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
        try:
            number = annotation(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}") from None
        if annotation is int and isinstance(value, float) and value != number:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return number
    raise ConfigError(f"{where}: unsupported type {annotation}")


def _build(cls, values: dict, where: str):
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names - ({"size"} if cls is ModelConfig else set()))
    if unknown:
        raise ConfigError(f"unknown field(s) in {where or 'config'}: {', '.join(unknown)}")
    kwargs = {}
    for name, value in values.items():
        if name == "size":
            continue
        hint, path = hints[name], f"{where}.{name}" if where else name
        kwargs[name] = _build(hint, value, path) if dataclasses.is_dataclass(hint) else _coerce(value, hint, path)
    if cls is ModelConfig and "size" in values:
        return named_config(str(values["size"]), **kwargs)
    return cls(**kwargs)


def _merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        merged[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return merged


def parse_overrides(overrides: list[str]) -> dict:
    """['optim.lr=3e-4', 'model.size=debug'] -> nested dict; values parsed as YAML scalars."""
    result: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} was given a value, it is a section")
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return result


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error (YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_config_file(path: str | Path) -> dict:
    """A YAML config file as a mapping; every way it can be wrong is a one-line ConfigError."""
    try:
        loaded = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read config {path}: {' '.join(str(error).split())}") from None  # one line
    except RecursionError:  # the YAML composer recurses once per level of nesting
        raise ConfigError(f"cannot read config {path}: nested too deeply (a config is sections of fields)") from None
    if loaded is None:
        raise ConfigError(f"config {path} is empty: give at least one field, or leave --config out for the defaults")
    if not isinstance(loaded, dict):
        raise ConfigError(f"config {path} must be a mapping (section: fields), not a {type(loaded).__name__}: "
                          f"{str(loaded)[:60]!r}")
    return loaded


def load_train_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                      periodic_eval: bool = True) -> TrainConfig:
    """Defaults, then the YAML file, then the overrides. periodic_eval=False turns the `eval` section off
    (eval.every = 0), for a reader of a run that does not train it."""
    layers = [read_config_file(path) if path is not None else {}, parse_overrides(overrides or [])]
    for layer in layers:  # data's flat fields of older configs and commands, each layer on its own
        if isinstance(layer.get("data"), dict):
            layer["data"] = nest_flat_fields(layer["data"])
    values = _merge(*layers)
    model_values = values.get("model", {})
    if isinstance(model_values, dict) and "size" not in model_values:  # fields override the default size
        values["model"] = {**named_config("cpu-small").to_dict(), **model_values}
    config = _build(TrainConfig, values, "")
    if not periodic_eval:
        config.eval.every = 0
    return config.validate()


def apply_overrides(config: TrainConfig, overrides: list[str]) -> TrainConfig:
    """`config` with `section.field=value` overrides (a command line's) on top. `model.size=NAME` takes
    that named size's fields, keeps the config's latent_bits (a baseline stays one), then the override's
    other model fields."""
    if not overrides:
        return config
    update = parse_overrides(overrides)
    if isinstance(update.get("data"), dict):
        update["data"] = nest_flat_fields(update["data"])
    values = _merge(config.to_dict(), update)
    model = update.get("model")
    if isinstance(model, dict) and "size" in model:
        values["model"] = {"latent_bits": config.model.latent_bits, **model}
    return _build(TrainConfig, values, "").validate()


def overrides_of(config: TrainConfig) -> list[str]:
    """The `section.field=value` overrides that give `config` from the defaults (`free-transformer train`'s
    command line for it): what a report shows of each run's settings."""
    out: list[str] = []

    def walk(value, default, where: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, default.get(key) if isinstance(default, dict) else None, f"{where}{key}.")
        elif value != default:
            text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
            out.append(f"{where[:-1]}={text.removesuffix(chr(10) + '...')}")

    walk(config.to_dict(), TrainConfig().to_dict(), "")
    return out


def save_train_config(config: TrainConfig, path: str | Path) -> None:
    values = config.to_dict()
    values["optim"]["betas"] = list(values["optim"]["betas"])
    atomic_write_text(path, yaml.safe_dump(values, sort_keys=False))


def flat_settings(config: TrainConfig) -> dict:
    """{"section.field": value} of every setting of a config."""
    def flatten(values: dict, prefix: str) -> dict:
        flat = {}
        for key, value in values.items():
            if isinstance(value, dict):
                flat.update(flatten(value, f"{prefix}{key}."))
            else:
                flat[prefix + key] = list(value) if isinstance(value, tuple) else value
        return flat
    return flatten(config.to_dict(), "")


def changed_settings(before: TrainConfig, after: TrainConfig) -> dict[str, list]:
    """{"section.field": [before, after]} of the settings that differ."""
    old, new = flat_settings(before), flat_settings(after)
    return {key: [old.get(key), new.get(key)] for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}
