"""The GPU targets of docs/gpu.md, one owner: each figure's id, what it measures, its threshold, and the
step of scripts/gpu-check.sh that reads it. The benchmarks compare against these thresholds and write
what they measured as figures (write_figure: one JSON line each), from which the check's report opens
with one table, target against measured.

Every target is for paper-1.5b in bf16 on one H100 or H200 unless its text says otherwise; a figure with
no threshold is recorded for reading (compile times, the tuned decoding step).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    what: str  # the figure, in words
    unit: str  # "%" (a share, stored as a fraction), "x", "GiB", "tok/s", "s"
    at_least: float | None = None  # passes when the figure is >= this
    at_most: float | None = None  # passes when the figure is <= this

    def passed(self, value: float) -> bool | None:
        if math.isnan(value):
            return False
        if self.at_least is not None:
            return value >= self.at_least
        if self.at_most is not None:
            return value <= self.at_most
        return None

    def threshold(self) -> str:
        if self.at_least is None and self.at_most is None:
            return "-"
        op, bound = (">=", self.at_least) if self.at_least is not None else ("<=", self.at_most)
        return f"{op} {format_value(bound, self.unit)}"


def format_value(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value:.1%}"
    if unit == "tok/s":
        return f"{value:,.0f} tok/s"
    if unit == "x":
        return f"{value:.3f}x"
    return f"{value:.1f} {unit}"


TARGETS: dict[str, Target] = {
    # bench/step.py --size paper-1.5b --dtype bf16 --bits 16 --compile (B=4, T=2048)
    "train-base-mfu": Target("baseline training MFU, compiled", "%", at_least=0.60),
    "train-peak": Target("training peak memory, Free H=16, compiled", "GiB", at_most=45.0),
    "train-free-per-flop": Target("Free H=16 / baseline step time per FLOP, compiled", "x", at_most=1.05),
    "train-free-per-flop-eager": Target("Free H=16 / baseline step time per FLOP, eager", "x", at_most=1.05),
    # bench/generate.py --size paper-1.5b --dtype bf16 --compile (generate(compile=True), 64 new tokens)
    "decode-b1-roof": Target("decoding B=1, share of the bandwidth roofline, compiled", "%", at_least=0.60),
    "decode-b1-free-base": Target("decoding B=1, Free / baseline tokens/s, compiled", "x", at_least=0.97),
    "decode-b16-tokens": Target("decoding B=16, tokens/s, compiled", "tok/s", at_least=8000.0),
    "decode-b16-free-base": Target("decoding B=16, Free / baseline tokens/s, compiled", "x", at_least=0.98),
    # bench/serve.py --size paper-1.5b --dtype bf16 --compile --clients 16 (serve --compile on)
    "serve-b16-vs-offline": Target(
        "serve: 16 concurrent clients / offline generate(compile=True) B=16, tokens/s", "x", at_least=0.7
    ),
    # bench/mapper.py --quick --dtype bf16 on CUDA: (H, N, D) = (16, 8192, 1536)
    "mapper-matmul-x": Target("Binary Mapper fwd+bwd / its dR @ W^T matmul, H=16, N=8192, D=1536", "x", at_most=3.0),
    # bench/peers.py at L=16, D=1024, T=1024, B=8: x-transformers / ours
    **{
        f"peers-{dtype}-h{bits}-{what}": Target(
            f"vs x-transformers {dtype} H={bits}: {what} x (theirs / ours)", "x", at_least=bound
        )
        for dtype in ("bf16", "fp32")
        for bits, bounds in ((16, {"time": 2.0, "memory": 3.0}), (8, {"time": 1.0, "memory": 1.0}))
        for what, bound in bounds.items()
    },
    # free-transformer demo --preset paper --seeds 3 --device cuda: its wall time
    "demo-paper-seconds": Target("demo --preset paper --seeds 3 on the GPU, wall time", "s", at_most=300.0),
    # figures without a threshold
    "decode-compile-cold": Target("decoding: first generate(compile=True) call, cold caches", "s"),
    "decode-compile-warm": Target("decoding: the same for a second model of the same shapes", "s"),
    "decode-step-b1-roof-tuned": Target("decoding step alone B=1, coordinate-descent tuned: roofline share", "%"),
    "decode-step-b1-roof-untuned": Target("decoding step alone B=1, untuned: roofline share", "%"),
    # bench/engine.py --presets paper-1.5b --dtype bf16: eager generate() / a bare loop of the model's forwards
    "engine-b1-vs-bare": Target("eager decoding B=1: the engine / a bare loop of forwards, time", "x"),
    "engine-b16-vs-bare": Target("eager decoding B=16: the engine / a bare loop of forwards, time", "x"),
    # bench/engine.py --policy --presets paper-1.5b --dtype bf16: generate(latents="policy") / latents="prior"
    "policy-b1-vs-prior": Target("eager decoding B=1: Z from a policy head / from the prior, time", "x", at_most=1.15),
    "policy-b16-vs-prior": Target("eager decoding B=16: the same", "x", at_most=1.15),
}


def write_figure(path: str | None, target_id: str, value: float, note: str = "") -> None:
    """Append one measured figure to `path` (JSON lines; nothing when path is None), as soon as it is known,
    so that a run cut short keeps every figure it reached."""
    if path is None:
        return
    target = TARGETS[target_id]
    line = {
        "id": target_id,
        "value": value,
        "unit": target.unit,
        "target": target.threshold(),
        "passed": target.passed(value),
        "note": note,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def read_figures(path: str) -> dict[str, dict]:
    """The figures written to `path`, the last one of each id kept."""
    figures: dict[str, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    figures[record["id"]] = record
    return figures
