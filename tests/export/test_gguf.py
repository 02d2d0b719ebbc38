"""GGUF input on tiny files written by gguf's GGUFWriter: every supported tensor type, the
llama q/k permutation, config and tokenizer, against transformers' own GGUF loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType

from fuselm.converter.cli.main import cli
from fuselm.export.errors import ExportError
from fuselm.export.gguf.file import SUPPORTED_TYPES
from fuselm.export.gguf.source import GGUFCheckpoint, unpermute_qk
from fuselm.runtime_metal.artifact import read_manifest
from fuselm.runtime_metal.ort_engine.engine import OrtEngine
from fuselm.runtime_metal.validate import rel
from tests.export.gguf_files import permute_qk, rewrite_gguf, write_gguf

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=384)
# Each supported type appears once across the three files. llama: GQA 4:1 and head_dim 64 !=
# 256 / 8; q/k kept float so the unpermuted rows compare to HF's directly.
CASES = {
    "llama": (dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64), {
        "attn_q": "F16", "attn_k": "F32", "attn_v": "Q4_K", "attn_output": "Q5_K",
        "ffn_gate": "Q6_K", "ffn_up": "Q4_0", "ffn_down": "Q4_1", "token_embd": "Q8_0",
        "output": "BF16"}),
    "qwen2": (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64), {
        "attn_q": "Q5_1", "attn_k": "Q3_K", "attn_v": "Q2_K", "attn_output": "IQ4_XS",
        "ffn_gate": "IQ4_NL", "ffn_up": "IQ1_S", "ffn_down": "IQ1_M", "token_embd": "IQ2_XXS",
        "output": "Q5_0"}),
    # transformers reads no head_dim for qwen3 GGUF (its config default, 128, applies)
    "qwen3": (dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128), {
        "attn_q": "IQ2_XS", "attn_k": "IQ2_S", "attn_v": "IQ3_XXS", "attn_output": "IQ3_S",
        "ffn_gate": "TQ1_0", "ffn_up": "TQ2_0", "ffn_down": "MXFP4", "token_embd": "F16"}),
}
PROMPT = [5, 17, 99, 200, 3, 42, 7, 300, 11]


@pytest.fixture(scope="session")
def gguf_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    root = tmp_path_factory.mktemp("gguf")
    return {name: write_gguf(root / f"{name}.gguf", name, types, seed=i, **SHAPE, **shape)
            for i, (name, (shape, types)) in enumerate(CASES.items())}


@pytest.fixture(scope="session")
def gguf_artifacts(gguf_cases: dict[str, tuple[Path, dict]],
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fuselm.converter.pipeline import ConvertOptions, convert

    root = tmp_path_factory.mktemp("gguf_out")
    out = {}
    for name, (path, _) in gguf_cases.items():
        # float weights: this compares the dequantization of every type (test_gguf_exact.py
        # covers the default conversion, which keeps the blocks)
        convert(path, root / name, ConvertOptions(dtype="float32", source_quant=False))
        out[name] = root / name
    return out


def test_every_supported_type_is_covered() -> None:
    used = {t for _, types in CASES.values() for t in types.values()} | {"F32"}
    assert used == set(SUPPORTED_TYPES)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 8), 8), w)
    assert not np.array_equal(permute_qk(w, 8), w)


def test_llama_qk_rows_come_back_in_hf_order(gguf_cases: dict[str, tuple[Path, dict]]) -> None:
    path, weights = gguf_cases["llama"]
    ckpt = GGUFCheckpoint(path)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.norm.weight"):
        got = ckpt.get(name).numpy()
        assert rel(got, weights[name]) <= 1e-3, name  # q is stored F16, k F32


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_gguf_loader(gguf_cases: dict[str, tuple[Path, dict]],
                                               gguf_artifacts: dict[str, Path],
                                               name: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    path, _ = gguf_cases[name]
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    out = gguf_artifacts[name]
    eng = OrtEngine(out, read_manifest(out), accuracy_level=0)
    got = eng.forward(np.asarray(PROMPT)[None], all_logits=True)
    assert rel(got, want) <= 1e-4
    m = read_manifest(out).model
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    assert (m.num_heads, m.num_kv_heads, m.head_dim) == (
        c.num_attention_heads, c.num_key_value_heads, head_dim)
    assert m.tie_word_embeddings == (name == "qwen3")


def test_tokenizer_and_chat_template_written(gguf_cases: dict[str, tuple[Path, dict]],
                                             gguf_artifacts: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    path, _ = gguf_cases["qwen2"]
    ours = AutoTokenizer.from_pretrained(str(gguf_artifacts["qwen2"]))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "The quick brown fox jumps over the lazy dog. Hello metal!"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == text
    msgs = [{"role": "user", "content": "Hello world"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == theirs.apply_chat_template(
        msgs, tokenize=False)
    gen = json.loads((gguf_artifacts["qwen2"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1
    source = read_manifest(gguf_artifacts["qwen2"]).source
    assert source["format"] == "gguf" and source["path"] == str(path.resolve())


def _cli_error(args: list[str]) -> str:
    res = CliRunner().invoke(cli, args)
    assert isinstance(res.exception, ExportError), res.output
    return str(res.exception)


def test_truncated_and_corrupt_files(gguf_cases: dict[str, tuple[Path, dict]],
                                     tmp_path: Path) -> None:
    data = gguf_cases["qwen3"][0].read_bytes()
    for name, blob in [("cut-data", data[: len(data) - 1000]), ("cut-header", data[:200]),
                       ("garbage", b"GGUF" + bytes(range(256)) * 4)]:
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(blob)
        msg = _cli_error(["convert", str(bad), "-o", str(tmp_path / f"out-{name}")])
        assert "truncated" in msg or "not a valid GGUF" in msg, msg
        assert not (tmp_path / f"out-{name}").exists()
    plain = tmp_path / "plain.gguf"
    plain.write_text("hello")
    assert "not a GGUF file" in _cli_error(["convert", str(plain), "-o", str(tmp_path / "o")])


def test_unsupported_architecture_and_type(tmp_path: Path) -> None:
    path, _ = write_gguf(tmp_path / "gemma.gguf", "llama", {}, arch="gemma", **SHAPE,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    msg = _cli_error(["convert", str(path), "-o", str(tmp_path / "o1")])
    assert "'gemma' is not supported" in msg and "llama, qwen2, qwen3" in msg
    path, _ = write_gguf(tmp_path / "q4_0.gguf", "llama", {"ffn_up": "Q4_0"}, **SHAPE,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)

    def nvfp4(table: list) -> None:  # NVFP4 blocks take the bytes Q4_0's do (36 per 64)
        for row in table:
            if row[0] == "blk.1.ffn_up.weight":
                row[2] = int(GGMLQuantizationType.NVFP4)

    bad = rewrite_gguf(path, tmp_path / "nvfp4.gguf", tensors=nvfp4)
    msg = _cli_error(["convert", str(bad), "-o", str(tmp_path / "o2")])
    assert "tensor type NVFP4 is not supported (tensor blk.1.ffn_up.weight)" in msg
    assert "Q5_1" in msg and "IQ4_XS" in msg


def _maps_of(path: Path) -> list[str]:
    """Lines of /proc/self/maps that map `path` (Linux: where CI runs)."""
    real = str(path.resolve())
    return [ln for ln in Path("/proc/self/maps").read_text().splitlines() if ln.endswith(real)]


def test_reader_holds_no_map_and_slabs_match_whole_tensors(
        gguf_cases: dict[str, tuple[Path, dict]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The GGUF file is read with positioned reads, never left mapped (mapped pages count in the
    resident set until unmapped); its metadata is kept as plain values (the reader's per-entry
    views are dropped); block tensors dequantized a few rows at a time equal the whole-tensor
    dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from fuselm.export.gguf import file as gguf_file

    path, _ = gguf_cases["llama"]
    f = gguf_file.GGUFFile(path)
    assert not hasattr(f, "fields") and _maps_of(path) == []
    assert f.value("general.architecture") == "llama"
    assert isinstance(f.value("tokenizer.ggml.tokens"), list)
    monkeypatch.setattr(gguf_file, "SLAB_BYTES", 3 * 4 * 256)  # 3 rows of 256 per slab
    for name in ("blk.0.attn_v.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        t = f.tensors[name]
        got = f.read(name)
        assert _maps_of(path) == []
        with path.open("rb") as fh:
            fh.seek(t.offset)
            raw = np.frombuffer(fh.read(t.nbytes), np.uint8)
        want = dequantize(raw.reshape(int(np.prod(t.shape[:-1])), -1),
                          GGMLQuantizationType[t.type_name]).reshape(t.shape)
        np.testing.assert_array_equal(got, want)


def test_header_reader_matches_llama_cpp_reader(gguf_cases: dict[str, tuple[Path, dict]]) -> None:
    """export/gguf/header.py (plain values, no per-entry numpy views) reads what gguf's
    GGUFReader reads: every metadata value, every tensor's type, shape, offset and size."""
    from gguf import GGUFReader

    from fuselm.export.gguf.header import read_header

    for path, _ in gguf_cases.values():
        reader = GGUFReader(path)
        metadata, tensors = read_header(path)
        want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert list(metadata) == list(want)
        for key, value in want.items():
            assert metadata[key] == pytest.approx(value), key
        assert [t.name for t in reader.tensors] == list(tensors)
        for t in reader.tensors:
            e = tensors[t.name]
            assert (e.ggml_type, e.shape, e.offset, e.nbytes) == (
                int(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())),
                int(t.data_offset), int(t.n_bytes)), t.name


