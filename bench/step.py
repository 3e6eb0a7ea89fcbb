"""Benchmark a Free Transformer training step against the baseline decoder at equal dims.

One step is what the trainer does (train/trainer.py): forward with targets (cross-entropy plus the
free-bits KL), backward, gradient clipping, the fused AdamW built by train/optim.build_optimizer,
zero_grad(set_to_none=True). The baseline is the same ModelConfig with latent_units=0.

Time: per config both models are warmed up, then timed in interleaved rounds (free, base, free,
base, ...) in this one process; we report each median and the median of the per-round ratios
free / base. That ratio is divided by the analytic FLOP ratio of ModelConfig.training_flops_per_token:
the implementation may add at most 10% on top of the compute the design needs (TARGET).

Memory: the peak resident memory of building the model and optimizer and running two steps, in a
fresh process (bench/common.py), so it holds params, grads, both Adam moments and the activations
of the step at its peak. Its ratio free / base is divided by the analytic ratio of
    4 * params * 4 bytes (params, grads, exp_avg, exp_avg_sq)  +  V * D * 4 (the read-out weight's
    gradient, formed in forward by the fused cross-entropy)  +  tokens * saved_floats_per_token * 4
(see saved_floats_per_token). A "saved MiB" column checks that activation count against what
autograd really saves in one forward (saved_tensors_hooks, unique storages).

The machine's limit: fp32 and bf16 matmul FLOP/s (2048^3 on a CPU, 8192^3 on a GPU). Each model's
achieved TFLOP/s (the analytic count above / median step time) and its MFU, that figure over the
matmul limit of the dtype the step runs its matmuls in (bf16 with --dtype bf16, else fp32).

Sizes (--size): `narrow` (default) is dim 256 at the paper's depths, L in {8, 28}, T=256, B=8;
`paper-1.5b` is free_transformer.model.config's named size (L=28, D=1536, 12/2 heads, vocab 2^17, tied),
H in {16, 8}, T=2048, B=4 by default: the GPU targets of docs/gpu.md, about 50 GiB at its eager peak in bf16
(bench/memory.py)
(a GPU with 80 GB; never on a CPU). At that size the two models of a pair share one decoder: the
baseline is made of the Free Transformer's own embedding, blocks and read-out (no copy) and both
steps use one optimizer (AdamW skips the latent path's parameters, which get no gradient in the
baseline's step); two separate models with their Adam state would not fit in 80 GB beside a step's
activations. Both still run exactly their own forward, backward, clipping and AdamW update.

    PYTHONPATH=src python bench/step.py [--quick] [--threads T] [--repeats R] [--device cpu|cuda]
                                        [--dtype fp32|bf16] [--compile] [--no-memory]
                                        [--size narrow|paper-1.5b] [--bits H ...] [--seq-len T] [--batch B]
                                        [--[no-]shared-decoder] [--vocab V]
    PYTHONPATH=src python bench/step.py --compare-loss [--vocab V] ...   # fused vs plain cross-entropy

--compare-loss: the Free Transformer's step with the cross-entropy fused with the read-out
(free_transformer.model.loss, what the trainer runs) against the plain one over the logits of every token
(the model's return_logits=True), one model: time interleaved, peak memory each in a fresh process.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import torch
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

from free_transformer.distributed.parallelize import apply_compile
from free_transformer.model.config import ModelConfig, named_config
from free_transformer.model.transformer import FreeTransformer
from free_transformer.train.config import OptimConfig
from free_transformer.train.optim import build_optimizer, clip_gradients
from free_transformer.train.validation import autocast_context

# Narrow width, the paper's depths: dim 256, 4 query / 2 key-value heads (head dim 64), SwiGLU 3 * dim.
DIMS = dict(vocab_size=256, dim=256, n_heads=4, n_kv_heads=2, ffn_hidden=768, max_seq_len=256)
SEQ_LEN, BATCH = 256, 8  # 2,048 tokens per step
FULL_GRID = [(h, n_layers) for n_layers in (8, 28) for h in (8, 16)]
QUICK_GRID = [(8, 8), (16, 8)]
PAPER = "paper-1.5b"
PAPER_SEQ_LEN, PAPER_BATCH = 2048, 4  # 8,192 tokens per step
PAPER_BITS = (16, 8)
# The demo's letters models: cpu-small at width 64 (`demo --preset paper`, and `--preset narrow`'s kappa = 1 bit
# model) or 32 (`--preset narrow`'s others, DEMO_NARROW), H = 8, 256 sequences of 65 predicted tokens per step, one
# thread per model (the demo trains two side by side on a 2-core CPU).
DEMO, DEMO_NARROW = "demo", "demo-narrow"
DEMO_WIDTHS = {DEMO: (64, 192), DEMO_NARROW: (32, 96)}  # dim, ffn_hidden
DEMO_SEQ_LEN, DEMO_BATCH, DEMO_BITS = 65, 256, 8
TARGET = 1.10  # (time ratio) / (FLOP ratio) and (memory ratio) / (analytic memory ratio) at most this
# On a GPU at paper-1.5b, bf16, B=4, T=2048, compiled (docs/gpu.md, bench/targets.py): the baseline's MFU, the Free
# H=16 step's peak, its time per FLOP
TARGET_MFU, TARGET_PEAK_GIB = TARGETS["train-base-mfu"].at_least, TARGETS["train-peak"].at_most
TARGET_GPU_T_PER_F = TARGETS["train-free-per-flop"].at_most
KAPPA_NATS = 0.5 * 0.6931471805599453  # the trainer's default kappa_bits = 0.5
GRAD_CLIP = OptimConfig().grad_clip


def model_config(n_bits: int, n_layers: int, size: str = "narrow", vocab: int | None = None) -> ModelConfig:
    if vocab:
        return model_config(n_bits, n_layers, size).replace(vocab_size=vocab)
    if size == PAPER:
        return named_config(PAPER, latent_units=n_bits)  # n_layers is the named size's (28)
    if size in DEMO_WIDTHS:
        dim, ffn_hidden = DEMO_WIDTHS[size]
        return named_config("cpu-small", latent_units=n_bits, dim=dim, ffn_hidden=ffn_hidden)  # n_layers: cpu-small's
    return ModelConfig(**DIMS, n_layers=n_layers, latent_units=n_bits)


def saved_floats_per_token(cfg: ModelConfig) -> int:
    """Floats autograd keeps per token for backward (fp32): what this implementation saves, op by op.

    An RMSNorm keeps its input, the normalised input (for its weight's gradient) and its output (the
    next matmul's input): 3D. Each block: two norms (6D), q, k, v after RoPE (D + 2 kv), the attention
    output (D, read by o_proj as a view), gate, up, silu(gate) and their product (4F). The read-out:
    the final norm (3D) and, the cross-entropy being fused with it (free_transformer.model.loss), the
    gradient with respect to its input (D) (and once per step, not per token, the read-out weight's
    gradient: analytic_memory_bytes; the plain path kept the log-softmax, V per token). The Free path adds the
    encoder block (the same count:
    its input is the next block's, already counted, but its attention output is copied for o_proj
    because the broadcast query gives SDPA another layout), the encoder norm (3D), x + R with its
    norm for the injection block's keys and values (3D), and a few (B, T, H) bit-logit tensors (8H).
    Per-row scalars (norm rstd, attention log-sum-exp) and targets are left out.
    """
    kv = cfg.n_kv_heads * cfg.head_dim
    block = 8 * cfg.dim + 2 * kv + 4 * cfg.ffn_hidden
    floats = cfg.n_layers * block + 3 * cfg.dim + cfg.dim
    if cfg.is_free:
        floats += block + 3 * cfg.dim + 3 * cfg.dim + 8 * cfg.latent_units
    return floats


def analytic_memory_bytes(cfg: ModelConfig, tokens: int) -> int:
    # + the read-out weight's gradient, formed in forward by the fused cross-entropy and kept for backward
    return 4 * (4 * cfg.num_params() + cfg.vocab_size * cfg.dim + tokens * saved_floats_per_token(cfg))


def make_batch(cfg: ModelConfig, batch: int, seq_len: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen).to(device)


def build(cfg: ModelConfig, device, compile_model: bool = False):
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (a 1.5B model initialised on the host takes minutes)
        model = FreeTransformer(cfg)
    model.train()
    optimizer = build_optimizer(model, OptimConfig())
    if compile_model:
        apply_compile(model)  # as the trainer's compile=true: each block, in place
    return model, optimizer


def decoder_of(free: FreeTransformer) -> FreeTransformer:
    """The baseline decoder made of `free`'s own embedding, blocks, final norm and read-out (shared, not
    copied): the Free Transformer minus its latent path, as test_free_model_with_zero_post_sampler_equals_baseline
    states. Built on the meta device, so it allocates nothing."""
    with torch.device("meta"):
        base = FreeTransformer(free.config.replace(latent_units=0))
    for name in ("embed_tokens", "layers", "norm", "lm_head"):
        setattr(base, name, getattr(free, name))
    base.rope_cos, base.rope_sin = free.rope_cos, free.rope_sin
    return base.train(free.training)


def train_step(model, optimizer, tokens, precision: str, return_logits: bool = False) -> None:
    """The trainer's step for one batch (no gradient accumulation, one process). return_logits: the
    plain cross-entropy over the logits of every token, instead of the one fused with the read-out."""
    with autocast_context(precision, tokens.device):
        out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=KAPPA_NATS, return_logits=return_logits)
    out.loss.backward()
    clip_gradients(optimizer, model.parameters(), GRAD_CLIP)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def saved_bytes(model, tokens, precision: str) -> int:
    """Bytes of the unique storages autograd saves in one forward (what backward will read)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        # A detached alias of t: returning t itself makes a saved output hold its own grad_fn, a cycle
        # through autograd's C++ graph that Python's collector never frees (the forward would stay alive).
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_context(precision, tokens.device):
        out = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=KAPPA_NATS)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    del out
    return sum(n for ptr, n in storages.items() if ptr not in params)


