"""Benchmark the fused Binary Mapper + post-sampler against the paper's formula taken literally.

Both variants sample the same index and run forward + backward of (r * grad_out).sum() with respect
to the bit-logits (N, H) and the post-sampler table (2^H, D), in float32 (--dtype bf16: under bf16
autocast, as the trainer's precision=bf16; the fused backward's matmul then runs in bf16).
  fused  free_transformer.model.latent.binary_mapper_project: a row gather forward, a chunked backward.
  naive  (Y + G - detach(G)) @ W with Y and G materialised as (N, 2^H) tensors.
  matmul the one matmul the exact gradient needs, dR @ W^T ((N, D) x (D, 2^H), in the matmul dtype),
         alone: the floor of the fused variant. Its time is printed beside the fused one, with the
         ratio fused / matmul (target on a GPU at H=16, N=8192, D=1536: at most 3).

Time: per config both variants are warmed up once, then timed in interleaved rounds
(fused, naive, fused, naive, ...) in this one process; a sample repeats the step until it lasts at
least MIN_SAMPLE_S. We report each variant's median and the median of the per-round ratios, which
cancels most of the drift of a shared machine.

Memory: the extra peak memory of one forward + backward beyond its inputs, measured for each variant
in a fresh process (so nothing cached by an earlier run is reused). See peak_memory.

    PYTHONPATH=src python bench/mapper.py [--quick] [--repeats R] [--device cpu|cuda] [--threads T]
                                          [--dtype fp32|bf16] [--compile]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

import torch
import torch.nn.functional as F
from common import (
    MIB,
    add_machine_arguments,
    add_smoke_argument,
    describe_limits,
    describe_machine,
    interleaved_times,
    matmul_limits_gflops,
    median_ratio,
    mfu,
    peak_memory_in_fresh_process,
    setup_machine,
)
from targets import TARGETS, write_figure
from tqdm import tqdm

from free_transformer.base.devices import DTYPE_NAMES, torch_dtype
from free_transformer.model.latent import binary_mapper_project, index_to_bits, sample_bits

# (H, N tokens, D)
FULL_GRID = [(h, n, d) for h in (8, 12, 16) for n in (1024, 4096) for d in (256, 512)]
QUICK_GRID = [(8, 4096, 256), (16, 4096, 256)]
# On a GPU the paper-1.5b step's mapper: N = B*T = 4*2048 tokens, D=1536 (--quick on CUDA runs these).
GPU_GRID = [(8, 8192, 1536), (16, 8192, 1536)]
# Target at H=16, 4,096 tokens: fused at least this many times faster / lighter than naive.
TARGET_BITS, TARGET_TOKENS, TARGET_SPEEDUP, TARGET_MEMORY = 16, 4096, 4.0, 15.0
# Target on a GPU (docs/gpu.md) at (H, N, D) = GPU_TARGET: fused forward + backward at most this many
# times the dR @ W^T matmul alone.
GPU_TARGET, GPU_TARGET_MATMUL_X = (16, 8192, 1536), TARGETS["mapper-matmul-x"].at_most


def naive_mapper_project(bit_logits, weight, generator=None):
    """(Y + G - detach(G)) @ W as the paper writes it. bit_logits (N, H), weight (2^H, D)."""
    n_bits = bit_logits.shape[-1]
    index = sample_bits(bit_logits, generator)  # (N,) the same draw as the fused variant's for the same generator
    patterns = index_to_bits(torch.arange(2**n_bits, device=bit_logits.device), n_bits)  # (2^H, H) U(d)
    log_p1, log_p0 = F.logsigmoid(bit_logits), F.logsigmoid(-bit_logits)  # (N, H) log P(B_h = 1), log P(B_h = 0)
    G = torch.exp(log_p0 @ (1 - patterns).T + log_p1 @ patterns.T)  # (N, 2^H)
    Y = F.one_hot(index, 2**n_bits).to(G.dtype)  # (N, 2^H)
    return (Y + G - G.detach()) @ weight, index  # (N, D)


COMPILED_CHUNKS = {"on": False}  # --compile: the fused variant's backward fuses each chunk (torch.compile)


def set_compiled_chunks(enabled: bool) -> None:
    COMPILED_CHUNKS["on"] = enabled


def fused_mapper_project(bit_logits, weight, generator=None):
    return binary_mapper_project(bit_logits, weight, generator, compiled=COMPILED_CHUNKS["on"])


VARIANTS = {"fused": fused_mapper_project, "naive": naive_mapper_project}


def make_inputs(n_bits, n_tokens, dim, device):
    """bit_logits (N, H) and weight (2^H, D), both requiring grad, and grad_out (N, D)."""
    gen = torch.Generator().manual_seed(0)
    bit_logits = torch.randn(n_tokens, n_bits, generator=gen).to(device).requires_grad_()
    weight = torch.randn(2**n_bits, dim, generator=gen).mul_(dim**-0.5).to(device).requires_grad_()
    grad_out = torch.randn(n_tokens, dim, generator=gen).to(device)
    return bit_logits, weight, grad_out


def step(variant, bit_logits, weight, grad_out, precision="fp32"):
    """Forward + backward; returns the gradients with respect to (bit_logits, weight)."""
    device = bit_logits.device
    generator = torch.Generator(device).manual_seed(1)  # same index for both variants
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        r, _ = VARIANTS[variant](bit_logits, weight, generator)  # (N, D)
    return torch.autograd.grad((r * grad_out).sum(), (bit_logits, weight))


def matmul_only(grad_out, table, out):
    """dR @ W^T, (N, D) x (D, 2^H) -> (N, 2^H), inputs already in the matmul dtype: the fused backward's one matmul."""
    return torch.mm(grad_out, table.T, out=out)


