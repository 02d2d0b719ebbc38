"""The tokenizer of a GGUF file through transformers' own GGUF tokenizer converter, without
transformers' GGUF reader (which imports torch: +290 MB peak on SmolLM2, more than the whole
torch-free conversion).

transformers builds a GGUF tokenizer in two steps: its reader collects the `tokenizer.*`
metadata into a tokenizer dict and a tokenizer config (`get_gguf_tokenizer`), then
`convert_gguf_tokenizer` makes the `tokenizers` backend. The first step is a renaming of
metadata keys, done here from the values fuselm's own header reader already holds
(export/gguf/header.py), under transformers' own key table; the second is transformers' code,
unchanged. tests/export/test_graph_builder_gguf.py checks the saved files against
`AutoTokenizer.from_pretrained(gguf_file=...)`'s, byte for byte (tokenizer.json, chat template).
"""

from __future__ import annotations

from typing import Any

from fuselm.export.gguf.file import GGUFFile

# transformers' reader keeps these string arrays whole and every other string array as its
# length (the tokenizer builders need no more).
_FULL_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
# tokenizer config entries set to the token (string) of an id in the metadata
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _value(gguf: GGUFFile, key: str) -> Any:
    value = gguf.value(key)
    if isinstance(value, list) and key not in _FULL_ARRAYS and any(
            isinstance(v, str) for v in value):
        return len(value)
    return value


def light_tokenizer(gguf: GGUFFile) -> Any:
    """transformers' tokenizer of `gguf` (a TokenizersBackend), or None where this
    transformers has no torch-free GGUF tokenizer pieces (then its loader is used: 5.17's
    `gguf_tokenizer_mapping` has neither the key table nor the converter, and its
    `tokenization_utils_tokenizers` imports torch itself)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    present = set(gguf.metadata)
    grouped = {
        group: {name: _value(gguf, f"tokenizer.{key}") for key, name in renames.items()
                if f"tokenizer.{key}" in present}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        # transformers: llama.cpp adds BOS to a sentencepiece vocabulary that does not say
        config.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":
        return None  # transformers special-cases it; its own loader handles it
    for name, key in _SPECIAL_TOKENS.items():
        token_id = gguf.value(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(gguf.value("general.architecture"), tokenizer)
    return TokenizersBackend(tokenizer_object=backend, **config, **extra)
