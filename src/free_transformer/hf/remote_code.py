"""A self-contained Hugging Face export: the modeling code beside the weights (`auto_map`, Hugging
Face's convention for custom architectures) and a `tokenizer.json`, so that

    AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    AutoTokenizer.from_pretrained(directory)

work where transformers and torch are installed but this package is not.

The code is not a second copy to maintain: at export time the modules that `hf/modeling.py` needs
(found by following its relative imports, so a refactoring of them is followed too) are copied flat
beside the weights, their relative imports rewritten to sibling files, as Hugging Face's dynamic
module loader expects. Both offline tokenizers are expressed with the `tokenizers` library: bytes as a
byte-level BPE without merges (ids = byte values), GPT-2 from the same encoder.json / vocab.bpe that
our tiktoken encoding is built from.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

from ..base.install import install_hint
from ..base.version import __version__
from ..data.tokenizer import GPT2_EOT, GPT2_PACKAGE, TokenizerError

PACKAGE = "free_transformer"
ENTRY = {
    "AutoConfig": ("hf.configuration", "FreeTransformerConfig"),
    "AutoModelForCausalLM": ("hf.modeling", "FreeTransformerForCausalLM"),
}
# transformers before 5.10.1 copies only the direct relative imports of a local export's entry file into its
# module cache, so each entry file also imports, directly, every sibling it needs through another.
SIBLINGS_NOTE = "\n# Every sibling file this one needs, imported directly (transformers < 5.10.1 copies only those).\n"
FILE_NAMES = {"hf.configuration": "configuration_free_transformer", "hf.modeling": "modeling_free_transformer"}


def _file_name(module: str) -> str:
    """Flat, collision-free names: hf.generation -> free_transformer_hf_generation."""
    return FILE_NAMES.get(module, "free_transformer_" + module.replace(".", "_"))


def _source_path(root: Path, module: str) -> Path:
    """The file of a package-relative module: a module file, or a package's __init__.py."""
    package = root / module.replace(".", "/") / "__init__.py"
    return package if package.is_file() else root / (module.replace(".", "/") + ".py")


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The package-relative module name ("model", "latent.path") a relative import names; in a package's
    __init__.py one dot is the package itself."""
    parts = (module.split(".") + ([""] if is_package else []))[: -node.level] if node.level else []
    return ".".join([p for p in [*parts, *([node.module] if node.module else [])] if p])


def _rewrite(module: str, source: str, is_package: bool = False) -> tuple[str, set[str]]:
    """`source` with every relative import pointing at a sibling file; and the modules it imports."""
    lines = source.splitlines(keepends=True)
    needed, edits = set(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            if node.module is None:
                raise ValueError(f"{module}: `from . import ...` is not supported by the HF export bundler")
            target = _resolve(module, node, is_package)
            needed.add(target)
            text = ast.unparse(ast.ImportFrom(module=_file_name(target), names=node.names, level=1))
            end, end_col = node.end_lineno, node.end_col_offset
            assert end is not None and end_col is not None, "ast.parse gives every statement its end"
            edits.append((node.lineno, node.col_offset, end, end_col, text))
    for start, col, end, end_col, text in sorted(edits, reverse=True):  # bottom up: positions stay valid
        head, tail = lines[start - 1][:col], lines[end - 1][end_col:]
        lines[start - 1 : end] = [head + text + tail]
    return "".join(lines), needed


def _closure(module: str, needs: dict[str, set[str]]) -> set[str]:
    """Every module `module` imports, directly or not."""
    found: set[str] = set()
    todo = [module]
    while todo:
        for target in needs[todo.pop()] - found:
            found.add(target)
            todo.append(target)
    return found - {module}


def write_remote_code(out_dir: str | Path) -> list[str]:
    """Copy the modeling code beside a save_pretrained directory and add `auto_map` to its config.json.
    Returns the files written."""
    out_dir, root = Path(out_dir), Path(__file__).parents[1]
    todo, sources, needs = [module for module, _ in ENTRY.values()], {}, {}
    while todo:
        module = todo.pop()
        if module in sources:
            continue
        path = _source_path(root, module)
        source, needs[module] = _rewrite(module, path.read_text(encoding="utf-8"), path.name == "__init__.py")
        header = (
            f"# Copied from {PACKAGE} {__version__} ({PACKAGE}/{path.relative_to(root)}) by\n"
            f"# its Hugging Face export, with relative imports pointing at the sibling files.\n"
        )
        sources[module] = header + source
        todo += sorted(needs[module] - sources.keys())
    for entry, _ in ENTRY.values():
        indirect = sorted(_closure(entry, needs) - needs[entry])
        if indirect:
            sources[entry] += "".join(
                [SIBLINGS_NOTE, *(f"from .{_file_name(m)} import __name__ as _  # noqa: E402\n" for m in indirect)]
            )
    for module, source in sources.items():
        (out_dir / f"{_file_name(module)}.py").write_text(source, encoding="utf-8")
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {auto: f"{_file_name(module)}.{name}" for auto, (module, name) in ENTRY.items()}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sorted(f"{_file_name(module)}.py" for module in sources)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what byte-level BPE vocabularies use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level(vocab: dict[str, int], merges: list[tuple[str, str]], use_regex: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def build_tokenizer(name: str):
    """Our offline tokenizer `name` (byte or gpt2) as a transformers PreTrainedTokenizerFast with the
    same ids; None for any other name."""
    from transformers import PreTrainedTokenizerFast

    if name == "byte":
        vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
        return PreTrainedTokenizerFast(tokenizer_object=_byte_level(vocab, [], use_regex=False))
    if name == "gpt2":
        spec = importlib.util.find_spec(GPT2_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise TokenizerError(f"the gpt2 tokenizer's export needs {GPT2_PACKAGE}: {install_hint('text')}")
        data = Path(spec.submodule_search_locations[0]) / "data"
        vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
        lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()[1:]
        merges = [(first, second) for first, second in (line.split() for line in lines if line.strip())]
        tokenizer = _byte_level(vocab, merges, use_regex=True)  # GPT-2's pre-tokenization pattern
        return PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, bos_token=GPT2_EOT, eos_token=GPT2_EOT, unk_token=GPT2_EOT
        )
    return None


def write_tokenizer(out_dir: str | Path, name: str | None) -> bool:
    """tokenizer.json + tokenizer_config.json for our byte or gpt2 tokenizer; False for others (an
    hf:<directory> tokenizer's own files are copied instead)."""
    tokenizer = build_tokenizer(name) if name else None
    if tokenizer is None:
        return False
    tokenizer.save_pretrained(out_dir)
    return True
