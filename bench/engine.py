"""The decoding engine against a bare loop of its model's forwards: what a step costs beyond the model.

Two ways to sample the same rows and tokens from one random model (`--presets`, named sizes), B rows of a
`--prompt-len`-token prompt, `--new-tokens` new tokens each, temperature 1, no filter, no stop token:
- **engine**: `free_transformer.generate()` (the decoding engine, eager), one seed per row;
- **bare**: the model's own forwards and nothing else: a prefill of the prompts into a KV cache (Z from the
  encoder, as generate's default), then one token a step from the cache (Z from the prior), each next token
  `torch.multinomial` of the softmax of the last logits, one generator for the batch, nothing read back.

A step is one call of the model (the prefill is the first): a call of either variant takes `--new-tokens` of
them. Every call of the model's forward is timed (its `forward` wrapped: on a CPU with the host's clock, on
CUDA by events recorded around it, read after the call), so each variant's wall time splits into the model's
time and the rest, the host time a step spends outside the model's call (on CUDA: the wall time in which the
device is not running the model). Both variants are timed in interleaved rounds in one process after one
warm-up call each; printed: each median ms per step, the median of the per-round ratios engine / bare, and
each variant's ms per step outside the model.

--leave-at N measures instead what a row leaving costs against a step: B rows of N-token prompts in an engine
of B slots; a step of them (median of --rounds), then the first row ended (`finish`), --rounds times: its
keys and values zeroed, the last row's moved into its slot (N positions each, every layer) and that slot
zeroed. Printed: each in ms, and the leave as a share of a step and of the row's --new-tokens steps.

--baseline-src PATH runs the same measurement on another checkout's package (a `src` folder, e.g. a
`git worktree` of an older commit) beside this one's: two worker processes, one per package, take turns
call by call, and the table adds the other code's engine and bare loop, its engine's host time outside the
model, and the ratio engine / other engine.

--policy measures instead what drawing Z from a policy head inside the step costs: the same models with a policy
head (model.latent.policy, random weights), `generate()` with latents="prior" against latents="policy", interleaved;
printed: each median ms per step and the median of the per-round ratios policy / prior (with --baseline-src, the
other code's too, and the ratio of the two codes' policy steps). --policy --steps times the engine's step alone
instead (no prefill: the rows rewound to the end of their prompts, then --new-tokens - 1 steps), eager and compiled
by Inductor (on a CPU too; the first step of each engine compiles, minutes at cpu-small), the variants interleaved.

--host-only makes every one-token forward return the first one's output of its batch size (the prefill still
runs the model): each variant's time a step is then its host work alone, the engine's against the bare loop's
softmax and multinomial (and, with --baseline-src, against the other code's).

    PYTHONPATH=src python bench/engine.py [--presets debug cpu-small] [--batch 1 16 64] [--prompt-len 32]
                                          [--new-tokens 96] [--rounds 5] [--threads T] [--device cpu|cuda]
                                          [--dtype fp32|bf16] [--baseline-src PATH] [--leave-at N] [--host-only]
                                          [--policy [--steps]] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from common import (
    add_machine_arguments,
    add_smoke_argument,
    describe_machine,
    interleaved_times,
    median_ratio,
    rewind_rows,
    setup_machine,
    sync,
)
from targets import TARGETS, write_figure

import free_transformer
from free_transformer.base.devices import DTYPE_NAMES, torch_dtype
from free_transformer.model.config import named_config
from free_transformer.model.transformer import FreeTransformer

VARIANTS = ("engine", "bare")
POLICY_VARIANTS = ("prior", "policy")  # --policy: generate() with latents="prior" and with latents="policy"
# The prior's name as every version of the model's forward takes it (LatentChoice.PRIOR's value), so that the
# bare loop runs unchanged on an older checkout (--baseline-src).
PRIOR = "prior"
# The size whose ratios --figures writes (bench/targets.py: engine-b1-vs-bare, engine-b16-vs-bare, and with
# --policy policy-b1-vs-prior, policy-b16-vs-prior).
FIGURES_PRESET = "paper-1.5b"


@dataclass
class Sample:
    """One timed call: its wall time, the time inside the model's forward, and the forward's calls."""

    wall: float
    model: float
    calls: int


class ForwardTimer:
    """Times every call of one model's forward (the instance's `forward` wrapped, so that `model(...)` and
    `model.forward(...)` are both seen, whatever calls them). On CUDA a pair of events is recorded around
    each call and read after the timed call (no synchronisation inside it)."""

    def __init__(self, model: FreeTransformer, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple] = []
        forward = model.forward

        def timed(*args, **kwargs):
            start = self._mark()
            out = forward(*args, **kwargs)
            self.spans.append((start, self._mark()))
            return out

        model.forward = timed  # type: ignore[method-assign]

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self) -> float:
        """The time inside the forward since the last call of `seconds` (read after the device synchronised)."""
        spans, self.spans = self.spans, []
        if self.cuda:
            return sum(start.elapsed_time(end) for start, end in spans) / 1000
        return sum(end - start for start, end in spans)

    def calls(self) -> int:
        return len(self.spans)


def stub_steps(model: FreeTransformer) -> None:
    """Make every one-token forward of `model` return the first one's output of its batch size (a prefill still
    runs the model): what is left of a step's time is the caller's host work."""
    forward, first = model.forward, {}

    def stubbed(tokens, *args, **kwargs):
        if tokens.shape[1] > 1:
            return forward(tokens, *args, **kwargs)
        if tokens.shape[0] not in first:
            first[tokens.shape[0]] = forward(tokens, *args, **kwargs)
        return first[tokens.shape[0]]

    model.forward = stubbed


@torch.no_grad()
def bare_loop(model: FreeTransformer, prompts: torch.Tensor, new_tokens: int, generator: torch.Generator):
    """(B, new_tokens) tokens sampled with the model's forwards alone: prefill, then one token a step."""
    B, P = prompts.shape
    cache = model.new_cache(B, capacity=P + new_tokens - 1)
    logits = model(prompts, cache=cache, generator=generator).logits[:, -1]  # (B, V), Z from the encoder
    tokens = []
    for step in range(new_tokens):
        token = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)  # (B, 1)
        tokens.append(token)
        if step + 1 < new_tokens:
            logits = model(token, latents=PRIOR, cache=cache, generator=generator).logits[:, -1]
    return torch.cat(tokens, 1)


