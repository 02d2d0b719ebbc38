"""Gemma 2 GGUF input: a seeded random Gemma 2 written as llama.cpp writes a gemma2 file
(sandwich norms under llama.cpp's names, norm weights with their +1, the window and both
soft-caps in the metadata, nothing stating the alternating layer pattern, a tied Q8_0 table, a
Gemma-style SentencePiece vocabulary), in block types llama.cpp's small quantizations use,
converted by default (every block kept). The reference is transformers' Gemma2ForCausalLM in
float32 built from the random model's own config, holding the file's weights as gguf's own
dequantizer reads them (gguf_files.reference_model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fuselm.export.gguf.source import GGUFCheckpoint
from fuselm.runtime_metal.artifact import read_manifest
from tests.export.gguf_files import (
    GEMMA_PROMPT,
    GEMMA_SHAPE,
    assert_engine_equals_reference,
    converted_gguf,
    reference_model,
    rewrite_gguf,
)

# caps small enough to bite on a random model's logits
CONFIG = dict(GEMMA_SHAPE, attn_logit_softcapping=1.0, final_logit_softcapping=5.0)
# each fused projection in one stored form: q/k/v Q5_1 (8-bit, bias), gate/up Q5_K (8-bit,
# bias), o Q3_K (4-bit in blocks of 16), down IQ4_XS (non-linear levels in 8 bits)
TYPES = {"attn_q": "Q5_1", "attn_k": "Q5_1", "attn_v": "Q5_1", "attn_output": "Q3_K",
         "ffn_gate": "Q5_K", "ffn_up": "Q5_K", "ffn_down": "IQ4_XS", "token_embd": "Q8_0"}
PROMPT = GEMMA_PROMPT


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return converted_gguf(tmp_path_factory.mktemp("gguf_gemma2"), "g", "gemma2", TYPES, seed=5,
                          **CONFIG)


@pytest.fixture(scope="module")
def reference(gemma: tuple[Path, Path]):  # noqa: ANN201 - a transformers model
    return reference_model(gemma[0], "gemma2")


def test_config_reads_as_the_hf_models(gemma: tuple[Path, Path], tmp_path: Path) -> None:
    """The file's window and caps, llama.cpp's layer pattern and scale; a file without the
    caps or the window gets llama.cpp's defaults (50, 30, 4096: Gemma 2's own)."""
    path, _ = gemma
    got = GGUFCheckpoint(path).config
    want = json.loads((path.with_suffix(".hf") / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim",
                "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings",
                "hidden_activation"):
        assert got[key] == want[key], key
    bare = rewrite_gguf(path, tmp_path / "bare.gguf", {
        f"gemma2.{k}": None for k in ("attn_logit_softcapping", "final_logit_softcapping",
                                      "attention.sliding_window")})
    c = GGUFCheckpoint(bare).config
    assert (c["attn_logit_softcapping"], c["final_logit_softcapping"], c["sliding_window"]) == (
        50.0, 30.0, 4096)


def test_default_convert_keeps_the_files_blocks(gemma: tuple[Path, Path]) -> None:
    q = read_manifest(gemma[1]).quantization
    assert q is not None and q["given"]["quantized"] == 0
    assert set(q["given"]["kept"]) == {f"gguf {t}" for t in TYPES.values()}
    assert all(t["rel_rms_error"] == 0 for t in q["tensors"])


@pytest.mark.parametrize("engine", ["onnxruntime", "mlx"])
def test_logits_and_greedy_equal_the_files_dequantized_weights(
        gemma: tuple[Path, Path], reference, engine: str) -> None:  # noqa: ANN001
    assert_engine_equals_reference(gemma[1], reference, engine, PROMPT)
