"""Tokenizer, chat template and generation config read from an artifact folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fuselm.input_files import check_regular, load_file
from fuselm.runtime_metal.artifact import (
    GENERATION_CONFIG,
    TOKENIZER_FILES,
    ArtifactError,
    Manifest,
    read_manifest,
)
from fuselm.runtime_metal.chat_template import ChatTemplateError, chat_ids, chat_text
from fuselm.runtime_metal.errors import RuntimeUserError


def load_tokenizer(out_dir: str | Path) -> Any:  # a transformers PreTrainedTokenizer
    root = Path(out_dir)
    if not (root / "tokenizer.json").is_file() and not (root / "tokenizer_config.json").is_file():
        raise RuntimeUserError(
            f"{root} has no tokenizer files; pass --prompt-ids, or re-convert from a checkpoint "
            "that has them")
    missing = [n for n in _recorded_tokenizer_files(root) if not (root / n).is_file()]
    if missing:
        raise RuntimeUserError(
            f"{root} lacks tokenizer file(s) {', '.join(missing)} that the conversion copied; "
            "copy the whole output folder again, or pass --prompt-ids")
    for name in TOKENIZER_FILES:
        if (root / name).is_file() and not os.access(root / name, os.R_OK):
            raise RuntimeUserError(f"cannot read {root / name}: permission denied; fix its "
                                   "permissions")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root))
    except Exception as e:  # transformers raises many types for broken tokenizer files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeUserError(f"cannot load the tokenizer in {root}: {first}") from e


def _recorded_tokenizer_files(root: Path) -> list[str]:
    """The tokenizer files fuselm.json says the conversion copied (none if it cannot say)."""
    try:
        files = read_manifest(root).files.get("tokenizer", [])
    except ArtifactError:
        return []
    return [n for n in files if isinstance(n, str) and n in TOKENIZER_FILES]


def check_text(text: str, what: str = "--prompt") -> str:
    """Refuse text that is not valid Unicode: bytes that were not UTF-8 reach Python as lone
    surrogates (e.g. from argv or stdin), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.end].encode("utf-8", "surrogateescape")
        raise RuntimeUserError(
            f"{what} is not valid UTF-8 (bytes {bad!r} at character {e.start}); pass UTF-8 "
            "text, or token ids with --prompt-ids") from None
    return text


def generation_config(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / GENERATION_CONFIG
    check_regular(path)
    if not path.is_file():
        return {}
    try:
        return load_file(path)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and JSONTooDeep too
        raise RuntimeUserError(f"{path} is not valid JSON ({e})") from None
    except PermissionError:
        raise RuntimeUserError(f"cannot read {path}: permission denied; fix its permissions"
                               ) from None


def eos_ids(manifest: Manifest, gen_config: dict[str, Any], tokenizer: Any = None) -> list[int]:
    """Stop on any EOS the model declares: manifest, generation config and tokenizer."""
    ids = set(manifest.eos_token_ids)
    eos = gen_config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise RuntimeUserError(
            f"generation_config.json's eos_token_id must be an integer or a list of integers, "
            f"got {eos!r}; fix it in the artifact folder")
    return sorted(int(i) for i in ids)


def encode_prompt(tokenizer: Any, text: str, raw: bool = False,
                  history: list[dict[str, str]] | None = None) -> list[int]:
    """Apply the chat template when the tokenizer has one (unless `raw`), with the limits of
    runtime_metal/chat_template.py."""
    if not raw and getattr(tokenizer, "chat_template", None):
        messages = [*(history or []), {"role": "user", "content": text}]
        try:
            return chat_ids(tokenizer, chat_text(tokenizer, messages))
        except ChatTemplateError as e:
            raise ChatTemplateError(
                f"{e}; fix chat_template.jinja / tokenizer_config.json in the artifact, or pass "
                "--raw", e.kind, e.limit) from None
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=True)]