def matmul_flops(config) -> float:
    n_bits, n_tokens, dim = config
    return 2.0 * n_tokens * 2**n_bits * dim


def time_config(config, device, rounds, precision):
    """Median seconds per step of fused, naive and the matmul alone; median per-round ratios naive / fused
    and fused / matmul; gradient mismatch."""
    inputs = make_inputs(*config, device)
    grads = {variant: step(variant, *inputs, precision) for variant in VARIANTS}  # compared, and a first warm-up
    grad_err = max(((f - n).abs().max() / n.abs().max()).item() for f, n in zip(grads["fused"], grads["naive"]))
    del grads
    _, weight, grad_out = inputs
    dtype = torch_dtype(precision)
    table, dr = weight.detach().to(dtype), grad_out.to(dtype)
    out = dr.new_empty(dr.shape[0], table.shape[0])  # (N, 2^H)
    variants = {v: functools.partial(step, v, *inputs, precision) for v in VARIANTS}
    variants["matmul"] = functools.partial(matmul_only, dr, table, out)
    times = interleaved_times(variants, rounds, device)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return (
        medians,
        median_ratio(times["naive"], times["fused"]),
        median_ratio(times["fused"], times["matmul"]),
        grad_err,
    )


def setup_inputs(config, device_name, compiled_chunks=False):
    set_compiled_chunks(compiled_chunks)  # a fresh process starts with the eager chunks
    return make_inputs(*config, torch.device(device_name))


def peak_memory(variant, config, device_name, threads, precision, compiled_chunks=False):
    """Extra peak bytes of one forward + backward beyond its inputs, in a fresh process (see bench/common.py)."""
    return peak_memory_in_fresh_process(
        setup_inputs,
        functools.partial(step, variant, precision=precision),
        (config, device_name, compiled_chunks),
        device_name=device_name,
        threads=threads,
        # compiled chunks compile per shape (dynamic=False): warm up on the measured shape, or the step compiles
        warmup_args=(config if compiled_chunks else (config[0], 8, config[2]), device_name, compiled_chunks),
    )


