"""`free-transformer generate --interactive`: the model stays loaded; prompts and commands that change
the settings are read a line at a time (docs/sampling.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys

from ..base.errors import UserError
from ..inference.latents import parse_latents, refuse_on_baseline
from .sampling import Sampler, Settings, unescape

INTERACTIVE_HELP = """\
A line is a prompt: its samples are printed as `generate --prompt` prints them for its text, with the
current settings. The escapes of --stop are read (\\n is a newline); begin a line with // for a prompt that
begins with /. An empty line is skipped. Commands:
  /latents encoder|prior|shared|reference  where Z comes from (--latents)
  /reference TEXT         Z inferred by the encoder from TEXT (--latents reference --reference TEXT)
  /seed N                 pin the seed: every prompt samples with N, N+1, ... (--seed N)
  /seed off               each prompt takes the next n seeds (the default, from --seed)
  /n N                    samples per prompt (-n)
  /temperature T          softmax temperature; 0 for greedy decoding
  /top-k K|off            sample among the K likeliest tokens
  /top-p P|off            nucleus sampling threshold in (0, 1]
  /max-new-tokens N|auto  tokens after each prompt
  /stop TEXT|off          add a stop string (escapes read); off: none
  /settings               the current settings, as generate's options
  /help                   this text
  /quit                   leave (Ctrl-D and Ctrl-C too)"""


def interact(sampler: Sampler, settings: Settings) -> int:
    """Read a prompt or a command per line from stdin until /quit, its end (Ctrl-D) or Ctrl-C, and print
    each prompt's samples as the non-interactive command prints them with the same options. Messages,
    errors (one line each; the loop goes on) and the "> " marker of a terminal go to stderr."""
    tty = sys.stdin.isatty()
    if tty:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        print("a prompt per line; /help lists the commands, /quit leaves", file=sys.stderr)
    pinned, index = False, 0
    try:
        while (line := _read_line(tty)) is not None:
            if not line:
                continue
            if line.startswith("/") and not line.startswith("//"):
                name, _, argument = line[1:].partition(" ")
                if name in ("quit", "exit"):
                    break
                try:
                    settings, pinned = _command(sampler, settings, pinned, name, argument.strip())
                except ValueError as error:
                    print("error: " + " ".join(str(error).split()), file=sys.stderr)
                continue
            try:
                sampler.sample([unescape(line.removeprefix("/"))], settings, first_index=index)
            except (UserError, ValueError) as error:
                print("error: " + " ".join(str(error).split()), file=sys.stderr)
                continue
            index += 1
            if not pinned:
                settings = dataclasses.replace(settings, seed=settings.seed + settings.n)
    except KeyboardInterrupt:
        print(file=sys.stderr)
    return 0


def _read_line(tty: bool) -> str | None:
    """The next line without its newline; None at the end of the input."""
    if tty:
        print("> ", end="", file=sys.stderr, flush=True)
        try:
            return input()
        except EOFError:
            print(file=sys.stderr)
            return None
    line = sys.stdin.readline()
    return line.removesuffix("\n").removesuffix("\r") if line else None


def _command(sampler: Sampler, settings: Settings, pinned: bool, name: str, argument: str) -> tuple[Settings, bool]:
    """(settings, pinned) after the command `/name argument`; a one-line ValueError for a bad one."""
    if name == "help":
        print(INTERACTIVE_HELP, file=sys.stderr)
        return settings, pinned
    if name == "settings":
        _show(settings, pinned)
        return settings, pinned
    if name not in SETTERS:
        raise ValueError(f"unknown command /{name}: /help lists the commands")
    if not argument:
        raise ValueError(f"/{name} needs a value: /help lists the commands")
    if name == "seed" and argument == "off":
        changed, pinned = settings, False
    else:
        changed = SETTERS[name](settings, argument, sampler.model.config.latent_bits)
        pinned = pinned or name == "seed"
    changed.check()
    _show(changed, pinned)
    return changed, pinned


def _show(settings: Settings, pinned: bool) -> None:
    print(settings.options() + ("" if pinned else " (the seed moves on by n after each prompt)"), file=sys.stderr)


def _number(kind: type, name: str, argument: str, off: str | None = None):
    """`argument` read as an int or a float; `off` (a word) is None."""
    if off is not None and argument == off:
        return None
    try:
        return kind(argument)
    except ValueError:
        extra = f" or {off}" if off else ""
        raise ValueError(f"/{name} takes {'an integer' if kind is int else 'a number'}{extra}, got {argument!r}") \
            from None


def _latents(settings: Settings, argument: str, bits: int) -> Settings:
    choice = parse_latents(argument, where="/latents", indices=False)
    refuse_on_baseline(choice, bits, "/latents")
    if choice == "reference" and settings.reference is None:
        raise ValueError("/latents reference needs a text: /reference TEXT")
    return dataclasses.replace(settings, latents=choice, reference=settings.reference if choice == "reference" else None)


def _reference(settings: Settings, argument: str, bits: int) -> Settings:
    refuse_on_baseline("reference", bits, "/latents")  # /reference TEXT is /latents reference with its text
    return dataclasses.replace(settings, latents="reference", reference=unescape(argument))


# /name argument -> the settings it gives (the model's latent bits decide what a baseline refuses)
SETTERS = {
    "latents": _latents,
    "reference": _reference,
    "seed": lambda s, a, _: dataclasses.replace(s, seed=_number(int, "seed", a)),
    "n": lambda s, a, _: dataclasses.replace(s, n=_number(int, "n", a)),
    "temperature": lambda s, a, _: dataclasses.replace(s, temperature=_number(float, "temperature", a)),
    "top-k": lambda s, a, _: dataclasses.replace(s, top_k=_number(int, "top-k", a, "off")),
    "top-p": lambda s, a, _: dataclasses.replace(s, top_p=_number(float, "top-p", a, "off")),
    "max-new-tokens": lambda s, a, _: dataclasses.replace(s, max_new_tokens=_number(int, "max-new-tokens", a, "auto")),
    "stop": lambda s, a, _: dataclasses.replace(s, stops=[] if a == "off" else [*s.stops, unescape(a)]),
}
