"""`free-transformer tokenize`: a corpus -> token shards in llm.c's format, written once and then trained on
with `data.kind=tokens` (data/shards.py). The corpus is read as `data.text.path` is (data/readers.py);
its own validation split (a named corpus's held-out documents, a DatasetDict's validation split) becomes
the validation shards."""

from __future__ import annotations

from pathlib import Path

NAME = "tokenize"
HELP = "tokenize a corpus once into token shards (llm.c's format) that data.kind=tokens trains on"
EPILOG = """example (the Python standard library, GPT-2's BPE; then train on the shards):
  free-transformer tokenize corpus:python-stdlib --out runs/tokens/stdlib --tokenizer gpt2
  free-transformer train --out runs/stdlib data.kind=tokens data.tokens.path='runs/tokens/stdlib/tokens_*.bin' \\
      data.tokens.tokenizer=gpt2 model.vocab_size=50257"""


def add_arguments(parser) -> None:
    parser.add_argument(
        "path",
        help="the corpus, as data.text.path: a file, a folder (.txt, .jsonl, .jsonl.gz, "
        ".parquet, .arrow), a Hugging Face save_to_disk folder, or corpus:NAME",
    )
    parser.add_argument("--out", "-o", required=True, help="folder for the shards (created if needed)")
    parser.add_argument("--tokenizer", default="gpt2", help="byte, gpt2 or hf:<directory> (default: gpt2)")
    parser.add_argument(
        "--field", default="text", help=".jsonl, .parquet, .arrow: the text's key or column (default: text)"
    )
    parser.add_argument(
        "--prefix",
        default="tokens",
        help="shard names: PREFIX_train_000000.bin, PREFIX_val_000000.bin (default: tokens)",
    )
    parser.add_argument(
        "--shard-tokens", type=int, default=100_000_000, help="tokens per shard at most (default: 100,000,000, llm.c's)"
    )
    parser.add_argument("--workers", type=int, default=0, help="tokenizing processes (default 0: min(CPUs, 8))")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    from ..data.datasets import DataError
    from ..data.shards import MAX_SHARD_TOKENS, is_validation, read_shard, write_shards
    from ..data.text import corpus_splits
    from ..data.tokenizer import get_tokenizer
    from ..data.tokenizing import encode_corpus

    out = Path(args.out)
    if not 0 < args.shard_tokens <= MAX_SHARD_TOKENS:
        raise DataError(f"--shard-tokens must be in [1, {MAX_SHARD_TOKENS}], got {args.shard_tokens}")
    if "/" in args.prefix or not args.prefix or is_validation(Path(f"{args.prefix}_train.bin")):
        raise DataError(
            f"--prefix {args.prefix!r} must be a file name without the word val, valid or validation "
            "(shards so named are validation shards)"
        )
    existing = sorted(out.glob(f"{args.prefix}_*.bin"))
    if existing:
        raise DataError(f"{out} already holds {existing[0].name}: choose another --out or --prefix")
    tokenizer = get_tokenizer(args.tokenizer)
    train, val = corpus_splits(args.path)
    out.mkdir(parents=True, exist_ok=True)
    for split, files in (("train", train), ("val", val or [])):
        if not files:
            continue
        ids = encode_corpus(files, tokenizer, args.field, args.workers, progress=False if args.no_progress else None)
        paths = write_shards(ids, out, args.prefix, split, tokenizer.vocab_size, args.shard_tokens)
        tokens = sum(len(read_shard(p)) for p in paths)
        print(f"{split}: {len(files)} file(s), {tokens:,} tokens -> {len(paths)} shard(s) in {out}")
    print(
        f"train on them: data.kind=tokens data.tokens.path='{out / args.prefix}_*.bin' "
        f"data.tokens.tokenizer={args.tokenizer}"
    )
    return 0
