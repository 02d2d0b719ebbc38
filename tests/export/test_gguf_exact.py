"""Exact GGUF import: a GGUF in any type of export/gguf/blocks.py's EXACT_TYPES converted by
default keeps its blocks (no second quantization), so fuselm's logits are those of the file's
own dequantized weights run in float32 by transformers' GGUF loader, on both engines; a float
matrix beside them goes to 8-bit blocks, its error recorded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fuselm.converter.pipeline import ConvertOptions, convert
from fuselm.runtime_metal.artifact import read_manifest
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.ort_engine.engine import OrtEngine
from fuselm.runtime_metal.validate import engine_logits, rel
from tests.export.gguf_files import converted_gguf, write_gguf

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=384)
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
         "token_embd", "output")
# llama: q/k rows permuted in the file, untied head; qwen3: a tied embedding / LM head
CASES = {f"llama-{t}": ("llama", dict(num_attention_heads=8, num_key_value_heads=2,
                                      head_dim=64), t)
         for t in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q3_K", "Q2_K",
                   "IQ3_S", "MXFP4", "TQ2_0", "IQ1_M")}
CASES |= {f"qwen3-{t}": ("qwen3", dict(num_attention_heads=2, num_key_value_heads=1,
                                       head_dim=128), t) for t in ("Q4_1", "Q8_0")}
# (Q5_K, IQ4_XS and Q6_K: tests/export/test_gguf_gemma2.py and test_gguf_gemma3.py)
# the stored form's bits per code (Q5_*, IQ4_NL, the grid types, MXFP4: codes held in 8 bits)
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q5_0": 8, "Q5_1": 8, "IQ4_NL": 8, "Q4_K": 4, "Q3_K": 4,
        "Q2_K": 4, "IQ3_S": 8, "MXFP4": 8, "TQ2_0": 4, "IQ1_M": 8}
# the other read-back types, one per role (q/k/v and gate/up stacked in one form holding each)
MIX = {"attn_q": "IQ2_XS", "attn_k": "IQ2_XS", "attn_v": "IQ2_S", "attn_output": "IQ1_S",
       "ffn_gate": "TQ1_0", "ffn_up": "MXFP4", "ffn_down": "IQ2_S", "token_embd": "TQ1_0",
       "output": "IQ1_S"}
CASES["llama-mix"] = ("llama", CASES["llama-Q4_0"][1], "mix")
PROMPT = [5, 17, 99, 200, 3, 42, 7, 300, 11]


@pytest.fixture(scope="module")
def exact(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each case's GGUF and its default conversion (float32 graph: only the blocks' own
    values can differ from transformers')."""
    root = tmp_path_factory.mktemp("gguf_exact")
    out = {}
    for i, (name, (family, shape, kind)) in enumerate(CASES.items()):
        types = MIX if kind == "mix" else dict.fromkeys(ROLES, kind)
        out[name] = converted_gguf(root, name, family, types, seed=i, **SHAPE, **shape)
    return out


def _hf_logits(path: Path) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].numpy()


@pytest.mark.parametrize("name", [n for n in CASES if n != "llama-mix"])
def test_default_convert_keeps_the_files_blocks(exact: dict[str, tuple[Path, Path]],
                                                name: str) -> None:
    _, out = exact[name]
    kind = CASES[name][2]
    q = read_manifest(out).quantization
    assert q is not None and q["given"] == {"kept": {f"gguf {kind}": len(q["tensors"])},
                                            "quantized": 0}
    assert all(t["rel_rms_error"] == 0 for t in q["tensors"])
    assert q["bits"] == BITS[kind]
    from fuselm.converter.cli.quant_report_cmd import render

    text = render(q)
    assert f"kept from the checkpoint: gguf {kind} x{len(q['tensors'])}, 0 quantized" in text
    assert text.count(f"(gguf {kind})") == len(q["tensors"])


