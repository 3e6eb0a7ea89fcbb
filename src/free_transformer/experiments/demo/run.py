"""The synthetic experiment as a sweep: a baseline and Free Transformers at kappa = 1/64, 1/8, 1 and 8
bits on the paper's letters, and one on the coin flips of its Motivation section; each seed's models
are measured (blue and green groups, what Z holds), the claims judged, and a report written."""

from __future__ import annotations

import dataclasses
import json
import random
import string
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ...data import build_dataset
from ...runs.checkpoint import load_model
from ...train.config import TrainConfig, apply_overrides, load_train_config, overrides_of
from ...train.metrics import read_metrics
from ...train.validation import validate
from ..launch.launchers import Launcher
from ..launch.pool import last_step, run_work, work_done
from ..launch.sweep import Sweep, Variant
from .claims import claims_over_seeds, judge_claims
from .coins import coin_bits_saved, coin_groups, coin_measures, posterior_coin_match
from .groups import Groups, generate_groups, group_measures, mean_of_present
from .letters import latent_kl_split, latent_units
from .presets import DemoPreset
from .report import write_report

VARIANTS = (
    Variant("baseline", "baseline", None),
    Variant("kappa-1-64", "κ = 1/64 bit", 1 / 64),
    Variant("kappa-1-8", "κ = 1/8 bit", 1 / 8),
    Variant("kappa-1", "κ = 1 bit", 1.0),
    Variant("kappa-8", "κ = 8 bits", 8.0),
    Variant("coins", "coin flips, κ = 1/8 bit", 1 / 8, task="coins"),
)
# Coin sequences are short and their model tiny: COIN_GROUPS times as many groups as for the letters keep the
# green-blue difference's sampling noise well under the claim's margin (claims.COIN_OVER_BLUE).
COIN_GROUPS = 4


