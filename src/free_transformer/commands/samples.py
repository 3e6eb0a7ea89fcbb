"""What `free-transformer generate` prints for its prompts, with or without --interactive: the settings
a sample depends on and the printer of samples (text or JSON lines)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..base import settings
from ..inference.params import DEFAULT_BATCH_SIZE, SamplingError, SamplingParams, check_room, spelling, spelt_fields

if TYPE_CHECKING:  # torch is imported when a command runs, not for its --help
    from ..data.tokenizer import Tokenizer
    from ..inference.batches import Prompt
    from ..model.transformer import FreeTransformer

FORMATS = ("text", "jsonl")
# The backslash escapes --stop, --prompts-file and the interactive prompts read (a shell passes "\n" as a
# backslash and an n; a line of a file cannot hold a newline).
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\"}


# what the command line adds to a field's docstring
OPTION_NOTES = {"stop": r" The escapes \n \t \r \0 \\ are read.", "latents": " Give the text with --reference."}


# generate's defaults where they differ from SamplingParams' (which are the server's)
DEFAULTS = SamplingParams(n=4, seed=0)


def add_sampling_options(parser) -> None:
    """generate's options of the sampling settings: every field of SamplingParams that has a flag, with its
    type, default and docstring as help (base/settings.add_option)."""
    for name, flag in spelt_fields(SamplingParams, "flag").items():
        spelt = spelling(SamplingParams, name)
        settings.add_option(
            parser,
            SamplingParams,
            name,
            flag=flag,
            aliases=("-n",) if name == "n" else (),
            default=getattr(DEFAULTS, name),
            metavar=spelt.metavar,
            choices=name != "latents",
            extra_help=OPTION_NOTES.get(name, ""),
        )


def params_from(args) -> SamplingParams:
    """The sampling settings the options give, checked (a one-line ValueError naming the option)."""
    values = {name: getattr(args, name) for name in spelt_fields(SamplingParams, "flag")}
    values["stop"] = tuple(unescape(stop) for stop in values["stop"])
    return checked(values, "flag")


def checked(values: dict, surface: str) -> SamplingParams:
    """SamplingParams(**values), its refusal worded with the setting as `surface` ("flag" or "command") spells it."""
    try:
        return SamplingParams(**values)
    except SamplingError as error:
        raise ValueError(error.spelt(getattr(spelling(SamplingParams, error.field), surface))) from None


def options(params: SamplingParams) -> str:
    """The command-line options that give these settings, quoted for a POSIX shell."""
    words = [f"-n {params.n}", f"--seed {params.seed}", f"--latents {params.latents}"]
    for name, flag in spelt_fields(SamplingParams, "flag").items():
        value = getattr(params, name)
        if name == "stop":
            words += [f"{flag} {shlex.quote(escape(stop))}" for stop in value]
        elif name not in ("n", "seed", "latents") and value is not None:
            words.append(f"{flag} {shlex.quote(value if isinstance(value, str) else f'{value:g}')}")
    return " ".join(words)


@dataclass(frozen=True)
class Sampler:
    """A loaded model with the options that do not change what it samples: how samples are batched,
    compiled and printed."""

    model: FreeTransformer
    tokenizer: Tokenizer
    format: str = "text"  # one of FORMATS
    batch_size: int = DEFAULT_BATCH_SIZE
    compile: bool = False

    def sample(
        self, texts: list[str], params: SamplingParams, labels: list[str] | None = None, first_index: int = 0
    ) -> None:
        """Print every prompt's settings.n samples, in order, as they are decoded (JSON lines number the
        prompts from first_index). Every refusal comes before the first sample."""
        from ..inference.batches import sample_prompts
        from ..inference.stops import cut_at_stop, stop_check

        prompts = self.prepare(texts, params, labels)
        seed, _ = params.seeds()
        decode, stops = self.tokenizer.decode, list(params.stop)
        prompt_chars = [len(decode(prompt.ids)) for prompt in prompts]
        if params.searched:
            self._best_of(texts, [prompt.ids for prompt in prompts], params, first_index)
            return
        rows = sample_prompts(
            self.model,
            prompts,
            params.n,
            seed,
            batch_size=self.batch_size,
            should_stop=stop_check(decode, stops),
            compile=self.compile,
        )
        at_once = []  # the lines of samples that a stop string ended before their first character
        for line, row in enumerate(rows, 1):
            start = prompt_chars[row.prompt]
            text = cut_at_stop(decode(prompts[row.prompt].ids + row.tokens), stops, start)  # prompt and sample
            if self.format == "text":
                print(escape(text), flush=True)  # one line, read back by unescape
                at_once += [line] if stops and len(text) == start else []
            else:
                print(
                    json.dumps(
                        {
                            "prompt": texts[row.prompt],
                            "sample": text[start:],
                            "index": first_index + row.prompt,
                            "seed": row.seed,
                            "latents": params.latents,
                        },
                        ensure_ascii=False,
                    ),
                    flush=True,
                )
        say_stopped_at_once(at_once, stops)

    def _best_of(self, texts: list[str], ids: list[list[int]], params: SamplingParams, first_index: int) -> None:
        """Every prompt's best_of candidates, decoded as rows of one engine batch (inference.search.best_of), and
        the n printed: with best_of above n those of the highest mean token log-probability, best first; else
        every candidate in order. JSON lines add the candidate's index, its score and every candidate's."""
        from ..inference.search import best_of, ranking
        from ..inference.stops import cut_at_stop, stop_check

        seed, _ = params.seeds()
        decode, stops = self.tokenizer.decode, list(params.stop)
        found = best_of(
            self.model,
            ids,
            params.candidates,
            params.generation_config(params.max_new_tokens),
            vary=params.vary,
            seed=seed,
            latents=params.latents,
            should_stop=stop_check(decode, stops),
            compile=self.compile,
            batch_size=self.batch_size,
        )
        at_once, line = [], 0  # as in `sample`
        for p, scores in enumerate(found.scores):
            shown = ranking(scores)[: params.n] if params.candidates > params.n else range(params.candidates)
            start = len(decode(ids[p]))
            for k in shown:
                text, line = cut_at_stop(decode(ids[p] + found.tokens[p][k]), stops, start), line + 1
                if self.format == "text":
                    print(escape(text), flush=True)
                    at_once += [line] if stops and len(text) == start else []
                    continue
                record = {
                    "prompt": texts[p],
                    "sample": text[start:],
                    "index": first_index + p,
                    "seed": found.seeds[p][k],
                    "latents": params.latents,
                    "vary": params.vary,
                    "candidate": k,
                    "score": scores[k],
                    "scores": scores,
                }
                print(json.dumps(record, ensure_ascii=False), flush=True)
        say_stopped_at_once(at_once, stops)

    def prepare(self, texts: list[str], params: SamplingParams, labels: list[str] | None = None) -> list[Prompt]:
        """The prompts tokenized, checked against the model's context (`encode_prompts`) and given their Z
        (`prepare_prompts`)."""
        import torch

        from ..inference.batches import prepare_prompts

        encoded = encode_prompts(self.tokenizer, texts, params, self.model.config.max_seq_len, labels)
        ids, configs = [prompt for prompt, _ in encoded], [params.generation_config(new) for _, new in encoded]
        reference = None if params.reference is None else torch.tensor([self.tokenizer.encode(params.reference)])
        _, latent_seed = params.seeds()
        return prepare_prompts(
            self.model, ids, configs, params.latents, reference=reference, latent_seed=latent_seed, where="--latents"
        )


def encode_prompts(
    tokenizer: Tokenizer, texts: list[str], params: SamplingParams, context: int, labels: list[str] | None = None
) -> list[tuple[list[int], int]]:
    """(ids, new tokens) of each prompt, checked against a model that reads `context` tokens; without torch, so
    that `generate` checks its prompts with the run's saved config before it loads the model. A one-line
    ValueError names the prompt at fault by its label when there are several."""
    labels = labels or [f"prompt {k + 1}" for k in range(len(texts))]
    encoded = []
    for text, label in zip(texts, labels):
        where = f"{label}: " if len(texts) > 1 else ""
        prompt = tokenizer.encode(text)
        if not prompt:
            raise ValueError(f"{label if where else '--prompt'} must not be empty (give at least one character)")
        try:
            new = params.new_tokens(len(prompt), context)
            check_room(len(prompt), new, context)
        except ValueError as error:
            raise ValueError(f"{where}{error}") from None
        encoded.append((prompt, new))
    return encoded


def say_stopped_at_once(lines: list[int], stops: list[str]) -> None:
    """On stderr, which printed lines are a prompt alone because a stop string began their continuation: in
    the text format they would look like samples that were never drawn."""
    if lines:
        which = f"line{'s' if len(lines) > 1 else ''} {', '.join(map(str, lines))}"
        given = " or ".join(f'"{escape(stop)}"' for stop in stops)
        print(
            f"note: {which} stopped at once: their continuation began with {given} (--stop), so they show the "
            "prompt alone",
            file=sys.stderr,
        )


def unescape(text: str) -> str:
    """`text` with the backslash escapes of ESCAPES read; any other backslash is kept as typed."""
    return re.sub(r"\\(.)", lambda match: ESCAPES.get(match[1], match[0]), text)


def escape(text: str) -> str:
    """What `unescape` reads back as `text`."""
    inverse = {value: key for key, value in ESCAPES.items()}
    return "".join("\\" + inverse[char] if char in inverse else char for char in text)
