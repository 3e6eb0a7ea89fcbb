"""Benchmark the fused Binary Mapper + post-sampler against the paper's formula taken literally.

Both variants sample the same index and run forward + backward of (r * grad_out).sum() with respect
to the bit-logits (N, H) and the post-sampler table (2^H, D), in float32.
  fused  free_transformer.latent.binary_mapper_project: a row gather forward, a chunked backward.
  naive  (Y + G - detach(G)) @ W with Y and G materialised as (N, 2^H) tensors.

Time: per config both variants are warmed up once, then timed in interleaved rounds
(fused, naive, fused, naive, ...) in this one process; a sample repeats the step until it lasts at
least MIN_SAMPLE_S. We report each variant's median and the median of the per-round ratios, which
cancels most of the drift of a shared machine.

Memory: the extra peak memory of one forward + backward beyond its inputs, measured for each variant
in a fresh process (so nothing cached by an earlier run is reused). See peak_memory.

    PYTHONPATH=src python bench/mapper.py [--quick] [--repeats R] [--device cpu|cuda] [--threads T]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

import torch
import torch.nn.functional as F
from tqdm import tqdm

from common import (MIB, add_machine_arguments, describe_machine, interleaved_times, median_ratio,
                    peak_memory_in_fresh_process, setup_machine)
from free_transformer.latent import binary_mapper_project, index_to_bits, sample_bits

# (H, N tokens, D)
FULL_GRID = [(h, n, d) for h in (8, 12, 16) for n in (1024, 4096) for d in (256, 512)]
QUICK_GRID = [(8, 4096, 256), (16, 4096, 256)]
# Target at H=16, 4,096 tokens: fused at least this many times faster / lighter than naive.
TARGET_BITS, TARGET_TOKENS, TARGET_SPEEDUP, TARGET_MEMORY = 16, 4096, 4.0, 15.0


def naive_mapper_project(bit_logits, weight, generator=None):
    """(Y + G - detach(G)) @ W as the paper writes it. bit_logits (N, H), weight (2^H, D)."""
    n_bits = bit_logits.shape[-1]
    index = sample_bits(bit_logits, generator)  # (N,) the same draw as the fused variant's for the same generator
    patterns = index_to_bits(torch.arange(2**n_bits, device=bit_logits.device), n_bits)  # (2^H, H) U(d)
    log_p1, log_p0 = F.logsigmoid(bit_logits), F.logsigmoid(-bit_logits)  # (N, H) log P(B_h = 1), log P(B_h = 0)
    G = torch.exp(log_p0 @ (1 - patterns).T + log_p1 @ patterns.T)  # (N, 2^H)
    Y = F.one_hot(index, 2**n_bits).to(G.dtype)  # (N, 2^H)
    return (Y + G - G.detach()) @ weight, index  # (N, D)


VARIANTS = {"fused": binary_mapper_project, "naive": naive_mapper_project}


def make_inputs(n_bits, n_tokens, dim, device):
    """bit_logits (N, H) and weight (2^H, D), both requiring grad, and grad_out (N, D)."""
    gen = torch.Generator().manual_seed(0)
    bit_logits = torch.randn(n_tokens, n_bits, generator=gen).to(device).requires_grad_()
    weight = torch.randn(2**n_bits, dim, generator=gen).mul_(dim**-0.5).to(device).requires_grad_()
    grad_out = torch.randn(n_tokens, dim, generator=gen).to(device)
    return bit_logits, weight, grad_out


def step(variant, bit_logits, weight, grad_out):
    """Forward + backward; returns the gradients with respect to (bit_logits, weight)."""
    generator = torch.Generator(bit_logits.device).manual_seed(1)  # same index for both variants
    r, _ = VARIANTS[variant](bit_logits, weight, generator)  # (N, D)
    return torch.autograd.grad((r * grad_out).sum(), (bit_logits, weight))


def time_config(config, device, rounds):
    """Median seconds per step of each variant, median per-round ratio naive / fused, gradient mismatch."""
    inputs = make_inputs(*config, device)
    grads = {variant: step(variant, *inputs) for variant in VARIANTS}  # compared, and a first warm-up
    grad_err = max(
        ((f - n).abs().max() / n.abs().max()).item() for f, n in zip(grads["fused"], grads["naive"])
    )
    del grads
    times = interleaved_times({v: functools.partial(step, v, *inputs) for v in VARIANTS}, rounds, device)
    ratio = median_ratio(times["naive"], times["fused"])
    return statistics.median(times["fused"]), statistics.median(times["naive"]), ratio, grad_err


def setup_inputs(config, device_name):
    return make_inputs(*config, torch.device(device_name))


def peak_memory(variant, config, device_name, threads):
    """Extra peak bytes of one forward + backward beyond its inputs, in a fresh process (see bench/common.py)."""
    return peak_memory_in_fresh_process(
        setup_inputs, functools.partial(step, variant), (config, device_name), device_name=device_name,
        threads=threads, warmup_args=((config[0], 8, config[2]), device_name),
    )


def verdict(config, speedup, memory_ratio):
    n_bits, n_tokens, _ = config
    if (n_bits, n_tokens) != (TARGET_BITS, TARGET_TOKENS):
        return ""
    return "PASS" if speedup >= TARGET_SPEEDUP and memory_ratio >= TARGET_MEMORY else "FAIL"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="H in {8, 16}, N=4096, D=256, 3 rounds")
    parser.add_argument("--repeats", type=int, help="timing rounds per config (default 5, 3 with --quick)")
    add_machine_arguments(parser)
    args = parser.parse_args()
    grid = QUICK_GRID if args.quick else FULL_GRID
    rounds = args.repeats or (3 if args.quick else 5)
    device = setup_machine(args)

    print(f"{describe_machine(device)}, rounds: {rounds}")
    print(f"target at H={TARGET_BITS}, N={TARGET_TOKENS}: fused >= {TARGET_SPEEDUP:g}x faster, "
          f">= {TARGET_MEMORY:g}x less peak memory")
    rows = []
    for config in tqdm(grid, desc="configs"):
        fused_s, naive_s, speedup, grad_err = time_config(config, device, rounds)
        fused_mem, naive_mem = (
            peak_memory(variant, config, args.device, args.threads) for variant in VARIANTS
        )
        memory_ratio = naive_mem / fused_mem
        rows.append((*config, fused_s * 1e3, naive_s * 1e3, speedup, fused_mem / MIB, naive_mem / MIB,
                     memory_ratio, grad_err, verdict(config, speedup, memory_ratio)))

    print(f"{'H':>3} {'N':>5} {'D':>4} | {'fused ms':>9} {'naive ms':>9} {'time x':>7} | "
          f"{'fused MiB':>9} {'naive MiB':>9} {'mem x':>7} | {'grad err':>8}  target")
    for h, n, d, f_ms, n_ms, speedup, f_mib, n_mib, mem_x, err, target in rows:
        print(f"{h:>3} {n:>5} {d:>4} | {f_ms:>9.2f} {n_ms:>9.2f} {speedup:>7.1f} | "
              f"{f_mib:>9.1f} {n_mib:>9.1f} {mem_x:>7.1f} | {err:>8.1e}  {target}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}; grad err = max |fused - naive| / max |naive| "
          "over both gradients")


if __name__ == "__main__":
    main()
