"""A run of `free-transformer rl` at a glance (`free-transformer inspect RUN`): what it trained, from what run and
against what, from its newest checkpoint's rl section; what it reached, from metrics.jsonl. Read-only: nothing is
verified, renamed or loaded beyond the two files."""

from __future__ import annotations

from pathlib import Path

from ...model.config import ModelConfig
from ...model.latent import latent_kind
from ...runs.locate import checkpoint_dirs, read_checkpoint_config
from ..metrics import read_metrics
from .trainer import LOGGED


def rl_section(run_dir: Path) -> dict | None:
    """The rl section of the run's newest checkpoint (what `free-transformer rl` started it with), or None when the
    run holds no checkpoint or its newest is not of an rl run."""
    kept = checkpoint_dirs(run_dir)
    if not kept:
        return None
    section = read_checkpoint_config(kept[-1]).get("rl")
    return section if isinstance(section, dict) else None


def summarize_rl_run(run_dir: str | Path, history: int = 8) -> str:
    """The summary as text; `history` logged steps are listed (evenly spread). The run must hold an rl checkpoint
    (`rl_section`)."""
    run_dir = Path(run_dir)
    kept = checkpoint_dirs(run_dir)
    saved = read_checkpoint_config(kept[-1])
    rl, model = saved["rl"], ModelConfig.from_dict(saved["model"])
    config = rl.get("config") or {}
    metrics = read_metrics(run_dir / "metrics.jsonl", LOGGED)
    lines = [
        f"run {run_dir}: free-transformer rl from {rl['source']}; {_what(rl, config)}",
        f"model: {_model(model)}",
        f"steps: {metrics[-1]['step'] if metrics else 0} logged of {config.get('steps', '?')}; checkpoints: "
        + ", ".join(d.name for d in kept),
    ]
    if not metrics:
        return "\n".join(lines + ["nothing logged yet"])
    shown, last = spread(metrics, history), metrics[-1]
    if rl["mode"] == "prior":
        lines.append(
            f"step {last['step']}: KL of the encoder's posterior to the head's {last['kl_encoder_bits']:.4f} "
            f"bits/token, of the head's to the uniform prior {last['kl_uniform_bits']:.4f}"
        )
        lines.append(
            "KL to the encoder's posterior over training (bits/token): "
            + ", ".join(f"{m['step']}: {m['kl_encoder_bits']:.3f}" for m in shown)
        )
        return "\n".join(lines + _use(run_dir, rl))
    kl = f", its Z {last['kl_bits']:.4f} bits/token from the uniform prior" if rl["mode"] == "latent" else ""
    lines.append(
        f"step {last['step']} ({last['reward_calls']:,} reward calls): reward {last['reward']:.3f}, a prompt solved "
        f"by one of its group {last['solved']:.3f}; KL to the reference ({_reference(rl)}) "
        f"{max(0.0, last['kl_ref_bits']):.4f} bits/{'action' if rl['mode'] == 'latent' else 'token'}{kl}"
    )
    lines.append(
        "reward over training (reward calls: reward): "
        + ", ".join(f"{m['reward_calls']:,}: {m['reward']:.3f}" for m in shown)
    )
    return "\n".join(lines + _use(run_dir, rl))


def spread(items: list, count: int) -> list:
    """At most `count` of `items`, evenly spread, the first and the last among them."""
    if len(items) <= count:
        return items
    if count == 1:
        return items[-1:]
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def _what(rl: dict, config: dict) -> str:
    if rl["mode"] == "prior":
        return "a learned prior over Z (the head trained to match the encoder's posterior, the decoder frozen)"
    actions = (
        "GRPO over Z (the policy head trained, the decoder frozen)"
        if rl["mode"] == "latent"
        else "GRPO over the tokens (the decoder trained, Z from the prior)"
    )
    group = f"{config.get('prompts', '?')} prompts x {config.get('group', '?')} samples a step"
    return f"{actions}, reward {rl['reward']}, {group}, kl_coef {config.get('kl_coef', '?')}"


def _use(run_dir: Path, rl: dict) -> list[str]:
    """How to sample with what the run trained: its head's Z, or its decoder's tokens."""
    if rl["mode"] == "tokens":
        return [f"samples: free-transformer generate {run_dir} (its decoder; Z from the prior)"]
    return [f'Z from its head: free-transformer generate {run_dir} --latents policy (Python latents="policy")']


def _reference(rl: dict) -> str:
    """What the KL penalty of a GRPO run is to."""
    if rl["mode"] == "tokens":
        return f"the decoder of {rl['source']}"
    return f"the learned prior of {rl['source']}" if rl.get("reference") == "learned" else "the uniform prior"


def _model(model: ModelConfig) -> str:
    shape = f"{model.n_layers} blocks of width {model.dim}"
    if not model.is_free:
        return f"baseline decoder (no latent); {shape}"
    head = "; a policy head" if model.latent.policy else ""
    units = latent_kind(model.latent.kind).count(model.latent_units)
    return f"Free Transformer, H = {units} ({model.latent.kind}); {shape}{head}"
