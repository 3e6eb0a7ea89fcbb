"""lm-evaluation-harness adapter: registers a checkpoint as the model type "free-transformer", so
that any lm-eval task whose data is on the machine runs on it (from Python, or from the shell with
`python -m free_transformer.eval.lm_eval_adapter run --model free-transformer --model_args
checkpoint=RUN_DIR --tasks ... --include_path TASK_DIR`).

model_args: checkpoint (required), device, latents (prior | encoder | policy), samples (K), seed,
max_new_tokens. A `device` in model_args wins over lm-eval's --device; lm-eval's own default
(cuda:0) falls back to cpu on a machine without CUDA, while a device asked for explicitly must
exist. Latents follow scoring.py: prior by default, never the encoder on the answer; requests that
share a context share their latent draws. loglikelihood_rolling returns, for a Free Transformer, the
IWAE lower bound of log p(x) (a baseline's is exact), text cut into model-sized windows whose first
token is context only.
"""

from __future__ import annotations

import hashlib
import sys

import torch

from .task_data import require

require("lm_eval", "lm-eval==0.4.13")

from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

from ..base.devices import parse_device  # noqa: E402
from ..base.errors import UserError  # noqa: E402
from ..data.tokenizer import get_tokenizer  # noqa: E402
from ..runs.checkpoint import load_model  # noqa: E402
from .likelihood import heldout_likelihood  # noqa: E402
from .scoring import continuation_logprobs, generate_texts, log_mean_exp  # noqa: E402
from .settings import EvalConfig  # noqa: E402


def _key(text: str) -> str:
    return "lm-eval/" + hashlib.sha256(text.encode()).hexdigest()[:16]


LM_EVAL_DEFAULT_DEVICE = "cuda:0"  # lm_eval.config.evaluate_config.EvaluateConfig.device


def _pick_device(device: str | None, harness_device: str | None):
    """model_args' device if given; else lm-eval's --device, whose default cuda:0 means cpu where
    there is no CUDA; else cpu."""
    if device is not None:
        return parse_device(device)
    if harness_device == LM_EVAL_DEFAULT_DEVICE and not torch.cuda.is_available():
        print(
            f"free-transformer: no CUDA here, running on cpu (lm-eval's default device is {harness_device})",
            file=sys.stderr,
        )
        return torch.device("cpu")
    return parse_device(harness_device or "cpu")


@register_model("free-transformer")
class FreeTransformerLM(LM):
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """lm-eval passes its own options (batch_size, device) beside model_args; a key in both is the
        user's model_args value (lm-eval's would raise "got multiple values for keyword argument")."""
        args = dict(arg_dict)
        for key, value in (additional_config or {}).items():
            if value is not None:
                args.setdefault("harness_device" if key == "device" else key, value)
        return cls(**args)

    def __init__(
        self,
        checkpoint: str,
        device: str | None = None,
        latents: str = "prior",
        samples: int = 4,
        seed: int = 0,
        max_new_tokens: int = 256,
        batch_size=None,
        harness_device: str | None = None,
        **_ignored,
    ) -> None:
        super().__init__()
        self.model, config = load_model(checkpoint, _pick_device(device, harness_device))
        self.tokenizer = get_tokenizer(config.get("tokenizer", "byte"))
        self.settings = EvalConfig(
            tasks="none",
            latents=latents,  # type: ignore[arg-type]  # the user's spelling: settings() parses and checks it
            latent_samples=int(samples),
            seed=int(seed),
        ).settings()
        self.settings.check_model(self.model)
        self.max_new_tokens = int(max_new_tokens)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [req.args for req in requests]
        encoded = [[(self.tokenizer.encode(c), self.tokenizer.encode(t))] for c, t in pairs]
        greedy: list = []
        draws = continuation_logprobs(self.model, encoded, [_key(c) for c, _ in pairs], self.settings, greedy=greedy)
        return [(float(log_mean_exp(d)[0]), bool(g[0].all())) for d, g in zip(draws, greedy)]

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for req in requests:
            result = heldout_likelihood(
                self.model, self.tokenizer, req.args[0], samples=self.settings.latent_samples, seed=self.settings.seed
            )
            nats = result["exact" if "exact" in result else "iwae"]["nats"]
            out.append(-nats)
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(kwargs.get("max_gen_toks", self.max_new_tokens))
            texts, _ = generate_texts(
                self.model, self.tokenizer, context, _key(context), self.settings, max_new_tokens=budget, stop=until
            )
            out.append(texts[0])
        return out


def main() -> None:
    """lm-eval's command line with the "free-transformer" model type registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm-eval"
    try:
        cli_evaluate()
    except UserError as error:  # a bad checkpoint or device: one line, as in free-transformer's own CLI
        print("error: " + " ".join(str(error).split()), file=sys.stderr)
        sys.exit(error.exit_code)


if __name__ == "__main__":
    main()
