"""6-bit weights (`--quant q6`, and `--quant mixed`'s middle width): codes packed four in three
bytes and read through fuselm.UnpackUInt6, which both engines run exactly — MLX as its own 6-bit
quantized matmul and row gather (a tied table among them), onnxruntime as 8-bit MatMulNBits over
the codes unpacked at load (lowered graph) or through UnpackUInt6's ONNX body (plain graph) —
giving the logits of the model's own dequantized weights in float32."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from fuselm.converter.models.builtin import build_model
from fuselm.passes import ops
from fuselm.runtime_metal.artifact import read_manifest
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.generate import generate
from fuselm.runtime_metal.mlx_engine import qweight
from fuselm.runtime_metal.mlx_engine.qweight import QWeight
from fuselm.runtime_metal.validate import engine_logits, rel
from tests.runtime.conftest import convert, rehash

PROMPT = [int(i) for i in np.random.default_rng(6).integers(4, 300, 24)]
# Under this budget the seeded model below takes 6-bit blocks (its tied table and fused
# projections among them) and 8-bit ones, chosen by choose_bits (head_dim 16: the lowering
# covers it).
BUDGET = 6.8


def _dequantized(artifact: Path) -> dict[str, np.ndarray]:
    """name -> the quantized weight as the record's [K, N] float32 values, from the artifact's
    own initializers and the NumPy references."""
    model = onnx.load(str(artifact / "model.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = {}
    for t in read_manifest(artifact).quantization["tensors"]:  # type: ignore[index]
        codes = inits[t["codes"]]
        if t.get("bits") == 6:
            codes = ops.unpack_uint6_reference(codes)
        out[t["name"]] = ops.dequantize_reference(
            codes.astype(np.uint8), inits[t["scales"]].astype(np.float32),
            inits[t["zero_points"]], t["block_size"])
    return out


def _float_copy(f32: Path, artifact: Path, out: Path) -> Path:
    """The float32 artifact with each quantized weight replaced by its dequantized values."""
    shutil.copytree(f32, out)
    model = onnx.load(str(out / "model.onnx"))
    values = _dequantized(artifact)
    for t in model.graph.initializer:
        if t.name in values:
            w = values.pop(t.name)
            w = w if list(w.shape) == list(t.dims) else w.T  # stored [N, K] behind a Transpose
            t.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(w), t.name))
    assert not values, f"weights the float graph lacks: {sorted(values)}"
    (out / "model.onnx.data").unlink()
    onnx.save(model, str(out / "model.onnx"), save_as_external_data=True,
              location="model.onnx.data", all_tensors_to_one_file=True)
    rehash(out)
    return out


@pytest.fixture(scope="module")
def q6(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("q6")
    hf = build_model(root / "hf", "qwen3", seed=5, head_dim=16)
    f32 = convert(hf, root / "f32")
    art = convert(hf, root / "q6", quant="mixed", bits_budget=BUDGET, default_calibration=False)
    return {"hf": hf, "f32": f32, "q6": art, "ref": _float_copy(f32, art, root / "ref")}


@pytest.fixture(scope="module")
def all6(q6: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same model through `fuselm convert --q-bits 6` (mlx-lm's spelling of --quant q6)."""
    from fuselm.converter.cli.main import main

    root = tmp_path_factory.mktemp("all6")
    argv, sys.argv = sys.argv, ["fuselm", "convert", str(q6["hf"]), "-o", str(root / "q6"),
                                "--q-bits", "6", "--dtype", "float32", "--quiet"]
    try:
        main()
    except SystemExit as e:
        assert not e.code, e.code
    finally:
        sys.argv = argv
    return {"q6": root / "q6", "ref": _float_copy(q6["f32"], root / "q6", root / "ref")}