# ---- peak memory in a fresh process (module-level functions: they are pickled) -------------------


def memory_setup(n_bits, n_layers, batch, seq_len, device_name, size="narrow", vocab=None):
    cfg = model_config(n_bits, n_layers, size, vocab)
    if size == PAPER and n_layers != cfg.n_layers:  # the warm-up's small model of the same width
        cfg = cfg.replace(n_layers=n_layers, max_seq_len=max(seq_len, 16))
    return cfg, make_batch(cfg, batch, seq_len, torch.device(device_name))


def memory_step(precision, compile_model, cfg, tokens, return_logits=False):
    """Build the model and optimizer and run two steps (the first creates the Adam moments)."""
    model, optimizer = build(cfg, tokens.device, compile_model)
    for _ in range(2):
        train_step(model, optimizer, tokens, precision, return_logits)


def peak_memory(n_bits, n_layers, args, return_logits=False) -> int:
    return peak_memory_in_fresh_process(
        memory_setup,
        functools.partial(memory_step, args.precision, args.compile, return_logits=return_logits),
        (n_bits, n_layers, args.batch, args.seq_len, args.device, args.size, args.vocab),
        device_name=args.device,
        threads=args.threads,
        warmup_args=(n_bits and 4, 2, 1, 8, args.device, args.size),
    )


