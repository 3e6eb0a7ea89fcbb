"""`free-transformer demo`: the paper's synthetic experiment end to end, with an HTML report."""

from __future__ import annotations

from pathlib import Path

from ..base.devices import Placement
from ..base.settings import add_option
from ..experiments.demo.presets import PRESETS
from ..train.config import check_overrides, settings_help
from .arguments import (
    add_launcher_arguments,
    add_sweep_check_arguments,
    check_sweep,
    launcher_from,
    parse_seeds,
    training_device,
)

NAME = "demo"
HELP = (
    "train a baseline and Free Transformers at kappa = 1/64, 1/8, 1, 8 bits on the synthetic letters, and one on "
    "the coin flips; report"
)
# (preset, seeds) when neither is given: a CPU runs the quick preset once (about 12 minutes on 2 cores); a GPU trains
# every model at once, so the paper's recipe over 3 seeds costs it about two minutes.
CPU_DEFAULT = ("quick", 1)
GPU_DEFAULT = ("paper", 3)
EPILOG = "The overrides apply on top of the preset's own settings.\n\n" + settings_help()


def add_arguments(parser) -> None:
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help=f"default: {CPU_DEFAULT[0]} on a CPU, {GPU_DEFAULT[0]} on a GPU. " + PRESETS.help(),
    )
    parser.add_argument(
        "--out",
        "-o",
        default="runs/demo",
        help="output directory: each seed's runs in OUT/seed-S/MODEL, one seed or many (finished runs are reused)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="training overrides applied to every model, e.g. steps=500 precision=bf16",
    )
    parser.add_argument("--steps", type=int, help="training steps of every model (same as steps=N)")
    parser.add_argument("--seed", type=int, default=None, help="one seed")
    parser.add_argument(
        "--seeds",
        default=None,
        help="several seeds: a count N (seeds 0..N-1) or a comma-separated list; the report gives "
        "each claim's success count and every seed's figures (runs in OUT/seed-S/). Default: "
        f"{CPU_DEFAULT[1]} on a CPU (seed 0), {GPU_DEFAULT[1]} on a GPU",
    )
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated models to run, as the report names them (kappa-1-8,kappa-1; an "
        "unknown name is refused with the list), default all; only their claims are judged",
    )
    add_option(parser, Placement, "device")
    add_launcher_arguments(
        parser, "models trained side by side, one process each (default: 2 on CPU, all of them on a GPU)"
    )
    add_sweep_check_arguments(parser)


def run(args) -> int:
    extra = (*args.overrides, *([f"steps={args.steps}"] if args.steps is not None else []))
    check_overrides(list(extra))  # before the device is resolved, which imports torch
    device = training_device(args)
    if args.seed is not None and args.seeds is not None:
        raise ValueError("give --seed or --seeds, not both")
    default_preset, default_seeds = GPU_DEFAULT if device.startswith("cuda") else CPU_DEFAULT
    preset = PRESETS[args.preset or default_preset]
    if args.seeds is not None:
        seeds = parse_seeds(args.seeds, default_seeds)
    else:
        seeds = (args.seed,) if args.seed is not None else parse_seeds(None, default_seeds)
    from ..experiments.demo.run import demo_sweep, run_demo

    models = tuple(args.models.split(",")) if args.models else None
    sweep = demo_sweep(preset, Path(args.out), seeds=seeds, extra=extra, device=device, models=models)
    launcher = launcher_from(args, Path(args.out), len(sweep.variants) * len(seeds) if device.startswith("cuda") else 2)
    if check_sweep(sweep, launcher.threads, print_config=args.print_config, dry_run=args.dry_run):
        return 0
    report = run_demo(preset, Path(args.out), seeds=seeds, extra=extra, launcher=launcher, device=device, models=models)
    print(f"report: {report.resolve()}")
    print(f"figure: {(report.parent / 'report.png').resolve()}")
    return 0
