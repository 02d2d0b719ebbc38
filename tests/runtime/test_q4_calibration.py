"""Activation-aware Q4 (`--calibration FILE`) and the bits budget (per-tensor block sizes):
deterministic, never worse than the data-free search on the calibration activations, within
budget and recorded in fuselm.json, and the same model through onnxruntime and MLX."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from fuselm.converter.errors import UserError
from fuselm.converter.models.builtin import build_model
from fuselm.errors import FuselmError
from fuselm.passes.quant.q4_allocate import bits_per_weight
from fuselm.passes.quant.q4_calibration import Calibration, collect
from fuselm.passes.quant.q4_math import output_error, quantize_array, quantize_gptq
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.validate import engine_logits, rel
from tests.runtime.conftest import convert, quantized_copy

CALIB = Path(__file__).resolve().parents[2] / "passes" / "calibration.txt"
BUDGET = 4.45


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Qwen3 (tied head, GQA 4:2, head_dim 24 != 64 / 4): its HF dir, a float32 artifact,
    and a Q4 conversion with the calibration text and a bits budget."""
    root = tmp_path_factory.mktemp("q4cal")
    hf = build_model(root / "hf", "qwen3", seed=5)
    return {
        "hf": hf,
        "float": convert(hf, root / "float"),
        "q4": convert(hf, root / "q4", quant="q4", calibration=str(CALIB), bits_budget=BUDGET),
        "data_free": convert(hf, root / "data_free", quant="q4", default_calibration=False),
    }


def _tokens(n: int = 300) -> tuple[int, ...]:
    return tuple(int(i) for i in np.random.default_rng(11).integers(4, 384, n))


def test_calibration_is_deterministic(models: dict[str, Path], tmp_path: Path) -> None:
    cal = Calibration(_tokens(), context=128)
    a = quantized_copy(models["float"], tmp_path / "a", calibration=cal, bits_budget=BUDGET)
    b = quantized_copy(models["float"], tmp_path / "b", calibration=cal, bits_budget=BUDGET)
    assert (a / "model.onnx.data").read_bytes() == (b / "model.onnx.data").read_bytes()


def test_calibrated_error_never_worse_on_calibration_activations(models: dict[str, Path]) -> None:
    """Per weight: output error tr(D^T H D) on the calibration activations with calibration <=
    the data-free search's, H the activations' second moments."""
    model = onnx.load(str(models["float"] / "model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    pairs = [(n.input[0], n.input[1]) for n in model.graph.node
             if n.op_type in ("MatMul", "FusedQKV", "FusedGateUp") and n.input[1] in inits
             and len(inits[n.input[1]].dims) == 2]
    assert len(pairs) >= 6
    acts = {a: inits[w].data_type for a, w in pairs}
    moments = collect(model, numpy_helper.to_array, _tokens(), acts, context=128)
    again = collect(model, numpy_helper.to_array, _tokens(), acts, context=128)
    for a, w in pairs:
        assert np.array_equal(moments[a].gram, again[a].gram)  # deterministic statistics
        arr = numpy_helper.to_array(inits[w]).astype(np.float32)
        h = moments[a].gram
        calibrated = quantize_gptq(arr, h, 32)
        plain = quantize_array(arr, 32)
        assert output_error(calibrated, arr, h) <= output_error(plain, arr, h)
    # and on this model it is a real gain, not only a tie
    a, w = pairs[0]
    arr = numpy_helper.to_array(inits[w]).astype(np.float32)
    h = moments[a].gram
    assert output_error(quantize_gptq(arr, h, 32), arr, h) < 0.9 * output_error(
        quantize_array(arr, 32), arr, h)


def test_budget_respected_and_recorded(models: dict[str, Path]) -> None:
    from fuselm.runtime_metal.artifact import read_manifest

    q = read_manifest(models["q4"]).quantization
    assert q is not None and q["bits_budget"] == BUDGET
    assert q["calibration"]["file"] == "calibration.txt" and q["calibration"]["tokens"] > 64
    sizes = [t["block_size"] for t in q["tensors"]]
    assert set(sizes) == {32, 64}  # the rule spends the budget on some tensors, not all
    weights = [int(np.prod(t["shape"])) for t in q["tensors"]]
    mean_bits = sum(w * bits_per_weight(b) for w, b in zip(weights, sizes, strict=True))
    assert mean_bits / sum(weights) <= BUDGET
    assert all(t["calibration"] in ("gptq", "importance") for t in q["tensors"])
    # the graph carries each tensor's block size
    model = onnx.load(str(models["q4"] / "model.onnx"), load_external_data=False)
    blocks = {a.i for n in model.graph.node for a in n.attribute if a.name == "block_size"}
    assert blocks == {32, 64}


def test_calibrated_mixed_blocks_mlx_equals_onnxruntime(models: dict[str, Path]) -> None:
    mlx_engine = make_engine(models["q4"], "mlx")
    ort_engine = make_engine(models["q4"], "onnxruntime", accuracy_level=0)
    prompt = [int(i) for i in np.random.default_rng(4).integers(4, 384, 30)]
    assert rel(engine_logits(mlx_engine, prompt, 6), engine_logits(ort_engine, prompt, 6)) <= 1e-3


def test_calibration_errors(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(FuselmError, match="needs --quant q4"):
        convert(models["hf"], tmp_path / "x", calibration=str(CALIB))
    with pytest.raises(UserError, match="does not exist"):
        convert(models["hf"], tmp_path / "y", quant="q4", calibration=str(tmp_path / "none.txt"))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_no_calibration_is_block_32_and_norm_weighted(models: dict[str, Path]) -> None:
    """`--quant q4 --no-calibration`: block 32 for every tensor (no budget), and every weight
    fed by an RMSNorm quantized with gamma^2 as its input channels' importance."""
    from fuselm.passes.quant.options import DEFAULT_BLOCK_SIZE
    from fuselm.runtime_metal.artifact import read_manifest

    q = read_manifest(models["data_free"]).quantization
    assert q is not None and q["bits_budget"] is None and q["norm_importance"]
    ts = q["tensors"]
    assert q["block_size"] == DEFAULT_BLOCK_SIZE == 32
    assert {t["block_size"] for t in ts} == {DEFAULT_BLOCK_SIZE}
    by_role = {t["role"]: t.get("calibration") for t in ts}
    assert by_role["fused:FusedQKV"] == by_role["fused:FusedGateUp"] == "norm-weight"
    assert by_role["tied_embedding_lm_head"] == "norm-weight"  # fed by the final norm
    assert by_role["linear"] is None  # o_proj / down_proj: no norm in front, plain search
    # the stored codes are the importance-weighted search's, gamma^2 from the graph's norm
    model = onnx.load(str(models["float"] / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    prod = {o: nd for nd in model.graph.node for o in nd.output}
    rec = next(t for t in ts if t["role"] == "fused:FusedQKV")
    qkv = next(nd for nd in model.graph.node if nd.op_type == "FusedQKV"
               and nd.input[1] == rec["name"])
    gamma = inits[prod[qkv.input[0]].input[1]].astype(np.float64)
    want = quantize_array(inits[qkv.input[1]], rec["block_size"], importance=gamma**2)
    qm = onnx.load(str(models["data_free"] / "model.onnx"))
    qinits = {t.name: t for t in qm.graph.initializer}
    got = numpy_helper.to_array(qinits[rec["codes"]]).astype(np.uint8)
    assert np.array_equal(got, want.codes)