# ---- main ------------------------------------------------------------------------------------------


def compare_compile(n_bits, n_layers, device, rounds, args, limits, tokens_per_step) -> None:
    """The Free Transformer's step eager against compiled (the trainer's compile=true), timed in interleaved
    rounds in this process; the compiled model's first two steps, less the eager model's, are its compile
    time (cold or warm: Inductor's cache under TORCHINDUCTOR_CACHE_DIR decides)."""
    cfg = model_config(n_bits, n_layers, args.size, args.vocab)
    tokens = make_batch(cfg, args.batch, args.seq_len, device)
    steps, first = {}, {}
    for name, compiled in (("eager", False), ("compiled", True)):
        model, optimizer = build(cfg, device, compiled)
        steps[name] = functools.partial(train_step, model, optimizer, tokens, args.precision)
        began = time.perf_counter()
        steps[name]()
        steps[name]()
        first[name] = time.perf_counter() - began
    times = interleaved_times(steps, rounds, device)
    flops = cfg.training_flops_per_token(args.seq_len) * tokens_per_step
    print(
        f"\n{'H':>2} {'L':>2} | {'eager ms':>8} {'compiled ms':>11} {'speed-up':>8} | {'eager MFU':>9} "
        f"{'compiled MFU':>12} | {'compile s':>9}"
    )
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    util = {name: mfu(flops / ms[name] * 1e3, limits, args.precision) for name in ms}
    speed_up = median_ratio(times["eager"], times["compiled"])
    print(
        f"{n_bits:>2} {n_layers:>2} | {ms['eager']:>8.1f} {ms['compiled']:>11.1f} {speed_up:>8.3f} | "
        f"{util['eager']:>9.1%} {util['compiled']:>12.1%} | {first['compiled'] - first['eager']:>9.1f}"
    )
    print(
        "speed-up = median of the per-round ratios eager / compiled; MFU = the analytic FLOPs / median step time "
        f"/ the {args.precision} matmul limit ({limits[args.precision]:.0f} GFLOP/s)"
    )