class Bench:
    """The models and forward timers of one package, and one timed call of a variant (its B prompts drawn from a
    generator seeded with B: the same rows in every call, in this package and another's)."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.device, self.new_tokens, self.prompt_len = device, args.new_tokens, args.prompt_len
        self.models: dict[str, tuple[FreeTransformer, ForwardTimer]] = {}
        for preset in args.presets:
            config = named_config(preset)  # its context stretched to the positions asked for (RoPE tables only)
            config = config.replace(max_seq_len=max(config.max_seq_len, args.prompt_len + args.new_tokens - 1))
            torch.manual_seed(0)
            if args.policy:
                config = config.replace(latent=dataclasses.replace(config.latent, policy=True))
            with torch.device(device):  # initialised where it runs (a paper-size model on the host takes minutes)
                model = FreeTransformer(config).to(torch_dtype(args.dtype)).eval()
            if args.host_only:
                stub_steps(model)
            self.models[preset] = (model, ForwardTimer(model, device))
        self.generator = torch.Generator(device=device)

    def call(self, preset: str, batch: int, variant: str) -> Sample:
        model, timer = self.models[preset]
        generator = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, model.config.vocab_size, (batch, self.prompt_len), generator=generator)
        prompts = prompts.to(self.device)
        sync(self.device)
        timer.seconds()
        started = time.perf_counter()
        if variant in ("engine", *POLICY_VARIANTS):
            latents = {"engine": {}, "prior": {"latents": "prior"}, "policy": {"latents": "policy"}}[variant]
            config = free_transformer.GenerationConfig(max_new_tokens=self.new_tokens)
            tokens = free_transformer.generate(model, prompts, config, seeds=list(range(batch)), **latents).tokens
        else:
            tokens = bare_loop(model, prompts, self.new_tokens, self.generator.manual_seed(0)).tolist()
        sync(self.device)
        wall = time.perf_counter() - started
        calls = timer.calls()
        assert [len(row) for row in tokens] == [self.new_tokens] * batch, "every row decodes every new token"
        return Sample(wall, timer.seconds(), calls)


def leave_costs(model: FreeTransformer, batch: int, positions: int, rounds: int, device) -> tuple[float, float]:
    """(a step's seconds, a row's leave's seconds), medians: `batch` rows of `positions`-token prompts in an engine
    of `batch` slots, their steps, then `rounds` rows ended one after the other (each moves the last row's cache)."""
    from free_transformer.inference.engine import DecodeEngine, Row  # here: --baseline-src may predate the engine

    engine = DecodeEngine(model, batch, capacity=positions + rounds + 1)
    config = free_transformer.GenerationConfig(max_new_tokens=rounds + 2)
    generator = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, model.config.vocab_size, (batch, positions), generator=generator).tolist()
    engine.add([Row(prompt, config, seed) for seed, prompt in enumerate(prompts)])
    steps, leaves = [], []
    for _ in range(rounds):
        sync(device)
        started = time.perf_counter()
        engine.step()
        sync(device)
        steps.append(time.perf_counter() - started)
    for _ in range(rounds):
        sync(device)
        started = time.perf_counter()
        engine.finish(engine.rows[0])
        sync(device)
        leaves.append(time.perf_counter() - started)
    return statistics.median(steps), statistics.median(leaves)


def report_leaves(args: argparse.Namespace, device) -> None:
    print(f"a row leaving at {args.leave_at} positions against a step, medians of {args.rounds}; ms")
    print(f"{'preset':>10} {'B':>3} | {'step':>8} {'leave':>8} | {'leave/step':>10} {'leave/row steps':>15}")
    bench = Bench(args, device)
    for preset, (model, _) in bench.models.items():
        for batch in args.batch:
            if batch <= args.rounds:
                raise SystemExit(f"--leave-at needs more rows than --rounds ({args.rounds}), got B={batch}")
            step, leave = leave_costs(model, batch, args.leave_at, args.rounds, device)
            print(
                f"{preset:>10} {batch:>3} | {1000 * step:8.3f} {1000 * leave:8.3f} | {leave / step:9.2f}x "
                f"{leave / (step * args.new_tokens):14.2%}"
            )


class Worker:
    """This script run as `--worker` on another package: one JSON request a line in, one Sample a line out."""

    def __init__(self, src: Path, argv: list[str]):
        env = {**os.environ, "PYTHONPATH": str(src)}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.package = self._read()["package"]

    def _read(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"the worker on {self.process.args} ended (exit status {self.process.wait()})")
        return json.loads(line)

    def call(self, preset: str, batch: int, variant: str) -> Sample:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps([preset, batch, variant]) + "\n")
        self.process.stdin.flush()
        return Sample(**self._read())

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def serve_requests(bench: Bench) -> None:
    """The worker's loop: announce the package, then answer each request until stdin closes."""
    print(json.dumps({"package": str(Path(free_transformer.__file__).parent)}), flush=True)
    for line in sys.stdin:
        preset, batch, variant = json.loads(line)
        print(json.dumps(asdict(bench.call(preset, batch, variant))), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_machine_arguments(parser)
    parser.add_argument("--presets", nargs="+", default=["debug", "cpu-small"], help="named model sizes")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="rows decoded together")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32", help="weights and KV cache dtype")
    parser.add_argument("--baseline-src", type=Path, help="another checkout's src folder, measured beside this one")
    parser.add_argument("--leave-at", type=int, metavar="N", help="measure a row leaving at N positions instead")
    parser.add_argument("--policy", action="store_true", help="measure Z from a policy head against the prior instead")
    parser.add_argument("--steps", action="store_true", help="with --policy: the step alone, eager and by Inductor")
    parser.add_argument(
        "--host-only",
        action="store_true",
        help="every one-token forward returns the first one's output: a step's time is its host work alone",
    )
    parser.add_argument(
        "--figures",
        metavar="PATH",
        help=f"append the ratios at {FIGURES_PRESET}, B=1 and 16 (bench/targets.py) to PATH",
    )
    add_smoke_argument(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.presets, args.batch, args.prompt_len, args.new_tokens, args.rounds = ["debug"], [1, 2], 4, 3, 1
        if args.leave_at is not None:
            args.batch, args.leave_at = [2], min(args.leave_at, 16)
        if args.steps:  # each batch size compiles two steps
            args.batch = [2]
    if args.leave_at is not None:  # the models' context must hold the prompts and their steps
        args.prompt_len = max(args.prompt_len, args.leave_at + args.rounds + 2 - args.new_tokens)
    return args


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The options a worker needs to build the same models and prompts."""
    return [
        *("--device", args.device, "--threads", str(args.threads), "--dtype", args.dtype),
        *("--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--presets", *args.presets),
        *(["--host-only"] if args.host_only else []),
        *(["--policy"] if args.policy else []),
    ]


def main() -> None:
    args = parse_args()
    device = setup_machine(args)
    if args.worker:
        serve_requests(Bench(args, device))
        return
    print(describe_machine(device))
    if args.leave_at is not None:
        report_leaves(args, device)
        return
    if args.steps:
        if not args.policy or args.baseline_src is not None:
            raise SystemExit("--steps measures the policy's step (--policy), in this code alone (no --baseline-src)")
        report_policy_steps(args, device)
        return
    print(
        f"presets {', '.join(args.presets)}; B in {args.batch}; prompts of {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens (steps: the prefill and {args.new_tokens - 1} one-token steps); {args.dtype}"
        + ("; latents prior against policy" if args.policy else "")
    )
    sides: dict[str, Bench | Worker]
    if args.baseline_src is None:
        sides = {"": Bench(args, device)}
    else:
        if not (args.baseline_src / "free_transformer" / "__init__.py").is_file():
            raise SystemExit(f"--baseline-src {args.baseline_src}: no free_transformer package there")
        here = Path(free_transformer.__file__).parent.parent
        sides = {"": Worker(here, worker_argv(args)), "other ": Worker(args.baseline_src, worker_argv(args))}
        for name, side in sides.items():
            print(f"{name or 'this '}code: {side.package}")  # type: ignore[union-attr]
    cases = [(preset, batch) for preset in args.presets for batch in args.batch]
    samples: dict[tuple, list[Sample]] = {}
    try:
        for _ in range(args.rounds + 1):  # the first round warms up
            for preset, batch in cases:
                for name, side in sides.items():
                    for variant in POLICY_VARIANTS if args.policy else VARIANTS:
                        samples.setdefault((preset, batch, name + variant), []).append(
                            side.call(preset, batch, variant)
                        )
    finally:
        for side in sides.values():
            if isinstance(side, Worker):
                side.close()
    kept = {key: values[1:] for key, values in samples.items()}
    (report_policy if args.policy else report)(args, cases, kept, list(sides))


def ms_per_step(samples: list[Sample], steps: int, part: str = "wall") -> float:
    """The median ms per step of `samples`: of the whole call ("wall"), inside the model, or outside it."""
    values = [{"wall": s.wall, "model": s.model, "outside": s.wall - s.model}[part] for s in samples]
    return 1000 * statistics.median(values) / steps


def wall_ratio(numerator: list[Sample], denominator: list[Sample]) -> float:
    return median_ratio([s.wall for s in numerator], [s.wall for s in denominator])


def report(args: argparse.Namespace, cases: list[tuple], samples: dict[tuple, list[Sample]], sides: list[str]) -> None:
    steps = args.new_tokens
    print(f"ms per step, medians of {args.rounds} interleaved rounds (ratio: median of the per-round ratios)")
    header = f"{'preset':>10} {'B':>3} | {'engine':>7} {'bare':>7} {'ratio':>6} | in the model: {'engine':>7} "
    header += f"{'bare':>7} | outside: {'engine':>7} {'bare':>7}"
    if len(sides) > 1:
        header += f" | other code: {'engine':>7} {'bare':>7} {'engine outside':>14} {'engine/other':>12}"
    print(header)
    for preset, batch in cases:
        of = {variant: samples[(preset, batch, variant)] for variant in (side + v for side in sides for v in VARIANTS)}
        engine_vs_bare = wall_ratio(of["engine"], of["bare"])
        line = (
            f"{preset:>10} {batch:>3} | {ms_per_step(of['engine'], steps):7.3f} {ms_per_step(of['bare'], steps):7.3f}"
        )
        line += f" {engine_vs_bare:5.2f}x | {'':>13} "
        line += " ".join(f"{ms_per_step(of[v], steps, 'model'):7.3f}" for v in VARIANTS) + f" | {'':>8} "
        line += " ".join(f"{ms_per_step(of[v], steps, 'outside'):7.3f}" for v in VARIANTS)
        if len(sides) > 1:
            line += f" | {'':>11} " + " ".join(f"{ms_per_step(of['other ' + v], steps):7.3f}" for v in VARIANTS)
            line += f" {ms_per_step(of['other engine'], steps, 'outside'):14.3f}"
            line += f" {wall_ratio(of['engine'], of['other engine']):11.2f}x"
        print(line)
        calls = {values[0].calls for values in of.values()}
        if calls != {steps}:  # a forward the timer did not see (inside a compiled graph): "in the model" is not valid
            print(f"{'':>15}note: the model's forward was timed {sorted(calls)} times a call, not {steps}")
        if preset == FIGURES_PRESET and f"engine-b{batch}-vs-bare" in TARGETS:
            write_figure(args.figures, f"engine-b{batch}-vs-bare", engine_vs_bare, f"{preset} {args.dtype}, eager")


def report_policy(args: argparse.Namespace, cases: list[tuple], samples: dict[tuple, list[Sample]], sides: list[str]):
    """--policy's table: Z from the prior against Z from the policy head, in this code and the other's."""
    steps = args.new_tokens
    print(f"ms per step, medians of {args.rounds} interleaved rounds (ratio: median of the per-round ratios)")
    header = f"{'preset':>10} {'B':>3} | {'prior':>7} {'policy':>7} {'policy/prior':>12}"
    if len(sides) > 1:
        header += f" | other code: {'prior':>7} {'policy':>7} {'policy/prior':>12} | {'policy/other':>12}"
    print(header)
    for preset, batch in cases:
        of = {v: samples[(preset, batch, v)] for v in (side + v for side in sides for v in POLICY_VARIANTS)}
        line = f"{preset:>10} {batch:>3} |"
        for side in sides:
            prior, policy = of[side + "prior"], of[side + "policy"]
            line += " | other code:" if side else ""
            line += f" {ms_per_step(prior, steps):7.3f} {ms_per_step(policy, steps):7.3f}"
            line += f" {wall_ratio(policy, prior):11.2f}x"
        if len(sides) > 1:
            line += f" | {wall_ratio(of['policy'], of['other policy']):11.2f}x"
        print(line)
        if preset == FIGURES_PRESET and f"policy-b{batch}-vs-prior" in TARGETS:
            ratio = wall_ratio(of["policy"], of["prior"])
            write_figure(args.figures, f"policy-b{batch}-vs-prior", ratio, f"{preset} {args.dtype}, eager")


def policy_step_times(model: FreeTransformer, batch: int, args: argparse.Namespace, device) -> dict[str, float]:
    """{engine: median seconds per step} of four engines on the same B rows (seeds 0..B-1): Z from the prior and
    from the policy, each eager and compiled by Inductor. A timed sample is the rows rewound to the end of their
    prompt, then --new-tokens - 1 steps (the step attends the whole cache under a mask: its cost does not depend
    on the values)."""
    from free_transformer.inference.engine import DecodeEngine, Row  # here: --baseline-src may predate the engine

    prompts = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=torch.Generator())
    sampling = free_transformer.GenerationConfig(max_new_tokens=args.new_tokens + 1)  # no row ends in a sample
    capacity, n = args.prompt_len + args.new_tokens, args.new_tokens - 1
    engines = {}
    for compiled in (False, True):
        for latents in POLICY_VARIANTS:
            engine = DecodeEngine(model, batch, capacity=capacity, compile=compiled, inductor=compiled)
            engine.add([Row(ids, sampling, seed, latents) for seed, ids in enumerate(prompts.tolist())])
            engines[f"{latents}{', Inductor' if compiled else ''}"] = engine

    @torch.inference_mode()
    def run(engine):
        rewind_rows(engine, args.prompt_len)
        for _ in range(n):
            engine.step()
        assert len(engine.rows) == batch and all(len(row.tokens) == 1 + n for row in engine.rows), "every row steps"

    for name, engine in engines.items():
        started = time.perf_counter()
        run(engine)  # compiles the Inductor engines
        print(f"  {model.config.dim}-wide, B={batch}: {name} warmed up in {time.perf_counter() - started:.1f} s")
    times = interleaved_times(
        {name: functools.partial(run, engine) for name, engine in engines.items()}, args.rounds, device
    )
    return {name: [t / n for t in values] for name, values in times.items()}


def report_policy_steps(args: argparse.Namespace, device) -> None:
    print(f"the engine's step alone, {args.new_tokens - 1} steps after {args.prompt_len} positions; {args.dtype}")
    lines = []
    for preset in args.presets:
        config = named_config(preset)
        config = config.replace(max_seq_len=max(config.max_seq_len, args.prompt_len + args.new_tokens))
        config = config.replace(latent=dataclasses.replace(config.latent, policy=True))
        torch.manual_seed(0)
        with torch.device(device):
            model = FreeTransformer(config).to(torch_dtype(args.dtype)).eval()
        for batch in args.batch:
            times = policy_step_times(model, batch, args, device)
            line = f"{preset:>10} {batch:>3} |"
            for suffix in ("", ", Inductor"):
                prior, policy = times["prior" + suffix], times["policy" + suffix]
                line += f" {1000 * statistics.median(prior):7.3f} {1000 * statistics.median(policy):7.3f}"
                line += f" {median_ratio(policy, prior):11.2f}x |"
            lines.append(line.rstrip(" |"))
    print(f"ms per step, medians of {args.rounds} interleaved rounds (ratio: median of the per-round ratios)")
    print(f"{'':>14} | {'eager':^33} | {'compiled by Inductor':^33}")
    print(f"{'preset':>10} {'B':>3} |" + f" {'prior':>7} {'policy':>7} {'policy/prior':>12} |" * 2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
