"""The defaults an export gives Hugging Face's generic code, so that a plain
`pipeline("text-generation", model=DIR, trust_remote_code=True)(prompt)` works without arguments:

- generation_config.json: `max_length` = the model's context (max_position_embeddings), so that the prompt and
  its continuation fit it (the pipeline's own default, 256 new tokens, is not added when the model's
  generation config sets a length); eos and pad (eos where the tokenizer has no pad, as Hugging Face falls back);
- config.json: the same bos / eos / pad ids;
- tokenizer_config.json: `model_max_length` = the context;
- chat_template.jinja, given a template: transformers reads it before any template of tokenizer_config.json.

Token ids given by the source (a Llama's config.json) win over the tokenizer's."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, GenerationConfig

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' own name for a tokenizer's template
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_token_ids(out_dir: Path) -> dict[str, int]:
    """The bos / eos / pad ids of the tokenizer in `out_dir` that has them; {} without a tokenizer there."""
    if not (out_dir / "tokenizer_config.json").is_file():
        return {}
    tokenizer = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    return {key: value for key in TOKEN_ID_KEYS if isinstance(value := getattr(tokenizer, key, None), int)}


def write_export_defaults(
    out_dir: str | Path, max_positions: int, token_ids: dict | None = None, chat_template: str | None = None
) -> dict[str, int]:
    """Write the defaults above into the export `out_dir` (its config.json and tokenizer files written);
    returns the token ids set."""
    out_dir = Path(out_dir)
    tokenizer_config = out_dir / "tokenizer_config.json"
    if chat_template is not None:
        if not tokenizer_config.is_file():
            raise ValueError("a chat template needs the export's tokenizer, and this model records none")
        (out_dir / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
    if tokenizer_config.is_file():
        values = json.loads(tokenizer_config.read_text(encoding="utf-8"))
        tokenizer_config.write_text(json.dumps({**values, "model_max_length": max_positions}, indent=2) + "\n")
    given = {key: value for key, value in (token_ids or {}).items() if key in TOKEN_ID_KEYS and value is not None}
    ids = {**tokenizer_token_ids(out_dir), **given}
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config_path.write_text(json.dumps({**config, **ids}, indent=2, sort_keys=True) + "\n")
    pad = ids.get("pad_token_id", ids.get("eos_token_id"))
    GenerationConfig(
        max_length=max_positions,
        bos_token_id=ids.get("bos_token_id"),
        eos_token_id=ids.get("eos_token_id"),
        pad_token_id=pad,
    ).save_pretrained(out_dir)
    return ids