@pytest.mark.parametrize("name", ["llama-Q4_K", "llama-Q2_K", "llama-Q4_1", "llama-Q4_0"])
def test_the_record_says_which_values_each_tensors_scales_hold(
        exact: dict[str, tuple[Path, Path]], name: str) -> None:
    """A K-quant's d*sc and -dmin*mn are kept float32 where float16 cannot hold them: each
    tensor's record names the values its stored scales and biases hold, and the summary says
    float16 only where every tensor's are."""
    import onnx
    from onnx import numpy_helper

    _, out = exact[name]
    q = read_manifest(out).quantization
    model = onnx.load(str(out / "model.onnx"), load_external_data=True)
    inits = {i.name: i for i in model.graph.initializer}
    held = {}
    for t in q["tensors"]:
        parts = [numpy_helper.to_array(inits[t[k]]) for k in ("scales", "biases") if k in t]
        f16 = all(np.array_equal(a.astype(np.float16).astype(np.float32), a.astype(np.float32))
                  for a in parts)
        held[t["name"]] = "float16" if f16 else "float32"
        assert t["scale_values"] == held[t["name"]], t["name"]
        assert t["scale_stored"] == str(parts[0].dtype)
    wide = sorted(n for n, v in held.items() if v == "float32")
    assert bool(wide) == (name in ("llama-Q4_K", "llama-Q2_K"))  # the K-quants' d*sc
    assert q["scale_dtype"].startswith("float16 values") == (not wide)
    assert ("float32 values" in q["scale_dtype"]) == bool(wide)


def test_every_read_back_type_is_kept_beside_the_others(
        exact: dict[str, tuple[Path, Path]]) -> None:
    """IQ2_XS, IQ2_S, IQ1_S, TQ1_0, MXFP4 in one file: every tensor kept, none quantized
    again; q/k/v and gate/up stacked in one form that holds each part (8 bits, blocks of 16
    where a part has them)."""
    q = read_manifest(exact["llama-mix"][1]).quantization
    layers = SHAPE["num_hidden_layers"]
    assert q["given"] == {"kept": {"gguf IQ2_S+gguf IQ2_XS": layers, "gguf MXFP4+gguf TQ1_0":
                                   layers, "gguf IQ1_S": layers + 1, "gguf IQ2_S": layers,
                                   "gguf TQ1_0": 1}, "quantized": 0}
    assert all(t["rel_rms_error"] == 0 for t in q["tensors"])
    forms = {t["given"]: (t.get("bits", 4), t["block_size"]) for t in q["tensors"]}
    assert forms["gguf IQ2_S+gguf IQ2_XS"] == (8, 16) and forms["gguf MXFP4+gguf TQ1_0"] == (8, 32)


@pytest.mark.parametrize("engine", ["onnxruntime", "mlx"])
@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_the_files_dequantized_weights(exact: dict[str, tuple[Path, Path]],
                                                    name: str, engine: str) -> None:
    path, out = exact[name]
    want = _hf_logits(path)
    if engine == "onnxruntime":  # float compute (accuracy level 0): no int8 activations
        eng = OrtEngine(out, read_manifest(out), accuracy_level=0)
        got = eng.forward(np.asarray(PROMPT)[None], all_logits=True)
    else:
        got = engine_logits(make_engine(out, "mlx"), PROMPT, None)
    assert rel(got, want) <= 1e-4


def test_explicit_quant_none_converts_to_float(exact: dict[str, tuple[Path, Path]],
                                               tmp_path: Path) -> None:
    path, _ = exact["llama-Q4_1"]
    convert(path, tmp_path / "f", ConvertOptions.from_flags(quant="none", dtype="float32"))
    assert read_manifest(tmp_path / "f").quantization is None


