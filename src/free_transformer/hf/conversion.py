"""Conversions between our checkpoints, the Hugging Face format of FreeTransformerForCausalLM, and
Llama checkpoints (`LlamaForCausalLM` names).

A Llama decoder is our baseline: same blocks, same names (ours are HF Llama's without the "model."
prefix, q/k/v and gate/up stacked into one projection each: `model.layers.FUSED_PROJECTIONS`), same RoPE
layout. `load_llama` reads its config.json and safetensors directly (no Llama model is instantiated) and refuses the
Llama features we do not implement. `with_fresh_latent_path`
turns a baseline into a Free Transformer whose decoder weights are the baseline's and whose encoder,
zeta, read-out and post-sampler are freshly initialised: the starting point for fine-tuning a
pretrained Llama into a Free Transformer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from ..base.bounded import loads_json
from ..base.checks import ConfigError
from ..base.fileio import NotARegularFile, regular_file
from ..data.tokenizer import TokenizerError, check_tokenizer_name
from ..model.config import ModelConfig
from ..model.layers import rope_tables
from ..model.transformer import FreeTransformer
from ..runs.checkpoint import CheckpointError, check_step, load_model, resolve_checkpoint, save_checkpoint
from ..runs.memory import build_model, check_fits_memory
from ..runs.migrations import split_state_dict, upgrade_state_dict
from ..runs.saved_config import upgrade_saved_model_config
from .configuration import FreeTransformerConfig
from .export_defaults import CHAT_TEMPLATE_FILE, TOKEN_ID_KEYS, write_export_defaults
from .modeling import FreeTransformerForCausalLM
from .remote_code import write_remote_code, write_tokenizer

FORMATS = ("checkpoint", "hf", "llama")
# Files of a Hugging Face tokenizer, copied along when a Llama is converted to the HF format.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
)
LLAMA_NEEDS_BASELINE = (
    "only a baseline (latent_units = 0) converts to Llama: a Free Transformer's encoder and "
    "latent injection have no Llama equivalent"
)


class ConversionError(ValueError):
    """A source that cannot be converted: unknown format, missing files, unsupported features."""


# ---- reading directories -------------------------------------------------------------------------


def _unique_keys(pairs: list) -> dict:
    """A JSON object whose keys are each given once (json keeps the last of two silently)."""
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        twice = next(key for i, key in enumerate(keys) if key in keys[:i])
        raise ValueError(f"duplicate key {twice!r}")
    return dict(pairs)


def _regular(path: Path) -> Path:
    """`path`, a regular file (base.fileio.regular_file), else a ConversionError: a FIFO named as a shard or a
    config would block the conversion forever."""
    try:
        return regular_file(path)
    except NotARegularFile as error:
        raise ConversionError(str(error)) from None


def read_json(path: Path) -> dict:
    """A JSON object (a config, an index of shards), each key given once; ConversionError naming the file."""
    try:
        regular = _regular(path)
    except FileNotFoundError:
        raise ConversionError(f"missing {path}") from None
    try:
        value = loads_json(regular.read_text(), object_pairs_hook=_unique_keys)
    except ValueError as error:  # not JSON, not UTF-8, a key given twice
        raise ConversionError(f"corrupt {path}: {error}") from None
    if not isinstance(value, dict):
        raise ConversionError(f"corrupt {path}: it must hold a JSON object, not a {type(value).__name__}")
    return value


def detect_format(path: str | Path) -> str:
    """ "checkpoint" (ours: a step_* or run directory), "hf" (FreeTransformerForCausalLM) or "llama"."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"{path} is not a directory")
    if not (path / "config.json").is_file():
        try:
            resolve_checkpoint(path)  # a run directory
            return "checkpoint"
        except CheckpointError:
            raise ConversionError(f"{path}: no config.json and no checkpoints/step_* inside") from None
    config = read_json(path / "config.json")
    if isinstance(config.get("model"), dict):  # ours: {"model": ModelConfig, "step": ..., ...}
        return "checkpoint"
    model_type = config.get("model_type")
    if model_type == "free_transformer":
        return "hf"
    if model_type == "llama":
        return "llama"
    raise ConversionError(
        f"{path}: unsupported model_type {model_type!r} (expected 'free_transformer' or 'llama', "
        "or one of our checkpoint directories)"
    )