def compare_loss(n_bits, n_layers, device, rounds, args) -> None:
    """The Free Transformer's step with the cross-entropy fused with the read-out (free_transformer.model.loss,
    what the trainer runs) against the plain one (the logits of every token, then F.cross_entropy: the
    model's return_logits=True): peak memory in fresh processes, and time in interleaved rounds."""
    cfg = model_config(n_bits, n_layers, args.size, args.vocab)
    tokens = make_batch(cfg, args.batch, args.seq_len, device)
    model, optimizer = build(cfg, device, args.compile)
    variants = {"fused": False, "plain": True}
    steps = {
        name: functools.partial(train_step, model, optimizer, tokens, args.precision, plain)
        for name, plain in variants.items()
    }
    for fn in steps.values():  # optimizer state, compilation, first-call allocations
        fn()
    times = interleaved_times(steps, rounds, device)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    peak = {
        name: peak_memory(n_bits, n_layers, args, plain) if args.memory else float("nan")
        for name, plain in variants.items()
    }
    logits_mib = args.batch * args.seq_len * cfg.vocab_size * 4 / MIB
    print(
        f"\n{'H':>2} {'L':>2} {'V':>6} | {'fused ms':>8} {'plain ms':>8} {'time x':>6} | {'fused MiB':>9} "
        f"{'plain MiB':>9} {'saved MiB':>9} | {'fp32 logits MiB':>15}"
    )
    print(
        f"{n_bits:>2} {n_layers:>2} {cfg.vocab_size:>6} | {ms['fused']:>8.1f} {ms['plain']:>8.1f} "
        f"{median_ratio(times['fused'], times['plain']):>6.3f} | "
        f"{peak['fused'] / MIB:>9.1f} {peak['plain'] / MIB:>9.1f} "
        f"{(peak['plain'] - peak['fused']) / MIB:>9.1f} | {logits_mib:>15.1f}"
    )
    print(
        "time x = median of the per-round ratios fused / plain; MiB: the peak a fresh process adds for the "
        "model, optimizer and two steps; fp32 logits: B x T x V x 4 bytes, one copy of what the plain path holds"
    )


def time_config(n_bits, n_layers, device, rounds, precision, compile_model, args):
    free_cfg = model_config(n_bits, n_layers, args.size, args.vocab)
    configs = {"free": free_cfg, "base": free_cfg.replace(latent_units=0)}
    tokens = make_batch(free_cfg, args.batch, args.seq_len, device)
    if args.shared_decoder:
        free, optimizer = build(free_cfg, device, compile_model)  # compiles the shared blocks once
        states = {"free": (free, optimizer), "base": (decoder_of(free), optimizer)}
    else:
        states = {name: build(cfg, device, compile_model) for name, cfg in configs.items()}
    saved = {name: saved_bytes(states[name][0], tokens, precision) for name in configs}
    steps = {name: functools.partial(train_step, *states[name], tokens, precision) for name in configs}
    for fn in steps.values():  # optimizer state, compilation, first-call allocations
        fn()
    peaks = {name: peak_memory_here(fn, device) for name, fn in steps.items()} if args.memory == "here" else None
    times = interleaved_times(steps, rounds, device)
    return configs, times, saved, peaks


