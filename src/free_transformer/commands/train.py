"""`free-transformer train`: train a baseline or a Free Transformer from a YAML config + overrides."""

from __future__ import annotations

from pathlib import Path

from ..base.checks import ConfigError
from ..train.config import config_yaml, load_train_config, settings_help
from ..train.errors import TrainingError

NAME = "train"
HELP = "train a model (YAML config, then section.field=value overrides); --resume continues a run"
EPILOG = """example (the paper's synthetic letters, a debug-size model, about a minute on 2 CPU cores):
  free-transformer train --out runs/try model.size=debug steps=100

SIGTERM or Ctrl-C saves a checkpoint at the next step and exits (143 / 130); --resume continues.

"""


def epilog(argv: list[str]) -> str:
    """The help's end: the example and every setting, with the latent kind's own settings where the command
    line names the kind (model.latent.kind=NAME)."""
    kind = next((word.partition("=")[2] for word in reversed(argv) if word.startswith("model.latent.kind=")), None)
    try:
        return EPILOG + settings_help(kind)
    except ConfigError as error:
        return EPILOG + settings_help() + f" ({error})"


def add_arguments(parser) -> None:
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="config overrides, e.g. optim.lr=3e-4 kappa_bits=0.125 model.size=cpu-small (every "
        "setting is listed below)",
    )
    parser.add_argument("--config", "-c", help="YAML config (see configs/); defaults apply without one")
    parser.add_argument("--out", "-o", help="run directory (checkpoints, metrics, plots); required to train")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest checkpoint, with its saved config",
    )
    parser.add_argument("--init-from", help="checkpoint whose decoder weights initialise the model")
    parser.add_argument(
        "--matched-baseline",
        action="store_true",
        help="train the control of the configured Free Transformer: no latent, one more block per "
        "encoder block (the same parameters and about the same FLOPs; docs/real-text.md)",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML (which `train -c FILE` reads back) and exit without training",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything a run needs (the config, --out, the data against the model) and exit without training",
    )


def run(args) -> int:
    """The settings are read and checked first, before torch is imported: a mistyped one is a quick line."""
    out = Path(args.out) if args.out is not None else None
    if args.resume and args.init_from:  # a resumed run goes on from its own checkpoint, never another's weights
        raise TrainingError(
            "--init-from starts a new run from another checkpoint's decoder; --resume continues "
            "this run from its own: give one of them"
        )
    config_path = args.config
    if args.resume and config_path is None:
        if out is None:
            raise TrainingError("--resume continues the run in --out: give it")
        config_path = out / "config.yaml"
        if not config_path.exists():
            raise TrainingError(f"nothing to resume: {config_path} not found")
    config = load_train_config(config_path, args.overrides)
    if out is None and not (args.print_config or args.dry_run):
        raise TrainingError("give the run directory with --out (or --print-config to only print the config)")
    sizes = [override for override in args.overrides if override.startswith("model.size=")]
    # the saved config names every dimension, which would silently win over a size: the size (with the
    # other model overrides) must describe the run's own model
    if args.resume and sizes and load_train_config(None, args.overrides).model != config.model:
        raise TrainingError(
            f"--resume continues the run's own model: {sizes[-1]} (with the other model "
            "overrides) describes another; train into another --out (where --init-from reuses "
            "the decoder if only the latent path changed)"
        )
    if args.matched_baseline:
        if args.resume:
            raise TrainingError("--matched-baseline makes a new run's config; --resume reads the run's own")
        config.model = config.model.matched_baseline()
    if args.print_config:
        print(config_yaml(config), end="")
        return 0
    from ..distributed.env import is_main_process
    from ..train.trainer import check_run, train

    if args.dry_run:
        print(f"dry run, nothing trained: {check_run(config, out, resume=args.resume)}")
        return 0
    assert out is not None  # refused above unless --print-config or --dry-run, which have returned
    result = train(config, out, resume=args.resume, init_from=args.init_from)
    m = result.metrics
    if not is_main_process():  # under torchrun, rank 0 reports for all
        return 0
    losses = (
        f", cross-entropy {m['cross_entropy_bits']:.4f} bits/token, KL {m['kl_bits']:.4f} bits/token"
        if "cross_entropy_bits" in m
        else ""
    )  # nothing logged: say nothing rather than nan
    print(f"done: step {result.step}{losses}; run in {out}")
    return 0
