"""Argument parsers shared by several commands (not a command itself)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..base import settings
from ..base.devices import parse_device
from ..base.errors import UserError
from ..inference.params import MAX_SEED  # torch.manual_seed takes an int64

if TYPE_CHECKING:  # the launchers import torch: when a command runs, not for its --help
    from ..experiments.launch.launchers import Launcher

MAX_SEEDS = 1000  # seeds of one sweep: each trains every model, so more is a typo, not a plan


def parse_seeds(text: str | None, default: int) -> tuple[int, ...]:
    if text is None:
        return tuple(range(default))
    listed = "," in text  # else a count
    try:
        numbers = [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"--seeds takes a count or a comma-separated list of integers, got {text!r}") from None
    if not listed and not 1 <= numbers[0] <= MAX_SEEDS:
        raise ValueError(f"--seeds takes a count from 1 to {MAX_SEEDS}, got {text!r}")
    seeds = tuple(numbers) if listed else tuple(range(numbers[0]))
    if len(seeds) > MAX_SEEDS or any(not 0 <= seed <= MAX_SEED for seed in seeds):
        raise ValueError(f"--seeds lists at most {MAX_SEEDS} seeds, each from 0 to 2**63 - 1, got {text[:60]!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must name at least one seed, each once, got {text!r}")
    return seeds


SLURM_DEFAULTS: dict[str, object] = {
    "slurm_partition": None,
    "gpus_per_run": 0,
    "nodes_per_run": 1,
    "cpus_per_run": 1,
    "time_limit": 24 * 60,
    "slurm_arg": [],
    "report_on": "local",
}


def add_launcher_arguments(parser, workers_help: str) -> None:
    """Where a sweep's runs train: --launcher local (--workers) or slurm (the options of each job)."""
    parser.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="local: the runs side by side on this machine; slurm: each run one Slurm job through "
        "submitit, recorded in OUT/slurm/record.json (docs/cluster.md)",
    )
    parser.add_argument("--workers", type=int, help=workers_help)
    slurm = parser.add_argument_group("--launcher slurm (docs/cluster.md)")
    slurm.add_argument("--slurm-partition", help="sbatch --partition (left out: the partition Slurm picks)")
    slurm.add_argument(
        "--gpus-per-run",
        type=int,
        default=SLURM_DEFAULTS["gpus_per_run"],
        help="GPUs of each run per node, one process each (FSDP2 across them); 0 (the default): a CPU run",
    )
    slurm.add_argument(
        "--nodes-per-run",
        type=int,
        default=SLURM_DEFAULTS["nodes_per_run"],
        help="nodes of each run (default 1; more needs --gpus-per-run)",
    )
    slurm.add_argument(
        "--cpus-per-run",
        type=int,
        default=SLURM_DEFAULTS["cpus_per_run"],
        help="CPUs of each process, and its torch threads (default 1)",
    )
    slurm.add_argument(
        "--time-limit",
        type=int,
        default=SLURM_DEFAULTS["time_limit"],
        metavar="MINUTES",
        help="each job's time limit (default 1440: 24 hours); a run checkpoints 2 minutes before it, "
        "and the next invocation resubmits it",
    )
    slurm.add_argument(
        "--slurm-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one more sbatch option, e.g. account=lab, qos=high, constraint=a100 (repeatable)",
    )
    slurm.add_argument(
        "--report-on",
        choices=("local", "slurm"),
        default=SLURM_DEFAULTS["report_on"],
        help="where the measures and report run once every run is done: on this machine (the default), "
        "or as one more job",
    )


def training_device(args) -> str:
    """The runs' device: --device checked against this machine, or with --launcher slurm the jobs' (auto: cuda
    when --gpus-per-run > 0, else cpu), which this machine need not have."""
    if args.launcher == "local":
        return str(parse_device(args.device))
    if args.device == "auto":
        return "cuda" if args.gpus_per_run > 0 else "cpu"
    if args.device.startswith("cuda") != (args.gpus_per_run > 0):
        raise ValueError(
            f"--device {args.device} with --gpus-per-run {args.gpus_per_run}: a cuda run needs "
            "--gpus-per-run >= 1, and GPUs need --device cuda (or auto)"
        )
    return args.device


def launcher_from(args, out_dir: Path, default_workers: int) -> Launcher:
    from ..experiments.launch.launchers import LocalLauncher
    from ..experiments.launch.slurm import SlurmLauncher, SlurmOptions, parse_slurm_args

    if args.workers is not None and args.workers < 1:
        raise ValueError("--workers must be >= 1")
    if args.launcher == "local":
        given = [name for name, default in SLURM_DEFAULTS.items() if getattr(args, name) != default]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is an option of --launcher slurm")
        return LocalLauncher(args.workers or default_workers)
    if args.workers is not None:
        raise ValueError("--workers is for --launcher local: with slurm every run is a job")
    options = SlurmOptions(
        partition=args.slurm_partition,
        gpus_per_run=args.gpus_per_run,
        nodes_per_run=args.nodes_per_run,
        cpus_per_run=args.cpus_per_run,
        time_minutes=args.time_limit,
        extra=parse_slurm_args(args.slurm_arg),
        report_on=args.report_on,
    )
    return SlurmLauncher(options, out_dir)


def checked_options(options, flags: dict[str, str] | None = None):
    """`options.check()` (a settings dataclass whose one-line ValueError begins with the field's name), its
    error naming the option as typed: flags[name], or --NAME with dashes."""
    try:
        return options.check()
    except ValueError as error:
        name, _, rest = str(error).partition(" ")
        flag = (flags or {}).get(name, f"--{name.replace('_', '-')}")
        raise UserError(f"{flag} {rest}") from None


def join_repeated(values: list[str]) -> str:
    """A repeatable option's values as the comma-separated string of its field."""
    return ",".join(values)


def print_configs(configs: list[tuple[str, object]]) -> None:
    """Each run's resolved training config as one YAML document, headed by a comment naming the run: one
    document is a file that `free-transformer train -c FILE` reads."""
    for index, (run, config) in enumerate(configs):
        print(("---\n" if index else "") + f"# {run}\n" + settings.to_yaml(config, explained=True), end="")


def add_sweep_check_arguments(parser) -> None:
    """--print-config and --dry-run of a command that trains many runs (demo, study)."""
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print every run's resolved training config (one YAML document each, which "
        "`train -c FILE` reads) and exit without training",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check every run's config, data and model as `train --dry-run` does, and exit without training",
    )


def check_sweep(sweep, threads: int, *, print_config: bool, dry_run: bool) -> bool:
    """--print-config or --dry-run over every run of `sweep`; False when neither is asked."""
    configs = [
        (str(sweep.run_dir(seed, variant)), sweep.train_config(variant, seed, threads))
        for seed, variant in sweep.runs()
    ]
    if print_config:
        print_configs(configs)
    elif dry_run:
        from ..train.trainer import check_run

        for run, config in configs:  # finished runs are reused: their directories are not checked
            print(f"{run}: {check_run(config)}")
        print(f"dry run, nothing trained: {len(configs)} run(s) checked")
    return print_config or dry_run
