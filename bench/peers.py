"""Our Free Transformer against x-transformers' (PyPI x-transformers==2.31.10, x_transformers.free_transformer):
time and peak memory of one training step at the same size.

A training step is forward + backward + one AdamW step (torch.optim.AdamW, fused where the device
supports it, the same settings for both), on a batch of B sequences of T tokens, loss = next-token
cross-entropy + the free-bits KL term with a threshold of 1 bit (x-transformers' default; ours is
given kappa = log 2). Both models run in float32, or with --dtype bf16 under bf16 autocast (weights
and AdamW state stay float32, as our trainer's precision=bf16), the same context for both.

Built to match (x-transformers keywords in brackets):
  depth        L blocks, L/2 before Z and L/2 after  [dec_head_depth = L/2, dec_tail_depth = L/2]
  width        D                                     [dim]
  heads        query heads, KV heads (GQA)           [heads, attn_dim_head = D / heads, attn_kv_heads]
  feed-forward SwiGLU of hidden size F, no bias      [ff_glu, ff_swish, ff_mult = F / D, ff_no_bias]
  positions    RoPE on the whole head, base 10000    [rotary_pos_emb, rotary_emb_dim = D / heads]
  attention    scaled_dot_product_attention          [attn_flash = True]
  norm         pre-norm RMSNorm, final norm          [use_rmsnorm]
  encoder      one non-causal block, queries a learned constant, keys/values the first half's output
               [enc_depth = 1, only_cross: a cross-attention + feed-forward block], then a final norm
               and a linear read-out to H bit-logits
  latent       H bits, one Z_t per token, R = post-sampler(Z) added to the keys/values input of block
               L/2 + 1 only                          [latent_bits, self_attn_kv_residuals]
Parameter counts then agree to 0.2% (x-transformers has a bias on the GLU input projection).

What differs and cannot be matched by its options:
  * The Binary Mapper. x-transformers materialises the one-hot Y and G as (B*T, 2^H) float tensors
    and applies the post-sampler as a dense nn.Linear(2^H, D) to Y + G - detach(G): forward, weight
    gradient and input gradient are three B*T x 2^H x D matmuls over a mostly-zero input. Ours
    looks the row up in the forward, scatter-adds the weight gradient and needs only the one matmul
    dR @ W^T for the bit-logit gradient, chunked, without an N x 2^H tensor (free_transformer.model.latent).
    Both compute the same gradients; this is what the comparison measures at large H.
  * Where R enters: x-transformers adds R after the block's input RMSNorm (k/v input = norm(x) + R);
    ours normalises x + R (the paper's block applied to in_kv = x + r). Same cost.
  * The encoder block normalises only its queries in x-transformers, both inputs in ours; it passes
    an all-true padding mask (pad_id) to the encoder's attention; its bit read-out has no bias.
  * Its forward takes B x (T + 1) tokens and shifts them itself; ours takes inputs and targets.
  * Initialisations differ (irrelevant to the cost of a step).

    PYTHONPATH=src python bench/peers.py [--bits 8 16] [--rounds R] [--threads T] [--device cpu|cuda]
                                         [--dtype fp32|bf16]
                                         [--dim D --layers L --heads h --kv-heads k --ffn F --vocab V
                                          --seq-len T --batch B]

On a GPU, the size of docs/gpu.md's targets: --layers 16 --dim 1024 --heads 16 --kv-heads 4 --ffn 2816
--vocab 32000 --seq-len 1024 --batch 8 (scripts/gpu-check.sh runs it in fp32 and bf16).

Time: both models are built in this process, run once (warm-up), then timed in interleaved rounds
(ours, x-transformers, ours, ...); we report each median and the median of the per-round ratios.
Memory: the extra peak memory of one step, each implementation in a fresh process, after one earlier
step so that AdamW's state already exists (see bench/common.py, peak_memory_in_fresh_process).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics

import torch
from common import (
    MIB,
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
    peak_memory_in_fresh_process,
    setup_machine,
)
from targets import TARGETS as GPU_TARGETS
from targets import write_figure

from free_transformer.model.config import ModelConfig
from free_transformer.model.transformer import FreeTransformer

IMPLEMENTATIONS = ("ours", "x-transformers")
KAPPA_NATS = math.log(2.0)  # x-transformers' default free-bits threshold, one bit
# device type: {H: (ours at least this many times faster, at least this many times less peak memory or None)}
# cpu: the first targets; cuda: docs/gpu.md's (bench/targets.py: H=16 2x faster and 3x lighter; H=8 never slower
# nor larger), the same in fp32 and bf16.
TARGETS = {
    "cpu": {16: (1.5, 3.0), 8: (1.0, None)},
    "cuda": {
        bits: (GPU_TARGETS[f"peers-bf16-h{bits}-time"].at_least, GPU_TARGETS[f"peers-bf16-h{bits}-memory"].at_least)
        for bits in (16, 8)
    },
}


def build_x_transformers(config: ModelConfig):
    from x_transformers.free_transformer import FreeTransformer as XFreeTransformer

    return XFreeTransformer(
        num_tokens=config.vocab_size,
        dim=config.dim,
        max_seq_len=config.max_seq_len,
        dec_head_depth=config.injection_layer,
        dec_tail_depth=config.n_layers - config.injection_layer,
        enc_depth=1,
        heads=config.n_heads,
        attn_dim_head=config.head_dim,
        attn_kv_heads=config.n_kv_heads,
        attn_flash=True,
        ff_glu=True,
        ff_swish=True,
        ff_mult=config.ffn_hidden / config.dim,
        ff_no_bias=True,
        rotary_emb_dim=config.head_dim,
        latent_bits=config.latent_units,
        kl_loss_threshold=KAPPA_NATS,
        verbose=False,
    )


def build(impl: str, config: ModelConfig, batch: int, seq_len: int, device_name: str):
    """(impl, model, optimizer, tokens (B, T + 1)) on the device, seeded."""
    device = torch.device(device_name)
    torch.manual_seed(0)
    model = (FreeTransformer(config) if impl == "ours" else build_x_transformers(config)).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + 1), device=device)
    return impl, model, optimizer, tokens


def train_step(impl: str, model, optimizer, tokens, precision: str = "fp32") -> torch.Tensor:
    """Forward + backward + AdamW step; returns the loss."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        # x-transformers' model shifts the tokens into inputs and targets itself
        loss = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=KAPPA_NATS).loss if impl == "ours" else model(tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def setup_after_one_step(impl, config, batch, seq_len, device_name, precision="fp32"):
    """Build, then take one step so that the optimizer state and every kernel exist before measuring."""
    inputs = build(impl, config, batch, seq_len, device_name)
    train_step(*inputs, precision)
    return inputs


def peak_memory(impl, config, batch, seq_len, device_name, threads, precision="fp32") -> int | None:
    """Extra peak bytes of one training step in a fresh process; None if it runs out of memory."""
    try:
        return peak_memory_in_fresh_process(
            setup_after_one_step,
            functools.partial(train_step, precision=precision),
            (impl, config, batch, seq_len, device_name, precision),
            device_name=device_name,
            threads=threads,
            warmup_args=(impl, config.replace(latent_units=4), 1, 16, device_name, precision),
        )
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
        print(f"  {impl}: peak memory run failed: {str(error).splitlines()[0][:200]}")
        return None


def time_pair(config, batch, seq_len, device, rounds, precision="fp32"):
    """Median seconds per step of each implementation, median per-round ratio x-transformers / ours,
    first losses. An implementation that fails (out of memory) is reported as None."""
    variants, losses = {}, {}
    for impl in IMPLEMENTATIONS:
        try:
            inputs = build(impl, config, batch, seq_len, str(device))
            losses[impl] = float(train_step(*inputs, precision))
            variants[impl] = functools.partial(train_step, *inputs, precision)
        except (RuntimeError, MemoryError) as error:
            print(f"  {impl}: failed at H={config.latent_units}: {str(error).splitlines()[0][:200]}")
    times = interleaved_times(variants, rounds, device)
    medians = {impl: statistics.median(times[impl]) if impl in times else None for impl in IMPLEMENTATIONS}
    ratio = median_ratio(times["x-transformers"], times["ours"]) if len(times) == 2 else None
    return medians, ratio, losses


def verdict(bits, speedup, memory_ratio, device_type="cpu") -> str:
    targets = TARGETS["cuda" if device_type == "cuda" else "cpu"]
    if bits not in targets or speedup is None:
        return ""
    min_speedup, min_memory = targets[bits]
    ok = speedup >= min_speedup and (min_memory is None or (memory_ratio is not None and memory_ratio >= min_memory))
    return "PASS" if ok else "FAIL"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 16], help="latent bits H to compare")
    add_model_arguments(parser, dim=256, layers=8, ffn=768)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument(
        "--dtype",
        dest="precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: both under bf16 autocast (weights and AdamW state float32)",
    )
    parser.add_argument(
        "--figures",
        metavar="PATH",
        help="on CUDA, append the GPU targets' figures (bench/targets.py) to PATH as JSON lines",
    )
    add_machine_arguments(parser)
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.dim, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab = 32, 2, 2, 1, 64, 64
        args.bits, args.seq_len, args.batch, args.rounds = [4], 16, 2, 1
    device = setup_machine(args)

    print(describe_machine(device))
    limits = matmul_limits_gflops(device, smoke=args.smoke)
    print(describe_limits(limits))
    print(f"{describe_size(args)} T={args.seq_len} B={args.batch}, {args.precision}, {args.rounds} rounds")
    targets = TARGETS["cuda" if device.type == "cuda" else "cpu"]
    print(
        "targets: "
        + "; ".join(
            f"H={bits} ours >= {speed:g}x faster" + (f" and >= {mem:g}x less peak memory" if mem else "")
            for bits, (speed, mem) in targets.items()
        )
    )

    rows = []
    for bits in args.bits:
        config = model_config(args, max_seq_len=args.seq_len, latent_units=bits)
        medians, speedup, losses = time_pair(config, args.batch, args.seq_len, device, args.rounds, args.precision)
        memory = {
            impl: peak_memory(impl, config, args.batch, args.seq_len, args.device, args.threads, args.precision)
            for impl in IMPLEMENTATIONS
        }
        memory_ratio = memory["x-transformers"] / memory["ours"] if None not in memory.values() else None
        flops = config.training_flops_per_token(args.seq_len) * args.batch * args.seq_len
        rows.append(
            (
                bits,
                medians,
                speedup,
                memory,
                memory_ratio,
                flops,
                losses,
                verdict(bits, speedup, memory_ratio, device.type),
            )
        )
        print(f"  H={bits}: first losses {', '.join(f'{k} {v:.3f}' for k, v in losses.items())}")
        if device.type == "cuda" and bits in (8, 16):
            for what, value in (("time", speedup), ("memory", memory_ratio)):
                write_figure(
                    args.figures, f"peers-{args.precision}-h{bits}-{what}", float("nan") if value is None else value
                )

    def ms(seconds):
        return f"{seconds * 1e3:>9.1f}" if seconds is not None else f"{'failed':>9}"

    def mib(nbytes):
        return f"{nbytes / MIB:>9.1f}" if nbytes is not None else f"{'failed':>9}"

    def gflops(flops, seconds):
        return f"{flops / seconds / 1e9:>6.1f}" if seconds is not None else f"{'-':>6}"

    def utilisation(flops, seconds):
        return f"{mfu(flops / seconds, limits, args.precision):>5.1%}" if seconds is not None else f"{'-':>5}"

    def times_x(value):
        return f"{value:>6.2f}" if value is not None else f"{'-':>6}"

    print(
        f"{'H':>3} | {'ours ms':>9} {'x-tf ms':>9} {'time x':>6} | {'ours MiB':>9} {'x-tf MiB':>9} {'mem x':>6} "
        f"| model GFLOP/s ours x-tf | MFU ours  x-tf | target"
    )
    for bits, medians, speedup, memory, memory_ratio, flops, _, target in rows:
        print(
            f"{bits:>3} | {ms(medians['ours'])} {ms(medians['x-transformers'])} {times_x(speedup)} | "
            f"{mib(memory['ours'])} {mib(memory['x-transformers'])} {times_x(memory_ratio)} | "
            f"{'':>8}{gflops(flops, medians['ours'])} {gflops(flops, medians['x-transformers'])} | "
            f"{'':>3}{utilisation(flops, medians['ours'])} {utilisation(flops, medians['x-transformers'])} | {target}"
        )
    print(
        "time x = median of per-round (x-transformers / ours); mem x = x-transformers / ours peak; model GFLOP/s "
        "= ModelConfig.training_flops_per_token(T) * B * T / median step time, the same useful work for both; "
        f"MFU = that / the {args.precision} matmul limit"
    )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
