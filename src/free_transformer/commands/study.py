"""`free-transformer study`: the paper's kappa study in small, on real text, over seeds."""

from __future__ import annotations

import math
from pathlib import Path

from ..base.devices import Placement
from ..base.settings import add_option
from ..experiments.study.presets import PRESETS, StudyPlan
from ..train.config import check_overrides, settings_help
from .arguments import (
    add_launcher_arguments,
    add_sweep_check_arguments,
    check_sweep,
    launcher_from,
    parse_seeds,
    training_device,
)

NAME = "study"
HELP = (
    "train a baseline, a parameter-matched baseline and Free Transformers at several kappa on real text over "
    "seeds; report honest likelihoods, bits Z saves, KL vs kappa, collapse per seed"
)
EPILOG = """example (about 50 minutes on 2 CPU cores; finished runs are reused, stopped ones resumed):
  free-transformer study --preset cpu --out runs/study
See docs/study.md.

The overrides apply on top of the preset's own settings.

""" + settings_help()


def add_arguments(parser) -> None:
    parser.add_argument("--preset", choices=list(PRESETS), default="cpu", help=PRESETS.help())
    parser.add_argument("--out", "-o", default="runs/study", help="output directory (runs, report.md, report.png)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.field=value",
        help="training overrides for every model, e.g. data.text.path=corpus:python-stdlib steps=1000",
    )
    parser.add_argument(
        "--seeds", default=None, help="number of seeds (0..N-1), or a comma-separated list (default: the preset's)"
    )
    parser.add_argument("--kappas", default=None, help="comma-separated kappa values in bits (default: 0.5,1,2,4)")
    parser.add_argument(
        "--heldout",
        default=None,
        help="text scored for the likelihoods: a file, or corpus:NAME (default: the corpus's own held-out documents)",
    )
    add_option(parser, Placement, "device")
    add_launcher_arguments(parser, "models trained side by side (default: 2 on CPU, 6 on a GPU)")
    add_sweep_check_arguments(parser)


def parse_kappas(text: str | None, default: tuple[float, ...]) -> tuple[float, ...]:
    if text is None:
        return default
    try:
        kappas = tuple(sorted(float(k) for k in text.split(",")))
    except ValueError:
        raise ValueError(f"--kappas takes comma-separated numbers of bits, got {text!r}") from None
    if not kappas or not all(0 < k < math.inf for k in kappas) or len(set(kappas)) != len(kappas):  # nan fails too
        raise ValueError(f"--kappas must be distinct positive finite numbers, got {text!r}")
    return kappas


def run(args) -> int:
    preset = PRESETS[args.preset]
    check_overrides(args.overrides)  # before the device is resolved, which imports torch
    device = training_device(args)
    plan = StudyPlan(
        preset,
        Path(args.out),
        parse_seeds(args.seeds, preset.seeds),
        parse_kappas(args.kappas, preset.kappas),
        tuple(args.overrides),
        device,
    )
    launcher = launcher_from(args, Path(args.out), 6 if device.startswith("cuda") else 2)
    if check_sweep(plan.sweep, launcher.threads, print_config=args.print_config, dry_run=args.dry_run):
        return 0
    from ..experiments.study.run import run_study

    report = run_study(plan, launcher=launcher, heldout=args.heldout)
    print(f"report: {report.resolve()}")
    return 0
