"""The tokenizer files of a model folder, loaded and checked before convert copies them.

The artifact's runtime loads whatever convert copied; a file that is not a tokenizer (or a
symlink to any other file) would otherwise end up inside the output and fail, or worse, load
and produce ids the model has no embedding for. So at convert time: tokenizer.json must load
with the `tokenizers` library and every id it can produce must be below the model's
vocab_size (a vocabulary padded *larger* than the tokenizer is normal and fine); the JSON side
files must be JSON objects; a chat template must compile in Jinja's sandbox, configured as
transformers renders it, and must not break out of the sandbox on a one-message chat.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fuselm.export.errors import ExportError
from fuselm.export.json_file import read_json

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


def _check_template(where: str, template: Any) -> None:
    from jinja2 import TemplateError, nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    if not isinstance(template, str):
        raise ExportError(f"{where} is {json.dumps(template)[:60]}; it must be a Jinja string")

    class Generation(Extension):  # transformers' {% generation %} block: a no-op here
        tags = {"generation"}

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    try:
        compiled = env.from_string(template)
    except TemplateError as e:
        raise ExportError(
            f"{where} is not a valid Jinja template ({e}); fix the template or remove it"
        ) from None
    # Other render failures (a template that insists on tools, say) are the chat's business
    # at run time; breaking out of the sandbox is refused outright.
    try:
        compiled.render(messages=[{"role": "user", "content": "hi"}],
                        add_generation_prompt=True, raise_exception=_ignore)
    except SecurityError as e:
        raise ExportError(f"{where} breaks out of Jinja's sandbox ({e}); refusing it") from None
    except Exception:  # noqa: BLE001, S110 - see above: not a convert-time error
        pass


def _ignore(*_: Any) -> str:
    return ""


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
        _check_template(where, template)
