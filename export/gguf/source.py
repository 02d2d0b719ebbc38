"""GGUF input: a .gguf file as a checkpoint the exporter reads like safetensors.

`GGUFCheckpoint` answers the exporter's questions (`info(name).shape`, `get(name)`, `dtype`)
in HF tensor names — the family-neutral checkpoint vocabulary — mapping each to its llama.cpp
name, dequantizing one tensor at a time and undoing llama.cpp's Q/K row permutation on llama
files. `stage` writes the small side files an HF directory would hold (config.json,
generation_config.json, tokenizer files with the chat template) so that the rest of the
pipeline, and `run`/`chat` on the artifact, work unchanged.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from fuselm.export.config import DecoderSpec
from fuselm.export.errors import ExportError
from fuselm.export.family import Family
from fuselm.export.gguf.blocks import EXACT_TYPES, given_blocks
from fuselm.export.gguf.config import generation_config, hf_config
from fuselm.export.gguf.file import FLOAT_TYPES, GGUFFile
from fuselm.export.registry import decoder_spec, family_of
from fuselm.given_blocks import GivenBlocks

if TYPE_CHECKING:  # torch is imported only where the torch exporter reads the file
    import torch

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def layer_names(family: Family | None = None) -> dict[str, str]:
    """HF layer tensor suffix → llama.cpp's, for `family` (None: Llama's table)."""
    return {**_LAYER, **(family.gguf_layer_names if family else {})}


def gguf_name(hf_name: str, family: Family | None = None) -> str | None:
    """The llama.cpp tensor name of an HF tensor name (None: no such tensor in GGUF)."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    m = _LAYER_NAME.fullmatch(hf_name)
    layer = layer_names(family)
    if m and m.group(2) in layer:
        return f"blk.{m.group(1)}.{layer[m.group(2)]}"
    return None


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's `permute` of q/k rows (weight [N, K] or bias [N]).

    llama.cpp rotates pairs of adjacent elements (GPT-J style); HF Llama rotates the two
    halves of each head, so the converter interleaves each head's two halves. This puts them
    back: per head, rows (2i, 2i+1) → (i, i + D/2).
    """
    rest = w.shape[1:]
    return np.ascontiguousarray(
        w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class GGUFCheckpoint:
    """The tensors of a GGUF file under their HF names, dequantized one at a time."""

    def __init__(self, path: str | Path, gguf: GGUFFile | None = None) -> None:
        self.gguf = gguf or GGUFFile(path)
        self.root = self.gguf.path
        self.config = hf_config(self.gguf)
        self.family = family_of(self.config["architectures"][0])
        # llama.cpp permutes q/k rows for Llama-style families only (Qwen is NeoX-style)
        self.permuted = self.family.gguf_permuted_qk
        self.files = [self.gguf.path]

    @property
    def dtype_name(self) -> str:
        """"float32" when the file's weights are mostly F32, else "float16" (F16, BF16 and the
        block formats dequantize to values a float16 graph holds to ~1e-3)."""
        counts: dict[str, int] = {}
        for t in self.gguf.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + int(np.prod(t.shape))
        top = max(counts, key=counts.__getitem__) if counts else "F32"
        return "float32" if top == "F32" else "float16"

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def nbytes(self) -> int:
        return self.gguf.path.stat().st_size

    @property
    def quantized(self) -> bool:
        """Whether any matrix comes in a block format (its conversion then keeps the blocks
        fuselm holds exactly and takes the others to 8-bit ones by default, rather than to
        float weights several times the file's size)."""
        return any(t.type_name not in FLOAT_TYPES and len(t.shape) == 2
                   for t in self.gguf.tensors.values())

    def tensor_types(self) -> dict[str, int]:
        """Tensor count per GGUF type, for the manifest."""
        out: dict[str, int] = {}
        for t in self.gguf.tensors.values():
            out[t.type_name] = out.get(t.type_name, 0) + 1
        return out

    @property
    def tensors(self) -> list[str]:
        """Every tensor of the file under its HF name (a GGUF name without an HF twin stays
        as it is, so the exporter's name check reports it); llama.cpp's precomputed RoPE
        factors are derived from the config instead, so they are left out."""
        reverse = {g: h for h, g in _GLOBAL.items()}
        layer = {g: h for h, g in layer_names(self.family).items()}
        out = []
        for name in self.gguf.tensors:
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
            if m and m.group(2) in layer:
                out.append(f"model.layers.{m.group(1)}.{layer[m.group(2)]}")
            elif name in reverse:
                out.append(reverse[name])
            elif name != "rope_freqs.weight":
                out.append(name)
        return out

    def _lookup(self, hf_name: str) -> str:
        name = gguf_name(hf_name, self.family)
        if name is None or name not in self.gguf.tensors:
            raise ExportError(
                f"tensor {hf_name!r} ({name or 'no GGUF name'}) is missing from {self.root}; "
                "the file does not match its metadata")
        return name

    def has(self, hf_name: str) -> bool:
        name = gguf_name(hf_name, self.family)
        return name is not None and name in self.gguf.tensors

    def info(self, hf_name: str) -> TensorInfo:
        import torch

        t = self.gguf.tensors[self._lookup(hf_name)]
        return TensorInfo(hf_name, t.shape, torch.float32)

    def shape(self, hf_name: str) -> tuple[int, ...]:
        return self.gguf.tensors[self._lookup(hf_name)].shape

    def array(self, hf_name: str) -> np.ndarray:
        """One tensor, dequantized to float32, in HF layout (q/k rows unpermuted, a norm
        applied as (1 + w) without the 1 that llama.cpp's converter adds to it)."""
        name = self._lookup(hf_name)
        w = self.gguf.read(name)
        if self.family.norm_offset and name.endswith("norm.weight"):
            w = w - np.float32(self.family.norm_offset)
        if self.permuted and name.split(".")[-2] in ("attn_q", "attn_k"):
            key = "num_attention_heads" if ".attn_q." in name else "num_key_value_heads"
            w = unpermute_qk(w, int(self.config[key]))
        return w

    def given_blocks(self, hf_name: str) -> GivenBlocks | None:
        """The tensor's own quantized blocks in HF layout [N, K] (q/k rows unpermuted, which
        moves whole rows and so keeps every block), or None when its type has no exact form in
        fuselm's stored formats (export/gguf/blocks.py)."""
        name = self._lookup(hf_name)
        t = self.gguf.tensors[name]
        if t.type_name not in EXACT_TYPES or len(t.shape) != 2:
            return None
        given = given_blocks(t.type_name, self.gguf.raw(name), t.shape)
        if given is not None and self.permuted and name.split(".")[-2] in ("attn_q", "attn_k"):
            key = "num_attention_heads" if ".attn_q." in name else "num_key_value_heads"
            rows = unpermute_qk(np.arange(t.shape[0]), int(self.config[key]))
            given = given.take_rows(rows)
        return given

    def get(self, hf_name: str) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.array(hf_name))


