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
import ctypes
import math
import multiprocessing as mp
import os
import re
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from free_transformer.latent import binary_mapper_project, index_to_bits, sample_bits

# (H, N tokens, D)
FULL_GRID = [(h, n, d) for h in (8, 12, 16) for n in (1024, 4096) for d in (256, 512)]
QUICK_GRID = [(8, 4096, 256), (16, 4096, 256)]
# Target at H=16, 4,096 tokens: fused at least this many times faster / lighter than naive.
TARGET_BITS, TARGET_TOKENS, TARGET_SPEEDUP, TARGET_MEMORY = 16, 4096, 4.0, 15.0
MIN_SAMPLE_S = 0.05  # a timing sample repeats the step until it lasts at least this long
MIB = 2**20
M_MMAP_THRESHOLD = -3  # mallopt parameter, from glibc's malloc.h


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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def seconds_per_step(variant, inputs, n_steps):
    device = inputs[0].device
    sync(device)
    start = time.perf_counter()
    for _ in range(n_steps):
        step(variant, *inputs)
    sync(device)
    return (time.perf_counter() - start) / n_steps


def time_config(config, device, rounds):
    """Median seconds per step of each variant, median per-round ratio naive / fused, gradient mismatch."""
    inputs = make_inputs(*config, device)
    grads, first = {}, {}
    for variant in VARIANTS:  # warm-up; its gradients are compared and its time sets the sample length
        start = time.perf_counter()
        grads[variant] = step(variant, *inputs)
        sync(device)
        first[variant] = time.perf_counter() - start
    grad_err = max(
        ((f - n).abs().max() / n.abs().max()).item() for f, n in zip(grads["fused"], grads["naive"])
    )
    del grads
    n_steps = {v: max(1, math.ceil(MIN_SAMPLE_S / first[v])) for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            times[variant].append(seconds_per_step(variant, inputs, n_steps[variant]))
    ratio = statistics.median(n / f for f, n in zip(times["fused"], times["naive"]))
    return statistics.median(times["fused"]), statistics.median(times["naive"]), ratio, grad_err


def proc_status_kib(field):
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def peak_memory(variant, config, device_name, threads):
    """Extra peak bytes of one forward + backward beyond its inputs; meant to run in a fresh process.

    CUDA: max_memory_allocated minus memory_allocated before the step.
    CPU: PyTorch's CPU allocator keeps no statistics, so we read the kernel's resident-set figures
    (VmRSS, and its peak VmHWM). glibc is told to give every block of 64 KiB or more its own
    mapping (M_MMAP_THRESHOLD; left dynamic, it moves freed 16 MiB chunks to its heaps and the
    peak wanders by +-30% from run to run), so freed tensors go back to the kernel and the
    resident set follows the live tensors. A step at 8 tokens loads kernels and thread pools, the
    inputs are allocated, malloc_trim hands back what glibc still holds (the step could otherwise
    reuse it unseen), and writing 5 to /proc/self/clear_refs resets VmHWM to VmRSS. VmHWM after
    the step minus VmRSS before it is what the step added. ru_maxrss is not used: it cannot be
    reset, and a spawned child can inherit its parent's.
    """
    device = torch.device(device_name)
    torch.set_num_threads(threads)
    if device.type == "cpu":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    step(variant, *make_inputs(config[0], 8, config[2], device))  # warm-up at 8 tokens
    inputs = make_inputs(*config, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(variant, *inputs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = proc_status_kib("VmRSS")
    step(variant, *inputs)
    return (proc_status_kib("VmHWM") - before) * 1024


def peak_memory_in_fresh_process(variant, config, device_name, threads):
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(peak_memory, (variant, config, device_name, threads))


def verdict(config, speedup, memory_ratio):
    n_bits, n_tokens, _ = config
    if (n_bits, n_tokens) != (TARGET_BITS, TARGET_TOKENS):
        return ""
    return "PASS" if speedup >= TARGET_SPEEDUP and memory_ratio >= TARGET_MEMORY else "FAIL"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="H in {8, 16}, N=4096, D=256, 3 rounds")
    parser.add_argument("--repeats", type=int, help="timing rounds per config (default 5, 3 with --quick)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads; on a loaded machine 1 avoids stalls at the threads' barriers")
    args = parser.parse_args()
    grid = QUICK_GRID if args.quick else FULL_GRID
    rounds = args.repeats or (3 if args.quick else 5)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)

    load = os.getloadavg()[0]
    busy = " (more than the cores: times are not reliable, see --threads)" if load > os.cpu_count() else ""
    print(f"device {device}, torch {torch.__version__}, threads: {torch.get_num_threads()}, rounds: {rounds}, "
          f"load average {load:.1f}{busy}")
    print(f"target at H={TARGET_BITS}, N={TARGET_TOKENS}: fused >= {TARGET_SPEEDUP:g}x faster, "
          f">= {TARGET_MEMORY:g}x less peak memory")
    rows = []
    for config in tqdm(grid, desc="configs"):
        fused_s, naive_s, speedup, grad_err = time_config(config, device, rounds)
        fused_mem, naive_mem = (
            peak_memory_in_fresh_process(variant, config, args.device, args.threads) for variant in VARIANTS
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
