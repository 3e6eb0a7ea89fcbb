"""`free-transformer generate --interactive`: the model stays loaded; prompts and commands that change
the settings are read a line at a time (docs/sampling.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import textwrap
import types
import typing

from ..base.errors import UserError
from ..base.latent_choice import LatentChoice
from ..base.settings import field_docs
from ..inference.latents import refuse_on_baseline
from ..inference.params import SamplingError, SamplingParams, spelling, spelt_fields
from .samples import Sampler, options, unescape

# the commands that do more than set their field (their help, then their code below)
SPECIAL_HELP = {
    "seed": [
        ("/seed N", "pin the seed: every prompt samples as `generate --seed N` samples it alone"),
        ("/seed off", "the seed moves on by n after each prompt (the default, from --seed)"),
    ],
    "stop": [("/stop TEXT|off", "add a stop string (escapes read); off: none")],
    "latents": [("/latents encoder|prior|shared|reference", "where Z comes from (--latents)")],
    "reference": [("/reference TEXT", "Z inferred by the encoder from TEXT (--latents reference --reference TEXT)")],
}


def interactive_help() -> str:
    """/help's text: a command per sampling setting (SamplingParams), its help from the field's docstring."""
    lines = []
    for name, command in spelt_fields(SamplingParams, "command").items():
        if name in SPECIAL_HELP:
            lines += SPECIAL_HELP[name]
            continue
        spelt = spelling(SamplingParams, name)
        usage = f"{command} {spelt.metavar}" + (f"|{spelt.unset}" if _optional(name) else "")
        lines.append((usage, f"{field_docs(SamplingParams)[name]} ({spelt.flag})"))
    lines += [
        ("/settings", "the current settings, as generate's options"),
        ("/help", "this text"),
        ("/quit", "leave (Ctrl-D and Ctrl-C too)"),
    ]
    listed = [
        ("" if len(usage) < 24 else f"  {usage}\n")  # a long command on a line of its own
        + "\n".join(
            textwrap.wrap(
                text, 100, initial_indent=f"  {usage if len(usage) < 24 else '':<24}", subsequent_indent=" " * 26
            )
        )
        for usage, text in lines
    ]
    return (
        "A line is a prompt: its samples are printed as `generate --prompt` prints them for its text, with the\n"
        "current settings. The escapes of --stop are read (\\n is a newline); begin a line with // for a prompt "
        "that\nbegins with /. An empty line is skipped. Commands:\n" + "\n".join(listed)
    )


def interact(sampler: Sampler, settings: SamplingParams) -> int:
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
                seed, _ = settings.seeds()
                settings = dataclasses.replace(settings, seed=seed + settings.n)
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


def _command(
    sampler: Sampler, settings: SamplingParams, pinned: bool, name: str, argument: str
) -> tuple[SamplingParams, bool]:
    """(settings, pinned) after the command `/name argument`; a one-line ValueError for a bad one."""
    if name == "help":
        print(interactive_help(), file=sys.stderr)
        return settings, pinned
    if name == "settings":
        _show(settings, pinned)
        return settings, pinned
    field = COMMANDS.get(f"/{name}")
    if field is None:
        raise ValueError(f"unknown command /{name}: /help lists the commands")
    if not argument:
        raise ValueError(f"/{name} needs a value: /help lists the commands")
    if name == "seed" and argument == "off":
        changed, pinned = settings, False
    else:
        try:
            setter = SPECIAL_SETTERS.get(field, _set)
            changed = setter(settings, field, argument, sampler.model.config.is_free)
        except SamplingError as error:
            raise ValueError(error.spelt(f"/{name}")) from None
        pinned = pinned or name == "seed"
    _show(changed, pinned)
    return changed, pinned


def _show(settings: SamplingParams, pinned: bool) -> None:
    print(options(settings) + ("" if pinned else " (the seed moves on by n after each prompt)"), file=sys.stderr)


def _optional(name: str) -> bool:
    """Whether the field can be unset (its type allows None)."""
    hint = typing.get_type_hints(SamplingParams)[name]
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _set(settings: SamplingParams, field: str, argument: str, is_free: bool) -> SamplingParams:
    """The settings with `field` set from a command's argument: a number, or the field's unset word."""
    spelt, hint = spelling(SamplingParams, field), typing.get_type_hints(SamplingParams)[field]
    kind = int if int in (hint, *typing.get_args(hint)) else float
    unset = spelt.unset if _optional(field) else None
    # below, the field is chosen at run time: SamplingParams checks its value, which the type checker cannot
    if argument == unset:
        return dataclasses.replace(settings, **{field: None})  # type: ignore[arg-type]
    try:
        value = kind(argument)
    except ValueError:
        extra = f" or {unset}" if unset else ""
        raise ValueError(
            f"{spelt.command} takes {'an integer' if kind is int else 'a number'}{extra}, got {argument!r}"
        ) from None
    return dataclasses.replace(settings, **{field: value})  # type: ignore[arg-type]


def _latents(settings: SamplingParams, field: str, argument: str, is_free: bool) -> SamplingParams:
    is_reference = argument == LatentChoice.REFERENCE
    if is_reference and settings.reference is None:
        raise ValueError("/latents reference needs a text: /reference TEXT")
    reference = settings.reference if is_reference else None
    # a name: the settings parse it into a LatentChoice, this entry's one parse (a SamplingError names /latents)
    changed = dataclasses.replace(settings, latents=argument, reference=reference)  # type: ignore[arg-type]
    refuse_on_baseline(changed.latents, is_free, "/latents")
    return changed


def _reference(settings: SamplingParams, field: str, argument: str, is_free: bool) -> SamplingParams:
    refuse_on_baseline(LatentChoice.REFERENCE, is_free, "/latents")  # /reference TEXT: /latents reference, its text
    return dataclasses.replace(settings, latents=LatentChoice.REFERENCE, reference=unescape(argument))


def _stop(settings: SamplingParams, field: str, argument: str, is_free: bool) -> SamplingParams:
    return dataclasses.replace(settings, stop=() if argument == "off" else (*settings.stop, unescape(argument)))


def _vary(settings: SamplingParams, field: str, argument: str, is_free: bool) -> SamplingParams:
    return dataclasses.replace(settings, vary=argument)  # type: ignore[arg-type]  # a name: SamplingParams checks it


# the commands that do more than set their field; whether the model has a Z decides what a baseline refuses
SPECIAL_SETTERS = {"latents": _latents, "reference": _reference, "stop": _stop, "vary": _vary}
COMMANDS = {command: name for name, command in spelt_fields(SamplingParams, "command").items()}  # "/top-k": "top_k"