def test_mixed_choice_stores_6_bit_tensors_packed(q6: dict[str, Path]) -> None:
    """The record names the 6-bit tensors (the tied table among them); each is stored as
    [3K/4, N] bytes read by one UnpackUInt6 that feeds DequantizeLinear (and the table's row
    lookup), at 6 + 40/B bits per weight in this float32 graph; quant-report counts them."""
    from click.testing import CliRunner

    from fuselm.converter.cli.main import cli

    q = read_manifest(q6["q6"]).quantization
    assert q is not None and q["bits"] == "mixed 6/8"
    six = q["mixed"]["six_bit"]
    tensors = {t["name"]: t for t in q["tensors"]}
    assert six and {n for n, t in tensors.items() if t.get("bits") == 6} == set(six)
    assert any(tensors[n]["role"] == "tied_embedding_lm_head" for n in six)
    assert any(tensors[n]["role"].startswith("fused:") for n in six)
    model = onnx.load(str(q6["q6"] / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    unpack = {n.input[0]: n for n in model.graph.node if n.op_type == "UnpackUInt6"}
    readers = {i: n for n in model.graph.node for i in n.input}
    for name in six:
        t = tensors[name]
        k, n = (t["shape"][1], t["shape"][0]) if t["role"] == "tied_embedding_lm_head" \
            else t["shape"]
        codes = inits[t["codes"]]
        assert codes.data_type == onnx.TensorProto.UINT8 and list(codes.dims) == [3 * k // 4, n]
        assert readers[unpack[t["codes"]].output[0]].op_type in ("DequantizeLinear", "Cast")
        assert t["bits_per_weight"] == pytest.approx(6 + 40 / t["block_size"], abs=1e-4)
    text = CliRunner().invoke(cli, ["quant-report", str(q6["q6"])]).output
    assert f"{len(q['mixed']['eight_bit'])} tensors at 8 bits, {len(six)} at 6 bits" in text


def test_unpack_body_runs_the_reference_in_onnxruntime() -> None:
    """UnpackUInt6's ONNX function body (standard ops only) gives the NumPy reference's codes."""
    import onnxruntime as ort

    codes = np.random.default_rng(1).integers(0, 64, (64, 5)).astype(np.uint8)
    packed = ops.pack_uint6(codes)
    node = helper.make_node("UnpackUInt6", ["p"], ["c"], domain=ops.DOMAIN)
    graph = helper.make_graph(
        [node], "unpack", [helper.make_tensor_value_info("p", onnx.TensorProto.UINT8, [48, 5])],
        [helper.make_tensor_value_info("c", onnx.TensorProto.UINT8, [64, 5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ops.ONNX_OPSET)],
                              ir_version=10)  # onnxruntime 1.30 reads <= 13
    ops.attach_functions(model)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert np.array_equal(sess.run(None, {"p": packed})[0], codes)


def test_both_engines_give_the_dequantized_weights_logits(q6: dict[str, Path]) -> None:
    """MLX (6-bit QWeights, the tied table's lookup reusing the head's), onnxruntime lowered
    (codes unpacked at load, no UnpackUInt6 left) and plain, all at float compute: the logits
    of the float32 model holding the artifact's own dequantized weights, and its greedy
    tokens."""
    from fuselm.runtime_metal.ort_engine.lowering import Lowered, lower_for_cpu

    ref_engine = make_engine(q6["ref"], "onnxruntime", accuracy_level=0)
    ref = engine_logits(ref_engine, PROMPT, 8)
    mlx_engine = make_engine(q6["q6"], "mlx")
    six = [w for w in mlx_engine.plan.constants.values()
           if isinstance(w, QWeight) and w.bits == 6]
    assert six and any(w.rows_only for w in six)
    lowered = lower_for_cpu(q6["q6"] / "model.onnx", read_manifest(q6["q6"]))
    assert isinstance(lowered, Lowered)
    assert not any(n.op_type == "UnpackUInt6" for n in lowered.model.graph.node)
    assert any(name.endswith("__u8_0") for name in lowered.memory_values or {})
    engines = {"mlx": mlx_engine,
               "ort": make_engine(q6["q6"], "onnxruntime", accuracy_level=0),
               "ort-plain": make_engine(q6["q6"], "onnxruntime", accuracy_level=0, lower=False)}
    want = generate(ref_engine, PROMPT, max_new_tokens=12).tokens
    for name, engine in engines.items():
        assert rel(engine_logits(engine, PROMPT, 8), ref) <= 1e-4, name
        assert generate(engine, PROMPT, max_new_tokens=12).tokens == want, name
    assert rel(ref, engine_logits(make_engine(q6["f32"], "onnxruntime", accuracy_level=0),
                                  PROMPT, 8)) <= 5e-2  # 6 and 8 bits: close to the float model


def test_a_6_bit_weight_runs_mlx_ops_where_the_cuda_kernels_would_run() -> None:
    """fuselm's CUDA GEMV and lookup kernels take 4- and 8-bit weights; inside gemv_kernel (the
    decode step's context on MLX-CUDA) a 6-bit weight's matmul and row gather are MLX's own
    quantized ops, the same values as its dequantized matrix."""
    from fuselm.runtime_metal.cuda_kernels import embedding as kernels_embedding
    from fuselm.runtime_metal.cuda_kernels import q4_gemv as kernels_q4

    w = mx.random.normal((96, 128), key=mx.random.key(3))
    packed, s, b = mx.quantize(w, group_size=64, bits=6)
    weight = QWeight(packed, s.astype(mx.float16), b.astype(mx.float16), 64, True, bits=6)
    rows = QWeight(packed, s, b, 64, False, bits=6)
    assert weight.shape == (128, 96) and rows.shape == (96, 128)
    x = mx.random.normal((1, 1, 128), key=mx.random.key(4)).astype(mx.float16)
    ids = mx.array([[3, 95, -1]], mx.int32)
    assert not kernels_q4.fits(x, packed, weight.scales, 64, 6, True)
    assert not kernels_embedding.take_fits(ids, packed, s, 64, 6)
    dense = mx.dequantize(packed, s, b, group_size=64, bits=6)
    with qweight.gemv_kernel():
        got = weight.matmul(x)
        looked_up = rows.take_rows(ids)
    want = x.astype(mx.float32) @ dense.T
    assert rel(np.array(got.astype(mx.float32)), np.array(want)) <= 1e-2  # float16 compute
    assert np.array_equal(np.array(looked_up), np.array(dense)[[3, 95, 95]][None])


def test_quant_q6_puts_every_weight_in_6_bit_blocks_that_both_engines_run(
        all6: dict[str, Path]) -> None:
    """`--q-bits 6`: every quantized weight (the tied table, the fused projections, the plain
    ones) in 6-bit blocks of 32, min/max or a grid step, no calibration; quant-report and
    inspect name it Q6; MLX and onnxruntime give the logits and greedy tokens of the float32
    model holding the artifact's own dequantized weights."""
    from click.testing import CliRunner

    from fuselm.converter.cli.main import cli

    q = read_manifest(all6["q6"]).quantization
    assert q is not None and q["bits"] == 6 and q["block_size"] == 32 and q["mixed"] is None
    assert q["method"] == "minmax+grid" and q["calibration"] is None
    assert {t.get("bits") for t in q["tensors"]} == {6}
    roles = {t["role"] for t in q["tensors"]}
    assert "tied_embedding_lm_head" in roles and any(r.startswith("fused:") for r in roles)
    assert CliRunner().invoke(cli, ["quant-report", str(all6["q6"])]).output.startswith(
        "Q6 block 32")
    assert "Q6 blocks of 32, asymmetric" in CliRunner().invoke(
        cli, ["inspect", str(all6["q6"])]).output
    ref_engine = make_engine(all6["ref"], "onnxruntime", accuracy_level=0)
    ref = engine_logits(ref_engine, PROMPT, 8)
    want = generate(ref_engine, PROMPT, max_new_tokens=12).tokens
    engines = {"mlx": make_engine(all6["q6"], "mlx"),
               "ort": make_engine(all6["q6"], "onnxruntime", accuracy_level=0)}
    for name, engine in engines.items():
        assert rel(engine_logits(engine, PROMPT, 8), ref) <= 1e-4, name
        assert generate(engine, PROMPT, max_new_tokens=12).tokens == want, name


def test_quant_q6_refuses_what_does_not_apply_by_name(q6: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """--bits-budget (a 4-bit mean) beside --q-bits 6: one error line, nothing written."""
    from tests.cli_run import cli, one_error

    out = tmp_path / "bad"
    line = one_error(*cli(capsys, "convert", str(q6["hf"]), "-o", str(out), "--q-bits", "6",
                          "--bits-budget", "4.45"))
    assert "--bits-budget" in line and "--q-bits 6" in line and not out.exists()
