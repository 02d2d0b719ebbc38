"""The tokenizer files of a model folder, loaded and checked before convert copies them.

The artifact's runtime loads whatever convert copied; a file that is not a tokenizer (or a
symlink to any other file) would otherwise end up inside the output and fail, or worse, load
and produce ids the model has no embedding for. So at convert time: tokenizer.json must load
with the `tokenizers` library and every id it can produce must be below the model's
vocab_size (a vocabulary padded *larger* than the tokenizer is normal and fine); the JSON side
files must be JSON objects; a chat template must render a few plain chats (one with a long
message) within the limits the runtime renders it with (runtime_metal/chat_template.py: time,
size, loops, recursion), without breaking out of Jinja's sandbox or crashing; a template that
refuses a chat by its own raise_exception is the chat's business at run time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fuselm.export.errors import ExportError
from fuselm.export.json_file import read_json
from fuselm.runtime_metal.chat_template import ChatTemplateError, probe_template

TOKENIZER_JSON = "tokenizer.json"
_JSON_SIDE_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
)


def _read_json(path: Path) -> dict[str, Any]:
    data = read_json(path, "re-download the tokenizer")
    if not isinstance(data, dict):
        raise ExportError(f"{path} must hold a JSON object, not a JSON {type(data).__name__}")
    return data


def _check_ids(path: Path, ids: list[int], vocab_size: int) -> None:
    top = max(ids, default=-1)
    if top >= vocab_size:
        raise ExportError(
            f"{path} produces token id {top} but the model's vocab_size is {vocab_size}; the "
            "model has no embedding for it. Use the tokenizer that belongs to this checkpoint"
        )


def _check_tokenizer_json(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the Rust library raises a bare Exception
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ExportError(
            f"{path} is not a valid tokenizer ({first[:200]}); re-download the tokenizer"
        ) from None
    _check_ids(path, list(tok.get_vocab(with_added_tokens=True).values()), vocab_size)


def _templates(root: Path, side: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    """(where, template) pairs from every place transformers reads one."""
    found: list[tuple[str, Any]] = []
    for name in ("tokenizer_config.json", "chat_template.json"):
        value = side.get(name, {}).get("chat_template")
        if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
            for i, item in enumerate(value):
                where = f"{root / name}: chat_template[{i}]"
                found.append((where, item.get("template") if isinstance(item, dict) else item))
        elif value is not None:
            found.append((f"{root / name}: chat_template", value))
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        try:
            found.append((str(jinja), jinja.read_text(encoding="utf-8")))
        except UnicodeDecodeError as e:
            raise ExportError(f"{jinja} is not UTF-8 text ({e})") from None
    return found


def _check_template(where: str, template: Any, variables: dict[str, str]) -> None:
    if not isinstance(template, str):
        raise ExportError(f"{where} is {json.dumps(template)[:60]}; it must be a Jinja string")
    try:
        probe_template(template, variables)
    except ChatTemplateError as e:
        raise ExportError(f"{where}: {e}; fix the template or remove it") from None


def _special_tokens(side: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The special tokens a template sees as variables (bos_token, eos_token, ...), as the
    tokenizer files declare them: a string, or an added-token object with its content."""
    out: dict[str, str] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        for key, value in side.get(name, {}).items():
            if isinstance(value, dict):
                value = value.get("content")
            if key.endswith("_token") and isinstance(value, str):
                out.setdefault(key, value)
    return out


def check_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """Raise ExportError if a tokenizer file in `model_dir` is broken or exceeds the vocab."""
    side = {n: _read_json(model_dir / n) for n in _JSON_SIDE_FILES if (model_dir / n).is_file()}
    if (model_dir / TOKENIZER_JSON).is_file():
        _check_tokenizer_json(model_dir / TOKENIZER_JSON, vocab_size)
    for name in ("vocab.json", "added_tokens.json"):  # the slow tokenizer's token -> id maps
        ids = list(side.get(name, {}).values())
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ExportError(f"{model_dir / name} must map tokens to integer ids >= 0")
        _check_ids(model_dir / name, ids, vocab_size)
    for where, template in _templates(model_dir, side):
        _check_template(where, template, _special_tokens(side))