def demo_sweep(
    preset: DemoPreset,
    out_dir: Path,
    *,
    seeds: tuple[int, ...] = (0,),
    extra: tuple[str, ...] = (),
    device: str = "cpu",
    models: tuple[str, ...] | None = None,
) -> Sweep:
    """The demo's runs: the preset's configs, the user's overrides (`extra`) on top, a few checkpoints each.
    models: the slugs of the variants to run (default: all of VARIANTS); the claims of the others are not judged."""
    unknown = sorted(set(models or ()) - {v.slug for v in VARIANTS})
    if unknown:
        known = ", ".join(v.slug for v in VARIANTS)
        raise ValueError(f"unknown demo model(s) {', '.join(unknown)}; choose among {known}")
    variants = VARIANTS if models is None else tuple(v for v in VARIANTS if v.slug in models)

    def config(variant: Variant) -> TrainConfig:
        config = apply_overrides(preset.config(variant), list(extra))
        return dataclasses.replace(config, log_every=25, keep_checkpoints=1, checkpoint_every=max(1, config.steps // 4))

    return Sweep(out_dir, variants, seeds, config, device)


def move_one_seed_runs(out_dir: Path) -> list[str]:
    """Runs of a one-seed demo written by 0.2 or earlier (OUT/SLUG) moved to the one layout (OUT/seed-S/SLUG,
    S the seed in the run's config.yaml), where they are reused; a run already there is left alone. The moves
    made, as "OLD -> NEW"."""
    moved = []
    for variant in VARIANTS:
        old = out_dir / variant.slug
        if not (old / "config.yaml").is_file():
            continue
        new = out_dir / f"seed-{load_train_config(old / 'config.yaml').seed}" / variant.slug
        if new.exists():
            continue
        new.parent.mkdir(parents=True, exist_ok=True)
        old.rename(new)
        moved.append(f"{old} -> {new}")
    return moved


@dataclass
class ModelResult:
    variant: Variant
    measures: dict
    groups: dict  # letter, blue, greens
    wall_seconds: float | None  # its training's, when this command trained it; None: reused, trained earlier
    curves: list[dict] = field(default_factory=list)


def evaluate_all(
    preset: DemoPreset, sweep: Sweep, *, seed: int, wall: dict[str, float], device: str
) -> list[ModelResult]:
    """Every model of one seed, on `device`: validation measures, what Z holds, the groups."""
    # One token at a time is far too little work to split over threads: one thread generates fastest.
    torch.set_num_threads(1)
    results = []
    for variant in tqdm(sweep.variants, desc="generating groups", dynamic_ncols=True):
        run_dir = sweep.run_dir(seed, variant)
        model, _ = load_model(run_dir, device)
        config = sweep.train_config(variant, seed)
        measures = dict(validate(model, build_dataset(config.data, seed), config, torch.device(device)))
        measure = _coin_measures if variant.task == "coins" else _letter_measures
        more, groups = measure(model, preset, config, seed)
        results.append(
            ModelResult(
                variant,
                {**measures, **more},
                asdict(groups),
                wall.get(str(run_dir)),
                read_metrics(run_dir / "metrics.jsonl"),
            )
        )
    return results


def prompt_seed(seed: int, index: int) -> int:
    """The generation seed of the seed's index-th prompt letter (the numbers the demo has always used)."""
    return seed + 97 * index


def _letter_measures(model, preset: DemoPreset, config: TrainConfig, seed: int) -> tuple[dict, Groups]:
    """What Z carries at the target start and per '!', and the group measures averaged over two prompt
    letters; the groups of the first (the figure's one random prompt)."""
    measures = {**latent_units(model, seed=seed), **latent_kl_split(model, seed=seed)}
    letters = [random.Random(seed + k).choice(string.ascii_uppercase) for k in range(2)]
    shown: Groups | None = None
    per_prompt: dict[str, list[float | None]] = {}
    for index, letter in enumerate(letters):
        groups = generate_groups(
            model,
            letter,
            blue_size=preset.blue_size,
            green_groups=preset.green_groups,
            green_size=preset.green_size,
            seed=prompt_seed(seed, index),
        )
        shown = shown or groups
        for key, value in group_measures(groups).items():
            per_prompt.setdefault(key, []).append(value)
    measures.update({key: mean_of_present(values) for key, values in per_prompt.items()})
    assert shown is not None  # two prompt letters, each with its groups
    return measures, shown


def _coin_measures(model, preset: DemoPreset, config: TrainConfig, seed: int) -> tuple[dict, Groups]:
    length, epsilon = config.data.coinflip.length, config.data.coinflip.epsilon
    groups = coin_groups(
        model,
        length,
        blue_size=COIN_GROUPS * preset.blue_size,
        green_groups=COIN_GROUPS * preset.green_groups,
        green_size=preset.green_size,
        seed=seed,
    )
    return {
        **coin_measures(groups),
        "coin_bits_saved": coin_bits_saved(model, length, epsilon, seed=seed),
        "posterior_coin_match": posterior_coin_match(model, length, epsilon, seed=seed),
    }, groups


def run_demo(
    preset: DemoPreset,
    out_dir: Path,
    *,
    launcher: Launcher,
    seeds: tuple[int, ...] = (0,),
    extra: tuple[str, ...] = (),
    device: str = "cpu",
    models: tuple[str, ...] | None = None,
) -> Path:
    """device: the training runs' cpu, cuda or cuda:N. launcher: where they train (launchers.py), and where the
    measures and the report run once they are done. models: as demo_sweep's."""
    started = time.time()  # wall-clock time: the report may be written on another machine
    sweep = demo_sweep(preset, out_dir, seeds=seeds, extra=extra, device=device, models=models)
    for seed, variant in sweep.runs():  # every run's config is checked before anything is written
        sweep.train_config(variant, seed)
    for move in move_one_seed_runs(out_dir):
        print(f"moved into OUT/seed-S/, where every seed's runs are kept: {move}", flush=True)
    print(first_line(preset, sweep, launcher), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    wall = sweep.train(launcher)
    return launcher.finish(
        measure_and_report, preset, sweep, extra, launcher.side_by_side(len(sweep.runs())), wall, started, device=device
    )


def first_line(preset: DemoPreset, sweep: Sweep, launcher: Launcher) -> str:
    """What the demo is about to do, and how long it is expected to take: the preset's measured minutes per seed
    (DemoPreset.minutes_per_seed, every model of one seed) scaled by the training work left against one seed's
    of every model (finished runs are reused; --models trains fewer)."""
    seeds = sweep.seeds
    start = (
        f"demo: preset {preset.name}, seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}, "
        f"output {sweep.out_dir}, on {sweep.device}"
    )
    runs = sweep.runs()
    steps = run_work([sweep.train_config(variant, seed) for seed, variant in runs])
    done, _ = work_done(steps, [last_step(str(sweep.run_dir(seed, variant))) for seed, variant in runs])
    total = sum(count * step for count, step in steps)
    left = 1 - done / total
    if left == 0:
        return f"{start}; every run is trained: measures and report only"
    on_gpu = sweep.device.startswith("cuda")
    minutes = preset.minutes_per_seed.gpu if on_gpu else preset.minutes_per_seed.cpu
    where = "one H100 GPU" if on_gpu else "2 CPU cores"
    if launcher.name != "local" or minutes is None:
        return f"{start}; no time measured for this preset on {where if launcher.name == 'local' else 'Slurm'}"
    every_model = run_work([sweep.train_config(variant, seeds[0]) for variant in VARIANTS])
    seeds_of_work = total / sum(count * step for count, step in every_model)  # len(seeds) with every model
    share = "" if left == 1 else f", {100 * left:.0f}% of the training left"
    chosen = "" if len(sweep.variants) == len(VARIANTS) else f", scaled to the {len(sweep.variants)} models chosen"
    more = ", seeds side by side add less" if on_gpu and len(seeds) > 1 else ""
    return (
        f"{start}; expected time about {_duration(minutes * seeds_of_work * left)} (an estimate: {minutes:g} min a "
        f"seed measured on {where}{more}{chosen}{share})"
    )


def _duration(minutes: float) -> str:
    return f"{minutes * 60:.0f} s" if minutes < 1 else f"{minutes:.0f} min"


def measure_and_report(
    preset: DemoPreset,
    sweep: Sweep,
    extra: tuple[str, ...],
    workers: int,
    wall: dict[str, float],
    started: float,
    *,
    device: str,
) -> Path:
    """Every seed's models measured on `device`, the claims judged, results.json and the report written. wall:
    the training seconds of the runs trained by this invocation, by run directory; workers: runs trained at once."""
    seeds, out_dir = sweep.seeds, sweep.out_dir
    results = {seed: evaluate_all(preset, sweep, seed=seed, wall=wall, device=device) for seed in seeds}
    claims = {seed: judge_claims(seed_results) for seed, seed_results in results.items()}
    summary = {
        "preset": {
            "name": preset.name,
            "extra": list(extra),
            "blue_size": preset.blue_size,
            "green_groups": preset.green_groups,
            "green_size": preset.green_size,
            "not_judged": preset.not_judged,
        },
        "seeds": list(seeds),
        "workers": workers,
        "device": device,
        "latent_kind": next(
            (sweep.train_config(v, seeds[0]).model.latent.kind for v in sweep.variants if v.is_free), None
        ),
        "total_seconds": time.time() - started,
        "per_seed": {
            seed: {
                "models": [
                    {
                        "slug": r.variant.slug,
                        "label": r.variant.label,
                        "kappa_bits": r.variant.kappa_bits,
                        "train_overrides": overrides_of(sweep.train_config(r.variant, seed)),
                        "train_seconds": r.wall_seconds,
                        **r.measures,
                        "groups": r.groups,
                    }
                    for r in seed_results
                ],
                "claims": claims[seed],
            }
            for seed, seed_results in results.items()
        },
        "claims": claims_over_seeds(claims),
    }
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2))
    return write_report(out_dir, results, summary)