def source_latent_units(path: str | Path) -> int:
    """H of the model in a directory of any FORMATS, read from its config alone (0 for a Llama), under its
    name of today or of before (SAVED_MODEL_RENAMED)."""
    path, fmt = Path(path), detect_format(path)
    config_file = resolve_checkpoint(path) / "config.json" if fmt == "checkpoint" else path / "config.json"
    config = read_json(config_file)["model"] if fmt == "checkpoint" else read_json(config_file)
    try:
        return int(upgrade_saved_model_config(config).get("latent_units", 0))
    except ValueError as error:  # latent_bits and latent_units with two values
        raise ConversionError(f"{config_file}: {error}") from None


def safetensors_weights(path: Path) -> Path:
    """The directory's model.safetensors or model.safetensors.index.json: the only weights read (a .bin is a
    pickle, which can run code when loaded)."""
    for name in ("model.safetensors", "model.safetensors.index.json"):
        if (path / name).exists():
            return _regular(path / name)
    raise ConversionError(
        f"{path}: no model.safetensors or model.safetensors.index.json "
        "(only safetensors weights are read; re-save .bin checkpoints with safe_serialization)"
    )


def safetensors_files(path: Path) -> list[Path]:
    """model.safetensors, or the shards that model.safetensors.index.json lists."""
    found = safetensors_weights(path)
    if found.name == "model.safetensors":
        return [found]
    weight_map = read_json(found).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and "/" not in v for v in weight_map.values()):
        raise ConversionError(f"corrupt {found}: its weight_map must map tensor names to shard files beside it")
    try:
        return [_regular(path / shard) for shard in sorted(set(weight_map.values()))]
    except FileNotFoundError as error:
        raise ConversionError(f"{found} names a shard that is missing: {error.filename}") from None


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json."""
    tensors = {}
    for file in safetensors_files(path):
        tensors.update(load_file(file))
    return tensors


def check_config_fits_weights(
    config: ModelConfig, config_file: Path, path: Path, prefix: str = "", skip=lambda name: False
) -> None:
    """Before anything is allocated: the model `config` describes (read from `config_file`) fits this
    machine's memory, and its tensors are the weights' of `path` (names under `prefix`, in any layout
    that upgrade_state_dict reads, less those the loader `skip`s), with their shapes, read from the
    files' headers alone."""
    try:
        check_fits_memory(config)
    except ConfigError as error:
        raise ConversionError(f"{config_file}: {error}") from None
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in FreeTransformer(config).state_dict().items()}
    found = {}
    try:
        for file in safetensors_files(path):
            with safe_open(file, framework="pt") as handle:
                for name in (n for n in handle.keys() if not skip(n)):  # noqa: SIM118 (a handle is not iterable)
                    shape = handle.get_slice(name).get_shape()
                    found[name.removeprefix(prefix)] = torch.empty(shape, device="meta")
    except (OSError, SafetensorError) as error:
        raise ConversionError(f"corrupt weights in {path}: {error}") from None
    try:
        shapes = {name: tuple(t.shape) for name, t in upgrade_state_dict(found).items()}
    except RuntimeError as error:  # separate projections that do not stack
        raise ConversionError(f"corrupt weights in {path}: {error}") from None
    problems = [
        f"{name} is {list(shapes[name])} in the weights, {list(shape)} by the config"
        for name, shape in expected.items()
        if name in shapes and shapes[name] != shape
    ]
    problems += [f"the weights lack {name}" for name in expected if name not in shapes]
    problems += [
        f"the weights hold {name}, which the config has no place for" for name in shapes if name not in expected
    ]
    if problems:
        raise ConversionError(
            f"{config_file} does not describe the weights in {path}: {'; '.join(problems[:3])}"
            + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
        )


# ---- Llama ---------------------------------------------------------------------------------------


