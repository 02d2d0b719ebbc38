"""`fuselm convert` writes a complete artifact; `fuselm inspect` reads its signature."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from fuselm.runtime_metal.artifact import ModelInfo, read_manifest


def fuselm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fuselm.converter.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_convert_writes_artifact_and_inspect_reads_it(checkpoint, tmp_path: Path) -> None:
    src = checkpoint("qwen3")
    out = tmp_path / "art"
    r = fuselm("convert", str(src), "-o", str(out), "--no-optimize", "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["architecture"] == "Qwen3ForCausalLM" and summary["dtype"] == "float32"
    for name in (
        "model.onnx",
        "model.onnx.data",
        "fuselm.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (out / name).is_file(), name
    m = read_manifest(out)
    assert (m.model.head_dim, m.model.num_heads, m.model.num_kv_heads) == (24, 4, 2)
    assert m.model.tie_word_embeddings and m.special_tokens["eos"] == [2, 3]
    assert m.versions["torch"] and "export" in m.steps

    r = fuselm("inspect", str(out), "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["inputs"][0] == {"name": "input_ids", "type": "int64", "shape": ["batch", "seq"]}
    assert info["outputs"][0]["shape"] == ["batch", "seq", 384]
    assert info["ops"]["fuselm.FusedRoPE"] == 2 and info["ops"]["Attention"] == 2
    # every weight byte is counted; only alignment padding (< 64 B per tensor) is not
    size = (out / "model.onnx.data").stat().st_size
    assert 0 <= size - info["weight_bytes"] < 64 * info["initializers"]

    # converting again into an existing artifact replaces it in one step
    r = fuselm(
        "convert", str(src), "-o", str(out), "--no-optimize", "--quiet", "--dtype", "float16"
    )
    assert r.returncode == 0, r.stderr
    assert read_manifest(out).dtype == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_the_parameter_count_is_the_models_own(tmp_path: Path) -> None:
    """Every family's count is transformers' num_parameters() (a tied table once): Qwen2's
    q/k/v biases, Qwen3's and Gemma 3's q/k norms, Gemma 2/3's extra norms all counted."""
    import torch
    from transformers import AutoModelForCausalLM

    from fuselm.converter.models.builtin import FAMILIES, build_model
    from fuselm.export.registry import decoder_spec
    from fuselm.runtime_metal.model_size import parameter_count
    from tests.families import TEST_CONFIGS

    for family in FAMILIES:
        folder = build_model(tmp_path / family, family, **TEST_CONFIGS.get(family, {}))
        hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        spec = decoder_spec(folder)
        assert spec.parameters == hf.num_parameters(), family
        fields = {f.name for f in dataclasses.fields(ModelInfo)}
        info = ModelInfo(**{k: getattr(spec, k) for k in fields})
        assert parameter_count(info) == hf.num_parameters(), family


def test_a_sentencepiece_tokenizer_model_is_copied(checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    """A checkpoint whose tokenizer is tokenizer.model (SentencePiece) alone: the artifact
    carries it, recorded, as it carries tokenizer.json (it was left behind, and the artifact
    had no tokenizer its loader could build)."""
    import shutil

    src = tmp_path / "sp"
    shutil.copytree(checkpoint("qwen3"), src)
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.model").write_bytes(b"\x0a\x05spiece-model-bytes")
    from fuselm.converter.pipeline import ConvertOptions, convert

    out = tmp_path / "art"
    convert(src, out, ConvertOptions(dtype="float32", optimize=False))
    assert (out / "tokenizer.model").read_bytes() == (src / "tokenizer.model").read_bytes()
    m = read_manifest(out)
    assert "tokenizer.model" in m.files["tokenizer"]
    assert "tokenizer.model" in m.integrity["files"]
