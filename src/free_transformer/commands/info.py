"""`free-transformer info`: sizes and training FLOPs of a named model, built on the meta device."""

from __future__ import annotations

import torch

from ..model.config import NAMED_CONFIGS, named_config
from ..model.transformer import FreeTransformer

NAME = "info"
HELP = "print parameter counts and training FLOPs of a named model size (no memory allocated)"


def add_arguments(parser) -> None:
    parser.add_argument("size", choices=list(NAMED_CONFIGS), help="named model size")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length for the FLOP count")


def run(args) -> int:
    config = named_config(args.size)
    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {args.seq_len}")
    seq_len = args.seq_len or config.max_seq_len
    with torch.device("meta"):
        model = FreeTransformer(config)
    baseline = config.replace(latent_bits=0)
    print(f"{args.size}: {config}")
    print(f"parameters      free {model.num_params():,}  baseline {baseline.num_params():,}")
    free_flops, base_flops = config.training_flops_per_token(seq_len), baseline.training_flops_per_token(seq_len)
    print(f"train FLOP/token (T={seq_len})  free {free_flops:.4g}  baseline {base_flops:.4g}  "
          f"overhead {100 * (free_flops / base_flops - 1):.2f}%")
    return 0
