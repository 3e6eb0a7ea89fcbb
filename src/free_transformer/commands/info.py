"""`free-transformer info`: sizes and training FLOPs of a named model, built on the meta device; with
--presets, every registered preset of every kind with its description, and the YAML configs."""

from __future__ import annotations

import re
from pathlib import Path

from ..experiments.demo.presets import PRESETS as DEMO_PRESETS
from ..experiments.study.presets import PRESETS as STUDY_PRESETS
from ..model.config import NAMED_CONFIGS, named_config

NAME = "info"
HELP = (
    "print parameter counts and training FLOPs of a named model size (no memory allocated), or list every "
    "preset and YAML config"
)

# Every kind of preset, with where a user names one: what --presets lists.
PRESET_KINDS = (
    (NAMED_CONFIGS, "model.size=NAME, info NAME"),
    (DEMO_PRESETS, "demo --preset NAME"),
    (STUDY_PRESETS, "study --preset NAME"),
)


def add_arguments(parser) -> None:
    parser.add_argument(
        "size", nargs="?", choices=list(NAMED_CONFIGS), help=f"named model size: {NAMED_CONFIGS.help()}"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length for the FLOP count")
    parser.add_argument(
        "--presets",
        action="store_true",
        help="list the model sizes, the demo's and the study's presets, and the YAML configs",
    )
    parser.add_argument(
        "--configs", default="configs", help="the folder of YAML configs that --presets lists (default: configs)"
    )


def yaml_summary(path: Path) -> str:
    """The first sentence of a YAML config's opening comment (its prose, before an indented example command)."""
    prose = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#") or line.startswith("#  "):
            break
        prose.append(line[1:].strip())
    return re.split(r"(?<=\.)\s", " ".join(prose))[0].rstrip(":")


def print_presets(configs: Path) -> None:
    for presets, where in PRESET_KINDS:
        print(f"{presets.kind}s ({where}):")
        width = max(map(len, presets))
        for name in presets:
            print(f"  {name:<{width}}  {presets.about(name)}")
    print(f"YAML configs (train --config FILE), in {configs}:")
    files = sorted(configs.glob("*.yaml")) if configs.is_dir() else []
    width = max((len(path.name) for path in files), default=0)
    for path in files:
        print(f"  {path.name:<{width}}  {yaml_summary(path)}".rstrip())
    if not files:
        print("  none (the examples are in the repository's configs/)")


def print_size(size: str, seq_len: int | None) -> None:
    config = named_config(size)
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    import torch

    from ..model.transformer import FreeTransformer

    seq_len = seq_len or config.max_seq_len
    with torch.device("meta"):
        model = FreeTransformer(config)
    baseline = config.replace(latent_units=0)
    print(f"{size}: {config}")
    print(f"parameters      free {model.num_params():,}  baseline {baseline.num_params():,}")
    free_flops, base_flops = config.training_flops_per_token(seq_len), baseline.training_flops_per_token(seq_len)
    print(
        f"train FLOP/token (T={seq_len})  free {free_flops:.4g}  baseline {base_flops:.4g}  "
        f"overhead {100 * (free_flops / base_flops - 1):.2f}%"
    )


def run(args) -> int:
    if args.size is None and not args.presets:
        raise ValueError("give a model size or --presets")
    if args.presets:
        print_presets(Path(args.configs))
    if args.size is not None:
        print_size(args.size, args.seq_len)
    return 0