def write_tokenizer(gguf: GGUFFile, out_dir: Path) -> list[str]:
    """tokenizer.json + tokenizer_config.json (chat template included), built by transformers'
    own GGUF tokenizer converter — the same tokenizer `from_pretrained(gguf_file=...)` gives."""
    if gguf.value("tokenizer.ggml.model") is None:
        return []
    from fuselm.export.gguf.tokenizer import light_tokenizer

    try:
        try:
            tok = light_tokenizer(gguf)
        except Exception:  # noqa: BLE001 - another transformers layout: its own loader decides
            tok = None
        if tok is None:  # a transformers without the torch-free pieces: its loader (+ torch)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(gguf.path.parent), gguf_file=gguf.path.name)
    except Exception as e:  # transformers raises many types for tokenizers it cannot convert
        raise ExportError(
            f"{gguf.path}: its tokenizer ({gguf.value('tokenizer.ggml.model')}) cannot be "
            f"converted by transformers ({e})") from e
    before = set(out_dir.iterdir())
    tok.save_pretrained(str(out_dir))
    return sorted(p.name for p in set(out_dir.iterdir()) - before)


def stage(ckpt: GGUFCheckpoint, out_dir: Path) -> None:
    """Write config.json, generation_config.json and the tokenizer files into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(ckpt.config, indent=2))
    gen = generation_config(ckpt.gguf)
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    write_tokenizer(ckpt.gguf, out_dir)


def source_record(ckpt: GGUFCheckpoint) -> dict[str, Any]:
    """What fuselm.json's `source` says about a GGUF input."""
    return {"format": "gguf", "gguf_tensor_types": ckpt.tensor_types(),
            "gguf_name": ckpt.gguf.value("general.name")}


def builder_unsupported(ckpt: GGUFCheckpoint) -> str | None:
    """What in this file's config keeps it from the graph builder (export/graph_builder.py)
    before its spec is made (None: nothing). RoPE scaling needs transformers' own frequency
    functions (torch)."""
    c = ckpt.config
    params = c["rope_parameters"]
    for rope in [v for v in params.values() if isinstance(v, dict)] or [params]:  # per type
        if rope.get("rope_type", "default") != "default":
            return f"RoPE scaling {rope['rope_type']}"
    return None


def gguf_spec(model_dir: Path, ckpt: GGUFCheckpoint) -> DecoderSpec:
    """The DecoderSpec of the staged GGUF directory: the registry's own, read from the config
    dict fuselm wrote (every field present) instead of transformers' config class."""
    return decoder_spec(model_dir, hf_config=SimpleNamespace(**ckpt.config))
