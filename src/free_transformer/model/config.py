"""Model configuration: a flat dataclass (with the latent path's mechanism in its own small section),
named sizes from a tiny debug model to the paper's 8B."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..base.checks import ConfigError, check_range
from ..base.presets import Presets
from ..base.settings import build, kind_section, resolve_kind_sections, to_dict


def latent_settings_type(kind: str) -> type | None:
    """The settings dataclass that the latent kind `kind` declares beside its class (None for a kind without),
    from the kinds' registry: a lookup when a config names the kind's settings or is checked, which loads
    the kinds' modules (and torch); nothing here imports a kind."""
    from .latent import latent_kind

    try:
        return latent_kind(kind).settings_type
    except KeyError as error:
        raise ConfigError(error.args[0]) from None


@dataclass(frozen=True)
class LatentConfig:
    """How the latent path works (its size, latent_units, and place, latent_layer, are ModelConfig fields): the
    kind, and the settings of that kind only, `model.latent.<kind>.*`, typed by the settings dataclass the kind
    registers with its class (docs/latent-variants.md)."""

    kind: str = "binary_mapper"
    """The form of Z_t and its map to the residual R: a kind registered with register_latent_kind (the
    package's are described in docs/latent-variants.md; an unknown name's error lists those registered).
    binary_mapper is the paper's: H bits, a 2^H x D post-sampler table."""
    encoder_layers: int = 1
    """Non-causal encoder blocks (the paper: 1). The first takes its queries from zeta and its
    keys/values from the first half; each further one attends over the encoder's own stream."""
    policy: bool = False
    """Give the model a learned prior or policy over Z: a causal head over the first half's output
    (free_transformer.model.latent.policy), trained by `free-transformer rl` with the decoder frozen, from which
    latents="policy" draws. The uniform prior stays the default."""
    settings: Any = kind_section(latent_settings_type)
    """The chosen kind's own settings (its settings dataclass), model.latent.<kind>.*; None for a kind without,
    and for the kind's defaults until the config is checked (ModelConfig.check_latent_kind fills them in)."""

    def section(self):
        """The chosen kind's settings: those given, else its defaults (asks the registry); None for a kind
        without."""
        return resolve_kind_sections(self).settings


