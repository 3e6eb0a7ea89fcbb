"""`free-transformer rl`: a learned prior over Z, or GRPO over Z or over the tokens, from a trained run."""

from __future__ import annotations

from pathlib import Path

NAME = "rl"
HELP = (
    "reinforcement learning from a trained run: GRPO over the latent decisions Z (--actions latent) or over the "
    "tokens (--actions tokens) with a verifier's reward, or the learned prior over Z (--learned-prior)"
)
EPILOG = """examples (a run of the letters; each writes a run that generate, eval, serve and convert take):
  free-transformer rl runs/letters --learned-prior --out runs/letters-prior steps=200
  free-transformer rl runs/letters --reward letters --actions latent --out runs/letters-rl steps=100
  free-transformer rl runs/letters --reward letters --actions tokens --out runs/letters-tokens steps=100 lr=3e-5
  free-transformer rl runs/letters-prior --reward letters --actions latent --reference learned --out runs/rl-2
  free-transformer rl runs/shake --reward eval:nq --actions latent --out runs/shake-nq steps=100

Z from the trained head: generate RUN --latents policy. SIGTERM or Ctrl-C saves a checkpoint at the next step
and exits (143 / 130); --resume --out DIR continues. Under torchrun, each process rolls out its share of the
prompts and the gradients are all-reduced.

"""


def epilog(argv: list[str]) -> str:
    from ..train.rl.config import rl_settings_help

    return EPILOG + rl_settings_help()


def add_arguments(parser) -> None:
    parser.add_argument(
        "source", nargs="?", metavar="RUN", help="the trained run (or checkpoint) to start from; left out with --resume"
    )
    parser.add_argument("overrides", nargs="*", metavar="field=value", help="settings, e.g. steps=200 group=16")
    parser.add_argument("--out", "-o", required=True, help="the run directory to write")
    parser.add_argument(
        "--reward",
        metavar="REWARD",
        help="the verifier: letters, coins, or eval:TASK, a generative task of free-transformer eval (em: gsm8k, "
        "nq, tqa; code: humaneval, mbpp, its tests run in the sandbox), rewarded 1 when its own checker passes",
    )
    parser.add_argument(
        "--actions", choices=["latent", "tokens"], help="what GRPO chooses: Z (the decoder frozen) or the tokens"
    )
    parser.add_argument(
        "--learned-prior",
        action="store_true",
        help="train the head to match the encoder's posterior on the run's data (no reward): a learned prior",
    )
    parser.add_argument(
        "--reference",
        choices=["uniform", "learned"],
        default=None,
        help="the latent policy's KL is to the uniform prior (default) or to the learned prior RUN holds",
    )
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")


def run(args) -> int:
    from ..train.rl.trainer import Mode, RLError, RLSetup, run_rl

    overrides = list(args.overrides)
    if args.source is not None and "=" in args.source:  # `rl --resume --out D steps=N`: the first override
        overrides.insert(0, args.source)
        args.source = None
    setup = None
    given = args.source is not None or args.reward or args.actions or args.learned_prior or args.reference
    if given:
        if args.source is None:
            raise RLError("give the run to start from (or --resume --out DIR alone)")
        if args.learned_prior and args.actions:
            raise RLError("--learned-prior trains the head against the encoder: leave --actions out")
        if not args.learned_prior and args.actions is None:
            raise RLError("give --actions latent or tokens (GRPO), or --learned-prior")
        from ..train.rl.rewards import check_reward_name

        if args.reward is not None:
            check_reward_name(args.reward)
        mode: Mode = "prior" if args.learned_prior else args.actions
        setup = RLSetup(str(Path(args.source)), mode, args.reward, args.reference or "uniform")
    elif not args.resume:
        raise RLError("give the run to start from, with --actions or --learned-prior")
    result = run_rl(setup, args.out, overrides, resume=args.resume)
    from ..distributed.env import is_main_process

    if is_main_process():
        shown = ", ".join(
            f"{k} {v:.4g}" for k, v in result.metrics.items() if k in ("reward", "kl_bits", "kl_encoder_bits")
        )
        print(f"done: step {result.step}{', ' + shown if shown else ''}; run in {result.run_dir}")
    return 0
