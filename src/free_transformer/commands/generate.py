"""`free-transformer generate`: sample continuations of one prompt or many (of any lengths) from a
checkpoint, one sample per line, or interactively with the model kept loaded (docs/sampling.md)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..base.devices import Placement
from ..base.settings import add_option
from ..inference.params import DEFAULT_BATCH_SIZE
from .samples import FORMATS, Sampler, add_sampling_options, encode_prompts, params_from, unescape

NAME = "generate"
HELP = (
    "sample continuations of one or many prompts from a checkpoint (one sample per line), or interactively "
    "(docs/sampling.md)"
)
FORMATTER = "defaults"  # cli.py: --help shows every default


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory, or a run directory (its newest checkpoint)")
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="text to continue, as typed (no escapes read); repeatable: one more prompt each time",
    )
    parser.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="more prompts, one per line, with the escapes of --stop read (write a newline inside a "
        "prompt as \\n); - reads them from stdin. They follow the --prompt ones (default: none)",
    )
    parser.add_argument(
        "--interactive",
        action="store_true",
        help="keep the model loaded and read prompts from the terminal (or stdin), one per line; "
        "/help lists the commands that change the settings (/latents, /seed, /n ...)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help="text: one sample per line, the prompt and its continuation, with the escapes of --stop "
        "written (\\n \\t \\r \\0, and a backslash as \\\\), a prompt's samples together, prompts "
        "in order; jsonl (the format to parse): one JSON object per sample with "
        "the keys prompt, sample (the continuation alone), index (the prompt's), seed and latents; with "
        "best-of candidates (--best-of above -n, or --vary other than both) also vary, candidate (its index), "
        "score (its mean token log-probability) and scores (every candidate's)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        metavar="N",
        help="samples decoded at once, the decoding engine's slots: prompts of any lengths and "
        "settings together (a sample depends on its prompt and seed, not on its batch)",
    )
    add_sampling_options(parser)
    add_option(parser, Placement, "device")
    add_option(parser, Placement, "dtype")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode with the engine's compiled step, compiled by Inductor and captured as a CUDA "
        "graph per batch-size bucket on a GPU (the first use of a bucket compiles, said on "
        "stderr; same samples)",
    )


def say_compile_times() -> None:
    """The library logs the decoding step's compilation (a minute at the paper's sizes, once per batch bucket)
    at INFO: --compile says it on stderr."""
    log = logging.getLogger("free_transformer.inference.engine")
    if not any(getattr(handler, "stream", None) is sys.stderr for handler in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def run(args) -> int:
    """The settings, the checkpoint and the prompts are checked first, before torch is imported: a mistyped
    setting, a missing run or checkpoint and a prompt past the model's context are a quick line."""
    if args.compile:
        say_compile_times()
    params = params_from(args)  # the one parse of --latents: a misspelt one fails before the checkpoint is read
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.interactive and (args.prompt or args.prompts_file is not None):
        raise ValueError("--interactive reads its prompts as you type them: drop --prompt and --prompts-file")
    labelled = [] if args.interactive else _prompts(args)  # a missing file fails before the checkpoint is read
    from ..data.tokenizer import get_tokenizer
    from ..model.config import ModelConfig
    from ..runs.locate import read_checkpoint_config

    saved = read_checkpoint_config(args.checkpoint)  # the run's saved config, read without torch
    tokenizer = get_tokenizer(saved.get("tokenizer", "byte"))
    context = ModelConfig.from_dict(saved["model"]).max_seq_len
    encode_prompts(tokenizer, [text for _, text in labelled], params, context, [label for label, _ in labelled])
    from ..base.devices import decoding_dtype, parse_device
    from ..runs.checkpoint import load_model
    from .interactive import interact

    device = parse_device(args.device)
    model, _ = load_model(args.checkpoint, device)
    model = model.to(decoding_dtype(args.dtype, device))
    sampler = Sampler(model, tokenizer, args.format, args.batch_size, args.compile)
    if args.interactive:
        return interact(sampler, params)
    sampler.sample([text for _, text in labelled], params, [label for label, _ in labelled])
    return 0


def _prompts(args) -> list[tuple[str, str]]:
    """(label, text) of each prompt: the --prompt ones, then the lines of --prompts-file."""
    labelled = [(f"--prompt {k + 1}", text) for k, text in enumerate(args.prompt)]
    if args.prompts_file is not None:
        name = "stdin" if args.prompts_file == "-" else args.prompts_file
        content = sys.stdin.read() if args.prompts_file == "-" else Path(args.prompts_file).read_text(encoding="utf-8")
        lines = content.split("\n")
        if lines[-1] == "":  # the newline that ends the last line
            lines.pop()
        for number, line in enumerate(lines, 1):
            line = line.removesuffix("\r")
            if not line:
                raise ValueError(
                    f"{name} line {number} is empty: every line is a prompt (write a newline inside one as \\n)"
                )
            labelled.append((f"{name} line {number}", unescape(line)))
        if not lines:
            raise ValueError(f"{name} holds no prompt (--prompts-file)")
    if not labelled:
        raise ValueError("give a prompt: --prompt TEXT, --prompts-file FILE (- reads stdin) or --interactive")
    return labelled