def llama_rope_theta(config: dict) -> float:
    """RoPE base of a Llama config written by transformers 4.x (rope_theta, rope_scaling) or 5.x
    (rope_parameters); any rope scaling other than the default is refused."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ConversionError(f"unsupported Llama rope scaling {rope_type!r}: only the default RoPE is implemented")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def llama_model_config(config: dict, max_seq_len: int | None = None) -> ModelConfig:
    """Our baseline ModelConfig for a Llama config.json; raises on features we do not implement."""
    if config.get("model_type") != "llama":
        raise ConversionError(f"expected a Llama config (model_type 'llama'), got {config.get('model_type')!r}")
    unsupported = []
    if config.get("attention_bias"):
        unsupported.append("attention_bias")
    if config.get("mlp_bias"):
        unsupported.append("mlp_bias")
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={config['hidden_act']!r}")
    n_heads = config["num_attention_heads"]
    if config.get("head_dim") not in (None, config["hidden_size"] // n_heads):
        unsupported.append(f"head_dim={config['head_dim']} != hidden_size / num_attention_heads")
    if unsupported:
        raise ConversionError(f"unsupported Llama feature(s): {', '.join(unsupported)}")
    try:
        return ModelConfig(
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            ffn_hidden=config["intermediate_size"],
            max_seq_len=max_seq_len or config.get("max_position_embeddings", 2048),
            rope_theta=llama_rope_theta(config),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
    except KeyError as error:
        raise ConversionError(f"Llama config lacks {error}") from None


def load_llama(
    path: str | Path, *, max_seq_len: int | None = None, dtype: torch.dtype | None = None
) -> tuple[FreeTransformer, dict]:
    """(our baseline holding the Llama's weights, the Llama's config.json dict)."""
    path = Path(path)
    llama_config = read_json(path / "config.json")
    try:
        config = llama_model_config(llama_config, max_seq_len)
    except (ValueError, TypeError) as error:  # a feature we lack, a size of the wrong type or out of range
        raise ConversionError(f"{path / 'config.json'}: {error}") from None
    check_config_fits_weights(
        config,
        path / "config.json",
        path,
        prefix="model.",
        skip=lambda name: name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_embeddings),
    )  # as read below
    weights = read_safetensors_dir(path)
    ours = {}
    for name, tensor in weights.items():
        if name.endswith("rotary_emb.inv_freq"):  # a derived buffer some old checkpoints saved
            continue
        key = name.removeprefix("model.")
        if key == "lm_head.weight" and config.tie_embeddings:
            continue  # tied: the read-out is the embedding table
        ours[key] = tensor
    dtype = dtype or next(iter(ours.values())).dtype
    upgrade_state_dict(ours)  # Llama's separate q/k/v and gate/up weights, stacked into our fused projections
    return _materialize(config, ours, dtype, source=path), llama_config


def _materialize(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, source) -> FreeTransformer:
    """Our model holding exactly `weights`, built without a random initialisation (large models)."""
    with torch.device("meta"):
        model = FreeTransformer(config)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ConversionError(
            f"{source}: weights do not match a model of this config; missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model = model.to(dtype).to_empty(device="cpu")
    model.load_state_dict(weights)
    cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
    model.rope_cos.copy_(cos)  # non-persistent buffers: derived from the config, as in init_weights
    model.rope_sin.copy_(sin)
    return model.eval()


def llama_tokenizer_name(path: str | Path) -> str | None:
    """ "hf:<absolute path>" when the Llama directory holds a tokenizer (see hf_tokenizer), else None."""
    path = Path(path)
    if any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return f"hf:{path.resolve()}"
    return None


def save_llama(model: FreeTransformer, out_dir: str | Path, token_ids: dict | None = None) -> Path:
    """Write a baseline as a LlamaForCausalLM directory (config.json + model.safetensors)."""
    c = model.config
    if c.is_free:
        raise ConversionError(LLAMA_NEEDS_BASELINE)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = model.embed_tokens.weight.dtype
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.dim,
        intermediate_size=c.ffn_hidden,
        num_hidden_layers=c.n_layers,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        **dict.fromkeys(TOKEN_ID_KEYS) | (token_ids or {}),
    )
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = dtype
    config.save_pretrained(out_dir)
    weights = {}
    for name, tensor in split_state_dict(model.state_dict(), model.config).items():  # Llama's separate weights
        key = name if name == "lm_head.weight" else f"model.{name}"
        weights[key] = tensor.detach().contiguous().cpu()
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


# ---- a Free Transformer from a baseline ----------------------------------------------------------


def with_fresh_latent_path(
    baseline: FreeTransformer, latent_units: int, latent_layer: int | None = None, seed: int = 0
) -> FreeTransformer:
    """A Free Transformer whose decoder (embeddings, every block, final norm, read-out) is a copy of
    `baseline`'s, and whose encoder block, zeta, encoder read-out and post-sampler are freshly
    initialised by `init_weights` from torch seed `seed`."""
    if baseline.config.is_free:
        raise ConversionError("the source already has a latent path (latent_units > 0)")
    if latent_units <= 0:
        raise ConversionError(f"latent_units must be positive for a Free Transformer, got {latent_units}")
    config = baseline.config.replace(latent_units=latent_units, latent_layer=latent_layer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(config)
    model = model.to(device=baseline.rope_cos.device, dtype=baseline.embed_tokens.weight.dtype)
    missing, unexpected = model.load_state_dict(baseline.state_dict(), strict=False)
    latent = set(model.state_dict()) - set(baseline.state_dict())
    assert set(missing) == latent and not unexpected, (missing, unexpected)
    return model.eval()


# ---- our checkpoints <-> the Hugging Face format -------------------------------------------------


def _check_tokenizer(name: str | None, source) -> None:
    """A tokenizer name that generate would refuse is refused when the source is read."""
    try:
        check_tokenizer_name(name)
    except TokenizerError as error:
        raise ConversionError(f"{source}: the model's tokenizer: {error}") from None


def load_any(
    path: str | Path, *, max_seq_len: int | None = None, dtype: torch.dtype | None = None
) -> tuple[FreeTransformer, dict]:
    """(our model, metadata {"tokenizer", "token_ids", "format"}) from a directory in any FORMATS."""
    fmt = detect_format(path)
    if fmt == "llama":
        model, llama_config = load_llama(path, max_seq_len=max_seq_len, dtype=dtype)
        token_ids = {key: llama_config.get(key) for key in TOKEN_ID_KEYS if llama_config.get(key) is not None}
        return model, {"format": fmt, "tokenizer": llama_tokenizer_name(path), "token_ids": token_ids}
    if fmt == "checkpoint":
        model, config = load_model(path)
        _check_tokenizer(config.get("tokenizer"), path)
        meta = {"format": fmt, "tokenizer": config.get("tokenizer"), "token_ids": config.get("token_ids", {})}
    else:
        safetensors_weights(Path(path))  # never a pickled pytorch_model.bin: from_pretrained would unpickle it
        config_file = Path(path) / "config.json"
        try:  # checked against the weights before transformers sees it (it would build what the config says)
            hf_config = FreeTransformerConfig.from_dict(read_json(config_file))
            config = hf_config.to_model_config()
        except (ValueError, TypeError) as error:
            raise ConversionError(f"{config_file}: {' '.join(str(error).split())}") from None
        _check_tokenizer(hf_config.tokenizer_name, path)
        check_config_fits_weights(config, config_file, Path(path), prefix="model.")
        hf_model = FreeTransformerForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True)
        model = hf_model.model
        token_ids = {
            key: getattr(hf_model.config, key)
            for key in TOKEN_ID_KEYS
            if getattr(hf_model.config, key, None) is not None
        }
        meta = {"format": fmt, "tokenizer": hf_model.config.tokenizer_name, "token_ids": token_ids}
    if max_seq_len is not None and max_seq_len != model.config.max_seq_len:  # changes the RoPE tables only
        model = _materialize(
            model.config.replace(max_seq_len=max_seq_len),
            model.state_dict(),
            model.embed_tokens.weight.dtype,
            source=path,
        )
    if dtype is not None:
        model = model.to(dtype)
    return model.eval(), meta


def save_hf(
    model: FreeTransformer,
    out_dir: str | Path,
    *,
    tokenizer: str | None = None,
    token_ids: dict | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write `model` as a FreeTransformerForCausalLM directory (save_pretrained, safetensors), with the
    defaults that let Hugging Face's pipeline generate from it (export_defaults.py) and `chat_template`, if
    given, as its tokenizer's."""
    hf_model = FreeTransformerForCausalLM.from_free_transformer(model, tokenizer_name=tokenizer, **(token_ids or {}))
    hf_model.save_pretrained(out_dir)
    if tokenizer and tokenizer.startswith("hf:"):  # make AutoTokenizer.from_pretrained(out_dir) work too
        for name in TOKENIZER_FILES:
            source = Path(tokenizer[3:]) / name
            if source.is_file():
                shutil.copy(source, Path(out_dir) / name)
    write_remote_code(out_dir)  # self-contained: trust_remote_code=True needs no free_transformer package
    write_tokenizer(out_dir, tokenizer)  # byte / gpt2 as tokenizer.json
    try:
        write_export_defaults(out_dir, model.config.max_seq_len, token_ids, chat_template)
    except ValueError as error:
        raise ConversionError(str(error)) from None
    return Path(out_dir)


