"""`free-transformer convert`: between our checkpoints, the Hugging Face format and Llama checkpoints.

The source format is detected (our step_* or run directory, a FreeTransformerForCausalLM directory,
or a LlamaForCausalLM directory); --to names the target. --latent-units turns a baseline source (a
Llama, or one of our baselines) into a Free Transformer with the same decoder and a fresh latent path.
--chat-template gives a Hugging Face export's tokenizer a chat template.
"""

from __future__ import annotations

from pathlib import Path

from ..base.fileio import share_like_umask

NAME = "convert"
HELP = "convert between our checkpoints, Hugging Face directories and Llama checkpoints (needs the hf extra)"

DTYPES = ("float32", "bfloat16", "float16", "float64")


def add_arguments(parser) -> None:
    parser.add_argument(
        "source",
        help="our checkpoint (step_* or run directory), a Hugging Face "
        "FreeTransformerForCausalLM directory, or a LlamaForCausalLM directory (detected)",
    )
    parser.add_argument(
        "destination",
        help="for --to checkpoint, a run directory (the checkpoint is written "
        "to DESTINATION/checkpoints/step_XXXXXXXX); otherwise a new directory",
    )
    parser.add_argument("--to", required=True, choices=["checkpoint", "hf", "llama"], help="target format")
    parser.add_argument(
        "--latent-units",
        type=int,
        default=None,
        metavar="H",
        help="make a Free Transformer with H latent units (bits for the default kind) from a baseline source: "
        "decoder weights copied, encoder / zeta / read-out / post-sampler freshly initialised",
    )
    parser.add_argument(
        "--latent-layer", type=int, default=None, help="decoder blocks before Z is injected (default: n_layers // 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the fresh latent path")
    parser.add_argument("--step", type=int, default=0, help="step number of a written checkpoint")
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=None,
        help="override the maximum sequence length (RoPE tables; e.g. a Llama's 131072)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="cast the weights (default: keep the source's; our checkpoints load as float32)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="with --to hf: a Jinja chat template (transformers' format), written as the export's "
        "chat_template.jinja, so that its tokenizer's apply_chat_template and chat pipelines work",
    )


def run(args) -> int:
    try:
        import torch

        from ..hf.conversion import convert, detect_format
    except ImportError as error:
        from ..base.errors import UserError
        from ..base.install import install_hint

        raise UserError(f"convert needs transformers: {install_hint('hf')} ({error})") from error
    chat_template = None
    if args.chat_template is not None:  # read first: a missing file fails before the weights are
        chat_template = Path(args.chat_template).read_text(encoding="utf-8")
    source_format = detect_format(args.source)  # errors are ValueErrors: the CLI prints them as one line
    written = convert(
        args.source,
        args.destination,
        args.to,
        latent_units=args.latent_units,
        latent_layer=args.latent_layer,
        seed=args.seed,
        step=args.step,
        max_seq_len=args.max_seq_len,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        chat_template=chat_template,
    )
    share_like_umask(written)  # save_pretrained / safetensors write 0600: readable by its owner alone
    print(f"converted {source_format} {args.source} -> {args.to} {written}")
    return 0