@dataclass(frozen=True)
class ModelConfig:
    # Names the model section takes besides its fields, read before it is built: model.size=NAME, a named size's
    # fields (train/config.py). An unknown setting's message offers them with the fields.
    READ_FIRST: ClassVar[tuple[str, ...]] = ("size",)

    vocab_size: int = 256
    """Number of token ids; every input id must lie in [0, vocab_size)."""
    dim: int = 128
    """Model width D (residual stream size)."""
    n_layers: int = 4
    """Number of decoder blocks L (the encoder block is extra)."""
    n_heads: int = 4
    """Query heads; must divide dim."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_hidden: int = 384
    """Hidden size of the SwiGLU feed-forward."""
    max_seq_len: int = 256
    """Longest sequence the model accepts (size of the RoPE tables and KV cache)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the token embedding table with the logit readout."""
    latent_units: int = 0
    """H, the number of units of the latent Z_t, each what the kind's unit is: a bit for the binary kinds (2^H
    values per token), a dimension for gaussian, a group of classes for categorical. 0 gives the plain
    baseline decoder."""
    latent_layer: int | None = None
    """Number of decoder blocks before Z is injected; None means L // 2 (the paper's middle)."""
    latent: LatentConfig = field(default_factory=LatentConfig)
    """The latent path's mechanism: model.latent.kind, model.latent.encoder_layers, a kind's own section."""

    def __post_init__(self) -> None:
        if isinstance(self.latent, dict):  # from a saved config.json or a YAML section
            object.__setattr__(self, "latent", build(LatentConfig, self.latent, "model.latent"))
        if not isinstance(self.latent, LatentConfig):
            raise ConfigError(f"model.latent must be a section (kind, encoder_layers), got {self.latent!r}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must divide dim ({self.dim})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head dim dim/n_heads = {self.head_dim} must be even for RoPE")
        self._check_latent()
        if self.latent_layer is not None and not (1 <= self.latent_layer <= self.n_layers - 1):
            raise ConfigError(
                f"latent_layer must be in [1, n_layers-1] = [1, {self.n_layers - 1}], got {self.latent_layer}"
            )
        if self.latent_units and self.n_layers < 2:
            raise ConfigError("a Free Transformer needs n_layers >= 2 (Z is injected between two blocks)")
        check_range("rope_theta", self.rope_theta, low_open=True)
        check_range("norm_eps", self.norm_eps, low_open=True)

    def _check_latent(self) -> None:
        layers = self.latent.encoder_layers
        if not isinstance(self.latent_units, int) or isinstance(self.latent_units, bool) or self.latent_units < 0:
            raise ConfigError(f"latent_units must be an integer >= 0, got {self.latent_units!r}")
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ConfigError(f"latent.encoder_layers must be a positive integer, got {layers!r}")

    def check_latent_kind(self) -> ModelConfig:
        """This config with the latent kind's settings filled in (its defaults where none were given), once the
        kind named, its settings and its limit on latent_units are checked against the kinds' registry. Not run
        when a config is made: the registry holds the kinds' modules, which import torch, and a config is also
        made to be described (`train --help`). TrainConfig.validate and FreeTransformer run it, before any
        model work."""
        from .latent import LATENT_KINDS

        kind = self.latent.kind
        if kind not in LATENT_KINDS:
            raise ConfigError(f"unknown latent kind {kind!r}; choose one of {', '.join(sorted(LATENT_KINDS))}")
        space, latent = LATENT_KINDS[kind], resolve_kind_sections(self.latent)
        expected = space.settings_type
        if (expected is None) != (latent.settings is None) or (expected and not isinstance(latent.settings, expected)):
            given = type(latent.settings).__name__
            raise ConfigError(
                f"latent kind {kind} has settings {getattr(expected, '__name__', None)}, but model.latent holds {given}"
            )
        max_units = space.max_units
        if self.latent_units > max_units:
            raise ConfigError(
                f"latent_units must be an integer in [0, {max_units}] for latent kind {kind} (H "
                f"{space.plural()}), got {self.latent_units!r}"
            )
        return self if latent is self.latent else self.replace(latent=latent)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def is_free(self) -> bool:
        """A Free Transformer (with a latent path), not the baseline decoder: the one test of it."""
        return self.latent_units > 0

    @property
    def injection_layer(self) -> int:
        """Blocks [0, injection_layer) form the first half; block injection_layer receives Z."""
        return self.latent_layer if self.latent_layer is not None else self.n_layers // 2

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def matched_baseline(self) -> ModelConfig:
        """The control of a Free Transformer: the baseline decoder with one more block per encoder block,
        so that it has the encoder's parameters and about its FLOPs (a causal block instead of a
        non-causal one). What it lacks is the latent itself: the read-out to H bits and the mapper (for the
        Binary Mapper a 2^H x D table, whose forward is a lookup). A gain over this baseline is the
        latent's, not the extra block's."""
        if not self.is_free:
            raise ConfigError("the matched baseline is that of a Free Transformer: this config has no latent")
        return self.replace(
            latent_units=0,
            latent_layer=None,
            latent=LatentConfig(),
            n_layers=self.n_layers + self.latent.encoder_layers,
        )

    def to_dict(self) -> dict:
        """The config as a mapping, the latent kind's settings under its name (`latent.<kind>`)."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """The config `to_dict` wrote; a saved one in older field names goes through
        runs/migrations.py first."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model config field(s): {', '.join(unknown)}")
        return cls(**values)  # a config.json written before `latent` existed gets its defaults

    # ---- analytic sizes -------------------------------------------------------------------------

    def block_params(self) -> int:
        kv_dim = self.n_kv_heads * self.head_dim
        attention = self.dim * self.dim * 2 + self.dim * kv_dim * 2  # q, o + k, v
        mlp = 3 * self.dim * self.ffn_hidden
        return attention + mlp + 2 * self.dim  # two RMSNorm weights

    def num_params(self) -> int:
        """Exact parameter count of the model built from this config."""
        embed = self.vocab_size * self.dim
        readout = 0 if self.tie_embeddings else self.vocab_size * self.dim
        total = embed + readout + self.n_layers * self.block_params() + self.dim  # final norm
        if self.is_free:
            total += self.latent_params()
        return total

    def latent_params(self) -> int:
        """Encoder blocks, zeta, encoder norm + readout, the mapper's (2^H x D for the Binary Mapper), and the policy
        head's with model.latent.policy."""
        if not self.is_free:
            return 0
        space = self.latent_space_on_meta()
        encoder = self.latent.encoder_layers * self.block_params() + self.dim + self.dim
        readout = (self.dim + 1) * space.posterior_size
        # the head: norm, hidden (with bias), memory (R_{t-1}, no bias), out (with bias)
        head = self.dim + (self.dim + 1) * (self.dim + space.posterior_size) + self.dim**2
        policy = head if self.latent.policy else 0
        return encoder + readout + policy + sum(p.numel() for p in space.parameters())

    def latent_space_on_meta(self):
        """The latent space this config builds, on the meta device (no memory): its sizes and costs."""
        import torch

        from .latent import build_latent_space

        with torch.device("meta"):
            return build_latent_space(self.latent.kind, self.latent_units, self.dim, self.latent.section())

    def training_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs per token of a training step at this sequence length: what the design
        needs, counted exactly.

        Matmuls count 6 FLOPs per weight (2 forward, 4 backward). Attention scores and values count
        12 * D FLOPs per (query, key) pair: a causal query sees (T + 1) / 2 keys on average, the
        encoder's non-causal queries all T. The first encoder block's query is the constant zeta, one
        row for every position: its query projection costs nothing per token. The read-out counts
        6 * D per posterior parameter (H bit-logits; H means and H log-variances for the Gaussian). The
        mapper counts what its kind says: for the Binary Mapper the forward is a row lookup (no FLOPs)
        and the exact backward needs dR @ W^T, 2 * 2^H * D per token.
        """
        matmul_weights = self.block_params() - 2 * self.dim  # q, k, v, o and the SwiGLU
        causal_block = 6 * matmul_weights + 12 * self.dim * (seq_len + 1) / 2
        flops = self.n_layers * causal_block + 6 * self.vocab_size * self.dim
        if self.is_free:
            non_causal_block = 6 * matmul_weights + 12 * self.dim * seq_len
            flops += self.latent.encoder_layers * non_causal_block - 6 * self.dim * self.dim  # zeta's q_proj: once
            space = self.latent_space_on_meta()
            flops += 6 * self.dim * space.posterior_size  # encoder read-out
            flops += space.training_flops_per_token()
        return float(flops)


# Named sizes (`model.size=NAME`, `free-transformer info NAME`), from a model for tests to the paper's two.
NAMED_CONFIGS: Presets[ModelConfig] = Presets(
    "model size",
    {
        "debug": (
            ModelConfig(
                vocab_size=256,
                dim=32,
                n_layers=2,
                n_heads=4,
                n_kv_heads=2,
                ffn_hidden=64,
                max_seq_len=128,
                latent_units=4,
            ),
            "a model for tests, 2 blocks of width 32, H = 4, a byte vocabulary",
        ),
        "cpu-small": (
            ModelConfig(
                vocab_size=256,
                dim=128,
                n_layers=4,
                n_heads=4,
                n_kv_heads=2,
                ffn_hidden=384,
                max_seq_len=128,
                latent_units=8,
            ),
            "the synthetic demo's model, 4 blocks of width 128, H = 8, a byte vocabulary",
        ),
        "paper-1.5b": (
            ModelConfig(
                vocab_size=2**17,
                dim=1536,
                n_layers=28,
                n_heads=12,
                n_kv_heads=2,
                ffn_hidden=8960,  # the paper gives no FFN size; 8960 makes the stated 1.5B
                max_seq_len=4096,
                rope_theta=500000.0,
                tie_embeddings=True,
                latent_units=16,
            ),
            "the paper's 1.5B model, 28 blocks of width 1536, H = 16",
        ),
        "paper-8b": (
            ModelConfig(
                vocab_size=2**17,
                dim=4096,
                n_layers=32,
                n_heads=32,
                n_kv_heads=8,
                ffn_hidden=14336,
                max_seq_len=8192,
                rope_theta=500000.0,
                latent_units=16,
            ),
            "the paper's 8B model, 32 blocks of width 4096, H = 16",
        ),
    },
)


def named_config(name: str, **overrides) -> ModelConfig:
    """The named size with `overrides` (ModelConfig fields) replaced; an unknown name is a ConfigError."""
    return NAMED_CONFIGS[name].replace(**overrides)