def test_a_qwen_files_window_is_ignored_as_llama_cpp_and_transformers_do(
        tmp_path: Path) -> None:
    """`qwen2.attention.sliding_window` in a file: llama.cpp's qwen2 and qwen3 graphs attend in
    full (they read no window), and so does transformers' GGUF loader; fuselm too, where it
    windowed the layers from transformers' max_window_layers (28) on."""
    import torch
    from transformers import AutoModelForCausalLM

    from fuselm.converter.pipeline import ConvertOptions, convert

    shape = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=30, vocab_size=384,
                 num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                 sliding_window=4)
    path, _ = write_gguf(tmp_path / "m.gguf", "qwen2", {}, seed=3, head_dim=16, **shape)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    out = tmp_path / "out"
    convert(path, out, ConvertOptions(dtype="float32"))
    assert read_manifest(out).model.sliding_window is None
    got = OrtEngine(out, read_manifest(out), accuracy_level=0).forward(
        np.asarray(PROMPT)[None], all_logits=True)
    assert rel(got, want) <= 1e-4
    qwen3, _ = write_gguf(tmp_path / "q3.gguf", "qwen3", {}, seed=3, head_dim=16, **shape)
    config = GGUFCheckpoint(qwen3).config
    assert (config["sliding_window"], config["use_sliding_window"]) == (None, False)
