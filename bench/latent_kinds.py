"""Training-step time of the latent kinds side by side: the baseline decoder and every registered kind (by
default; --kinds picks some), e.g. the paper's Binary Mapper (`binary_mapper`, a 2^H x D table with the exact
gradient) beside the ±1 bits through a D x H linear map (`bit_linear`, per-bit straight-through), at the
same sizes and H.

One step is bench/step.py's (forward with targets, backward, clipping, fused AdamW). All models are
built in this one process and timed in interleaved rounds; we print each median, its ratio to the
baseline, and the analytic FLOP ratio of ModelConfig.training_flops_per_token for comparison, and
each model's achieved TFLOP/s (that count / the median step) and MFU (over the matmul limit of the
step's dtype, measured now). --device cuda runs it on a GPU (the step synchronises before each timer
read: bench/common.py).

    PYTHONPATH=src python bench/latent_kinds.py [--bits 8 16] [--kinds K ...] [--rounds R] [--threads T]
                                                [--device cpu|cuda] [--dtype fp32|bf16] [--seq-len T] [--batch B]
                                                [--dim D --layers L --heads h --kv-heads k --ffn F --vocab V]
"""

from __future__ import annotations

import argparse
import functools
import statistics

from common import (
    add_machine_arguments,
    add_model_arguments,
    add_smoke_argument,
    describe_limits,
    describe_machine,
    describe_size,
    interleaved_times,
    matmul_limits_gflops,
    median_ratio,
    mfu,
    model_config,
    setup_machine,
)
from step import build, make_batch, train_step

from free_transformer.model.config import LatentConfig
from free_transformer.model.latent import LATENT_KINDS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_machine_arguments(parser)
    add_model_arguments(parser, dim=128, layers=4, ffn=384)  # cpu-small, the letters demo's size
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--kinds", nargs="+", choices=sorted(LATENT_KINDS), default=sorted(LATENT_KINDS))
    parser.add_argument("--seq-len", type=int, default=65)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.dim, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab = 32, 2, 2, 1, 64, 64
        args.bits, args.seq_len, args.batch, args.rounds = [4], 8, 2, 1
    device = setup_machine(args)
    print(describe_machine(device))
    limits = matmul_limits_gflops(device, smoke=args.smoke)
    print(describe_limits(limits))
    print(describe_size(args) + f"; T={args.seq_len} B={args.batch} {args.dtype}")

    configs = {"baseline": model_config(args, max_seq_len=args.seq_len, latent_units=0)}
    for bits in args.bits:
        for kind in args.kinds:
            configs[f"{kind} H={bits}"] = model_config(
                args, max_seq_len=args.seq_len, latent_units=bits, latent=LatentConfig(kind)
            )
    tokens = make_batch(configs["baseline"], args.batch, args.seq_len, device)
    steps = {}
    for name, config in configs.items():
        model, optimizer = build(config, device)
        steps[name] = functools.partial(train_step, model, optimizer, tokens, args.dtype)
    times = interleaved_times(steps, args.rounds, device)

    base_flops = configs["baseline"].training_flops_per_token(args.seq_len)
    print(
        f"\n{'model':<20} {'ms/step':>9} {'vs baseline':>12} {'FLOP ratio':>11} {'params':>11} "
        f"{'TFLOP/s':>8} {'MFU':>6}"
    )
    for name, config in configs.items():
        ratio = median_ratio(times[name], times["baseline"])
        flops = config.training_flops_per_token(args.seq_len)
        achieved = flops * args.seq_len * args.batch / statistics.median(times[name])
        print(
            f"{name:<20} {statistics.median(times[name]) * 1e3:9.1f} {ratio:12.3f} {flops / base_flops:11.3f} "
            f"{config.num_params():11,} {achieved / 1e12:8.3f} {mfu(achieved, limits, args.dtype):6.1%}"
        )
    print(f"TFLOP/s = training_flops_per_token(T) * B * T / median step; MFU = that / the {args.dtype} matmul limit")


if __name__ == "__main__":
    main()
