"""`free-transformer eval`: the paper's benchmarks (and held-out likelihoods) for one checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

from ..checkpoint import load_model, resolve_checkpoint
from ..data.corpora import is_named, named_corpus, read_heldout
from ..devices import parse_device
from ..tokenizer import get_tokenizer

NAME = "eval"
HELP = "evaluate a checkpoint on the paper's benchmarks offline; results as JSON + a printed table"

TASK_GROUPS = {"mc": "multiple-choice tasks", "generative": "em and pass@1 tasks", "paper": "the paper's 16 rows"}


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", nargs="?", help="checkpoint directory, or run directory (newest checkpoint)")
    parser.add_argument("--tasks", default="all",
                        help="comma-separated task names, or all (default), paper, mc, generative; "
                             "none: only the --heldout likelihoods; see --list-tasks")
    parser.add_argument("--list-tasks", action="store_true", help="list the benchmarks, their measures and availability")
    parser.add_argument("--num-fewshot", action="append", default=[], metavar="N | TASK=N",
                        help="few-shot examples for every task (N) or one task (TASK=N); repeatable")
    parser.add_argument("--limit", type=int, default=None,
                        help="evaluate only the first N documents of each task (of each subject for mmlu)")
    parser.add_argument("--data", action="append", default=[], metavar="TASK=PATH",
                        help="local data file for a task (race_high, race_middle, humaneval_plus, or to replace a "
                             "shipped one); repeatable")
    latents = parser.add_argument_group("Free Transformer latents (ignored for a baseline)")
    latents.add_argument("--latents", choices=["prior", "encoder"], default="prior",
                         help="Z for the context positions: uniform prior (default, as the paper generates) or the "
                              "encoder run on the context only (the paper's KV-cache prefill); continuation and "
                              "generated positions always use the prior")
    latents.add_argument("--latent-samples", type=int, default=4,
                         help="K latent draws per multiple-choice question, combined as log mean_k P(choice | Z_k)")
    latents.add_argument("--generation-samples", type=int, default=1,
                         help="generations per prompt, each with its own latent draw (em / pass@1 averaged)")
    latents.add_argument("--seed", type=int, default=0, help="seed of the latent draws")
    like = parser.add_argument_group("held-out likelihood")
    like.add_argument("--heldout", action="append", default=[], metavar="FILE",
                      help="text file(s) for bits/token and bits/byte (baseline exact; Free: prior CE, ELBO, IWAE), "
                           "or corpus:NAME for a named corpus's held-out documents (e.g. corpus:shakespeare)")
    like.add_argument("--heldout-samples", type=int, default=8, help="K samples for the prior CE and IWAE bound")
    like.add_argument("--heldout-windows", type=int, default=None, help="use at most this many windows")
    gen = parser.add_argument_group("generation and code execution")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="override every generative task's budget")
    gen.add_argument("--code-timeout", type=float, default=10.0, help="seconds per generated program (sandbox)")
    gen.add_argument("--code-memory-mb", type=int, default=1024, help="address-space limit per generated program")
    parser.add_argument("--output", default=None,
                        help="results JSON (default: RUN_DIR/eval/<checkpoint>-<tag>.json); an existing file is "
                             "never overwritten")
    parser.add_argument("--device", default="auto",
                        help="auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key or not rest:
            raise ValueError(f"{what} expects TASK=VALUE, got {value!r}")
        out[key.strip()] = rest.strip()
    return out


def _task_names(spec: str) -> list[str]:
    from ..eval.benchmarks import DEFAULT_TASKS, PAPER_TASKS
    from ..eval.tasks import get_benchmark

    if spec.strip() == "none":
        return []
    names: list[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part == "all":
            names += DEFAULT_TASKS
        elif part == "paper":
            names += PAPER_TASKS
        elif part in ("mc", "generative"):
            names += [t for t in DEFAULT_TASKS if (get_benchmark(t).kind == "mc") == (part == "mc")]
        else:
            get_benchmark(part)  # raises ValueError on an unknown name
            names.append(part)
    if not names:
        raise ValueError("--tasks is empty")
    return list(dict.fromkeys(names))


def _list_tasks() -> int:
    from ..eval.benchmarks import DEFAULT_TASKS
    from ..eval.sources import DataUnavailable
    from ..eval.tasks import get_benchmark

    for bench in map(get_benchmark, DEFAULT_TASKS):
        try:
            if bench.needs_file:
                raise DataUnavailable(bench.needs_file)
            bench.rows(None)
            status = f"available: {bench.source}"
        except DataUnavailable as error:
            status = f"UNAVAILABLE: {error}"
        print(f"{bench.name:<15} {bench.metric:<19} {bench.default_shots}-shot  {status}")
    return 0


def _fewshot(values: list[str]) -> dict[str, int]:
    out = {}
    for value in values:
        key, sep, number = value.rpartition("=")
        try:
            out[key.strip() if sep else "*"] = int(number)
        except ValueError:
            raise ValueError(f"--num-fewshot expects N or TASK=N, got {value!r}") from None
    return out


def run(args) -> int:
    if args.list_tasks:
        return _list_tasks()
    if not args.checkpoint:
        raise ValueError("give a CHECKPOINT (or --list-tasks)")
    from ..eval.likelihood import heldout_likelihood
    from ..eval.report import format_table, write_json
    from ..eval.runner import EvalOptions, evaluate
    from ..eval.sandbox import SandboxLimits
    from ..eval.scoring import LatentPolicy

    device = parse_device(args.device)
    if args.output and Path(args.output).exists():  # before hours of evaluation, not after
        raise FileExistsError(f"--output {args.output} already exists: it is kept; choose another name")
    tasks = _task_names(args.tasks)
    if not tasks and not args.heldout:
        raise ValueError("--tasks none evaluates nothing without --heldout")
    policy = LatentPolicy(context=args.latents, samples=args.latent_samples,
                          generation_samples=args.generation_samples, seed=args.seed)
    options = EvalOptions(policy=policy, num_fewshot=_fewshot(args.num_fewshot), limit=args.limit,
                          data_files=_pairs(args.data, "--data"), max_new_tokens=args.max_new_tokens,
                          sandbox=SandboxLimits(timeout_s=args.code_timeout, memory_mb=args.code_memory_mb),
                          progress=not args.no_progress)
    for path in args.heldout:
        if is_named(path):
            named_corpus(path).files()  # raises if unknown or not installed
        elif not Path(path).is_file():
            raise FileNotFoundError(f"held-out text not found: {path}")
    ckpt = resolve_checkpoint(args.checkpoint)
    model, config = load_model(ckpt, device)
    if "tokenizer" not in config:
        raise ValueError(f"{ckpt}/config.json names no tokenizer")
    tokenizer = get_tokenizer(config["tokenizer"])
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids, the model only {model.config.vocab_size}")
    started = time.monotonic()
    results = evaluate(model, tokenizer, tasks, options)
    if args.heldout:
        text = "\n".join(read_heldout(p) if is_named(p) else Path(p).read_text(encoding="utf-8") for p in args.heldout)
        from tqdm.auto import tqdm

        with tqdm(desc="held-out", unit="window", disable=args.no_progress, leave=False) as bar:
            results["likelihood"] = heldout_likelihood(model, tokenizer, text, samples=args.heldout_samples,
                                                       seed=args.seed, max_windows=args.heldout_windows,
                                                       progress=bar.update)
        results["likelihood"]["files"] = list(args.heldout)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
    results.update({
        "checkpoint": str(ckpt), "step": config.get("step"), "tokenizer": tokenizer.name,
        "label": run_dir.name, "model_config": model.config.to_dict(), "train_config": config.get("train"),
        "limit": args.limit, "seconds": round(time.monotonic() - started, 1),
    })
    output = Path(args.output) if args.output else _free_path(run_dir / "eval", ckpt.name, _tag(args, model, tasks))
    write_json(results, output, exclusive=True)
    print(format_table(results))
    print(f"results: {output}")
    return 0


def _tag(args, model, tasks: list[str]) -> str:
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