def convert(
    source: str | Path,
    destination: str | Path,
    to: str,
    *,
    latent_units: int | None = None,
    latent_layer: int | None = None,
    seed: int = 0,
    step: int = 0,
    max_seq_len: int | None = None,
    dtype: torch.dtype | None = None,
    chat_template: str | None = None,
) -> Path:
    """Convert `source` (any FORMATS, detected) to format `to` at `destination`; return the written path.

    With latent_units, the source must be a baseline (ours or a Llama): the result is a Free
    Transformer with that decoder and a fresh latent path (`with_fresh_latent_path`, seed `seed`).
    chat_template (a Jinja text, --to hf only) becomes the export's tokenizer's.
    A "checkpoint" destination is a run directory: the checkpoint goes to
    destination/checkpoints/step_{step:08d}. Everything is written in a temporary directory and renamed
    into place: a failure (a full disk) leaves nothing, and the same command can then be run again.
    """
    if to not in FORMATS:
        raise ConversionError(f"unknown target format {to!r}; choose one of {', '.join(FORMATS)}")
    destination = Path(destination)
    if destination.is_symlink():  # os.replace would put the result beside the link's target, or fail obscurely
        raise ConversionError(
            f"{destination} is a symbolic link: nothing is written through one; choose another "
            "destination (nothing was written)"
        )
    if to in ("hf", "llama") and destination.exists() and any(destination.iterdir()):
        raise ConversionError(f"{destination} exists and is not empty")
    if to == "checkpoint" and ((destination / "checkpoints").exists() or (destination / "config.yaml").exists()):
        # a step without state.pt inside a training run would stop its --resume
        raise ConversionError(f"{destination} already holds a run: convert into a new directory")
    if chat_template is not None and to != "hf":
        raise ConversionError("a chat template is written into a Hugging Face export's tokenizer: use --to hf")
    if latent_layer is not None and latent_units is None:
        raise ConversionError("latent_layer needs latent_units (it places the fresh latent path)")
    try:
        check_step(step)
    except CheckpointError as error:
        raise ConversionError(f"--step: {error}") from None
    if to == "llama" and (latent_units is not None or source_latent_units(source) > 0):
        raise ConversionError(LLAMA_NEEDS_BASELINE)
    model, meta = load_any(source, max_seq_len=max_seq_len, dtype=dtype)
    if latent_units is not None:
        try:
            model = with_fresh_latent_path(model, latent_units, latent_layer, seed)
        except ConfigError as error:
            raise ConversionError(str(error)) from error
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.converting", dir=destination.parent))
    try:
        if to == "checkpoint":
            metadata = {
                "tokenizer": meta["tokenizer"],
                "token_ids": meta["token_ids"],
                "converted_from": {"format": meta["format"], "path": str(Path(source).resolve())},
            }
            written = save_checkpoint(staging, step, model, metadata, keep=0)
            destination.mkdir(exist_ok=True)
            os.replace(staging / "checkpoints", destination / "checkpoints")
            return destination / "checkpoints" / written.name
        if to == "hf":
            save_hf(
                model, staging, tokenizer=meta["tokenizer"], token_ids=meta["token_ids"], chat_template=chat_template
            )
        else:
            save_llama(model, staging, token_ids=meta["token_ids"])
        os.replace(staging, destination)  # destination is absent or an empty directory
        return destination
    except (OSError, SafetensorError, CheckpointError) as error:
        cause = error.__cause__ if isinstance(error, CheckpointError) and error.__cause__ else error
        raise ConversionError(
            f"cannot write {destination}: is the disk full, or a quota or file-size limit "
            f"reached? ({' '.join(str(cause).split())}); nothing was written, make room and run "
            "the same command again"
        ) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