def verdict(config, speedup, memory_ratio, matmul_x):
    n_bits, n_tokens, _ = config
    if tuple(config) == GPU_TARGET:
        return "PASS" if matmul_x <= GPU_TARGET_MATMUL_X else "FAIL"
    if (n_bits, n_tokens) != (TARGET_BITS, TARGET_TOKENS):
        return ""
    return "PASS" if speedup >= TARGET_SPEEDUP and memory_ratio >= TARGET_MEMORY else "FAIL"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="H in {8, 16}, 3 rounds; N=4096, D=256 on a CPU, N=8192, D=1536 on a GPU"
    )
    parser.add_argument("--repeats", type=int, help="timing rounds per config (default 5, 3 with --quick)")
    parser.add_argument(
        "--dtype",
        dest="precision",
        choices=DTYPE_NAMES,
        default="fp32",
        help="bf16: forward under bf16 autocast (the backward's matmul follows it)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="fuse each backward chunk with torch.compile (binary_mapper_project(..., compiled=True), "
        "as the trainer's compile=true)",
    )
    parser.add_argument(
        "--figures", metavar="PATH", help="append the GPU target's figure (bench/targets.py) to PATH as a JSON line"
    )
    add_machine_arguments(parser)
    add_smoke_argument(parser)
    args = parser.parse_args()
    device = setup_machine(args)
    if args.smoke:
        grid, args.repeats = [(4, 64, 16)], 1
    elif args.quick:
        grid = GPU_GRID if device.type == "cuda" else QUICK_GRID
    else:
        grid = FULL_GRID + (GPU_GRID if device.type == "cuda" else [])
    rounds = args.repeats or (3 if args.quick else 5)
    set_compiled_chunks(args.compile)

    print(
        f"{describe_machine(device)}, rounds: {rounds}, precision {args.precision}"
        f"{', compiled chunks' if args.compile else ''}"
    )
    limits = matmul_limits_gflops(device, smoke=args.smoke)
    print(describe_limits(limits))
    print(
        f"target at H={TARGET_BITS}, N={TARGET_TOKENS}: fused >= {TARGET_SPEEDUP:g}x faster, "
        f">= {TARGET_MEMORY:g}x less peak memory; at (H, N, D) = {GPU_TARGET}: fused <= "
        f"{GPU_TARGET_MATMUL_X:g}x the dR @ W^T matmul alone"
    )
    rows = []
    for config in tqdm(grid, desc="configs"):
        medians, speedup, matmul_x, grad_err = time_config(config, device, rounds, args.precision)
        fused_mem, naive_mem = (
            peak_memory(variant, config, args.device, args.threads, args.precision, args.compile)
            for variant in VARIANTS
        )
        memory_ratio = naive_mem / fused_mem
        fused_flops = matmul_flops(config) / medians["fused"]  # the fused step's one matmul, per second
        rows.append(
            (
                *config,
                medians["fused"] * 1e3,
                medians["naive"] * 1e3,
                speedup,
                medians["matmul"] * 1e3,
                matmul_x,
                fused_flops / 1e12,
                mfu(fused_flops, limits, args.precision),
                fused_mem / MIB,
                naive_mem / MIB,
                memory_ratio,
                grad_err,
                verdict(config, speedup, memory_ratio, matmul_x),
            )
        )
        if tuple(config) == GPU_TARGET and device.type == "cuda":
            write_figure(
                args.figures, "mapper-matmul-x", matmul_x, f"{args.precision}, fused {medians['fused'] * 1e3:.2f} ms"
            )

    print(
        f"{'H':>3} {'N':>5} {'D':>4} | {'fused ms':>9} {'naive ms':>9} {'time x':>7} | {'matmul ms':>9} "
        f"{'f/mm':>5} {'TFLOP/s':>7} {'MFU':>5} | {'fused MiB':>9} {'naive MiB':>9} {'mem x':>7} | "
        f"{'grad err':>8}  target"
    )
    for h, n, d, f_ms, n_ms, speedup, mm_ms, mm_x, tflops, util, f_mib, n_mib, mem_x, err, target in rows:
        print(
            f"{h:>3} {n:>5} {d:>4} | {f_ms:>9.2f} {n_ms:>9.2f} {speedup:>7.1f} | {mm_ms:>9.2f} "
            f"{mm_x:>5.1f} {tflops:>7.2f} {util:>5.1%} | {f_mib:>9.1f} {n_mib:>9.1f} {mem_x:>7.1f} | "
            f"{err:>8.1e}  {target}"
        )
    print(
        f"load average at the end {os.getloadavg()[0]:.1f}; grad err = max |fused - naive| / max |naive| "
        "over both gradients; matmul = dR @ W^T alone, f/mm = median per-round fused / matmul; TFLOP/s and "
        f"MFU = that matmul's 2 N 2^H D FLOPs / the fused step's time, against the {args.precision} matmul limit"
    )


if __name__ == "__main__":
    main()
