"""GGUF metadata → an HF config.json and generation_config.json.

llama.cpp writes an HF config's numbers under `{arch}.*` keys (convert_hf_to_gguf.py); this
maps them back to the names transformers' config classes read, so the rest of fuselm sees an
ordinary HF model directory. Which family a file is, and what its tensors and window imply for
the config, each family says (export/family.py `gguf_*`; export/families/).
"""

from __future__ import annotations

import math
from typing import Any

from fuselm.export.errors import ExportError
from fuselm.export.gguf.file import GGUFFile
from fuselm.export.registry import gguf_architectures, gguf_family

ROPE_SCALING = ("none", "linear", "yarn")


def architecture(gguf: GGUFFile) -> str:
    arch = _text(gguf, "general.architecture")
    if arch is None:
        raise ExportError(f"{gguf.path} has no general.architecture; it is not a model GGUF")
    if arch not in gguf_architectures():
        raise ExportError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(gguf_architectures())}")
    return str(arch)


def _required(gguf: GGUFFile, key: str) -> Any:
    value = gguf.value(key)
    if value is None:
        raise ExportError(f"{gguf.path} is missing metadata {key}; the file is incomplete")
    return value


def _wrong(gguf: GGUFFile, key: str, value: Any, allowed: str) -> ExportError:
    shown = f"an array of {len(value)}" if isinstance(value, list) else repr(value)[:60]
    return ExportError(f"{gguf.path}: metadata {key} is {shown}; it must be {allowed} — the file "
                       "is corrupt or was written by a broken tool")


