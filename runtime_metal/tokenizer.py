"""Tokenizer, chat template and generation config read from an artifact folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fuselm.runtime_metal.artifact import GENERATION_CONFIG, Manifest
from fuselm.runtime_metal.errors import RuntimeUserError


def load_tokenizer(out_dir: str | Path) -> Any:  # a transformers PreTrainedTokenizer
    root = Path(out_dir)
    if not (root / "tokenizer.json").is_file() and not (root / "tokenizer_config.json").is_file():
        raise RuntimeUserError(
            f"{root} has no tokenizer files; pass --prompt-ids, or re-convert from a checkpoint "
            "that has them")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(root))
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise RuntimeUserError(f"cannot load the tokenizer in {root}: {e}") from e


def generation_config(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise RuntimeUserError(f"{path} is not valid JSON ({e})") from e


def eos_ids(manifest: Manifest, gen_config: dict[str, Any], tokenizer: Any = None) -> list[int]:
    """Stop on any EOS the model declares: manifest, generation config and tokenizer."""
    ids = set(manifest.eos_token_ids)
    eos = gen_config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(int(i) for i in ids)


def encode_prompt(tokenizer: Any, text: str, raw: bool = False,
                  history: list[dict[str, str]] | None = None) -> list[int]:
    """Apply the chat template when the tokenizer has one (unless `raw`)."""
    if not raw and getattr(tokenizer, "chat_template", None):
        messages = [*(history or []), {"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=True)]
