"""GGUF metadata → an HF config.json and generation_config.json.

llama.cpp writes an HF config's numbers under `{arch}.*` keys (convert_hf_to_gguf.py); this
maps them back to the names transformers' config classes read, so the rest of fuselm sees an
ordinary HF model directory. Which family a file is, and what its tensors and window imply for
the config, each family says (export/family.py `gguf_*`; export/families/).
"""

from __future__ import annotations

from typing import Any

from fuselm.export.errors import ExportError
from fuselm.export.gguf.file import GGUFFile
from fuselm.export.registry import gguf_architectures, gguf_family

ROPE_SCALING = ("none", "linear", "yarn")


def architecture(gguf: GGUFFile) -> str:
    arch = gguf.value("general.architecture")
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


def _rope(gguf: GGUFFile, arch: str, head_dim: int) -> dict[str, Any]:
    theta = float(gguf.value(f"{arch}.rope.freq_base", 10000.0))
    rot = gguf.value(f"{arch}.rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ExportError(
            f"{gguf.path}: rope.dimension_count {rot} != head_dim {head_dim} (partial rotary) "
            "is not supported for GGUF input")
    if "rope_freqs.weight" in gguf.tensors:
        raise ExportError(
            f"{gguf.path} stores per-frequency RoPE factors (rope_freqs, Llama 3.1-style "
            "scaling), which fuselm's GGUF input does not read; convert the HF checkpoint instead")
    kind = str(gguf.value(f"{arch}.rope.scaling.type", "none"))
    if kind not in ROPE_SCALING:
        raise ExportError(f"{gguf.path}: RoPE scaling {kind!r} is not supported; supported: "
                          f"{', '.join(ROPE_SCALING)}")
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if kind != "none":
        params.update(rope_type=kind,
                      factor=float(_required(gguf, f"{arch}.rope.scaling.factor")))
        orig = gguf.value(f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            params["original_max_position_embeddings"] = int(orig)
    return params


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The config.json of the model in `gguf` (transformers 4.x and 5.x read it)."""
    arch = architecture(gguf)
    name = str(gguf.value("general.name", "") or "")
    found = gguf_family(arch, name)
    if found is None:
        raise ExportError(f"{gguf.path}: no family reads GGUF architecture {arch!r} "
                          f"named {name!r}")
    cls, family = found
    hidden = int(_required(gguf, f"{arch}.embedding_length"))
    heads = int(_required(gguf, f"{arch}.attention.head_count"))
    kv_heads = int(gguf.value(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(gguf.value(f"{arch}.attention.key_length", 0)
                   or gguf.value(f"{arch}.rope.dimension_count", 0) or hidden // heads)
    vocab = gguf.value(f"{arch}.vocab_size")
    if vocab is None:
        tokens = gguf.value("tokenizer.ggml.tokens")
        embd = gguf.tensors.get("token_embd.weight")
        vocab = len(tokens) if tokens else embd.shape[0] if embd else None
        if vocab is None:
            raise ExportError(f"{gguf.path}: no vocab_size, tokens or token_embd.weight")
    t = gguf.tensors
    rope = _rope(gguf, arch, head_dim)
    config: dict[str, Any] = {
        "architectures": [cls],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(_required(gguf, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(_required(gguf, f"{arch}.feed_forward_length")),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(gguf.value(f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(gguf.value(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in t,
        # both spellings: transformers 5.x reads rope_parameters, 4.x rope_theta/rope_scaling
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope["rope_type"] == "default" else rope,
        "bos_token_id": gguf.value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf.value("tokenizer.ggml.eos_token_id"),
        "pad_token_id": gguf.value("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    # llama.cpp applies a sliding window only when the file declares one
    window = gguf.value(f"{arch}.attention.sliding_window")
    try:
        family.gguf_config(config, t, int(window) if window else None)
    except ExportError as e:
        raise ExportError(f"{gguf.path}: {e}") from None
    return config


def generation_config(gguf: GGUFFile) -> dict[str, Any]:
    """bos/eos/pad for generation_config.json; llama.cpp also stops on end-of-turn tokens."""
    eos = [gguf.value(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                   "tokenizer.ggml.eom_token_id")]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    out: dict[str, Any] = {"bos_token_id": gguf.value("tokenizer.ggml.bos_token_id")}
    if eos_ids:
        out["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = gguf.value("tokenizer.ggml.padding_token_id")
    if pad is not None:
        out["pad_token_id"] = pad
    return out