def test_cli_keeps_blocks_by_default_and_refuses_bad_eight_bit_flags(
        exact: dict[str, tuple[Path, Path]], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    from tests.cli_run import cli, one_error

    path, _ = exact["llama-Q4_0"]
    code, _ = cli(capsys, "convert", str(path), "-o", str(tmp_path / "d"), "--quiet")
    assert code == 0 and read_manifest(tmp_path / "d").quantization["given"]["quantized"] == 0
    code, _ = cli(capsys, "convert", str(path), "-o", str(tmp_path / "f"), "--quant", "none",
                  "--quiet")
    assert code == 0 and read_manifest(tmp_path / "f").quantization is None
    line = one_error(*cli(capsys, "convert", str(path), "-o", str(tmp_path / "x"),
                          "--q-bits", "8", "--bits-budget", "4.45"))
    assert "--bits-budget" in line and not (tmp_path / "x").exists()
    line = one_error(*cli(capsys, "convert", str(path), "-o", str(tmp_path / "y"),
                          "--quant", "q4", "--q-bits", "8"))
    assert "contradict" in line


def test_q4_calibrates_only_what_it_quantizes(exact: dict[str, tuple[Path, Path]],
                                               tmp_path: Path) -> None:
    """--quant q4 keeps a GGUF's exact blocks and quantizes the rest: the calibration forward
    runs for the rest only, and for none when every tensor is kept."""
    path, _ = exact["llama-Q4_1"]
    out = tmp_path / "q4"
    convert(path, out, ConvertOptions.from_flags(quant="q4", dtype="float32"))
    q = read_manifest(out).quantization
    assert q["given"] == {"kept": {"gguf Q4_1": len(q["tensors"])}, "quantized": 0}
    assert q["calibration"] is None
    float_head = {**dict.fromkeys(ROLES, "Q4_1"), "output": "F16"}
    mixed, _ = write_gguf(tmp_path / "mixed.gguf", "llama", float_head, seed=1, **SHAPE,
                          **CASES["llama-Q4_1"][1])
    convert(mixed, tmp_path / "mixed", ConvertOptions.from_flags(quant="q4", dtype="float32"))
    q = read_manifest(tmp_path / "mixed").quantization
    assert q["given"]["quantized"] == 1 and q["calibration"]["tokens"] > 0
    assert [t["calibration"] for t in q["tensors"] if "given" not in t] == ["gptq"]


def test_types_without_an_exact_form_go_to_eight_bits_with_their_error_recorded(
        tmp_path: Path) -> None:
    """A float matrix beside exact ones: 8-bit blocks, the loss in the record (quant-report);
    a packed projection whose parts differ in form (Q4_K q/k, Q6_K v) is kept in one that
    holds both (8 bits, blocks of 16, biases)."""
    types = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "IQ2_XS",
             "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "F16", "token_embd": "Q8_0",
             "output": "Q4_0"}
    path, _ = write_gguf(tmp_path / "mixed.gguf", "llama", types, seed=9, **SHAPE,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    convert(path, tmp_path / "out", ConvertOptions(dtype="float32"))
    q = read_manifest(tmp_path / "out").quantization
    layers = SHAPE["num_hidden_layers"]
    assert q["given"] == {"kept": {"gguf Q4_1": layers, "gguf Q8_0": 1, "gguf Q4_0": 1,
                                   "gguf Q4_K+gguf Q6_K": layers, "gguf IQ2_XS": layers},
                          "quantized": layers}
    qkv = [t for t in q["tensors"] if t.get("given") == "gguf Q4_K+gguf Q6_K"]
    assert {(t["bits"], t["block_size"]) for t in qkv} == {(8, 16)}
    again = [t for t in q["tensors"] if "given" not in t]
    assert {t["bits"] for t in again} == {8} and all(t["rel_rms_error"] > 0 for t in again)
    eng = OrtEngine(tmp_path / "out", read_manifest(tmp_path / "out"), accuracy_level=0)
    got = eng.forward(np.asarray(PROMPT)[None], all_logits=True)
    assert rel(got, _hf_logits(path)) <= 2e-2


def test_the_torch_exporter_keeps_the_blocks_too(exact: dict[str, tuple[Path, Path]],
                                                 tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = exact["llama-Q4_1"]
    monkeypatch.setenv("FUSELM_EXPORT", "torch")
    r = convert(path, tmp_path / "t", ConvertOptions(dtype="float32"))
    assert r.manifest.source["exporter"].startswith("torch")
    assert r.manifest.quantization["given"]["quantized"] == 0
    eng = OrtEngine(tmp_path / "t", r.manifest, accuracy_level=0)
    assert rel(eng.forward(np.asarray(PROMPT)[None], all_logits=True), _hf_logits(path)) <= 1e-4


def test_validate_takes_the_gguf_as_its_reference(exact: dict[str, tuple[Path, Path]],
                                                  capsys: pytest.CaptureFixture) -> None:
    """`fuselm validate model.gguf OUT`: transformers' GGUF load in float32 is the top rung;
    an artifact of another model is refused before any compute."""
    from tests.cli_run import cli, one_error, run_cli

    path, out = exact["llama-Q4_0"]
    code, stdout, err = run_cli(capsys, "validate", str(path), str(out), "-n", "4", "--no-ppl",
                                "--json")
    assert code == 0, err
    # every block kept: the artifact computes the reference's own weights, so it is judged by
    # its graph's float bound (float32: 1e-4), not Q4's 0.2, which would pass a wrong import
    assert list(json.loads(stdout)["thresholds"]) == [read_manifest(out).dtype] == ["float32"]
    other = exact["qwen3-Q8_0"][1]
    line = one_error(*cli(capsys, "validate", str(path), str(other), "-n", "4", "--no-ppl"))
    assert "different models" in line