def peak_memory_here(step, device) -> int:
    """Peak bytes allocated during one call of `step` in this process (CUDA only): everything the process holds
    at that peak, so the model, its optimizer state, gradients and the step's activations, as a fresh process
    that builds the model and runs two steps measures it, without compiling the model a second time."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="L=8 only (H in {8, 16}), 3 rounds")
    parser.add_argument("--repeats", type=int, help="timing rounds per config (default 5, 3 with --quick)")
    add_machine_arguments(parser)
    add_smoke_argument(parser)
    parser.add_argument(
        "--dtype",
        dest="precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: autocast, as the trainer's precision=bf16 (weights and Adam stay fp32)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile every block of both models, as the trainer's compile=true"
    )
    parser.add_argument(
        "--compare-compile",
        action="store_true",
        help="instead of Free against baseline: the Free Transformer eager against compiled, "
        "interleaved, with the compile time",
    )
    parser.add_argument(
        "--compare-loss",
        action="store_true",
        help="instead of Free against baseline: the Free Transformer's step with the cross-entropy "
        "fused with the read-out against the plain one (all logits), peak memory and time "
        "(vocabulary 32,768 unless --vocab)",
    )
    parser.add_argument("--vocab", type=int, help="the vocabulary size (default the size's own)")
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the fresh-process peak memory")
    parser.add_argument(
        "--memory-here",
        dest="memory",
        action="store_const",
        const="here",
        help="on CUDA: peak memory of one step in this process (torch.cuda.max_memory_allocated, "
        "all the process holds) instead of fresh processes, which compile again under --compile",
    )
    parser.add_argument(
        "--figures", metavar="PATH", help="append the GPU targets' figures (bench/targets.py) to PATH as JSON lines"
    )
    parser.add_argument(
        "--size",
        choices=("narrow", DEMO, DEMO_NARROW, PAPER),
        default="narrow",
        help=f"narrow: dim 256 at L in {{8, 28}}; {DEMO}: the demo's letters model (width 64, "
        f"L=4, H={DEMO_BITS}, T={DEMO_SEQ_LEN}, B={DEMO_BATCH}); {DEMO_NARROW}: the same at "
        f"width 32; {PAPER}: the named size, B=4, T=2048 (a GPU only)",
    )
    parser.add_argument(
        "--bits",
        type=int,
        nargs="+",
        help=f"latent bits H to compare (default: the grid's; {PAPER}: {' '.join(map(str, PAPER_BITS))})",
    )
    parser.add_argument("--seq-len", type=int, help=f"T (default {SEQ_LEN}; {PAPER}: {PAPER_SEQ_LEN})")
    parser.add_argument("--batch", type=int, help=f"B (default {BATCH}; {PAPER}: {PAPER_BATCH})")
    parser.add_argument(
        "--shared-decoder",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"the baseline made of the Free Transformer's decoder, one optimizer (default: on at "
        f"{PAPER}, off otherwise; --no-shared-decoder at {PAPER} needs more than 80 GB)",
    )
    args = parser.parse_args()
    if args.memory == "here" and not args.device.startswith("cuda"):
        parser.error("--memory-here needs --device cuda (the CPU allocator keeps no peak statistics)")
    paper, demo = args.size == PAPER, args.size in DEMO_WIDTHS
    args.seq_len = args.seq_len or (PAPER_SEQ_LEN if paper else DEMO_SEQ_LEN if demo else SEQ_LEN)
    args.batch = args.batch or (PAPER_BATCH if paper else DEMO_BATCH if demo else BATCH)
    args.shared_decoder = paper if args.shared_decoder is None else args.shared_decoder
    if paper or demo:
        named = named_config(PAPER if paper else "cpu-small")
        grid = [(h, named.n_layers) for h in (args.bits or (PAPER_BITS if paper else (DEMO_BITS,)))]
    else:
        grid = QUICK_GRID if args.quick else FULL_GRID
        if args.bits:
            grid = [(h, n_layers) for n_layers in sorted({n for _, n in grid}) for h in args.bits]
    rounds = args.repeats or (3 if args.quick else 5)
    if args.smoke:  # the narrow width at L=2, H=4
        grid, rounds, args.seq_len, args.batch = [(4, 2)], 1, 16, 2
    device = setup_machine(args)
    tokens_per_step = args.seq_len * args.batch

    args.vocab = args.vocab or (32768 if args.compare_loss else None)
    began = time.perf_counter()
    print(
        f"{describe_machine(device)}, rounds: {rounds}, precision {args.precision}"
        f"{', compiled' if args.compile else ''}"
    )
    if paper or demo:
        print(
            f"size {args.size}: {model_config(grid[0][0], grid[0][1], args.size)}, T={args.seq_len}, "
            f"batch {args.batch} ({tokens_per_step} tokens per step)"
        )
    else:
        print(
            f"dims {DIMS}{f' but vocabulary {args.vocab}' if args.vocab else ''}, T={args.seq_len}, "
            f"batch {args.batch} ({tokens_per_step} tokens per step)"
        )
    if args.shared_decoder:
        print("the baseline shares the Free Transformer's decoder weights and optimizer (see the docstring)")
    limits = matmul_limits_gflops(device, precisions=(args.precision,), smoke=args.smoke)
    print(describe_limits(limits))
    if args.compare_loss:
        for n_bits, n_layers in grid:
            compare_loss(n_bits, n_layers, device, rounds, args)
        print(f"load average at the end {os.getloadavg()[0]:.1f}; {time.perf_counter() - began:.0f} s")
        return
    if args.compare_compile:
        for n_bits, n_layers in grid:
            compare_compile(n_bits, n_layers, device, rounds, args, limits, tokens_per_step)
        print(f"load average at the end {os.getloadavg()[0]:.1f}; {time.perf_counter() - began:.0f} s")
        return
    rows = []
    for n_bits, n_layers in tqdm(grid, desc="configs"):
        configs, times, saved, peaks = time_config(n_bits, n_layers, device, rounds, args.precision, args.compile, args)
        flops = {name: cfg.training_flops_per_token(args.seq_len) * tokens_per_step for name, cfg in configs.items()}
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        time_ratio = median_ratio(times["free"], times["base"])
        flop_ratio = flops["free"] / flops["base"]
        gflops = {name: flops[name] / ms[name] / 1e6 for name in configs}
        analytic = {name: analytic_memory_bytes(cfg, tokens_per_step) for name, cfg in configs.items()}
        if peaks is not None or args.memory:
            mem = peaks or {name: peak_memory(cfg.latent_units, n_layers, args) for name, cfg in configs.items()}
            mem_ratio = mem["free"] / mem["base"]
            mem_excess = mem_ratio / (analytic["free"] / analytic["base"])
        else:
            mem = {name: float("nan") for name in configs}
            mem_ratio = mem_excess = float("nan")
        rows.append(
            dict(
                n_bits=n_bits,
                n_layers=n_layers,
                ms=ms,
                time_ratio=time_ratio,
                flop_ratio=flop_ratio,
                excess=time_ratio / flop_ratio,
                gflops=gflops,
                mem=mem,
                mem_ratio=mem_ratio,
                analytic=analytic,
                mem_excess=mem_excess,
                saved=saved,
            )
        )

    print(
        f"\n{'H':>2} {'L':>2} | {'free ms':>8} {'base ms':>8} {'time x':>6} {'FLOP x':>6} {'t/F':>5}       | "
        f"{'free TF/s':>9} {'base TF/s':>9} {'free MFU':>8} {'base MFU':>8} | {'free tok/s':>10} {'base tok/s':>10}"
    )
    for r in rows:
        verdict = "PASS" if r["excess"] <= TARGET else "FAIL"
        util = {name: mfu(r["gflops"][name] * 1e9, limits, args.precision) for name in ("free", "base")}
        print(
            f"{r['n_bits']:>2} {r['n_layers']:>2} | {r['ms']['free']:>8.1f} {r['ms']['base']:>8.1f} "
            f"{r['time_ratio']:>6.3f} {r['flop_ratio']:>6.3f} {r['excess']:>5.3f} {verdict} | "
            f"{r['gflops']['free'] / 1e3:>9.2f} {r['gflops']['base'] / 1e3:>9.2f} {util['free']:>8.1%} "
            f"{util['base']:>8.1%} | {tokens_per_step / r['ms']['free'] * 1e3:>10.0f} "
            f"{tokens_per_step / r['ms']['base'] * 1e3:>10.0f}"
        )
    print(
        f"\n{'H':>2} {'L':>2} | {'free MiB':>8} {'base MiB':>8} {'mem x':>6} {'model x':>7} {'m/M':>5}       | "
        f"{'saved MiB free':>14} {'(model)':>8} {'base':>6} {'(model)':>8}"
    )
    for r in rows:
        verdict = "PASS" if r["mem_excess"] <= TARGET else ("FAIL" if r["mem_excess"] > TARGET else "")
        model_ratio = r["analytic"]["free"] / r["analytic"]["base"]
        model_saved = {
            name: 4
            * tokens_per_step
            * saved_floats_per_token(
                model_config(r["n_bits"] if name == "free" else 0, r["n_layers"], args.size, args.vocab)
            )
            / MIB
            for name in ("free", "base")
        }
        print(
            f"{r['n_bits']:>2} {r['n_layers']:>2} | {r['mem']['free'] / MIB:>8.1f} {r['mem']['base'] / MIB:>8.1f} "
            f"{r['mem_ratio']:>6.3f} {model_ratio:>7.3f} {r['mem_excess']:>5.3f} {verdict:<4} | "
            f"{r['saved']['free'] / MIB:>14.1f} {model_saved['free']:>8.1f} {r['saved']['base'] / MIB:>6.1f} "
            f"{model_saved['base']:>8.1f}"
        )
    print_gpu_targets(rows, args, device, limits)
    print(
        f"\nt/F = time ratio / FLOP ratio, m/M = memory ratio / analytic memory ratio; target <= {TARGET} "
        f"(on a GPU at {PAPER} bf16 H=16: t/F <= 1.05, baseline MFU compiled >= {TARGET_MFU:.0%}, peak compiled <= "
        f"{TARGET_PEAK_GIB} GiB). "
        f"TF/s = training_flops_per_token(T) * B * T / median step time; MFU = TF/s / the {args.precision} matmul "
        f"limit ({limits[args.precision]:.0f} GFLOP/s)"
    )
    if args.precision == "bf16":
        print(
            "bf16: the analytic memory counts every activation in fp32 (autocast keeps matmul outputs in "
            "bf16, norms and the residual stream in fp32), so its columns only bound the measured ones"
        )
    print(f"load average at the end {os.getloadavg()[0]:.1f}; {time.perf_counter() - began:.0f} s")


def print_gpu_targets(rows, args, device, limits) -> None:
    """docs/gpu.md's training targets where this run is their configuration (paper-1.5b, bf16, B=4, T=2048 on a
    GPU), with PASS or FAIL when compiled (--compile): they are targets for the compiled step. --figures: each
    figure also goes to that file (bench/targets.py), the eager run's time per FLOP under its own id."""
    if (args.size, args.precision, args.batch, args.seq_len, device.type) != (
        PAPER,
        "bf16",
        PAPER_BATCH,
        PAPER_SEQ_LEN,
        "cuda",
    ):
        return
    row = next((r for r in rows if r["n_bits"] == 16), rows[0])

    def verdict(passed: bool) -> str:
        return (" PASS" if passed else " FAIL") if args.compile else ""

    base_mfu = mfu(row["gflops"]["base"] * 1e9, limits, args.precision)
    peak_gib = row["mem"]["free"] / 2**30
    measured = args.memory is not False
    peak = f"{peak_gib:.1f} GiB{verdict(peak_gib <= TARGET_PEAK_GIB)}" if measured else "not measured (--no-memory)"
    print(
        f"\ntargets ({'compiled' if args.compile else 'eager: they are read with --compile'}): baseline MFU >= "
        f"{TARGET_MFU:.0%}: {base_mfu:.1%}{verdict(base_mfu >= TARGET_MFU)}; H={row['n_bits']} peak <= "
        f"{TARGET_PEAK_GIB} GiB: {peak}; t/F <= {TARGET_GPU_T_PER_F}: {row['excess']:.3f}"
        f"{verdict(row['excess'] <= TARGET_GPU_T_PER_F)}"
    )
    note = f"H={row['n_bits']}, B={args.batch}, T={args.seq_len}"
    if not args.compile:
        write_figure(args.figures, "train-free-per-flop-eager", row["excess"], note)
        return
    write_figure(args.figures, "train-base-mfu", base_mfu, note)
    write_figure(args.figures, "train-free-per-flop", row["excess"], note)
    if measured:
        where = "in the step's process" if args.memory == "here" else "in a fresh process"
        write_figure(args.figures, "train-peak", peak_gib, f"{note}, {where}")


if __name__ == "__main__":
    main()
