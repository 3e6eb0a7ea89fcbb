"""What every benchmark here shares: interleaved timing, peak memory in a fresh process, the machine's limit.

The machines are shared and noisy, so a benchmark never compares two separate runs: variants are timed
in interleaved rounds (A, B, A, B, ...) in one process and we report medians of the per-round ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import math
import multiprocessing as mp
import os
import re
import statistics
import time
from collections.abc import Callable

import torch

from free_transformer.base.devices import DTYPE_NAMES, torch_dtype
from free_transformer.model.config import ModelConfig

MIN_SAMPLE_S = 0.05  # a timing sample repeats the step until it lasts at least this long
MIB = 2**20
M_MMAP_THRESHOLD = -3  # mallopt parameter, from glibc's malloc.h
SMOKE_MATMUL, SMOKE_COPY_BYTES = 256, 2**24  # the machine's limits measured small under --smoke


def sync(device: torch.device) -> None:
    """Wait for the device's queued work: CUDA kernels run asynchronously, so a timer read without this
    measures the launches, not the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cached_memory() -> None:
    """Hand the CUDA caching allocator's free blocks back to the driver: a spawned process measuring
    peak memory cannot use what this process still keeps reserved (a no-op without CUDA)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def seconds_per_call(fn: Callable[[], object], n_calls: int, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(n_calls):
        fn()
    sync(device)
    return (time.perf_counter() - start) / n_calls


def interleaved_times(
    variants: dict[str, Callable[[], object]], rounds: int, device: torch.device, min_sample_s: float = MIN_SAMPLE_S
) -> dict[str, list[float]]:
    """Seconds per call of each variant, one sample per round, the variants taking turns within a round.

    Each variant is called once first (warm-up; its time sets how many calls make one sample).
    """
    first = {name: seconds_per_call(fn, 1, device) for name, fn in variants.items()}
    n_calls = {name: max(1, math.ceil(min_sample_s / first[name])) for name in variants}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            times[name].append(seconds_per_call(fn, n_calls[name], device))
    return times


def rewind_rows(engine, position: int) -> None:
    """The rows in flight of a decoding engine (free_transformer.inference.engine) back to the end of their prompts,
    all `position` tokens long: every new token but the first dropped, and the engine's schedule made again for
    them, so that a timed sample of n steps runs n steps every time (with the old schedule, whose last step has
    passed, a step would launch nothing)."""
    for row in engine.rows:
        row.tokens[1:] = []  # its position follows: the prompt's end
    engine.runner.position[: len(engine.rows)] = position
    engine._in_flight()


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median of the per-round ratios: cancels most of the drift of a shared machine."""
    return statistics.median(n / d for n, d in zip(numerator, denominator))


def _proc_status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


def _peak_memory(
    setup: Callable, step: Callable, setup_args: tuple, warmup_args: tuple | None, device_name: str, threads: int
) -> int:
    """Extra peak bytes of step(*setup(*setup_args)) beyond what setup allocated; run in a fresh process.

    CUDA: max_memory_allocated minus memory_allocated before the step.
    CPU: PyTorch's CPU allocator keeps no statistics, so we read the kernel's resident-set figures
    (VmRSS, and its peak VmHWM). glibc is told to give every block of 64 KiB or more its own mapping
    (M_MMAP_THRESHOLD; left dynamic, it keeps freed chunks on its heaps and the peak wanders by +-30%
    from run to run), so freed tensors go back to the kernel and the resident set follows the live
    tensors. A warm-up step (setup(*warmup_args), small) loads kernels and thread pools, the inputs
    are built, malloc_trim hands back what glibc still holds, and writing 5 to /proc/self/clear_refs
    resets VmHWM to VmRSS. VmHWM after the step minus VmRSS before it is what the step added.
    """
    device = torch.device(device_name)
    torch.set_num_threads(threads)
    if device.type == "cpu":
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    if warmup_args is not None:
        step(*setup(*warmup_args))
    inputs = setup(*setup_args)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(*inputs)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _proc_status_kib("VmRSS")
    step(*inputs)
    return (_proc_status_kib("VmHWM") - before) * 1024


_FRESH = mp.get_context("forkserver")
_FRESH.set_forkserver_preload(["__main__"])  # the script's imports, torch's included, made once in the server


def peak_memory_in_fresh_process(
    setup: Callable,
    step: Callable,
    setup_args: tuple,
    *,
    device_name: str,
    threads: int,
    warmup_args: tuple | None = None,
) -> int:
    """Peak bytes one step adds, measured in a fresh process (nothing cached by earlier runs is reused).

    The process is forked from a server that imported the calling script and nothing more (no tensor made,
    no device touched), so each measurement starts clean without importing torch again: a spawned process
    took seconds of CPU a point to start.
    setup and step must be module-level functions (they are pickled); setup returns a tuple of inputs.
    On CUDA this process's cached blocks are released first, so that the fresh process can use them.
    """
    release_cached_memory()
    with _FRESH.Pool(1) as pool:
        return pool.apply(_peak_memory, (setup, step, setup_args, warmup_args, device_name, threads))


def matmul_size(device: torch.device) -> int:
    """The square matmul that measures the limit: 2048 on a CPU (a few ms), 8192 on a GPU (2048 leaves
    an H100 under-filled: its bf16 figure there is far below the 8192 one)."""
    return 8192 if device.type == "cuda" else 2048


