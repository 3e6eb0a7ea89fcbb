"""Settings as a tree of dataclasses, for any such tree: read from mappings (a YAML file, `section.field=value`
overrides) with each value converted to its field's declared type, written back as YAML or as overrides,
compared setting by setting, and described for a command's help (type, default and the docstring under
each field). One bad value is one ConfigError naming the setting."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import enum
import inspect
import itertools
import re
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from .bounded import load_yaml
from .checks import ConfigError
from .compat import SETTINGS_RENAMED
from .fileio import atomic_write_text


def field_default(item: dataclasses.Field):
    """A dataclass field's default value: its default, or a new one from its default_factory."""
    return item.default_factory() if callable(item.default_factory) else item.default


def kind_section(section_type: Callable[[str], type | None], named_by: str = "kind"):
    """A field that holds the settings of one kind, the one the field `named_by` names, under that kind's name
    (`model.latent.categorical.classes`): a section of the chosen kind only, whose type the kind's registry
    knows, `section_type(name)` (None for a kind without settings). The field's value is the settings, or
    None for the kind's defaults before its registry is asked (see `resolve_kind_sections`)."""
    return dataclasses.field(default=None, metadata={"named_by": named_by, "section_type": section_type})


def section_named_by(item: dataclasses.Field) -> str | None:
    """The field naming the kind whose settings `item` holds (a `kind_section`), else None."""
    return item.metadata.get("named_by")


def _entries(settings) -> list[tuple[str, dataclasses.Field, object]]:
    """(name as written, field, value) of a dataclass instance's settings: a kind section under its kind's
    name, and left out while it is None (a kind without settings, or its defaults not yet resolved)."""
    out = []
    for item in dataclasses.fields(settings):
        value, named_by = getattr(settings, item.name), section_named_by(item)
        if named_by is None:
            out.append((item.name, item, value))
        elif value is not None:
            out.append((str(getattr(settings, named_by)), item, value))
    return out


def resolve_kind_sections(settings):
    """`settings` with each kind section that is None filled with its kind's default settings, where the
    kind has any: asks the kinds' registries (which may import their modules)."""
    changes = {}
    for item in dataclasses.fields(settings):
        named_by = section_named_by(item)
        if named_by is not None and getattr(settings, item.name) is None:
            section_type = item.metadata["section_type"](getattr(settings, named_by))
            if section_type is not None:
                changes[item.name] = section_type()
    return dataclasses.replace(settings, **changes) if changes else settings


def _closed_set(annotation):
    """An enum (a LatentChoice) as the Literal of its members, which every reader here handles; else as it is."""
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return typing.Literal[tuple(annotation)]
    return annotation


def coerce(value, annotation, where: str):
    """A YAML or command-line value converted to the declared type `annotation`, or a ConfigError."""
    annotation = _closed_set(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: cannot read {value!r} as {type_name(annotation)}")
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            close = difflib.get_close_matches(str(value), list(map(str, choices)), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{where} must be one of {', '.join(map(str, choices))}, got {value!r}{hint}")
        # a choice declared as an enum's member (a LatentChoice) is read as that member
        return next((choice for choice in choices if isinstance(choice, enum.Enum) and choice == value), value)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v]
        items = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)) or len(value) != len(items):
            raise ConfigError(f"{where}: expected {len(items)} values, got {value!r}")
        return tuple(coerce(v, t, where) for v, t in zip(value, items))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if annotation in (int, float, str):
        if isinstance(value, bool) or (annotation is not str and isinstance(value, (list, dict))):
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
        try:
            number = annotation(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf), float(10**400)
            raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}") from None
        if annotation is int and isinstance(value, float) and value != number:
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return number
    raise ConfigError(f"{where}: unsupported type {annotation}")


