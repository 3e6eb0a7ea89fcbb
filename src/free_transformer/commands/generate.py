"""`free-transformer generate`: sample from a checkpoint, one sample per line."""

from __future__ import annotations

import logging
import re
import sys
import warnings

import torch

from ..base.devices import DTYPES, decoding_dtype, parse_device
from ..data.tokenizer import get_tokenizer
from ..inference.generate import GenerationConfig, generate
from ..inference.latents import CHOICES, CONTEXT_CHOICES, parse_latents, resolve_latents
from ..inference.stops import cut_at_stop, stop_check
from ..model.latent import ENCODER
from ..runs.checkpoint import load_model

NAME = "generate"
HELP = "sample continuations of a prompt from a checkpoint (one sample per line)"
DEFAULT_NEW_TOKENS = 64
FORMATTER = "defaults"  # cli.py: --help shows every default
# The backslash escapes --stop reads (a shell passes "\n" as a backslash and an n).
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\"}


def add_arguments(parser) -> None:
    parser.add_argument("checkpoint", help="checkpoint directory, or a run directory (its newest checkpoint)")
    parser.add_argument("--prompt", default="", help="text to continue (required)")
    parser.add_argument("--num-samples", "-n", type=int, default=4, help="samples, one per line")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="samples decoded at once (a sample depends on its seed, not on its batch)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"tokens to generate (default: {DEFAULT_NEW_TOKENS}, or fewer if the model's context "
                             "is shorter)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 for greedy decoding")
    parser.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (default: all)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling threshold (default: none)")
    parser.add_argument("--stop", action="append", default=[],
                        help="stop string, with the escapes \\n \\t \\r \\0 \\\\ read: a sample ends where it first "
                             "appears, which is not printed; repeatable")
    parser.add_argument("--seed", type=int, default=0, help="sample i uses seed + i")
    parser.add_argument("--latents", metavar="{" + ",".join(CHOICES) + "}", default=ENCODER,
                        help="Free Transformer: where Z comes from. encoder: the prompt's Z from the encoder (the "
                             "paper's prefill), each new token's from the prior, per sample; prior: every Z from "
                             "the prior, per sample; shared: one prior Z sequence for all samples; reference: Z "
                             "inferred by the encoder from --reference")
    parser.add_argument("--reference", help="text whose encoder latents condition generation (--latents reference)")
    parser.add_argument("--prompt-latents", metavar="{" + ",".join(CONTEXT_CHOICES) + "}",
                        help="deprecated: use --latents encoder or --latents prior")
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="weights and KV cache while decoding: auto is bf16 on a CUDA device that supports it "
                             "(half the bytes read per token), else fp32")
    parser.add_argument("--compile", action="store_true",
                        help="decode through one static step that samples inside itself, compiled by Inductor and captured as "
                             "a CUDA graph on a GPU (the first use of a batch size compiles, said on stderr; same samples)")


def _say_compile_times() -> None:
    """The library logs the static step's compilation (a minute at the paper's sizes, once per batch size and
    length) at INFO: --compile says it on stderr."""
    log = logging.getLogger("free_transformer.inference.generate")
    if not any(getattr(handler, "stream", None) is sys.stderr for handler in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)


def run(args) -> int:
    if args.compile:
        _say_compile_times()
    choice = _latent_choice(args)  # a misspelt --latents fails before the checkpoint is read
    device = parse_device(args.device)
    model, config = load_model(args.checkpoint, device)
    model = model.to(decoding_dtype(args.dtype, device))
    tokenizer = get_tokenizer(config.get("tokenizer", "byte"))
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ValueError("--prompt must not be empty (give at least one character)")
    if args.num_samples < 1 or args.batch_size < 1:
        raise ValueError("--num-samples and --batch-size must be >= 1")
    room = model.config.max_seq_len - len(prompt) + 1  # the last new token is never fed back
    if room < 1:
        raise ValueError(f"the prompt has {len(prompt)} tokens; this model reads at most {model.config.max_seq_len}")
    max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else min(DEFAULT_NEW_TOKENS, room)
    stops = [unescape(s) for s in args.stop if s]
    reference = torch.tensor([tokenizer.encode(args.reference)]) if args.reference is not None else None
    # Resolved once for every batch: "shared" and "reference" give every sample the same Z.
    resolved = resolve_latents(model, choice, length=len(prompt) + max_new_tokens - 1,
                               reference=reference, generator=torch.Generator(device=device).manual_seed(args.seed),
                               batch_size=1, prompt_length=len(prompt), where="--latents")
    latents = resolved.prompt_source if resolved.explicit is None else resolved.explicit  # (1, N) when explicit
    gen_config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p)
    should_stop = stop_check(tokenizer.decode, stops)
    prompt_chars = len(tokenizer.decode(prompt))
    for first in range(0, args.num_samples, args.batch_size):  # printed as each batch ends
        seeds = [args.seed + i for i in range(first, min(first + args.batch_size, args.num_samples))]
        prompts = torch.tensor([prompt] * len(seeds))
        result = generate(model, prompts, gen_config, seeds=seeds, latents=latents,
                          should_stop=should_stop, compile=args.compile)
        for tokens in result.tokens:
            text = tokenizer.decode(prompt + tokens)
            print(cut_at_stop(text, stops, prompt_chars).replace("\n", "\\n"), flush=True)
    return 0


def unescape(text: str) -> str:
    """`text` with the backslash escapes of ESCAPES read; any other backslash is kept as typed."""
    return re.sub(r"\\(.)", lambda match: ESCAPES.get(match[1], match[0]), text)


def _latent_choice(args):
    """--latents parsed (free_transformer.inference.latents), with the deprecated --prompt-latents mapped onto it;
    deprecations are said on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        choice = parse_latents(args.latents, where="--latents", indices=False)
        if args.prompt_latents is not None:
            if choice != ENCODER:
                raise ValueError(f"--prompt-latents cannot be combined with --latents {choice}")
            choice = parse_latents(args.prompt_latents, where="--prompt-latents", allowed=CONTEXT_CHOICES,
                                   indices=False)
    if args.prompt_latents is not None:
        print("warning: --prompt-latents is deprecated; use --latents encoder or --latents prior", file=sys.stderr)
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    return choice