def matmul_flops_per_second(
    device: torch.device, dtype: torch.dtype, size: int | None = None, rounds: int = 5
) -> float:
    """The machine's limit: median FLOP/s of a (size x size) @ (size x size) matmul in this dtype.

    fp32 on CUDA follows torch.backends.cuda.matmul.allow_tf32 (off by default: true fp32), the same
    setting the benchmarked step runs under."""
    size = size or matmul_size(device)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    matmul = functools.partial(torch.mm, a, b, out=out)
    times = interleaved_times({"matmul": matmul}, rounds, device, min_sample_s=0.2)["matmul"]
    del matmul
    del a, b, out
    release_cached_memory()
    return 2 * size**3 / statistics.median(times)


def copy_bandwidth_gbps(device: torch.device, nbytes: int | None = None, rounds: int = 5) -> float:
    """The machine's memory bandwidth: GB/s of dst.copy_(src) on one large tensor, counting the bytes
    read and the bytes written (2 x nbytes per copy, as STREAM's copy does). 1 GiB on a GPU (far
    beyond its L2 cache), 256 MiB on a CPU. Decoding one token reads every weight once, so this is
    the roofline it is measured against (bench/generate.py)."""
    nbytes = nbytes or (2**30 if device.type == "cuda" else 2**28)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = interleaved_times({"copy": functools.partial(dst.copy_, src)}, rounds, device, min_sample_s=0.2)["copy"]
    del src, dst
    release_cached_memory()
    return 2 * nbytes / statistics.median(times) / 1e9


def describe_machine(device: torch.device) -> str:
    """One line: device, torch, threads, load average (with a warning when it exceeds the cores)."""
    load = os.getloadavg()[0]
    busy = " (more than the cores: times are not reliable, see --threads)" if load > os.cpu_count() else ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}"
    if device.type == "cuda":
        name += f", CUDA {torch.version.cuda}"
    return (
        f"device {device} ({name}), torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"load average {load:.1f}{busy}"
    )


def matmul_limits_gflops(
    device: torch.device,
    *,
    bandwidth: bool = False,
    precisions: tuple[str, ...] = ("fp32", "bf16"),
    smoke: bool = False,
) -> dict[str, float]:
    """The machine's matmul GFLOP/s in each of `precisions`, measured now (see matmul_flops_per_second), and
    with bandwidth=True its copy bandwidth in GB/s under "copy_gbps" (see copy_bandwidth_gbps). "size"
    records the matmul's side. (A CPU without bf16 instructions takes minutes over one bf16 2048^3 matmul:
    a benchmark of fp32 steps asks for fp32 alone.) smoke: a 256^3 matmul and a 16 MiB copy, one round each
    (a --smoke run's figures, which nothing reads)."""
    size, rounds = (SMOKE_MATMUL, 1) if smoke else (matmul_size(device), 5)
    limits = {name: matmul_flops_per_second(device, torch_dtype(name), size, rounds) / 1e9 for name in precisions}
    limits["size"] = size
    if bandwidth:
        limits["copy_gbps"] = copy_bandwidth_gbps(device, SMOKE_COPY_BYTES if smoke else None, rounds)
    return limits


def describe_limits(limits: dict[str, float]) -> str:
    line = f"machine limit: matmul {limits['size']}^3 " + ", ".join(
        f"{name} {limits[name]:.0f} GFLOP/s" for name in DTYPE_NAMES if name in limits
    )
    if "copy_gbps" in limits:
        line += f"; copy bandwidth {limits['copy_gbps']:.0f} GB/s (read + write)"
    return line


def peak_gflops(limits: dict[str, float], precision: str) -> float:
    """The matmul limit of the dtype a step runs its matmuls in: bf16 under bf16 autocast, else fp32."""
    return limits["bf16" if precision == "bf16" else "fp32"]


def mfu(flops_per_second: float, limits: dict[str, float], precision: str) -> float:
    """Model FLOP utilisation: achieved FLOP/s (the model's analytic count) / the measured matmul limit
    of the step's dtype. Against a measured limit, not the datasheet's: 100% means as fast as one large
    matmul on this machine."""
    return flops_per_second / 1e9 / peak_gflops(limits, precision)


def add_machine_arguments(parser: argparse.ArgumentParser) -> None:
    """--device and --threads, as every benchmark takes them."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="CPU threads; on a loaded machine 1 avoids stalls at the threads' barriers",
    )


def add_smoke_argument(parser: argparse.ArgumentParser) -> None:
    """--smoke, as every script of bench/ takes it: tests/test_bench.py runs each one so, to see that it still runs."""
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny size and one round, seconds long: checks that the script runs"
    )


def setup_machine(args: argparse.Namespace) -> torch.device:
    """Applies --threads; returns the --device. A CUDA device that is not there is one clear error."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here (torch {torch.__version__})")
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def add_model_arguments(parser: argparse.ArgumentParser, *, dim: int, layers: int, ffn: int) -> None:
    """The model's size: --dim --layers --heads --kv-heads --ffn --vocab."""
    parser.add_argument("--dim", type=int, default=dim)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=ffn, help="SwiGLU hidden size")
    parser.add_argument("--vocab", type=int, default=256)


def model_config(args: argparse.Namespace, **fields) -> ModelConfig:
    """The ModelConfig of add_model_arguments' options, plus `fields` (max_seq_len, latent_units, ...)."""
    return ModelConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_hidden=args.ffn,
        **fields,
    )


def describe_size(args: argparse.Namespace) -> str:
    return f"size: L={args.layers} D={args.dim} heads {args.heads}/{args.kv_heads} ffn {args.ffn} vocab {args.vocab}"