def _read(cls, values: dict, where: str, section) -> dict:
    """The fields of the dataclass `cls` that `values` gives, each converted to its declared type, a nested
    dataclass by `section`; a ConfigError for a name that is not a field or a value of the wrong type. A kind
    section (`kind_section`) is read from the entry named after the chosen kind, with the type the kind's
    registry gives."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields if section_named_by(f) is None]
    values, kwargs, kinds = dict(values), {}, []
    for item in fields:
        named_by = section_named_by(item)
        if named_by is None:
            continue
        given = values.get(named_by, field_default(next(f for f in fields if f.name == named_by)))
        kind = str(coerce(given, hints[named_by], f"{where}.{named_by}" if where else named_by))
        kinds.append(f"{where}.{named_by}={kind}" if where else f"{named_by}={kind}")
        if kind not in values or kind in names:
            continue
        path = f"{where}.{kind}" if where else kind
        section_type = item.metadata["section_type"](kind)
        if section_type is None:
            raise ConfigError(f"{path}: {named_by} {kind} has no settings")
        kwargs[item.name] = section(section_type, values.pop(kind), path)
    unknown = sorted(set(values) - set(names), key=str)
    if unknown:  # the names a section reads before it is built (ModelConfig's size) are offered too
        offered = [*getattr(cls, "READ_FIRST", ()), *names]
        message = "; ".join(unknown_setting(str(name), offered, where) for name in unknown)
        section = kinds and any(isinstance(values[name], dict) for name in unknown)  # another kind's settings
        chosen = f" (and the settings of the chosen kind only: {', '.join(kinds)})" if section else ""
        raise ConfigError(message + chosen)
    for name, value in values.items():
        hint, path = hints[name], f"{where}.{name}" if where else name
        kwargs[name] = section(hint, value, path) if dataclasses.is_dataclass(hint) else coerce(value, hint, path)
    return kwargs


def build(cls, values: dict, where: str = ""):
    """An instance of the dataclass `cls` from a mapping of its fields (nested mappings for nested
    dataclasses, a kind section under the chosen kind's name); a field left out keeps its default."""
    return cls(**_read(cls, values, where, build))


def check_names_and_types(cls, values: dict, where: str = "") -> None:
    """What `build` refuses in `values` setting by setting (an unknown name, a value of the wrong type or out
    of a closed set), without building `cls`: no check across fields, for settings whose base is not known
    yet (the overrides of a sweep, before its presets are chosen)."""
    _read(cls, values, where, check_names_and_types)


def unknown_setting(name: str, names: list[str], where: str = "") -> str:
    """'unknown setting optim.lrr: did you mean optim.lr?': the new name of a setting renamed before 0.3, else
    the closest real field by difflib's ratio, or the section's fields when none is close."""
    prefix = f"{where}." if where else ""
    if f"{prefix}{name}" in SETTINGS_RENAMED:
        return f"unknown setting {prefix}{name}: it is {SETTINGS_RENAMED[prefix + name]} since 0.3"
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"{where or 'the config'} has {', '.join(names)}"
    return f"unknown setting {prefix}{name}: {hint}"


def check_choices(settings, prefix: str = "") -> None:
    """A ConfigError for a setting of a closed set (a Literal) holding a value outside it, anywhere in the tree:
    `build` checks the values it reads, this the ones code set."""
    hints = typing.get_type_hints(type(settings))
    for name, item, value in _entries(settings):
        path = prefix + name
        if dataclasses.is_dataclass(value):
            check_choices(value, path + ".")
        elif typing.get_origin(hints[item.name]) is typing.Literal:
            coerce(value, hints[item.name], path)


def merge(base: dict, update: dict) -> dict:
    """`update` over `base`, section by section."""
    merged = dict(base)
    for key, value in update.items():
        merged[key] = merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return merged


def parse_overrides(overrides: list[str]) -> dict:
    """['optim.lr=3e-4', 'model.size=debug'] -> nested dict; values parsed as YAML scalars."""
    result: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form section.field=value")
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} was given a value, it is a section")
        try:
            node[leaf] = load_yaml(raw) if raw else ""
        except yaml.YAMLError as error:
            raise ConfigError(f"override {key}: cannot read its value: {' '.join(str(error).split())}") from None
    return result


