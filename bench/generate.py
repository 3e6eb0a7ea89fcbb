"""Decoding speed: the Free Transformer against the baseline decoder, and the KV cache against recomputing the prefix.

(a) Free vs baseline. Two models of the same size, one with H latent bits and one without (the
    baseline: latent_units = 0, the same blocks), generate with free_transformer.inference.generate: a KV
    cache, sampling at temperature 1 with one generator per row, latents = "prior". Every
    Z_t, prompt included, is drawn from the uniform prior: the encoder is never run and Z_t is one
    row of the post-sampler table. Two instances of each model (different seeds, so different
    memory) are timed in every round. Reported: tokens/s of each and the median per-round ratio
    Free / baseline over the instances' summed times. Target: >= 0.95. A control compares the two
    baseline instances (an A/A comparison): how far noise and memory placement alone move a ratio.
(b) KV cache vs recompute. The Free Transformer decodes greedily --recompute-tokens new tokens
    twice with the same latents (drawn once from the prior): with generate (KV cache: one token per
    step), and by running the full forward on the whole growing sequence at each step and taking
    the last position's logits (no cache, the naive loop of tests/test_generate.py). Both must
    produce the same tokens (checked). Reported: the median per-round time ratio. Target: >= 10x
    at 512 new tokens.
(c) With --compile: the tokens of graph-captured decoding against the same engine's bucketed step run
    eagerly (the same kernels, so the same tokens unless capture froze a value or an address: must be
    equal), and their agreement with ordinary eager decoding (other kernels: in bf16, sampled tokens of a
    random model may part where two logits are within rounding).
(d) With --parts d: the decoding engine's step of generate(compile=True) (the rows' draws of Z and
    noise, then the model and each row's sampling, temperature 1, top-k 50) run as it is (eager on a
    CPU, a CUDA graph on a GPU) and compiled by Inductor first (captured after on a GPU), and on a GPU
    also compiled without coordinate-descent tuning ("untuned": cuBLAS GEMVs rather than Inductor's
    tuned reductions; free_transformer.inference.engine.INDUCTOR_OPTIONS), side by side in interleaved rounds on one
    model: steps/s and tokens/s of the step alone (no prefill), its roof (weights + visible KV-cache
    bytes of a step / copy bandwidth / step time), the compilation time, and the share of equal tokens
    from the same seeds after the same prefill (1.0 unless rounding parts two near-equal choices). Printed
    beside the targets: at paper-1.5b bf16 on an H100, B=1 roof >= 60% (about 600 tokens/s) and B=16 >= 8,000 tokens/s.

Both parts time the variants in interleaved rounds in this one process (bench/common.py).

Roofline (part (a)): decoding a token reads every matmul weight once and the cached keys and values
of the positions it attends to, whatever the batch. Bytes read by one generate call: per fed call
(the prefill and each of the new_tokens - 1 steps) the matmul weights (q, k, v, o, gate, up, down of
every block and the logit read-out, in the model's dtype), plus the KV cache read by attention,
2 * L * B * kv_heads * head_dim * (positions visible) elements. Embedding rows, norms and the
post-sampler row are left out (B * D each). Those bytes / the measured copy bandwidth
(bench/common.copy_bandwidth_gbps) is the fastest the call could run; "roof" is that time over the
measured one (1.0 = at the memory roofline; target on a GPU at paper-1.5b bf16, B=1: >= 0.60).

Options for a GPU: --size paper-1.5b (the named size's dims and H=16), --dtype bf16
(weights, RoPE tables and KV cache in bf16, as `generate --dtype bf16`), --compile (generate(..., compile=True):
the decoding step captured as a CUDA graph; the same bucketed step, eager, on a CPU).

FLOPs (to print the achieved GFLOP/s beside the machine's matmul limit): a token fed at position t
costs 2 FLOPs per weight of every matmul (q, k, v, o, gate, up, down of each block and the logit
read-out; the embedding and the post-sampler are lookups, the Free Transformer's encoder is not run)
plus 4 * (t + 1) * D per block for attention scores and values over its t + 1 visible keys. A
full forward of T tokens costs the sum of that over t < T. Norms, RoPE and sampling are not counted.

    PYTHONPATH=src python bench/generate.py [--batch 1 8] [--new-tokens N] [--recompute-tokens N]
                                            [--rounds R] [--threads T] [--device cpu|cuda]
                                            [--size paper-1.5b] [--dtype fp32|bf16] [--compile]
                                            [--parts a b c d] [--step-rounds R]
                                            [--dim D --layers L --heads h --kv-heads k --ffn F
                                             --vocab V --bits H --prompt-len P]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

import torch
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
    model_config,
    rewind_rows,
    seconds_per_call,
    setup_machine,
)
from targets import TARGETS, write_figure

from free_transformer.base.devices import DTYPE_NAMES, torch_dtype
from free_transformer.inference import engine as engine_module
from free_transformer.inference.engine import DecodeEngine, Row
from free_transformer.inference.generate import GenerationConfig, generate
from free_transformer.inference.kept_engines import decoding_engine
from free_transformer.inference.latents import shared_prior_latents
from free_transformer.model.config import ModelConfig, named_config
from free_transformer.model.transformer import FreeTransformer

TARGET_FREE_VS_BASELINE = 0.95
TARGET_CACHE_SPEEDUP, TARGET_CACHE_TOKENS = 10.0, 512
# The decoding targets on a GPU, at paper-1.5b in bf16 on an H100 (3.0 TB/s: the B=1 roofline is ~992 tokens/s).
TARGET_B1_ROOF, TARGET_B16_TOKENS_S = TARGETS["decode-b1-roof"].at_least, TARGETS["decode-b16-tokens"].at_least
SIZES = ("paper-1.5b",)
PROMPT_LEN = 16  # default prompt tokens (bench/profile_steps.py profiles decoding after prompts of this length)


def matmul_weights(config: ModelConfig) -> int:
    """Weights that a decoded token multiplies: every block's projections and the logit read-out."""
    return config.n_layers * (config.block_params() - 2 * config.dim) + config.vocab_size * config.dim


