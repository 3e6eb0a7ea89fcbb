"""How the Free Transformer's training step grows with the sequence length T and the latent bits H,
against the same model with the Binary Mapper written naively, and against proportional growth.

Step: forward + backward + a fused AdamW step, batch --batch, float32, a small model by default
(L=4, D=128, heads 4/2, SwiGLU 384, vocab 256) so that the default run stays short.
  ours   free_transformer.model.transformer.FreeTransformer as it is.
  naive  the same model, weights and sampled Z, with the posterior's Binary Mapper + post-sampler
         computed as the paper writes it, (Y + G - detach(G)) @ W with Y and G materialised as
         (B*T, 2^H) tensors (bench/mapper.py: naive_mapper_project). Its loss is checked equal to ours.
Sweeps: T in --seq-lens at H = --seq-bits, then H in --bits at T = --bits-seq-len.

Printed and plotted (bench/scaling.png): median step time (interleaved rounds, ours and naive
taking turns in this process) and the extra peak memory of one step (fresh process per point,
AdamW state already allocated; bench/common.py), each also as a multiple of the sweep's first
point. Dashed lines are proportional growth from ours' first point: linear in T (what a step
would cost if attention were free), T^2 (attention scores materialised), and 2^H (work or memory
per value of Z, which is what the naive mapper pays).

    PYTHONPATH=src python bench/scaling.py [--rounds R] [--threads T] [--device cpu|cuda] [--out PNG]
                                           [--seq-lens ...] [--seq-bits H] [--bits ...] [--bits-seq-len T]
                                           [--dim D --layers L --heads h --kv-heads k --ffn F --vocab V --batch B]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
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
    mfu,
    model_config,
    peak_memory_in_fresh_process,
    setup_machine,
)
from mapper import naive_mapper_project

from free_transformer.model.config import LatentConfig, ModelConfig
from free_transformer.model.latent import BinaryMapper, register_latent_kind
from free_transformer.model.transformer import FreeTransformer

VARIANTS = ("ours", "naive")
KAPPA_NATS = math.log(2.0)


@register_latent_kind("naive_binary_mapper")
class NaiveBinaryMapper(BinaryMapper):
    """The Binary Mapper as the paper writes it, Y and G materialised (a latent kind registered here,
    as a researcher would add one). Same table, same init and the same sample_bits calls as
    BinaryMapper, so Z, the loss and, up to rounding, every gradient equal ours."""

    def sample(self, bit_logits, generator=None):
        lead = bit_logits.shape[:-1]
        r, index = naive_mapper_project(bit_logits.reshape(-1, self.units), self.weight, generator)
        return r.reshape(*lead, -1), index.reshape(lead)  # (B, T, D), (B, T)


def build(variant: str, config: ModelConfig, batch: int, device_name: str):
    """(model, optimizer, tokens (B, T + 1)), seeded: both variants get the same weights and tokens."""
    device = torch.device(device_name)
    torch.manual_seed(0)
    kind = "binary_mapper" if variant == "ours" else "naive_binary_mapper"
    model = FreeTransformer(config.replace(latent=LatentConfig(kind))).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, config.vocab_size, (batch, config.max_seq_len + 1), device=device)
    return model, optimizer, tokens


def train_step(model, optimizer, tokens, seed: int = 1) -> float:
    generator = torch.Generator(tokens.device).manual_seed(seed)  # the same Z for both variants
    loss = model(tokens[:, :-1], tokens[:, 1:], kappa_nats=KAPPA_NATS, generator=generator).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def setup_after_one_step(variant, config, batch, device_name):
    inputs = build(variant, config, batch, device_name)
    train_step(*inputs)
    return inputs


def peak_memory(variant, config, batch, device_name, threads) -> int:
    return peak_memory_in_fresh_process(
        setup_after_one_step,
        train_step,
        (variant, config, batch, device_name),
        device_name=device_name,
        threads=threads,
        warmup_args=(variant, config.replace(latent_units=4, max_seq_len=16), 1, device_name),
    )


def measure(config, batch, device_name, rounds, threads):
    """{variant: (median seconds, peak bytes)} and the first losses of both (equal: same weights and Z)."""
    device = torch.device(device_name)
    inputs = {variant: build(variant, config, batch, device_name) for variant in VARIANTS}
    losses = {variant: train_step(*inputs[variant]) for variant in VARIANTS}  # before any update: comparable
    times = interleaved_times({v: functools.partial(train_step, *inputs[v]) for v in VARIANTS}, rounds, device)
    del inputs
    results = {v: (statistics.median(times[v]), peak_memory(v, config, batch, device_name, threads)) for v in VARIANTS}
    return results, losses


def sweep(name, points, make_config, args, measured):
    """Rows (x, config, results) for one sweep, printed as they come. measured: {config: (results, losses)}
    of the points measured so far, shared by both sweeps: their common point (T = --bits-seq-len at
    H = --seq-bits) is measured once."""
    rows = []
    for x in points:
        config = make_config(x)
        if config not in measured:
            measured[config] = measure(config, args.batch, args.device, args.rounds, args.threads)
        results, losses = measured[config]
        if abs(losses["ours"] - losses["naive"]) > 1e-4 * abs(losses["ours"]):
            raise AssertionError(f"{name}={x}: losses differ, ours {losses['ours']} naive {losses['naive']}")
        rows.append((x, config, results))
        print(
            f"  {name}={x}: done (first loss {losses['ours']:.4f} both), load average {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    return rows


def print_table(name, rows, batch, proportional, limits):
    """proportional: {label: function of (x, x0) -> growth factor} for the reference columns."""
    x0 = rows[0][0]
    base_s, base_mem = rows[0][2]["ours"]
    refs = " ".join(f"{label:>7}" for label in proportional)
    print(
        f"{name:>5} | {'ours ms':>9} {'naive ms':>9} {'time x':>6} | {'ours MiB':>9} {'naive MiB':>9} {'mem x':>6} | "
        f"growth ours: time {'mem':>6} | naive growth: {refs} | ours GFLOP/s   MFU"
    )
    for x, config, results in rows:
        (ours_s, ours_mem), (naive_s, naive_mem) = results["ours"], results["naive"]
        seq_len = config.max_seq_len
        gflops = config.training_flops_per_token(seq_len) * batch * seq_len / ours_s / 1e9
        growth = " ".join(f"{fn(x, x0):>7.1f}" for fn in proportional.values())
        print(
            f"{x:>5} | {ours_s * 1e3:>9.1f} {naive_s * 1e3:>9.1f} {naive_s / ours_s:>6.2f} | "
            f"{ours_mem / MIB:>9.1f} {naive_mem / MIB:>9.1f} {naive_mem / ours_mem:>6.2f} | "
            f"{'':>12}{ours_s / base_s:>5.1f} {ours_mem / base_mem:>6.1f} | {'':>13}{growth} | {gflops:>6.1f} "
            f"{mfu(gflops * 1e9, limits, 'fp32'):>5.1%}"
        )


def plot(seq_rows, bits_rows, args, path: Path):
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, (rows, label, refs) in enumerate(
        (
            (
                seq_rows,
                f"sequence length T (H={args.seq_bits})",
                {"∝ T": lambda x, x0: x / x0, "∝ T²": lambda x, x0: (x / x0) ** 2},
            ),
            (bits_rows, f"latent bits H (T={args.bits_seq_len})", {"∝ 2^H": lambda x, x0: 2.0 ** (x - x0)}),
        )
    ):
        xs = [row[0] for row in rows]
        for row_index, (quantity, scale, unit) in enumerate(
            (("time", 1e3, "step time (ms)"), ("memory", 1 / MIB, "extra peak memory (MiB)"))
        ):
            ax = axes[row_index][col]
            k = 0 if quantity == "time" else 1
            for variant, style in (("ours", "o-"), ("naive", "s-")):
                ax.plot(
                    xs,
                    [row[2][variant][k] * scale for row in rows],
                    style,
                    label="ours" if variant == "ours" else "naive Binary Mapper (Y, G materialised)",
                )
            first = rows[0][2]["ours"][k] * scale
            for (ref_label, fn), ls in zip(refs.items(), ("--", ":")):
                ax.plot(
                    xs,
                    [first * fn(x, xs[0]) for x in xs],
                    ls,
                    color="gray",
                    label=f"{ref_label} from ours' first point",
                )
            ax.set_xlabel(label)
            ax.set_ylabel(unit)
            ax.set_yscale("log")
            if col == 0:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(
        f"Free Transformer training step (L={args.layers}, D={args.dim}, B={args.batch}, float32, "
        f"{describe_machine(torch.device(args.device)).split(',')[0]})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--seq-bits", type=int, default=12, help="H during the sequence-length sweep")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 10, 12, 14, 16])
    parser.add_argument("--bits-seq-len", type=int, default=1024, help="T during the H sweep")
    add_model_arguments(parser, dim=128, layers=4, ffn=384)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per point")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("scaling.png"))
    add_machine_arguments(parser)
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:  # the plot goes to a folder removed when main returns, not over the committed one
        args.dim, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab = 32, 2, 2, 1, 64, 64
        args.seq_lens, args.seq_bits, args.bits, args.bits_seq_len, args.rounds = [16], 4, [4], 16, 1
        scratch = tempfile.TemporaryDirectory()
        args.out = Path(scratch.name) / "scaling.png"
    device = setup_machine(args)
    base = model_config(args)

    print(describe_machine(device))
    limits = matmul_limits_gflops(device, smoke=args.smoke)
    print(describe_limits(limits))
    print(f"{describe_size(args)} B={args.batch}, float32, {args.rounds} rounds")
    measured: dict = {}
    seq_rows = sweep(
        "T", args.seq_lens, lambda t: base.replace(max_seq_len=t, latent_units=args.seq_bits), args, measured
    )
    bits_rows = sweep(
        "H", args.bits, lambda h: base.replace(max_seq_len=args.bits_seq_len, latent_units=h), args, measured
    )

    print(f"sequence length sweep, H={args.seq_bits}")
    print_table("T", seq_rows, args.batch, {"T": lambda x, x0: x / x0, "T^2": lambda x, x0: (x / x0) ** 2}, limits)
    print(f"latent bits sweep, T={args.bits_seq_len}")
    print_table("H", bits_rows, args.batch, {"2^H": lambda x, x0: 2.0 ** (x - x0)}, limits)
    print(
        "time x, mem x = naive / ours; growth = this point / the sweep's first point (ours); "
        "GFLOP/s = ModelConfig.training_flops_per_token(T) * B * T / ours' median step time; MFU = that / the "
        "fp32 matmul limit"
    )
    plot(seq_rows, bits_rows, args, args.out)
    print(f"plot written to {args.out}; load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
