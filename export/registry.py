"""config.json → DecoderSpec through the family registered for `architectures[0]`.

The registry itself is export/family.py (a leaf that families register into); importing
export/families/ registers every module in it. Everything here is generic: the numbers every
decoder config has, then the family's hooks (export/family.py) for what differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fuselm.export.families  # noqa: F401 - registers every family module
from fuselm.export.config import DecoderSpec, load_hf_config, read_raw_config, rope_spec
from fuselm.export.errors import ExportError
from fuselm.export.family import ARCHITECTURES, Family
from fuselm.input_files import load_file


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def model_types() -> tuple[str, ...]:
    """transformers model_type of every family, in registration order."""
    return tuple(dict.fromkeys(f.model_type for f in ARCHITECTURES.values()))


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF `general.architecture` names some family reads, in registration order."""
    return tuple(dict.fromkeys(f.gguf_architecture for f in ARCHITECTURES.values()
                               if f.gguf_architecture))


def gguf_family(gguf_architecture: str, name: str) -> tuple[str, Family] | None:
    """(HF architecture, family) of a GGUF file written as `gguf_architecture` and named
    `name`: the family whose name marker the name holds, else the one without a marker."""
    found = [(arch, f) for arch, f in ARCHITECTURES.items()
             if f.gguf_architecture == gguf_architecture]
    marked = [(a, f) for a, f in found if f.gguf_name_marker
              and f.gguf_name_marker in name.lower()]
    plain = [(a, f) for a, f in found if not f.gguf_name_marker]
    return (marked or plain or [None])[0]


def family_named(model_type: str) -> Family:
    """The family of a transformers model_type."""
    for family in ARCHITECTURES.values():
        if family.model_type == model_type:
            return family
    raise ExportError(f"unknown family {model_type!r}; choose from {', '.join(model_types())}")


def demo_family() -> str:
    """The model_type the built-in demo model has unless told otherwise."""
    return next(f.model_type for f in ARCHITECTURES.values() if f.demo)


def family_of(architecture: str) -> Family:
    family = ARCHITECTURES.get(architecture)
    if family is None:
        raise ExportError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return family


def _eos_ids(model_dir: Path, hf_config: Any) -> list[int]:
    """EOS ids: generation_config.json (may list several) first, then config.json."""
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            value = load_file(gen).get("eos_token_id")
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and JSONTooDeep too
            raise ExportError(f"{gen} is not valid JSON ({e})") from None
        if value is not None:
            ids = list(value) if isinstance(value, list) else [value]
    if not ids:
        value = getattr(hf_config, "eos_token_id", None)
        if value is not None:
            ids = list(value) if isinstance(value, list) else [value]
    return [int(i) for i in ids]


def _tied(root: Path, hf: Any, has_checkpoint: bool) -> bool:
    """tie_word_embeddings as transformers (5.x) applies it: a tied config whose checkpoint also
    stores an lm_head.weight with other values than the embedding is *not* tied — transformers
    warns and loads the stored head — so the exported graph uses the stored head too (the
    equal case stays tied: one table in the artifact). `has_checkpoint`: the directory holds
    the weights (a GGUF's staged config states its tie itself)."""
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    if not (tied and has_checkpoint):
        return tied
    from fuselm.export.safetensors.checkpoint import Checkpoint
    from fuselm.export.safetensors.shard_index import INDEX

    if not (root / INDEX).is_file() and not any(root.glob("*.safetensors")):
        return tied  # no weights here (a config read on its own): the exporter says so later
    ckpt = Checkpoint(root)
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    if ckpt.has(head) and ckpt.has(embed) and not ckpt.same_values(head, embed):
        return False
    return tied


def decoder_spec(model_dir: str | Path, hf_config: Any = None) -> DecoderSpec:
    """Read and validate a model directory's config into the exporter's DecoderSpec.
    `hf_config`: the config's attributes when the caller has them complete (GGUF input writes
    every field itself), instead of transformers' config class — no torch import."""
    root = Path(model_dir)
    raw = read_raw_config(root)
    arch = raw["architectures"][0]
    family = family_of(arch)
    hf = hf_config if hf_config is not None else load_hf_config(root)
    heads = int(hf.num_attention_heads)
    kv_heads = int(getattr(hf, "num_key_value_heads", None) or heads)
    if heads % kv_heads:
        raise ExportError(f"num_attention_heads {heads} is not a multiple of kv heads {kv_heads}")
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    layers = int(hf.num_hidden_layers)
    ropes = family.ropes(hf, head_dim, layers)
    spec = DecoderSpec(
        architecture=arch,
        family=family.model_type,
        hidden_size=int(hf.hidden_size),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(hf.intermediate_size),
        vocab_size=int(hf.vocab_size),
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        tie_word_embeddings=_tied(root, hf, hf_config is None),
        context_length=int(getattr(hf, "max_position_embeddings", 4096)),
        rope=next((r for r in ropes if r is not None), None) or rope_spec(hf, head_dim),
        windows=family.windows(hf, layers),
        ropes=ropes,
        activation=family.activation(hf),
        bos_token_id=getattr(hf, "bos_token_id", None),
        eos_token_ids=_eos_ids(root, hf),
        pad_token_id=getattr(hf, "pad_token_id", None),
    )
    return family.configure(hf, spec)
