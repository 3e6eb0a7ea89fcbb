"""Where one training step and one decoding step spend their time: torch.profiler's operators by self
time (the GPU's kernels on CUDA, the host's operators on a CPU), the tables scripts/gpu-check.sh puts
in its report.

The training step is bench/step.py's (the trainer's: forward with the fused cross-entropy, backward,
clipping, fused AdamW), profiled after two warm-up steps. The decoding step is `generate(...,
compile=True)` as bench/generate.py's part (a) calls it (a 16-token prompt, temperature 1, prior latents,
a seed per row): after a warm-up call (which compiles and captures the decoding step on a GPU), one call
of --new-tokens tokens is profiled and each operator's time is divided by the tokens decoded. With
--untuned the step is compiled without coordinate-descent tuning, as bench/generate.py --untuned
compiles it: at the same batch and --new-tokens the graph is the same, so each leaves Inductor's cache
warm for the other.

    PYTHONPATH=src python bench/profile_steps.py [--size narrow|paper-1.5b] [--dtype fp32|bf16] [--compile]
                                           [--bits H] [--batch B] [--seq-len T] [--decode-batch B ...]
                                           [--new-tokens N] [--untuned] [--parts train,decode] [--top K]
                                           [--device cpu|cuda] [--threads T]
"""

from __future__ import annotations

import argparse

import torch
from common import add_machine_arguments, add_smoke_argument, describe_machine, setup_machine, sync
from generate import PROMPT_LEN, build_model, compile_untuned
from step import BATCH, PAPER, PAPER_BATCH, PAPER_SEQ_LEN, SEQ_LEN, build, make_batch, model_config, train_step
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from free_transformer import GenerationConfig, generate
from free_transformer.base.devices import torch_dtype


def top_operators(prof, device: torch.device, per: int, top: int) -> str:
    """The `top` operators by self time (on a GPU its kernels by device time), as a table; times divided by
    `per`. On a GPU only the kernels' own events are counted: an operator's self device time is that of the
    kernels it launched, which the kernels' rows already hold (counted both ways, the total doubles)."""
    on_gpu = device.type == "cuda"
    rows = []
    for event in prof.key_averages():
        if on_gpu and event.device_type != DeviceType.CUDA:
            continue
        self_us = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if self_us > 0:
            rows.append((self_us, event.count, event.key))
    rows.sort(reverse=True)
    total = sum(us for us, _, _ in rows)
    lines = [f"{'ms':>9} {'share':>6} {'calls':>7}  {'GPU kernel' if on_gpu else 'operator'} (self time)"]
    for us, calls, name in rows[:top]:
        lines.append(f"{us / 1e3 / per:9.3f} {us / total:6.1%} {calls / per:7.1f}  {name[:100]}")
    lines.append(f"{total / 1e3 / per:9.3f} {1:6.0%} {sum(c for _, c, _ in rows) / per:7.1f}  all")
    return "\n".join(lines)


def activities(device: torch.device) -> list:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def profile_training(args, device: torch.device) -> str:
    cfg = model_config(args.bits, 8, args.size)
    tokens = make_batch(cfg, args.batch, args.seq_len, device)
    model, optimizer = build(cfg, device, args.compile)
    for _ in range(2):  # the first creates the Adam moments (and compiles, with --compile)
        train_step(model, optimizer, tokens, args.precision)
    sync(device)
    with profile(activities=activities(device)) as prof:
        train_step(model, optimizer, tokens, args.precision)
        sync(device)
    return (
        f"training step: {shape_of(cfg)}, B={args.batch}, T={args.seq_len}, {args.precision}"
        f"{', compiled blocks' if args.compile else ''}\n{top_operators(prof, device, 1, args.top)}"
    )


def profile_decoding(args, device: torch.device, batch: int) -> str:
    cfg = model_config(args.bits, 8, args.size)
    # bf16: weights and cache in bf16, as generate --dtype bf16
    model = build_model(cfg, device, dtype=torch_dtype(args.precision))
    prompts = make_batch(cfg, batch, PROMPT_LEN, device)[:, :PROMPT_LEN]
    call = dict(
        config=GenerationConfig(max_new_tokens=args.new_tokens, temperature=1.0),
        seeds=list(range(batch)),
        latents="prior",
        compile=True,
    )
    generate(model, prompts, **call)  # compiles and captures the decoding step on a GPU
    with profile(activities=activities(device)) as prof:
        generate(model, prompts, **call)
        sync(device)
    return (
        f"decoding step (generate compile=True{', untuned' if args.untuned else ''}): {shape_of(cfg)}, "
        f"B={batch}, {args.precision}, per token of {args.new_tokens}\n"
        f"{top_operators(prof, device, args.new_tokens, args.top)}"
    )


def shape_of(cfg) -> str:
    return (
        f"L={cfg.n_layers}, D={cfg.dim}, {cfg.n_heads}/{cfg.n_kv_heads} heads, vocab {cfg.vocab_size}, "
        f"H={cfg.latent_units}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_machine_arguments(parser)
    parser.add_argument("--size", choices=("narrow", PAPER), default="narrow")
    parser.add_argument("--dtype", dest="precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true", help="compile every block, as the trainer's compile=true")
    parser.add_argument("--bits", type=int, default=16, help="H of the Free Transformer")
    parser.add_argument("--batch", type=int, help=f"training B (default {BATCH}; {PAPER}: {PAPER_BATCH})")
    parser.add_argument("--seq-len", type=int, help=f"training T (default {SEQ_LEN}; {PAPER}: {PAPER_SEQ_LEN})")
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1], help="decoding batch sizes, one table each")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--untuned",
        action="store_true",
        help="compile the decoding step without coordinate-descent tuning (bench/generate.py --untuned)",
    )
    parser.add_argument("--top", type=int, default=20, help="operators listed per table")
    parser.add_argument("--parts", default="train,decode", help="train, decode or both (comma-separated)")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.bits, args.batch, args.seq_len, args.decode_batch, args.new_tokens = 4, 2, 16, [1], 4
    paper = args.size == PAPER
    args.batch = args.batch or (PAPER_BATCH if paper else BATCH)
    args.seq_len = args.seq_len or (PAPER_SEQ_LEN if paper else SEQ_LEN)
    device = setup_machine(args)
    print(describe_machine(device))
    if args.untuned:
        compile_untuned()
    parts = set(args.parts.split(","))
    if "train" in parts:
        print("\n" + profile_training(args, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for batch in args.decode_batch if "decode" in parts else ():
        print("\n" + profile_decoding(args, device, batch))


if __name__ == "__main__":
    main()