def tokens_flops(config: ModelConfig, first: int, last: int) -> float:
    """FLOPs to feed positions [first, last) given a cache of the positions before (see the docstring)."""
    n = last - first
    visible = (last * (last + 1) - first * (first + 1)) // 2  # sum over t in [first, last) of (t + 1)
    return 2.0 * matmul_weights(config) * n + 4.0 * config.n_layers * config.dim * visible


def cached_decode_flops(config: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Prefill of the prompt, then one token per step (the last sampled token is never fed)."""
    return batch * tokens_flops(config, 0, prompt_len + new_tokens - 1)


def recompute_decode_flops(config: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> float:
    return batch * sum(tokens_flops(config, 0, prompt_len + step) for step in range(new_tokens))


def cached_decode_bytes(config: ModelConfig, batch: int, prompt_len: int, new_tokens: int, element_bytes: int) -> float:
    """Bytes one generate call must read (see the docstring's roofline): the matmul weights once per fed
    call, and the KV cache's visible positions at each call."""
    calls = new_tokens  # the prefill, then new_tokens - 1 steps (the last sampled token is never fed)
    kv_per_position = 2 * config.n_layers * batch * config.n_kv_heads * config.head_dim
    visible = prompt_len + sum(prompt_len + step + 1 for step in range(new_tokens - 1))
    return float(element_bytes) * (calls * matmul_weights(config) + kv_per_position * visible)


def build_model(config: ModelConfig, device, seed: int = 0, dtype: torch.dtype = torch.float32) -> FreeTransformer:
    """Initialised on its device (a 1.5B model on the host takes minutes), in `dtype` (its RoPE tables too, as
    `free-transformer generate --dtype` casts them)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = FreeTransformer(config)
    return model.to(dtype).eval()


@torch.no_grad()
def recompute_greedy(model: FreeTransformer, prompts: torch.Tensor, new_tokens: int, latents: torch.Tensor) -> list:
    """Greedy decoding without a cache: the full forward on the whole sequence at every step."""
    seq = prompts
    for _ in range(new_tokens):
        length = seq.shape[1]
        logits = model(seq, latents=latents[:, :length]).logits[:, -1]  # (B, V)
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    return seq[:, prompts.shape[1] :].tolist()


def free_vs_baseline(config, batch, args, device):
    """Median seconds of each, median per-round ratios Free / baseline and baseline B / baseline A
    (tokens/s; the second is the A/A control), and each instance's first call in seconds.

    --instances (default two) of each model, built from different seeds: identical models in different
    memory decode at speeds up to ~5% apart on these CPUs (measured), so one instance of each would measure
    where their weights landed as much as the design. Each round times all of them; the ratio uses the
    sum of each model's instances, and the control compares the first two baseline instances. The first
    call of each instance is timed apart: under --compile it compiles and captures its decoding step, the
    first instance of each model with whatever Inductor's caches hold, the later ones with what the first
    left there (the same graph, other weights)."""
    models = {
        f"{name}{i}": build_model(config.replace(latent_units=bits), device, seed=i, dtype=torch_dtype(args.dtype))
        for i in range(args.instances)
        for name, bits in (("free", config.latent_units), ("baseline", 0))
    }
    prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    gen_config = GenerationConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    seeds = list(range(batch))
    calls = {
        name: functools.partial(
            generate, model, prompts, gen_config, seeds=seeds, latents="prior", compile=args.compile
        )
        for name, model in models.items()
    }
    first = {name: seconds_per_call(call, 1, device) for name, call in calls.items()}
    times = interleaved_times(calls, args.rounds, device)
    instances = range(args.instances)
    free = [sum(t) for t in zip(*(times[f"free{i}"] for i in instances))]
    baseline = [sum(t) for t in zip(*(times[f"baseline{i}"] for i in instances))]
    control = median_ratio(times["baseline0"], times["baseline1"]) if args.instances > 1 else float("nan")
    return (
        statistics.median(free) / args.instances,
        statistics.median(baseline) / args.instances,
        median_ratio(baseline, free),
        control,
        first,
    )


def cache_vs_recompute(config, args, device):
    """Median seconds of each, median per-round ratio recompute / cached, and whether the tokens agree."""
    model = build_model(config, device, dtype=torch_dtype(args.dtype))
    prompts = torch.randint(0, config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    n = args.recompute_tokens
    latents = shared_prior_latents(model, args.prompt_len + n - 1, torch.Generator(device).manual_seed(2))
    gen_config = GenerationConfig(max_new_tokens=n, temperature=0.0)
    cached = functools.partial(generate, model, prompts, gen_config, latents=latents, compile=args.compile)
    recompute = functools.partial(recompute_greedy, model, prompts, n, latents)
    same = cached().tokens == recompute()
    times = interleaved_times({"cached": cached, "recompute": recompute}, args.recompute_rounds, device)
    return (
        statistics.median(times["cached"]),
        statistics.median(times["recompute"]),
        median_ratio(times["recompute"], times["cached"]),
        same,
    )


def graph_vs_eager(config, batch, args, device):
    """(graph tokens == the engine's bucketed step run eagerly, share of tokens equal to eager decoding's)."""
    model = build_model(config, device, dtype=torch_dtype(args.dtype))
    prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    gen_config = GenerationConfig(max_new_tokens=args.new_tokens, temperature=1.0)
    run = functools.partial(generate, model, prompts, gen_config, seeds=list(range(batch)))
    graphed = run(compile=True).tokens
    engine = decoding_engine(model, batch, args.prompt_len + args.new_tokens - 1, compile=True)  # generate's
    engine.runner.use_graph = False
    static_eager = run(compile=True).tokens
    engine.runner.use_graph = device.type == "cuda"
    eager = run().tokens
    pairs = [(a, b) for row_a, row_b in zip(graphed, eager) for a, b in zip(row_a, row_b)]
    return graphed == static_eager, sum(a == b for a, b in pairs) / max(1, len(pairs))


def static_step_bytes(config: ModelConfig, batch: int, visible: float, element_bytes: int) -> float:
    """Bytes one decoding step must read: the matmul weights, and the keys and values of `visible` positions."""
    kv_per_position = 2 * config.n_layers * batch * config.n_kv_heads * config.head_dim
    return float(element_bytes) * (matmul_weights(config) + kv_per_position * visible)


def untuned_options() -> dict:
    """generate's Inductor options without coordinate-descent tuning."""
    return {k: v for k, v in engine_module.INDUCTOR_OPTIONS.items() if k != "coordinate_descent_tuning"}


def compile_untuned() -> None:
    """From now on in this process, generate(compile=True) compiles its decoding step without
    coordinate-descent tuning (its compilation then takes about a third of the time: docs/gpu.md)."""
    engine_module.INDUCTOR_OPTIONS = untuned_options()


def engine_step_eager_vs_compiled(config, batch, args, device):
    """{name: seconds per step}, {name: compile seconds} and {name: share of tokens equal to the step as is}.

    One model, an engine per variant (as it is; compiled by Inductor; on a GPU compiled untuned), each with
    its own cache and the same rows (prior Z, seeds 0..B-1). A timed sample is `n` steps from position P,
    the rows rewound there first (the step attends the whole cache under a mask, so its cost does not depend
    on the values)."""
    model = build_model(config, device, dtype=torch_dtype(args.dtype))
    prompts = torch.randint(0, config.vocab_size, (batch, args.prompt_len), generator=torch.Generator().manual_seed(1))
    sampling = GenerationConfig(max_new_tokens=args.new_tokens + 1, temperature=1.0, top_k=50)
    capacity = args.prompt_len + args.new_tokens
    n = args.new_tokens - 1
    engines = {
        "as is": DecodeEngine(model, batch, capacity=capacity, compile=True, inductor=False),
        "inductor": DecodeEngine(model, batch, capacity=capacity, compile=True, inductor=True),
    }
    if device.type == "cuda":  # coordinate-descent tuning changes nothing on a CPU
        tuned = engine_module.INDUCTOR_OPTIONS
        engine_module.INDUCTOR_OPTIONS = untuned_options()
        engines["untuned"] = DecodeEngine(model, batch, capacity=capacity, compile=True, inductor=True)
        engine_module.INDUCTOR_OPTIONS = tuned
    for engine in engines.values():
        engine.add([Row(ids, sampling, seed, "prior") for seed, ids in enumerate(prompts.tolist())])

    @torch.inference_mode()
    def run(engine):  # the rows rewound to the end of their prompt, then n steps: the tokens (B, n)
        rewind_rows(engine, args.prompt_len)
        for _ in range(n):
            engine.step()
        tokens = torch.tensor([row.tokens[1:] for row in engine.rows])
        assert tokens.shape == (batch, n), "every row takes every step"
        return tokens

    reference = run(engines["as is"])
    same = {}
    for name, engine in engines.items():
        if name != "as is":  # compiles (coordinate-descent tuning may take minutes); captures on a GPU
            print(f"  B={batch}: compiling the {name} step ...", flush=True)
            same[name] = (run(engine) == reference).double().mean().item()
            print(
                f"  B={batch}: compiled the {name} step in {sum(engine.runner.compile_seconds.values()):.1f} s",
                flush=True,
            )
    compile_s = {
        name: sum(engine.runner.compile_seconds.values()) for name, engine in engines.items() if name != "as is"
    }
    times = interleaved_times(
        {name: functools.partial(run, engine) for name, engine in engines.items()}, args.step_rounds, device
    )
    return {name: statistics.median(t) / n for name, t in times.items()}, compile_s, same


def print_static_step(config, args, device, limits, element_bytes):
    at_target = args.size == "paper-1.5b" and args.dtype == "bf16" and device.type == "cuda"
    print(
        f"(d) the decoding engine's step (the rows' draws, the model, each row's sampling), as is "
        f"({'CUDA graph' if device.type == 'cuda' else 'eager'}) vs compiled by Inductor"
        f"{' then captured (untuned: without coordinate-descent tuning)' if device.type == 'cuda' else ''}, "
        f"{args.step_rounds} rounds; targets at paper-1.5b bf16 on an H100 (the inductor step): B=1 roof >= "
        f"{TARGET_B1_ROOF:.0%}, B=16 >= {TARGET_B16_TOKENS_S:,.0f} tok/s"
        f"{'' if at_target else ' (not this configuration: figures for reading only)'}"
    )
    for batch in args.batch:
        seconds, compile_s, same = engine_step_eager_vs_compiled(config, batch, args, device)
        visible = args.prompt_len + args.new_tokens / 2  # positions a step attends, on average
        roofline_s = static_step_bytes(config, batch, visible, element_bytes) / (limits["copy_gbps"] * 1e9)
        tokens = batch / seconds["inductor"]
        if batch == 1:
            target = f"roof >= {TARGET_B1_ROOF:.0%}: " + (
                "PASS" if roofline_s / seconds["inductor"] >= TARGET_B1_ROOF else "FAIL"
            )
        elif batch == 16:
            target = f">= {TARGET_B16_TOKENS_S:,.0f} tok/s: " + ("PASS" if tokens >= TARGET_B16_TOKENS_S else "FAIL")
        else:
            target = "-"
        if not at_target and target != "-":
            target = f"({target.split(':')[0]})"
        print(f"B={batch}: target {target}")
        print(f"  {'step':>8} | {'ms/step':>8} {'tok/s':>9} {'roof':>6} | {'compile s':>9} | {'equal tokens':>12}")
        for name, s in seconds.items():
            compiled = (
                f"{compile_s[name]:>9.1f} | {same[name]:>12.1%}" if name in compile_s else f"{'-':>9} | {'-':>12}"
            )
            print(f"  {name:>8} | {s * 1e3:>8.2f} {batch / s:>9.1f} {roofline_s / s:>6.1%} | {compiled}", flush=True)
        if at_target and batch == 1:
            write_figure(
                args.figures, "decode-step-b1-roof-tuned", roofline_s / seconds["inductor"], "the engine's step alone"
            )
            write_figure(
                args.figures, "decode-step-b1-roof-untuned", roofline_s / seconds["untuned"], "the engine's step alone"
            )


def write_decode_figures(path, batch, tokens_per_s, roof, free_vs_base, first) -> None:
    """docs/gpu.md's decoding targets from part (a) at their configuration (bench/targets.py), and the first
    call's time: cold (the first Free instance) and warm (the second, once the first filled the caches)."""
    note = f"generate(compile=True), B={batch}"
    if batch == 1:
        write_figure(path, "decode-b1-roof", roof, note)
        write_figure(path, "decode-b1-free-base", free_vs_base, note)
        write_figure(path, "decode-compile-cold", first["free0"], f"{note}, free0")
        if "free1" in first:
            write_figure(path, "decode-compile-warm", first["free1"], f"{note}, free1")
    elif batch == 16:
        write_figure(path, "decode-b16-tokens", tokens_per_s, note)
        write_figure(path, "decode-b16-free-base", free_vs_base, note)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, dim=256, layers=8, ffn=768)
    parser.add_argument("--bits", type=int, default=None, help="latent bits H of the Free Transformer (default 16)")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes for part (a)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per call in part (a)")
    parser.add_argument(
        "--recompute-tokens",
        type=int,
        default=TARGET_CACHE_TOKENS,
        help="tokens generated per call in part (b); 0 skips it",
    )
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds of part (a)")
    parser.add_argument("--recompute-rounds", type=int, default=3, help="interleaved timing rounds of part (b)")
    parser.add_argument(
        "--size", choices=SIZES, help="a named size's dims (overrides --dim ... --vocab; H=16 unless --bits is given)"
    )
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32", help="weights and KV cache dtype")
    parser.add_argument(
        "--compile", action="store_true", help="generate(..., compile=True): graph-captured decoding on CUDA"
    )
    parser.add_argument(
        "--parts",
        nargs="+",
        choices=("a", "b", "c", "d"),
        default=None,
        help="parts to run (default a b, and c with --compile); d: the engine's step, eager vs Inductor",
    )
    parser.add_argument("--step-rounds", type=int, default=5, help="interleaved timing rounds of part (d)")
    parser.add_argument("--instances", type=int, default=2, help="instances of each model in part (a), at least 1")
    parser.add_argument(
        "--untuned",
        action="store_true",
        help="compile the decoding steps without coordinate-descent tuning (part (d) compares both)",
    )
    parser.add_argument(
        "--figures", metavar="PATH", help="append the GPU targets' figures (bench/targets.py) to PATH as JSON lines"
    )
    add_machine_arguments(parser)
    add_smoke_argument(parser)
    args = parser.parse_args()
    if args.smoke:  # parts a, b and c unless --parts says (d compiles with Inductor: a minute on a CPU)
        args.dim, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab, args.bits = 32, 2, 2, 1, 64, 64, 4
        args.prompt_len, args.batch, args.new_tokens, args.recompute_tokens = 4, [1], 4, 4
        args.rounds = args.recompute_rounds = args.step_rounds = args.instances = 1
        args.parts = args.parts or ["a", "b", "c"]
    if args.instances < 1:
        parser.error("--instances must be at least 1")
    if args.untuned and "d" in (args.parts or ()):
        parser.error("--untuned: part (d) compiles the step both ways itself")
    if args.untuned:
        compile_untuned()
    args.parts = set(args.parts or ["a", "b"] + (["c"] if args.compile else []))
    if "b" not in args.parts:
        args.recompute_tokens = 0
    device = setup_machine(args)
    max_len = args.prompt_len + max(args.new_tokens, args.recompute_tokens)
    if args.size:
        named = named_config(args.size)
        args.dim, args.layers, args.heads, args.kv_heads = named.dim, named.n_layers, named.n_heads, named.n_kv_heads
        args.ffn, args.vocab = named.ffn_hidden, named.vocab_size
        args.bits = args.bits if args.bits is not None else named.latent_units
        config = named.replace(max_seq_len=max_len, latent_units=args.bits)
    else:
        args.bits = args.bits if args.bits is not None else 16
        config = model_config(args, max_seq_len=max_len, latent_units=args.bits)
    element_bytes = torch_dtype(args.dtype).itemsize

    print(describe_machine(device))
    limits = matmul_limits_gflops(device, bandwidth=True, smoke=args.smoke)
    print(describe_limits(limits))
    print(
        f"{describe_size(args)}{' (' + args.size + ')' if args.size else ''} "
        f"H={args.bits}, prompt {args.prompt_len} tokens, {args.dtype}{', compiled decoding' if args.compile else ''}"
    )

    if "a" in args.parts:
        print(
            f"(a) Free vs baseline, KV cache, {args.new_tokens} new tokens, temperature 1, prior latents, "
            f"{args.rounds} rounds; target Free / baseline >= {TARGET_FREE_VS_BASELINE}"
        )
        print(
            f"{'B':>3} | {'free tok/s':>10} {'base tok/s':>10} {'free/base':>9} {'control':>7} | "
            f"model GFLOP/s free base | roof free  base | target"
        )
    at_target = args.size == "paper-1.5b" and args.dtype == "bf16" and device.type == "cuda" and args.compile
    for batch in args.batch if "a" in args.parts else ():
        free_s, base_s, ratio, control, first = free_vs_baseline(config, batch, args, device)
        flops = cached_decode_flops(config, batch, args.prompt_len, args.new_tokens)
        roofline_s = cached_decode_bytes(config, batch, args.prompt_len, args.new_tokens, element_bytes) / (
            limits["copy_gbps"] * 1e9
        )
        tokens = batch * args.new_tokens
        target = "PASS" if ratio >= TARGET_FREE_VS_BASELINE else "FAIL"
        print(
            f"{batch:>3} | {tokens / free_s:>10.1f} {tokens / base_s:>10.1f} {ratio:>9.3f} {control:>7.3f} | "
            f"{'':>14}{flops / free_s / 1e9:>4.1f} {flops / base_s / 1e9:>4.1f} | "
            f"{'':>4}{roofline_s / free_s:>5.1%} {roofline_s / base_s:>5.1%} | {target}",
            flush=True,
        )
        print(
            "    first call of each instance (compiles and captures under --compile), s: "
            + ", ".join(f"{name} {seconds:.1f}" for name, seconds in first.items()),
            flush=True,
        )
        if at_target:
            write_decode_figures(args.figures, batch, tokens / free_s, roofline_s / free_s, ratio, first)

    if args.recompute_tokens:
        n = args.recompute_tokens
        print(
            f"(b) Free Transformer, B=1, greedy, {n} new tokens: KV cache vs recomputing the prefix, "
            f"{args.recompute_rounds} rounds; target >= {TARGET_CACHE_SPEEDUP:g}x at {TARGET_CACHE_TOKENS} tokens"
        )
        cached_s, recompute_s, speedup, same = cache_vs_recompute(config, args, device)
        cached_flops = cached_decode_flops(config, 1, args.prompt_len, n)
        recompute_flops = recompute_decode_flops(config, 1, args.prompt_len, n)
        target = ("PASS" if speedup >= TARGET_CACHE_SPEEDUP else "FAIL") if n == TARGET_CACHE_TOKENS else ""
        print(f"{'':>9} | {'tok/s':>8} {'seconds':>8} {'GFLOP':>7} {'GFLOP/s':>7}")
        for name, seconds, flops in (("cached", cached_s, cached_flops), ("recompute", recompute_s, recompute_flops)):
            print(f"{name:>9} | {n / seconds:>8.1f} {seconds:>8.2f} {flops / 1e9:>7.1f} {flops / seconds / 1e9:>7.1f}")
        print(f"recompute / cached time: {speedup:.1f}x {target}; same tokens: {same}")
    if "c" in args.parts:
        print(
            f"(c) compiled decoding, {args.new_tokens} new tokens, temperature 1: graph == the engine's step eagerly "
            "(must hold); share of tokens equal to eager decoding"
        )
        for batch in args.batch:
            same, agreement = graph_vs_eager(config, batch, args, device)
            print(
                f"B={batch}: graph == the step eagerly: {same} {'PASS' if same else 'FAIL'}; "
                f"equal to eager decoding: {agreement:.1%}",
                flush=True,
            )
    if "d" in args.parts:
        print_static_step(config, args, device, limits, element_bytes)
    print(
        "control: two baseline instances timed in every round (A/A), tokens/s of the second / the first: "
        "what noise and memory placement alone do to a ratio; roof = (weights + KV-cache bytes read) / copy "
        "bandwidth / measured time (targets on a GPU, paper-1.5b bf16: B=1 roof >= 60% and free/base >= 0.97; "
        "B=16 free/base >= 0.98)"
    )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
