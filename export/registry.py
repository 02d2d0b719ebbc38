"""Architecture registry: `architectures[0]` of config.json → the family module that reads it.

Each family module registers its HF class names with `@register(...)` and returns the
features its checkpoints have; everything else about a decoder is shared (export/config.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuselm.export.config import (
    DecoderSpec,
    layer_windows,
    load_hf_config,
    read_raw_config,
    rope_spec,
)
from fuselm.export.errors import ExportError


@dataclass(frozen=True)
class Features:
    """What a family's checkpoints contain beyond the plain Llama decoder."""

    family: str
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


FamilyReader = Callable[[Any], Features]
ARCHITECTURES: dict[str, FamilyReader] = {}


def register(*names: str) -> Callable[[FamilyReader], FamilyReader]:
    def wrap(fn: FamilyReader) -> FamilyReader:
        for name in names:
            ARCHITECTURES[name] = fn
        return fn

    return wrap


def _load_families() -> None:
    # Importing the modules runs their @register decorators.
    from fuselm.export.families import llama, mistral, qwen2, qwen3  # noqa: F401


def supported_architectures() -> list[str]:
    _load_families()
    return sorted(ARCHITECTURES)


def _eos_ids(model_dir: Path, hf_config: Any) -> list[int]:
    """EOS ids: generation_config.json (may list several) first, then config.json."""
    import json

    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            value = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ExportError(f"{gen} is not valid JSON ({e})") from e
        if value is not None:
            ids = list(value) if isinstance(value, list) else [value]
    if not ids:
        value = getattr(hf_config, "eos_token_id", None)
        if value is not None:
            ids = list(value) if isinstance(value, list) else [value]
    return [int(i) for i in ids]


def decoder_spec(model_dir: str | Path) -> DecoderSpec:
    """Read and validate a model directory's config into the exporter's DecoderSpec."""
    root = Path(model_dir)
    raw = read_raw_config(root)
    arch = raw["architectures"][0]
    _load_families()
    reader = ARCHITECTURES.get(arch)
    if reader is None:
        raise ExportError(
            f"architecture {arch!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    hf = load_hf_config(root)
    act = getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ExportError(f"hidden_act {act!r} is not supported (fuselm exports SiLU MLPs)")
    features = reader(hf)
    heads = int(hf.num_attention_heads)
    kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise ExportError(f"num_attention_heads {heads} is not a multiple of kv heads {kv_heads}")
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    layers = int(hf.num_hidden_layers)
    return DecoderSpec(
        architecture=arch,
        family=features.family,
        hidden_size=int(hf.hidden_size),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(hf.intermediate_size),
        vocab_size=int(hf.vocab_size),
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        context_length=int(getattr(hf, "max_position_embeddings", 4096)),
        rope=rope_spec(hf, head_dim),
        qkv_bias=features.qkv_bias,
        o_bias=features.o_bias,
        mlp_bias=features.mlp_bias,
        qk_norm=features.qk_norm,
        windows=layer_windows(hf, features.family, layers),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=_eos_ids(root, hf),
        pad_token_id=getattr(hf, "pad_token_id", None),
    )
