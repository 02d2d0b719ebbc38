"""Tiny GGUF files written with gguf's own GGUFWriter from seeded random HF checkpoints.

Laid out as llama.cpp's convert_hf_to_gguf.py lays them out: llama.cpp tensor names, q/k rows
permuted on llama files, norms in F32 (Gemma's with the 1 of its (1 + w) added, as llama.cpp's
converter adds it), every other 2-D weight in the tensor type a test asks for. A gemma2 or
gemma3 file gets Gemma's metadata and a small SentencePiece vocabulary laid out as Gemma's
(specials, byte tokens, pieces in merge order, no merges); the others the random model's
byte-level BPE.
gguf's Python package quantizes F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/TQ1_0/TQ2_0/MXFP4 itself; for
the K-quants and the IQ types it has no quantizer, so their blocks are random bytes with small,
valid float16 scales (what matters here is that fuselm and transformers dequantize the same
bytes the same way).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from fuselm.converter.models.builtin import build_model
from fuselm.export.gguf.source import gguf_name
from fuselm.export.registry import family_named

# Types gguf's package has no quantizer for: (bytes per 256 weights, byte offsets of the
# float16 scale fields in them, the range those scales are drawn from: weights come out of the
# order of a trained model's, ~0.01)
_K = (2e-5, 6e-5)
RANDOM = {"Q2_K": (84, (80, 82), (2e-4, 4e-4)), "Q3_K": (110, (108,), (1e-4, 3e-4)),
           "Q4_K": (144, (0, 2), _K), "Q5_K": (176, (0, 2), _K), "Q6_K": (210, (208,), _K),
           "IQ4_NL": (144, tuple(range(0, 144, 18)), (1e-4, 3e-4)),
           "IQ4_XS": (136, (0,), (5e-6, 1e-5)), "IQ1_S": (50, (0,), (1e-3, 3e-3)),
           "IQ1_M": (56, (), (1e-3, 3e-3)), "IQ2_XXS": (66, (0,), (2e-4, 5e-4)),
           "IQ2_XS": (74, (0,), (2e-4, 5e-4)), "IQ2_S": (82, (0,), (2e-4, 5e-4)),
           "IQ3_XXS": (98, (0,), (1e-4, 2.5e-4)), "IQ3_S": (110, (0,), (1e-4, 2.5e-4))}


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `permute` (HF halves → llama.cpp interleaved pairs)."""
    rest = w.shape[1:]
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def random_blocks(rows: int, cols: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `kind` (rows x cols weights) with small, valid float16 scales."""
    size, scale_at, (low, high) = RANDOM[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for at in scale_at:
        d = rng.uniform(low, high, size=blocks.shape[0]).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    if kind == "IQ1_M":  # its float16 d is four nibbles: the top nibble of each 16-bit scale
        d = rng.uniform(low, high, size=blocks.shape[0]).astype(np.float16).view(np.uint16)
        for i in range(4):
            nibble = ((d >> np.uint16(4 * i)) & np.uint16(15)).astype(np.uint8)
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & np.uint8(15)) | (nibble << 4)
    return blocks.reshape(rows, -1)


def _tensor(writer: Any, name: str, w: np.ndarray, kind: str, rng: np.random.Generator) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[kind]
    if w.ndim == 1 or kind == "F32":
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    elif kind in RANDOM:
        writer.add_tensor(name, random_blocks(*w.shape, kind, rng), raw_dtype=qtype)
    else:
        writer.add_tensor(name, quantize(np.ascontiguousarray(w, np.float32), qtype),
                          raw_dtype=qtype)


def _tokenizer(writer: Any, hf_dir: Path) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in spec["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text()).get(
        "chat_template") or (hf_dir / "chat_template.jinja").read_text())


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>",
                  "<end_of_turn>"]
GEMMA_WORDS = ("hello", "world", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
               "rotary", "embeddings", "rotate", "queries", "and", "keys", "user", "model")
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _gemma_tokenizer(writer: Any, vocab_size: int) -> None:
    """Gemma's vocabulary layout at `vocab_size`: control tokens, the 256 byte-fallback tokens,
    then pieces ("▁" is a space) in merge order, each one piece longer than one before it."""
    pieces: list[str] = ["▁", *"abcdefghijklmnopqrstuvwxyz"]
    for word in GEMMA_WORDS:
        for end in range(2, len(word) + 2):
            piece = ("▁" + word)[:end]
            if piece not in pieces:
                pieces.append(piece)
    tokens = [*GEMMA_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    tokens = tokens[:vocab_size] + [f"<unused{i}>" for i in range(vocab_size - len(tokens))]
    kinds = [3 if t in GEMMA_SPECIALS else 6 if t.startswith("<0x") else
             5 if t.startswith("<unused") else 1 for t in tokens]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(i) for i in range(len(tokens))])
    writer.add_token_types(kinds)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(GEMMA_TEMPLATE)


def _gemma_metadata(writer: Any, config: dict[str, Any]) -> None:
    """What llama.cpp reads of a Gemma 3 config beyond the common keys: the layer pattern (as
    one flag per layer), the sliding layers' RoPE base, the final soft-cap. The softmax scale
    is not stored: llama.cpp takes head_dim ** -0.5, so the config must have
    query_pre_attn_scalar == head_dim."""
    assert config["query_pre_attn_scalar"] == config["head_dim"]
    writer.add_array(f"{writer.arch}.attention.sliding_window_pattern",
                     [t == "sliding_attention" for t in config["layer_types"]])
    rope = config["rope_parameters"]
    writer.add_float32(f"{writer.arch}.rope.freq_base_swa",
                       rope["sliding_attention"]["rope_theta"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])


def _gemma2_metadata(writer: Any, config: dict[str, Any]) -> None:
    """What llama.cpp reads of a Gemma 2 config beyond the common keys: the two soft-caps (the
    window is written with the common keys). Nothing states the layer pattern (llama.cpp fixes
    it: every other layer slides, layer 0 first) or the softmax scale (head_dim ** -0.5), so
    the config must have them so."""
    assert config["query_pre_attn_scalar"] == config["head_dim"]
    assert config["layer_types"] == ["sliding_attention" if i % 2 == 0 else "full_attention"
                                     for i in range(config["num_hidden_layers"])]
    writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])


def reference_model(path: Path, family: str):  # noqa: ANN201 - a transformers model
    """transformers' model of the random checkpoint `path` was written from (its .hf config),
    in float32, holding the file's weights as gguf.GGUFReader + gguf.quants.dequantize read
    them (a norm less the 1 llama.cpp adds): the reference for a family whose GGUF transformers
    does not load itself; nothing of fuselm's GGUF reading is used."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(str(path.with_suffix(".hf"))), dtype=torch.float32).eval()
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    owner = family_named(family)
    state = {}
    for name, p in model.state_dict().items():
        t = tensors[gguf_name(name, owner) or ""] if name != "lm_head.weight" else None
        if t is None:
            continue
        w = dequantize(t.data, t.tensor_type).reshape(p.shape).astype(np.float32)
        state[name] = torch.from_numpy(w - owner.norm_offset if name.endswith("norm.weight")
                                       else w)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def hf_logits(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001 - a transformers model
    """The reference model's float32 logits for one prompt, [len(ids), vocab]."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def assert_engine_equals_reference(out: Path, reference, engine: str,  # noqa: ANN001
                                   prompt: list[int], new_tokens: int = 6) -> None:
    """The artifact on `engine` (onnxruntime at accuracy level 0: float activations) gives the
    reference model's logits within 1e-4 and its greedy tokens (the reference's by full
    forwards: no cache on its side)."""
    from fuselm.runtime_metal.engine import make_engine
    from fuselm.runtime_metal.generate import generate
    from fuselm.runtime_metal.validate import engine_logits, rel

    eng = make_engine(out, engine, **({"accuracy_level": 0} if engine == "onnxruntime" else {}))
    assert rel(engine_logits(eng, prompt, None), hf_logits(reference, prompt)) <= 1e-4
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(hf_logits(reference, ids)[-1].argmax()))
    assert generate(eng, prompt, max_new_tokens=new_tokens).tokens == ids[len(prompt):]


# A two-layer Gemma (2 or 3) as the GGUF Gemma tests write it: head_dim 64 =
# query_pre_attn_scalar (llama.cpp's scale for all but Gemma 2's 46-layer model); 4 heads x 64 =
# 256, a whole Q4_K super-block along o_proj's K; window 4 < GEMMA_PROMPT; layer 0 slides,
# layer 1 is global, as llama.cpp fixes it. Each test adds its family's soft-caps and RoPE.
GEMMA_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=384,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                   query_pre_attn_scalar=64, sliding_window=4, tie_word_embeddings=True,
                   layer_types=["sliding_attention", "full_attention"])
GEMMA_PROMPT = [2, 5, 17, 99, 200, 3, 42, 7, 300, 11]


def converted_gguf(root: Path, name: str, family: str, types: dict[str, str],
                   arch: str | None = None, seed: int = 0, **overrides: Any) -> tuple[Path, Path]:
    """write_gguf's file `root/name.gguf` and its default conversion `root/name` with a
    float32 graph (only the blocks' own values can differ from transformers')."""
    from fuselm.converter.pipeline import ConvertOptions, convert

    path, _ = write_gguf(root / f"{name}.gguf", family, types, arch, seed, **overrides)
    convert(path, root / name, ConvertOptions(dtype="float32"))
    return path, root / name


def write_gguf(path: Path, family: str, types: dict[str, str], arch: str | None = None,
               seed: int = 0, **overrides: Any) -> tuple[Path, dict[str, np.ndarray]]:
    """Build a random HF checkpoint and write it as a GGUF; `types` maps a llama.cpp tensor
    suffix ("attn_q", "ffn_down", "token_embd", ...) to its type (default F16).
    Returns the path and the HF float32 weights it came from."""
    import torch
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    hf_dir = build_model(path.with_suffix(".hf"), family, seed=seed, **overrides)
    config = json.loads((hf_dir / "config.json").read_text())
    weights = {k: v.to(torch.float32).numpy() for k, v in
               load_file(str(hf_dir / "model.safetensors")).items()}
    arch = arch or family
    owner = family_named(family)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny {family}")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers'
    w.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_vocab_size(config["vocab_size"])
    if config.get("sliding_window"):
        w.add_sliding_window(config["sliding_window"])
    if arch == "gemma3":
        _gemma_metadata(w, config)
    elif arch == "gemma2":
        _gemma2_metadata(w, config)
    if arch in ("gemma2", "gemma3"):
        _gemma_tokenizer(w, config["vocab_size"])
    else:
        _tokenizer(w, hf_dir)
    rng = np.random.default_rng(seed)
    for hf_name, value in weights.items():
        name = gguf_name(hf_name, owner)
        assert name is not None, hf_name
        if name.endswith("norm.weight"):
            value = value + np.float32(owner.norm_offset)
        if arch == "llama" and name.split(".")[-2] in ("attn_q", "attn_k"):
            value = permute_qk(value, heads if ".attn_q." in name else kv_heads)
        kind = types.get(name.split(".")[-2], "F16") if value.ndim == 2 else "F32"
        _tensor(w, name, value, kind, rng)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, weights


# ---- byte-level surgery on a GGUF file: metadata of any type or nesting, tensor table edits
# (GGUFWriter validates what it writes and recurses on nested arrays, so hostile files are
# written here from the format itself: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
STRING, ARRAY = 8, 9


def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def gguf_value(kind: int, value: Any, item: int | None = None) -> bytes:
    """Type code + payload of one metadata value (`item`: the element type of an array)."""
    return struct.pack("<I", kind) + _payload(kind, value, item)


def _payload(kind: int, value: Any, item: int | None) -> bytes:
    if kind in _SCALARS:
        return struct.pack("<" + _SCALARS[kind], value)
    if kind == STRING:
        return _string(value)
    assert kind == ARRAY and item is not None
    return struct.pack("<IQ", item, len(value)) + b"".join(_payload(item, v, None)
                                                         for v in value)


def nested_array(depth: int) -> bytes:
    """An array of one array of one array ... `depth` deep, the innermost an empty uint8 array
    (built flat: the writer itself must not recurse)."""
    return (struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * (depth - 1)
            + struct.pack("<IQ", 0, 0))


def _skip(buf: bytes, pos: int, kind: int) -> int:
    if kind in _SCALARS:
        return pos + struct.calcsize("<" + _SCALARS[kind])
    if kind == STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    for _ in range(count):
        pos = _skip(buf, pos, item)
    return pos


def rewrite_gguf(src: Path, dst: Path, metadata: dict[str, bytes | None] | None = None,
                 tensors: Any = None) -> Path:
    """Copy the GGUF `src` to `dst`, replacing metadata values (key -> `gguf_value(...)` bytes,
    None to drop the key; new keys are appended) and the tensor table (`tensors(list)` edits a
    list of [name, dims (ne order), type, offset] in place); tensor data is copied as is."""
    buf = src.read_bytes()
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos, kvs = 24, {}
    for _ in range(n_kv):
        n = struct.unpack_from("<Q", buf, pos)[0]
        key = buf[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        end = _skip(buf, pos + 4, struct.unpack_from("<I", buf, pos)[0])
        kvs[key] = buf[pos:end]
        pos = end
    table = []
    for _ in range(n_tensors):
        n = struct.unpack_from("<Q", buf, pos)[0]
        name = buf[pos + 8:pos + 8 + n].decode()
        pos += 8 + n
        (dims_n,) = struct.unpack_from("<I", buf, pos)
        dims = list(struct.unpack_from(f"<{dims_n}Q", buf, pos + 4))
        pos += 4 + 8 * dims_n
        kind, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        table.append([name, dims, kind, offset])
    align = 32
    if "general.alignment" in kvs:
        align = struct.unpack_from("<I", kvs["general.alignment"], 4)[0]
    data = buf[-(-pos // align) * align:]
    for key, value in (metadata or {}).items():
        if value is None:
            kvs.pop(key, None)
        else:
            kvs[key] = value
    if tensors is not None:
        tensors(table)
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(table), len(kvs)))
    for key, value in kvs.items():
        out += _string(key) + value
    for name, dims, kind, offset in table:
        out += _string(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        out += struct.pack("<IQ", kind, offset)
    out += bytes(-len(out) % align) + data
    dst.write_bytes(bytes(out))
    return dst
