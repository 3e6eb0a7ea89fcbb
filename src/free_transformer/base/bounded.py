"""JSON and YAML read with bounds, so that no input file or value can hang or crash a reader: nesting
deeper than Python's recursion allows is one line (json's and PyYAML's parsers recurse once per level),
and YAML aliases may not expand to more than MAX_YAML_VALUES values (a "billion laughs" file of nested
`&a [*a, *a, ...]` is a few lines whose expansion, printed in an error message, would never end).
YAML's merge key (`<<: *defaults`) is read; a key given twice in one mapping is an error (YAML
keeps the last one silently), and so is a key that is not a scalar (`? [1, 2]`)."""

from __future__ import annotations

import json

import yaml

MAX_YAML_VALUES = 10_000
"""Most values (scalars, lists, mappings) a YAML document may expand to, aliases counted each time."""

_MERGE = "tag:yaml.org,2002:merge"


class TooDeep(json.JSONDecodeError):
    """JSON nested deeper than the parser can follow (a JSONDecodeError: every reader already says
    which file is malformed)."""

    def __init__(self, text: str):
        super().__init__("nested too deeply (more levels than Python's recursion limit)", text, 0)

    def __str__(self) -> str:
        return self.msg


def loads_json(text: str | bytes, **options):
    """json.loads (with its `options`), with nesting too deep for the parser a TooDeep (a
    JSONDecodeError) instead of a RecursionError."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        raise TooDeep(text if isinstance(text, str) else "") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, except that a key given twice in one mapping is an error (merged keys may be
    overridden, as YAML's merge key means), and so is a key that is not a scalar (`? [1, 2]`)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a scalar (one line), not a {kind}", key_node.start_mark
                )
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _expanded_size(node, sizes: dict, open_: set) -> int:
    """How many values `node` stands for once every alias is expanded (each node counted once per use)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_:
        raise yaml.YAMLError("an alias refers to the value that contains it (a recursive value)")
    open_.add(id(node))
    size = 1
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            size += _expanded_size(child, sizes, open_)
            if size > MAX_YAML_VALUES:
                break
    elif isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            size += _expanded_size(key, sizes, open_) + _expanded_size(value, sizes, open_)
            if size > MAX_YAML_VALUES:
                break
    open_.discard(id(node))
    sizes[id(node)] = size
    if size > MAX_YAML_VALUES:
        raise yaml.YAMLError(f"its aliases expand to more than {MAX_YAML_VALUES:,} values")
    return size


def load_yaml(text: str):
    """One YAML document, as yaml.safe_load reads it but bounded (module docstring): a yaml.YAMLError
    for a document that is malformed, too nested, or whose aliases expand too far."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, set())
        return loader.construct_document(node)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply (more levels than Python's recursion limit)") from None
    finally:
        loader.dispose()
