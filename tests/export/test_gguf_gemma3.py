"""Gemma 3 GGUF input: a seeded random Gemma 3 text model written as llama.cpp writes a gemma3
file (sandwich norms under llama.cpp's names, norm weights with their +1, q/k norms, a tied
Q8_0 table, sliding and global layers with two RoPE bases, a final soft-cap, a Gemma-style
SentencePiece vocabulary), converted by default (the file's blocks kept). The reference is
transformers' Gemma3ForCausalLM in float32 built from the random model's own config, holding
the file's weights as gguf's own dequantizer reads them — nothing of fuselm's GGUF reading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuselm.export.errors import ExportError
from fuselm.export.gguf.source import GGUFCheckpoint
from fuselm.runtime_metal.artifact import read_manifest
from tests.export.gguf_files import (
    GEMMA_PROMPT,
    GEMMA_SHAPE,
    STRING,
    assert_engine_equals_reference,
    converted_gguf,
    gguf_value,
    reference_model,
    rewrite_gguf,
)

CONFIG = dict(GEMMA_SHAPE, final_logit_softcapping=30.0,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                               "full_attention": {"rope_type": "default",
                                                  "rope_theta": 1000000.0}})
# the types llama.cpp's Q4_K_M writes Gemma 3 270M in
TYPES = {"attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K",
         "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K", "token_embd": "Q8_0"}
PROMPT = GEMMA_PROMPT
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "  two  spaces\tand é",
         "<start_of_turn>user\nrotate keys<end_of_turn>"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return converted_gguf(tmp_path_factory.mktemp("gguf_gemma3"), "g", "gemma3_text", TYPES,
                          arch="gemma3", seed=3, **CONFIG)


@pytest.fixture(scope="module")
def reference(gemma: tuple[Path, Path]):  # noqa: ANN201 - a transformers model
    return reference_model(gemma[0], "gemma3_text")


def test_config_reads_as_the_hf_models(gemma: tuple[Path, Path]) -> None:
    path, _ = gemma
    got = GGUFCheckpoint(path).config
    want = json.loads((path.with_suffix(".hf") / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim",
                "final_logit_softcapping", "tie_word_embeddings", "hidden_activation"):
        assert got[key] == want[key], key
    assert {t: p["rope_theta"] for t, p in got["rope_parameters"].items()} == \
        {t: p["rope_theta"] for t, p in want["rope_parameters"].items()}


def test_default_convert_keeps_the_files_blocks(gemma: tuple[Path, Path]) -> None:
    q = read_manifest(gemma[1]).quantization
    assert q is not None and q["given"]["quantized"] == 0
    assert set(q["given"]["kept"]) == {"gguf Q5_0", "gguf Q8_0", "gguf Q4_K", "gguf Q6_K",
                                       "gguf Q5_0+gguf Q8_0"}  # fused QKV: Q5_0 q/k, Q8_0 v
    assert all(t["rel_rms_error"] == 0 for t in q["tensors"])


@pytest.mark.parametrize("engine", ["onnxruntime", "mlx"])
def test_logits_and_greedy_equal_the_files_dequantized_weights(
        gemma: tuple[Path, Path], reference, engine: str) -> None:  # noqa: ANN001
    assert_engine_equals_reference(gemma[1], reference, engine, PROMPT)


def test_tokenizer_equals_transformers_gguf_loader(gemma: tuple[Path, Path]) -> None:
    """The artifact's tokenizer encodes as transformers' own GGUF tokenizer does (BOS first,
    control tokens whole), and carries the file's chat template."""
    from transformers import AutoTokenizer

    path, out = gemma
    ours = AutoTokenizer.from_pretrained(str(out))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text)[0] == 2
    assert ours.encode(TEXTS[3])[1] == 5  # <start_of_turn>, one token
    chat = ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                    add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_layer_pattern_as_llama_cpp_reads_it(gemma: tuple[Path, Path], tmp_path: Path) -> None:
    """A period (every 2nd layer global here), the default period 6 when the file says none,
    and a pattern of the wrong type refused by name."""
    path, _ = gemma
    key = "gemma3.attention.sliding_window_pattern"
    period = rewrite_gguf(path, tmp_path / "p.gguf", {key: gguf_value(4, 2)})
    assert GGUFCheckpoint(period).config["layer_types"] == ["sliding_attention",
                                                            "full_attention"]
    default = rewrite_gguf(path, tmp_path / "d.gguf", {key: None})
    assert GGUFCheckpoint(default).config["layer_types"] == ["sliding_attention"] * 2
    bad = rewrite_gguf(path, tmp_path / "b.gguf", {key: gguf_value(STRING, "6")})
    with pytest.raises(ExportError, match="sliding_window_pattern is '6'; it must be a period"):
        GGUFCheckpoint(bad)