def _int(gguf: GGUFFile, key: str, default: int | None = None, low: int = 1,
         required: bool = False) -> int | None:
    """An integer value (>= low) of the metadata: a string, float or array where llama.cpp
    writes an integer is refused, never coerced (int("4") would hide a broken file)."""
    value = _required(gguf, key) if required else gguf.value(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _wrong(gguf, key, value, f"an integer >= {low}")
    return value


def _number(gguf: GGUFFile, key: str, default: float | None = None,
            required: bool = False) -> float | None:
    """A finite number > 0 of the metadata (integers allowed), as float."""
    value = _required(gguf, key) if required else gguf.value(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value > 0):
        raise _wrong(gguf, key, value, "a finite number > 0")
    return float(value)


def _text(gguf: GGUFFile, key: str, default: str | None = None) -> str | None:
    value = gguf.value(key, default)
    if value is not None and not isinstance(value, str):
        raise _wrong(gguf, key, value, "a string")
    return value


def _token_id(gguf: GGUFFile, key: str, vocab: int) -> int | None:
    value = _int(gguf, key, low=0)
    if value is not None and value >= vocab:
        raise _wrong(gguf, key, value, f"a token id below the vocabulary size {vocab}")
    return value


class ArchKeys:
    """The `{arch}.*` metadata of one file, read with the same type checks as hf_config's own
    (a family's `gguf_config` reads the keys only it knows through this)."""

    def __init__(self, gguf: GGUFFile, arch: str) -> None:
        self.gguf, self.arch = gguf, arch

    def int(self, key: str, default: int | None = None, low: int = 1) -> int | None:
        return _int(self.gguf, f"{self.arch}.{key}", default, low)

    def number(self, key: str, default: float | None = None) -> float | None:
        return _number(self.gguf, f"{self.arch}.{key}", default)

    def value(self, key: str) -> Any:
        """The raw value (None when absent), for a key whose type varies."""
        return self.gguf.value(f"{self.arch}.{key}")

    def wrong(self, key: str, value: Any, allowed: str) -> ExportError:
        return _wrong(self.gguf, f"{self.arch}.{key}", value, allowed)


def _rope(gguf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any]:
    theta = _number(gguf, f"{arch}.rope.freq_base", 10000.0)
    rot = _int(gguf, f"{arch}.rope.dimension_count", low=0)
    if rot is not None and rot != head_dim:
        raise ExportError(
            f"{gguf.path}: rope.dimension_count {rot} != head_dim {head_dim} (partial rotary) "
            "is not supported for GGUF input")
    if "rope_freqs.weight" in gguf.tensors:
        raise ExportError(
            f"{gguf.path} stores per-frequency RoPE factors (rope_freqs, Llama 3.1-style "
            "scaling), which fuselm's GGUF input does not read; convert the HF checkpoint instead")
    kind = _text(gguf, f"{arch}.rope.scaling.type", "none")
    if kind not in ROPE_SCALING:
        raise ExportError(f"{gguf.path}: RoPE scaling {kind!r} is not supported; supported: "
                          f"{', '.join(ROPE_SCALING)}")
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if kind != "none":
        params.update(rope_type=kind,
                      factor=_number(gguf, f"{arch}.rope.scaling.factor", required=True))
        orig = _int(gguf, f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            params["original_max_position_embeddings"] = orig
    return params


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The config.json of the model in `gguf` (transformers 4.x and 5.x read it)."""
    arch = architecture(gguf)
    name = _text(gguf, "general.name", "") or ""
    found = gguf_family(arch, name)
    if found is None:
        raise ExportError(f"{gguf.path}: no family reads GGUF architecture {arch!r} "
                          f"named {name!r}")
    cls, family = found
    # Every number is type-checked here (_int, _number): config_check.py then checks the
    # config.json written from them, as it checks any HF config.
    hidden = _int(gguf, f"{arch}.embedding_length", required=True)
    heads = _int(gguf, f"{arch}.attention.head_count", required=True)
    kv_heads = _int(gguf, f"{arch}.attention.head_count_kv", heads)
    head_dim = (_int(gguf, f"{arch}.attention.key_length", 0, low=0)
                or _int(gguf, f"{arch}.rope.dimension_count", 0, low=0) or hidden // heads)
    vocab = _int(gguf, f"{arch}.vocab_size")
    if vocab is None:
        tokens = gguf.value("tokenizer.ggml.tokens")
        embd = gguf.tensors.get("token_embd.weight")
        vocab = len(tokens) if isinstance(tokens, list) and tokens else (
            embd.shape[0] if embd and embd.shape else None)
        if not vocab:
            raise ExportError(f"{gguf.path}: no vocab_size, tokens or token_embd.weight")
    t = gguf.tensors
    rope = _rope(gguf, arch, head_dim)
    config: dict[str, Any] = {
        "architectures": [cls],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": _int(gguf, f"{arch}.block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": _int(gguf, f"{arch}.feed_forward_length", required=True),
        "vocab_size": vocab,
        "max_position_embeddings": _int(gguf, f"{arch}.context_length", 4096),
        "rms_norm_eps": _number(gguf, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in t,
        # both spellings: transformers 5.x reads rope_parameters, 4.x rope_theta/rope_scaling
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "bos_token_id": _token_id(gguf, "tokenizer.ggml.bos_token_id", vocab),
        "eos_token_id": _token_id(gguf, "tokenizer.ggml.eos_token_id", vocab),
        "pad_token_id": _token_id(gguf, "tokenizer.ggml.padding_token_id", vocab),
        "torch_dtype": "float32",
    }
    # llama.cpp applies a sliding window only when the file declares one (and only in the
    # architectures whose graph reads it: the family decides)
    window = _int(gguf, f"{arch}.attention.sliding_window", low=0)
    try:
        family.gguf_config(config, t, window or None, ArchKeys(gguf, arch))
    except ExportError as e:
        said = str(e)  # ArchKeys' own refusals already name the file
        raise ExportError(said if said.startswith(str(gguf.path)) else f"{gguf.path}: {said}"
                          ) from None
    return config


def generation_config(gguf: GGUFFile) -> dict[str, Any]:
    """bos/eos/pad for generation_config.json; llama.cpp also stops on end-of-turn tokens."""
    vocab = hf_config(gguf)["vocab_size"]
    eos = [_token_id(gguf, k, vocab) for k in ("tokenizer.ggml.eos_token_id",
                                               "tokenizer.ggml.eot_token_id",
                                               "tokenizer.ggml.eom_token_id")]
    eos_ids = list(dict.fromkeys(i for i in eos if i is not None))
    out: dict[str, Any] = {"bos_token_id": _token_id(gguf, "tokenizer.ggml.bos_token_id", vocab)}
    if eos_ids:
        out["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = _token_id(gguf, "tokenizer.ggml.padding_token_id", vocab)
    if pad is not None:
        out["pad_token_id"] = pad
    return out
