"""`convert --dtype bfloat16`: a bfloat16 graph (BFLOAT16 initializers, bfloat16 KV and logits)
that both engines run against HF float32 — onnxruntime with its weights upcast to float32 at
load (lowered, and as the plain graph), MLX on a CPU in float32 — and Q4 on top of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from fuselm.converter.models.builtin import build_model
from fuselm.converter.pipeline import ConvertOptions, convert
from fuselm.runtime_metal.artifact import read_manifest
from fuselm.runtime_metal.engine import make_engine, mlx_has_gpu
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.ort_engine.lowering import lower_for_cpu
from fuselm.runtime_metal.validate import engine_logits, hf_greedy, hf_logits, hf_model, rel
from tests.cli_run import cli

PROMPT = [5, 17, 99, 200, 3, 42, 7, 300, 11, 64, 2, 130]
STEPS = 8
# bfloat16 keeps 8 significant bits (relative step 2^-8 ≈ 4e-3, 8x float16's); the weights
# are rounded once, the activations computed in float32 (both engines on a CPU)
BF16_REL = 2e-2
# onnxruntime and MLX over the same bfloat16 weights: both in float32 on a CPU (the same
# values but for summation order); MLX on a GPU computes in bfloat16 itself
AGREE, AGREE_Q4 = (BF16_REL, BF16_REL) if mlx_has_gpu() else (1e-5, 1e-4)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """float32 qwen3 with head_dim 32: onnxruntime's lowering covers it (a multiple of 16)."""
    return build_model(tmp_path_factory.mktemp("bf16") / "hf", "qwen3", seed=5, head_dim=32)


@pytest.fixture(scope="module")
def reference(hf_dir: Path) -> tuple[np.ndarray, list[int]]:
    model = hf_model(hf_dir)
    return hf_logits(model, PROMPT), hf_greedy(model, PROMPT, STEPS)


def _convert(src: Path, out: Path, **options: object) -> Path:
    convert(src, out, ConvertOptions.from_flags(**options))
    return out


def _engines(out: Path) -> dict[str, object]:
    return {"onnxruntime lowered": make_engine(out, "onnxruntime", accuracy_level=0),
            "onnxruntime plain": make_engine(out, "onnxruntime", accuracy_level=0, lower=False),
            "mlx": make_engine(out, "mlx")}


def test_bfloat16_artifact_matches_hf(hf_dir: Path, reference: tuple[np.ndarray, list[int]],
                                      tmp_path: Path) -> None:
    out = _convert(hf_dir, tmp_path / "bf16", dtype="bfloat16")
    assert read_manifest(out).dtype == "bfloat16"
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    assert {t.data_type for t in graph.initializer if len(t.dims) == 2} == {TensorProto.BFLOAT16}
    assert {v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]
            if v.name.startswith(("past", "present", "logits"))} == {TensorProto.BFLOAT16}
    ref, ref_tokens = reference
    got = {}
    for name, engine in _engines(out).items():
        got[name] = engine_logits(engine, PROMPT, 8)
        assert 1e-4 < rel(got[name], ref) <= BF16_REL, (name, rel(got[name], ref))
        assert generate(engine, PROMPT, max_new_tokens=STEPS).tokens == ref_tokens, name
        if name.startswith("onnxruntime"):
            assert "bfloat16 weights upcast to float32 at load" in engine.describe()["lowering"]
    # the same bfloat16 weights computed in float32 by every engine: the same logits
    assert "GroupQueryAttention" in _engines(out)["onnxruntime lowered"].describe()["lowering"]
    for name in got:
        assert rel(got[name], got["mlx"]) <= AGREE, name


def test_bfloat16_with_q4(hf_dir: Path, reference: tuple[np.ndarray, list[int]],
                          tmp_path: Path) -> None:
    """--dtype bfloat16 --quant q4: float32 scales and a Cast back to bfloat16 after each
    dequantization; both engines give the same logits, as close to HF's as the float32 Q4."""
    out = _convert(hf_dir, tmp_path / "bf16-q4", dtype="bfloat16", quant="q4")
    f32 = _convert(hf_dir, tmp_path / "f32-q4", dtype="float32", quant="q4")
    manifest = read_manifest(out)
    assert manifest.dtype == "bfloat16" and manifest.quantization["bits"] == 4
    ref = reference[0]
    f32_rel = rel(engine_logits(make_engine(f32, "mlx"), PROMPT, 8), ref)
    got = {name: engine_logits(e, PROMPT, 8) for name, e in _engines(out).items()}
    # lowered for onnxruntime, each projection reads its dequantize node (MatMulNBits then),
    # not the Cast to bfloat16 (a no-op in float32, which would dequantize on every call)
    lowered = lower_for_cpu(out / "model.onnx", manifest).model.graph.node
    made_by = {o: n.op_type for n in lowered for o in n.output}
    assert not [n for n in lowered if n.op_type == "Cast" and made_by.get(n.input[0], "")
                .startswith("Dequantize")]
    assert sum(made_by.get(n.input[1]) == "DequantizeLinear" for n in lowered
               if n.op_type == "MatMul") >= 4
    for name, logits in got.items():
        assert rel(logits, got["mlx"]) <= AGREE_Q4, name
        assert rel(logits, ref) <= max(1.5 * f32_rel, 0.2), (name, rel(logits, ref), f32_rel)


def test_cli_bfloat16(hf_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = cli(capsys, "convert", str(hf_dir), "-o", str(tmp_path / "bf"), "--dtype",
                    "bfloat16", "--quiet")
    assert code == 0, err
    assert read_manifest(tmp_path / "bf").dtype == "bfloat16"
    code, err = cli(capsys, "convert", str(hf_dir), "-o", str(tmp_path / "x"), "--dtype",
                    "float8")
    assert code == 2 and "--dtype: 'float8' is not one of" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("quant", [None, "none"])
def test_gguf_to_bfloat16(tmp_path: Path, quant: str | None) -> None:
    """A Q4_1 GGUF in a bfloat16 graph: its blocks kept by default (float32 scales and mins,
    a Cast to bfloat16 after each), or (--quant none) its dequantized weights rounded to
    bfloat16 as they stream to the data file; both engines within bfloat16's tolerance of
    the file's own weights run in float32 by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.export.gguf_files import write_gguf

    roles = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
             "token_embd", "output")
    path, _ = write_gguf(tmp_path / "m.gguf", "llama", dict.fromkeys(roles, "Q4_1"), seed=2,
                         hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         vocab_size=384, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=32)
    out = _convert(path, tmp_path / "bf16", dtype="bfloat16", quant=quant)
    manifest = read_manifest(out)
    assert manifest.dtype == "bfloat16"
    if quant is None:
        q = manifest.quantization
        assert q["given"] == {"kept": {"gguf Q4_1": len(q["tensors"])}, "quantized": 0}
    else:
        assert manifest.quantization is None
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
    for name, engine in _engines(out).items():  # the norms' weights are bfloat16 too
        assert rel(engine_logits(engine, PROMPT, None), want) <= BF16_REL, name
