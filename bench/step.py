"""Benchmark a Free Transformer training step against the baseline decoder at equal dims.

One step is what the trainer does (train/trainer.py): forward with targets (cross-entropy plus the
free-bits KL), backward, gradient clipping, the fused AdamW built by train/optim.build_optimizer,
zero_grad(set_to_none=True). The baseline is the same ModelConfig with latent_bits=0.

Time: per config both models are warmed up, then timed in interleaved rounds (free, base, free,
base, ...) in this one process; we report each median and the median of the per-round ratios
free / base. That ratio is divided by the analytic FLOP ratio of ModelConfig.training_flops_per_token:
the implementation may add at most 10% on top of the compute the design needs (TARGET).

Memory: the peak resident memory of building the model and optimizer and running two steps, in a
fresh process (bench/common.py), so it holds params, grads, both Adam moments and the activations
of the step at its peak. Its ratio free / base is divided by the analytic ratio of
    4 * params * 4 bytes (params, grads, exp_avg, exp_avg_sq)  +  tokens * saved_floats_per_token * 4
(see saved_floats_per_token). A "saved MiB" column checks that activation count against what
autograd really saves in one forward (saved_tensors_hooks, unique storages).

The machine's limit: fp32 and bf16 (2048 x 2048) matmul FLOP/s, printed beside the FLOP/s each model
achieves.

    PYTHONPATH=src python bench/step.py [--quick] [--threads T] [--repeats R] [--device cpu|cuda]
                                        [--dtype fp32|bf16] [--compile] [--no-memory]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
from tqdm import tqdm

from common import (MIB, add_machine_arguments, describe_limits, describe_machine, interleaved_times,
                    matmul_limits_gflops, median_ratio, peak_memory_in_fresh_process, setup_machine)
from free_transformer.config import ModelConfig
from free_transformer.distributed.parallelize import apply_compile, clip_grad_norm
from free_transformer.model import FreeTransformer
from free_transformer.train.config import OptimConfig
from free_transformer.train.optim import build_optimizer
from free_transformer.train.trainer import autocast_context

# Narrow width, the paper's depths: dim 256, 4 query / 2 key-value heads (head dim 64), SwiGLU 3 * dim.
DIMS = dict(vocab_size=256, dim=256, n_heads=4, n_kv_heads=2, ffn_hidden=768, max_seq_len=256)
SEQ_LEN, BATCH = 256, 8  # 2,048 tokens per step
FULL_GRID = [(h, n_layers) for n_layers in (8, 28) for h in (8, 16)]
QUICK_GRID = [(8, 8), (16, 8)]
TARGET = 1.10  # (time ratio) / (FLOP ratio) and (memory ratio) / (analytic memory ratio) at most this
KAPPA_NATS = 0.5 * 0.6931471805599453  # the trainer's default kappa_bits = 0.5
GRAD_CLIP = OptimConfig().grad_clip


def model_config(n_bits: int, n_layers: int) -> ModelConfig:
    return ModelConfig(**DIMS, n_layers=n_layers, latent_bits=n_bits)


def saved_floats_per_token(cfg: ModelConfig) -> int:
    """Floats autograd keeps per token for backward (fp32): what this implementation saves, op by op.

    An RMSNorm keeps its input, the normalised input (for its weight's gradient) and its output (the
    next matmul's input): 3D. Each block: two norms (6D), q, k, v after RoPE (D + 2 kv), the attention
    output (D, read by o_proj as a view), gate, up, silu(gate) and their product (4F). The read-out:
    the final norm (3D) and the log-softmax (V). The Free path adds the encoder block (the same count:
    its input is the next block's, already counted, but its attention output is copied for o_proj
    because the broadcast query gives SDPA another layout), the encoder norm (3D), x + R with its
    norm for the injection block's keys and values (3D), and a few (B, T, H) bit-logit tensors (8H).
    Per-row scalars (norm rstd, attention log-sum-exp) and targets are left out.
    """
    kv = cfg.n_kv_heads * cfg.head_dim
    block = 8 * cfg.dim + 2 * kv + 4 * cfg.ffn_hidden
    floats = cfg.n_layers * block + 3 * cfg.dim + cfg.vocab_size
    if cfg.is_free:
        floats += block + 3 * cfg.dim + 3 * cfg.dim + 8 * cfg.latent_bits
    return floats


def analytic_memory_bytes(cfg: ModelConfig, tokens: int) -> int:
    return 4 * (4 * cfg.num_params() + tokens * saved_floats_per_token(cfg))


def make_batch(cfg: ModelConfig, batch: int, seq_len: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen).to(device)


def build(cfg: ModelConfig, device, compile_model: bool = False):
    torch.manual_seed(0)
    model = FreeTransformer(cfg).to(device)
    model.train()
    optimizer = build_optimizer(model, OptimConfig())
    if compile_model:
        apply_compile(model)  # as the trainer's compile=true: each block, in place
    return model, optimizer


def train_step(model, optimizer, tokens, precision: str) -> None:
    """The trainer's step for one batch (no gradient accumulation, one process)."""
    with autocast_context(precision, tokens.device):
        out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=KAPPA_NATS)
    out.loss.backward()
    clip_grad_norm(model.parameters(), GRAD_CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def saved_bytes(model, tokens, precision: str) -> int:
    """Bytes of the unique storages autograd saves in one forward (what backward will read)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast_context(precision, tokens.device):
            out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=KAPPA_NATS)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    del out
    return sum(n for ptr, n in storages.items() if ptr not in params)


# ---- peak memory in a fresh process (module-level functions: they are pickled) -------------------


def memory_setup(n_bits, n_layers, batch, seq_len, device_name):
    cfg = model_config(n_bits, n_layers)
    return cfg, make_batch(cfg, batch, seq_len, torch.device(device_name))


def memory_step(precision, cfg, tokens):
    """Build the model and optimizer and run two steps (the first creates the Adam moments)."""
    model, optimizer = build(cfg, tokens.device)
    for _ in range(2):
        train_step(model, optimizer, tokens, precision)


def peak_memory(n_bits, n_layers, args) -> int:
    return peak_memory_in_fresh_process(
        memory_setup, functools.partial(memory_step, args.precision), (n_bits, n_layers, BATCH, SEQ_LEN, args.device),
        device_name=args.device, threads=args.threads, warmup_args=(n_bits and 4, 2, 1, 8, args.device),
    )


# ---- main ------------------------------------------------------------------------------------------


def time_config(n_bits, n_layers, device, rounds, precision, compile_model):
    free_cfg = model_config(n_bits, n_layers)
    configs = {"free": free_cfg, "base": free_cfg.replace(latent_bits=0)}
    tokens = make_batch(free_cfg, BATCH, SEQ_LEN, device)
    states = {name: build(cfg, device, compile_model) for name, cfg in configs.items()}
    saved = {name: saved_bytes(states[name][0], tokens, precision) for name in configs}
    steps = {name: functools.partial(train_step, *states[name], tokens, precision) for name in configs}
    for fn in steps.values():  # optimizer state, compilation, first-call allocations
        fn()
    times = interleaved_times(steps, rounds, device)
    return configs, times, saved


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="L=8 only (H in {8, 16}), 3 rounds")
    parser.add_argument("--repeats", type=int, help="timing rounds per config (default 5, 3 with --quick)")
    add_machine_arguments(parser)
    parser.add_argument("--dtype", dest="precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: autocast, as the trainer's precision=bf16 (weights and Adam stay fp32)")
    parser.add_argument("--compile", action="store_true", help="torch.compile every block of both models, as the trainer's compile=true")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the fresh-process peak memory")
    args = parser.parse_args()
    grid = QUICK_GRID if args.quick else FULL_GRID
    rounds = args.repeats or (3 if args.quick else 5)
    device = setup_machine(args)

    began = time.perf_counter()
    print(f"{describe_machine(device)}, rounds: {rounds}, precision {args.precision}"
          f"{', compiled' if args.compile else ''}")
    print(f"dims {DIMS}, T={SEQ_LEN}, batch {BATCH} ({SEQ_LEN * BATCH} tokens per step)")
    limits = matmul_limits_gflops(device)
    print(describe_limits(limits))
    rows = []
    for n_bits, n_layers in tqdm(grid, desc="configs"):
        configs, times, saved = time_config(n_bits, n_layers, device, rounds, args.precision, args.compile)
        flops = {name: cfg.training_flops_per_token(SEQ_LEN) * SEQ_LEN * BATCH for name, cfg in configs.items()}
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        time_ratio = median_ratio(times["free"], times["base"])
        flop_ratio = flops["free"] / flops["base"]
        gflops = {name: flops[name] / ms[name] / 1e6 for name in configs}
        analytic = {name: analytic_memory_bytes(cfg, SEQ_LEN * BATCH) for name, cfg in configs.items()}
        if args.memory:
            mem = {name: peak_memory(cfg.latent_bits, n_layers, args) for name, cfg in configs.items()}
            mem_ratio = mem["free"] / mem["base"]
            mem_excess = mem_ratio / (analytic["free"] / analytic["base"])
        else:
            mem = {name: float("nan") for name in configs}
            mem_ratio = mem_excess = float("nan")
        rows.append(dict(n_bits=n_bits, n_layers=n_layers, ms=ms, time_ratio=time_ratio, flop_ratio=flop_ratio,
                         excess=time_ratio / flop_ratio, gflops=gflops, mem=mem, mem_ratio=mem_ratio,
                         analytic=analytic, mem_excess=mem_excess, saved=saved))

    print(f"\n{'H':>2} {'L':>2} | {'free ms':>8} {'base ms':>8} {'time x':>6} {'FLOP x':>6} {'t/F':>5}       | "
          f"{'free GF/s':>9} {'base GF/s':>9}")
    for r in rows:
        verdict = "PASS" if r["excess"] <= TARGET else "FAIL"
        print(f"{r['n_bits']:>2} {r['n_layers']:>2} | {r['ms']['free']:>8.1f} {r['ms']['base']:>8.1f} "
              f"{r['time_ratio']:>6.3f} {r['flop_ratio']:>6.3f} {r['excess']:>5.3f} {verdict} | "
              f"{r['gflops']['free']:>9.1f} {r['gflops']['base']:>9.1f}")
    print(f"\n{'H':>2} {'L':>2} | {'free MiB':>8} {'base MiB':>8} {'mem x':>6} {'model x':>7} {'m/M':>5}       | "
          f"{'saved MiB free':>14} {'(model)':>8} {'base':>6} {'(model)':>8}")
    for r in rows:
        verdict = "PASS" if r["mem_excess"] <= TARGET else ("FAIL" if r["mem_excess"] > TARGET else "")
        model_ratio = r["analytic"]["free"] / r["analytic"]["base"]
        tokens = SEQ_LEN * BATCH
        model_saved = {name: 4 * tokens * saved_floats_per_token(model_config(r["n_bits"] if name == "free" else 0,
                                                                               r["n_layers"])) / MIB
                       for name in ("free", "base")}
        print(f"{r['n_bits']:>2} {r['n_layers']:>2} | {r['mem']['free'] / MIB:>8.1f} {r['mem']['base'] / MIB:>8.1f} "
              f"{r['mem_ratio']:>6.3f} {model_ratio:>7.3f} {r['mem_excess']:>5.3f} {verdict:<4} | "
              f"{r['saved']['free'] / MIB:>14.1f} {model_saved['free']:>8.1f} {r['saved']['base'] / MIB:>6.1f} "
              f"{model_saved['base']:>8.1f}")
    print(f"\nt/F = time ratio / FLOP ratio, m/M = memory ratio / analytic memory ratio; target <= {TARGET}. "
          f"machine limit fp32 {limits['fp32']:.0f}, bf16 {limits['bf16']:.0f} GFLOP/s")
    if args.precision == "bf16":
        print("bf16: the analytic memory counts every activation in fp32 (autocast keeps matmul outputs in "
              "bf16, norms and the residual stream in fp32), so its columns only bound the measured ones")
    print(f"load average at the end {os.getloadavg()[0]:.1f}; {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