def read_yaml(path: str | Path) -> dict:
    """A YAML settings file as a mapping; every way it can be wrong is a one-line ConfigError."""
    try:
        loaded = load_yaml(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot read config {path}: {' '.join(str(error).split())}") from None  # one line
    if loaded is None:
        raise ConfigError(f"config {path} is empty: give at least one field, or leave --config out for the defaults")
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"config {path} must be a mapping (section: fields), not a {type(loaded).__name__}: {str(loaded)[:60]!r}"
        )
    return loaded


def to_dict(settings) -> dict:
    """The nested mapping of a dataclass tree, tuples as lists (as YAML and JSON write them)."""

    def plain(value):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {name: plain(item) for name, _, item in _entries(value)}
        if isinstance(value, enum.Enum):  # a str enum's member (a LatentChoice) is written as its name
            return value.value
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items()}
        return [plain(item) for item in value] if isinstance(value, (list, tuple)) else value

    return plain(settings)


def to_yaml(settings, explained: bool = False) -> str:
    """The settings as YAML. explained: a value whose meaning its docstring gives in parentheses, as `threads: 0`
    in `CPU threads for torch (0: torch's default).`, is followed by that meaning as a comment (what
    `--print-config` shows; a file written to be read back carries none)."""
    text = yaml.safe_dump(to_dict(settings), sort_keys=False)
    if not explained:
        return text
    meanings = {item.path: meaning for item in describe(settings) if (meaning := value_meaning(item))}
    lines: list[str] = []
    path: list[str] = []  # the keys of the mapping a line is in, by indentation (PyYAML's 2 spaces)
    for line in text.splitlines():
        match = re.match(r"( *)([\w-]+):( .*)?$", line)
        if match:
            path[len(match.group(1)) // 2 :] = [match.group(2)]
            if match.group(3) and ".".join(path) in meanings:
                line += f"  # {meanings['.'.join(path)]}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def value_meaning(setting: Setting) -> str | None:
    """What the setting's value means where its docstring says, as "(0: never)" or "(null: ...)"; else None."""
    value = setting.default
    for spelt in ("null", "None", "none") if value is None else (format_value(value),):
        start = setting.doc.find(f"({spelt}: ")
        if start < 0:
            continue
        depth = 0
        for index in range(start, len(setting.doc)):  # to the matching parenthesis: "(0: min(CPU count, 8))"
            depth += {"(": 1, ")": -1}.get(setting.doc[index], 0)
            if depth == 0:
                return setting.doc[start + len(spelt) + 3 : index]
    return None


def write_yaml(settings, path: str | Path) -> None:
    atomic_write_text(path, to_yaml(settings))


def flat(settings) -> dict:
    """{"section.field": value} of every setting."""

    def flatten(values: dict, prefix: str) -> dict:
        out = {}
        for key, value in values.items():
            if isinstance(value, dict):
                out.update(flatten(value, f"{prefix}{key}."))
            else:
                out[prefix + key] = value
        return out

    return flatten(to_dict(settings), "")


def changed(before, after) -> dict[str, list]:
    """{"section.field": [before, after]} of the settings that differ."""
    old, new = flat(before), flat(after)
    return {key: [old.get(key), new.get(key)] for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}


def overrides_of(settings, defaults) -> list[str]:
    """The `section.field=value` overrides that give `settings` from `defaults`."""
    out = []
    default_values = flat(defaults)
    for key, value in flat(settings).items():
        if key in default_values and value == default_values[key]:
            continue
        out.append(f"{key}={value if isinstance(value, str) else format_value(value)}")
    return out


@cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: the docstring under it} of a dataclass (and of its bases), read from its source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (a class made at run time): no docstrings
            continue
        definition = tree.body[0]
        assert isinstance(definition, ast.ClassDef)  # the source of a class: its definition
        body = definition.body
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def type_name(annotation) -> str:
    """'int', 'int | None', 'prior | encoder', 'tuple[float, float]': a type as a user writes the value."""
    annotation = _closed_set(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(map(str, typing.get_args(annotation)))
    if origin is tuple:
        return f"tuple[{', '.join(type_name(a) for a in typing.get_args(annotation))}]"
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


@dataclass(frozen=True)
class Setting:
    path: str  # "optim.lr"
    type: str  # "float"
    default: object
    doc: str


def describe(settings, prefix: str = "") -> list[Setting]:
    """Every setting of a dataclass tree, in declaration order, with the instance `settings`'s values as
    the defaults."""
    out = []
    cls: type = type(settings)
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for name, item, value in _entries(settings):
        path = prefix + name
        if dataclasses.is_dataclass(value):
            out += describe(value, path + ".")
        else:
            out.append(Setting(path, type_name(hints[item.name]), value, docs.get(item.name, "")))
    return out


def format_value(value) -> str:
    """A value as it is written after `section.field=`."""
    if isinstance(value, str):
        return value or "''"
    value = list(value) if isinstance(value, tuple) else value
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("\n...")


def help_text(settings_list: list[Setting], width: int = 100) -> str:
    """The settings grouped by section, each as `path=DEFAULT  (type)` and its docstring, indented."""
    lines, section = [], None
    for item in settings_list:
        here = item.path.rpartition(".")[0]
        if here != section:
            section = here
            lines += ["", f"{section or 'top level'}:"]
        lines.append(f"  {item.path}={format_value(item.default)}  ({item.type})")
        if item.doc:
            lines += textwrap.wrap(item.doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines).lstrip("\n")


def add_option(
    parser,
    cls,
    name: str,
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    default=dataclasses.MISSING,
    metavar: str | None = None,
    repeatable: bool = False,
    choices: bool = True,
    extra_help: str = "",
    default_help: str = "",
) -> None:
    """The command-line option of the field `name` of the dataclass `cls` (flag: --NAME with dashes for
    underscores, unless given): its type, its choices (a Literal; choices=False shows them without argparse
    refusing the others, for a value that is parsed afterwards), its default (the field's unless given) and
    its docstring as help, written once, in the dataclass. A repeatable option collects a list.
    default_help is what the help says of the default where the value does not say it (an option left out
    that the command resolves: from an environment variable, from another argument)."""
    hint = typing.get_type_hints(cls)[name]
    declared = next(f for f in dataclasses.fields(cls) if f.name == name)
    if default is dataclasses.MISSING:
        default = field_default(declared)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: an X, or left out
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]: a repeatable option of Xs
        hint, repeatable = typing.get_args(hint)[0], True
    kwargs: dict = {"metavar": metavar or ("N" if hint is int else None)}
    hint = _closed_set(hint)
    if typing.get_origin(hint) is typing.Literal:
        names = list(typing.get_args(hint))
        kwargs = {"choices": names} if choices else {"metavar": "{" + ",".join(map(str, names)) + "}"}
        if choices and isinstance(names[0], enum.Enum):  # read as the member it names (argparse refuses others)
            kwargs["type"] = lambda text: next((name for name in names if name == text), text)
    elif hint is not str:
        kwargs["type"] = hint
    shown = default_help or ("none" if default in (None, "", ()) else default)
    more = "; repeatable" if repeatable else ""
    parser.add_argument(
        flag or f"--{name.replace('_', '-')}",
        *aliases,
        dest=name,
        action="append" if repeatable else "store",
        default=list(default or []) if repeatable else default,
        help=f"{field_docs(cls).get(name, '')}{extra_help} (default: {shown}{more})",
        **kwargs,
    )
