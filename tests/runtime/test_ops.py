"""Each registered fuselm op and the core standard ops vs the NumPy references (passes/ops.py)
and onnxruntime (optimizer off), on random inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import helper

from fuselm.passes import ops as contract
from fuselm.runtime_metal.validate import rel
from tests.runtime.helpers import node_model, run_mlx, run_ort

RNG = np.random.default_rng(0)
D = contract.DOMAIN


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _q4(k: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    codes = RNG.integers(0, 16, (k, n)).astype(ml_dtypes.uint4)
    scales = (RNG.random((k // 32, n)) * 0.05 + 0.01).astype(np.float16).astype(np.float32)
    zps = RNG.integers(0, 16, (k // 32, n)).astype(ml_dtypes.uint4)
    return codes, scales, zps


ROPE_CASES = {
    "qk_norm": dict(norm=True, rotary_dim=24),
    "partial_interleaved": dict(norm=False, rotary_dim=16, interleaved=1),
    "yarn_scale": dict(norm=False, rotary_dim=24, attention_scale=1.2),
    "gapped_positions": dict(norm=True, rotary_dim=24, positions="gapped"),
    "dynamic_ntk": dict(norm=False, rotary_dim=24, dynamic_factor=2.0, dynamic_max_positions=8),
}


@pytest.mark.parametrize("case", ROPE_CASES)
def test_fused_rope(case: str) -> None:
    c = dict(ROPE_CASES[case])
    hd, rd = 24, c.pop("rotary_dim")
    norm = c.pop("norm")
    gapped = c.pop("positions", None) == "gapped"
    q, k = _f(2, 5, 4 * hd), _f(2, 5, 2 * hd)
    pos = np.stack([np.arange(7, 12), np.arange(0, 5)]).astype(np.int64)
    if gapped:  # non-contiguous positions: the general path, not mx.fast.rope's offset
        pos = np.array([[0, 2, 3, 9, 10], [4, 4, 5, 6, 7]], np.int64)
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, rd, 2) / rd))).astype(np.float32)
    # every attribute set, as the exporter does (the function body references each one)
    # (LongRoPE's pair only where used: an empty list has no ONNX attribute type)
    attrs = {**contract.ROPE_ATTRS, "head_dim": hd, "rotary_dim": rd,
             "inv_freq": inv_freq.tolist(), **c}
    if not attrs["long_after"]:
        del attrs["long_inv_freq"], attrs["long_after"]
    feeds = {"q": q, "k": k, "position_ids": pos}
    inputs = ["q", "k", "position_ids"]
    inits = {}
    if norm:
        inits = {"qn": 1 + 0.1 * _f(hd), "kn": 1 + 0.1 * _f(hd)}
        inputs += ["qn", "kn"]
    node = helper.make_node("FusedRoPE", inputs, ["qr", "kr"], domain=D, **attrs)
    model = node_model(node, feeds, ["qr", "kr"], inits)
    want = contract.fused_rope_reference(q, k, pos, inits.get("qn"), inits.get("kn"), **attrs)
    got = run_mlx(model, feeds)
    ort_out = run_ort(model, feeds)
    for g, w, o in zip(got, want, ort_out, strict=True):
        assert rel(g, w) <= 1e-5 and rel(o, w) <= 1e-5


@pytest.mark.parametrize("quant", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_qkv(quant: bool, bias: bool) -> None:
    x = _f(1, 3, 64)
    sizes = dict(q_size=96, k_size=48, v_size=48)
    inits: dict[str, np.ndarray] = {}
    if quant:
        codes, scales, zps = _q4(64, 192)
        inits = {"w": codes, "s": scales, "z": zps}
        inputs = ["x", "w", "s", "z"]
    else:
        inits = {"w": _f(64, 192)}
        inputs = ["x", "w", "", ""]
    if bias:
        inits["b"] = _f(192)
        inputs.append("b")
    node = helper.make_node("FusedQKV", inputs, ["q", "k", "v"], domain=D, block_size=32, **sizes)
    model = node_model(node, {"x": x}, ["q", "k", "v"], inits)
    args = [inits.get(n) if n else None for n in inputs[1:]] + [None] * (4 - len(inputs[1:]))
    want = contract.fused_qkv_reference(x, *args, **sizes)
    for g, w, o in zip(run_mlx(model, {"x": x}), want, run_ort(model, {"x": x}), strict=True):
        assert rel(g, w) <= 1e-5 and rel(o, w) <= 1e-5


@pytest.mark.parametrize("quant", [False, True])
def test_fused_gate_up(quant: bool) -> None:
    x = _f(2, 3, 64)
    if quant:
        codes, scales, zps = _q4(64, 128)
        inits, inputs = {"w": codes, "s": scales, "z": zps}, ["x", "w", "s", "z"]
    else:
        inits, inputs = {"w": _f(64, 128)}, ["x", "w"]
    node = helper.make_node("FusedGateUp", inputs, ["y"], domain=D, block_size=32,
                            activation="silu")
    model = node_model(node, {"x": x}, ["y"], inits)
    want = contract.fused_gate_up_reference(x, *[inits[n] for n in inputs[1:]])
    assert rel(run_mlx(model, {"x": x})[0], want) <= 1e-5
    assert rel(run_ort(model, {"x": x})[0], want) <= 1e-5


def test_q4_weights_are_the_onnx_weights_exactly() -> None:
    """MLX's affine form (bias = -zp*scale) dequantizes to ONNX's weights bit for bit."""
    from fuselm.runtime_metal.mlx_engine.qweight import from_dequantize_linear

    codes, scales, zps = _q4(128, 40)
    want = contract.dequantize_reference(codes, scales, zps, 32)
    q = from_dequantize_linear(codes, scales, zps, axis=0, block_size=32)
    assert np.array_equal(np.array(q.dense()), want)
    # axis 1 (a tied [V, H] embedding): the packed layout is the tensor itself
    q1 = from_dequantize_linear(codes.T.copy(), scales.T.copy(), zps.T.copy(), axis=1,
                                block_size=32)
    assert np.array_equal(np.array(q1.dense()), want.T)


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("with_zp", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_q4_packing_all_code_types(signed: bool, with_zp: bool, axis: int) -> None:
    """int4 and uint4 codes, with and without zero points (ONNX's default zero point is 0),
    blocks along either axis: the packed weight dequantizes to ONNX's values bit for bit."""
    from fuselm.runtime_metal.mlx_engine.qweight import from_dequantize_linear

    t = ml_dtypes.int4 if signed else ml_dtypes.uint4
    lo, hi = (-8, 8) if signed else (0, 16)
    k, n = 96, 24
    codes = RNG.integers(lo, hi, (k, n)).astype(np.int8).astype(t)
    scales = (RNG.random((k // 32, n)) * 0.05 + 0.01).astype(np.float16).astype(np.float32)
    zps = RNG.integers(lo, hi, (k // 32, n)).astype(np.int8).astype(t)
    want = contract.dequantize_reference(codes, scales, zps if with_zp else np.zeros_like(zps),
                                         32)
    if axis == 0:
        q = from_dequantize_linear(codes, scales, zps if with_zp else None, 0, 32)
        assert np.array_equal(np.array(q.dense()), want)
    else:
        q = from_dequantize_linear(codes.T.copy(), scales.T.copy(),
                                   zps.T.copy() if with_zp else None, 1, 32)
        assert np.array_equal(np.array(q.dense()), want.T)


def test_four_bit_external_data_loads_as_written(tmp_path) -> None:  # noqa: ANN001
    """int4/uint4 initializers in external data (odd element count: a half-used last byte)
    load with the values onnx itself reads back."""
    import onnx
    from onnx import TensorProto, numpy_helper

    from fuselm.runtime_metal.loader import load_graph

    vals = {"u": RNG.integers(0, 16, (5, 7)).astype(np.uint8),
            "s": RNG.integers(-8, 8, (3, 9)).astype(np.int8)}
    inits = [helper.make_tensor("u", TensorProto.UINT4, (5, 7), vals["u"].ravel().tolist()),
             helper.make_tensor("s", TensorProto.INT4, (3, 9), vals["s"].ravel().tolist())]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Constant", [], ["y"], value_float=1.0)], "g",
                              [], [out], initializer=inits)
    model = helper.make_model(graph)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=0)
    got = load_graph(path).weights
    ref = {t.name: numpy_helper.to_array(t)
           for t in onnx.load(str(path)).graph.initializer}
    for name, v in vals.items():
        assert got[name].dtype == ref[name].dtype
        assert np.array_equal(got[name].astype(np.int16), v.astype(np.int16))
        assert np.array_equal(got[name].astype(np.int16), ref[name].astype(np.int16))


def test_rms_norm_and_attention_vs_onnxruntime() -> None:
    x, w = _f(2, 5, 64), 1 + 0.1 * _f(64)
    node = helper.make_node("RMSNormalization", ["x", "w"], ["y"], axis=-1, epsilon=1e-6)
    model = node_model(node, {"x": x}, ["y"], {"w": w})
    assert rel(run_mlx(model, {"x": x})[0], contract.rms_norm_reference(x, w, 1e-6)) <= 1e-5
    # GQA 4:2, head_dim 24, past 3, new 5, padding in the bool mask
    q, k, v = _f(2, 5, 96), _f(2, 5, 48), _f(2, 5, 48)
    pk, pv = _f(2, 2, 3, 24), _f(2, 2, 3, 24)
    mask = np.tri(5, 8, 3, dtype=bool)[None, None].repeat(2, 0)
    mask[1, :, :, 0] = False
    feeds = {"q": q, "k": k, "v": v, "m": mask, "pk": pk, "pv": pv}
    node = helper.make_node("Attention", list(feeds), ["y", "pko", "pvo"], q_num_heads=4,
                            kv_num_heads=2, scale=0.3)
    model = node_model(node, feeds, ["y", "pko", "pvo"])
    for g, o in zip(run_mlx(model, feeds), run_ort(model, feeds), strict=True):
        assert rel(g, o) <= 1e-5


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_vs_onnxruntime(approximate: str) -> None:
    """ONNX Gelu (opset 20), exact and tanh: what a plain Gemma graph (no Gate/Up pairing)
    computes its GeGLU gate with, on MLX as onnxruntime computes it."""
    x = 3 * _f(2, 5, 64)
    node = helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)
    model = node_model(node, {"x": x}, ["y"])
    assert rel(run_mlx(model, {"x": x})[0], run_ort(model, {"x": x})[0]) <= 1e-5


def test_tied_q4_embedding_gather_and_lm_head() -> None:
    """DequantizeLinear(axis=1) shared by Gather (embedding) and Transpose -> MatMul (LM head)."""
    codes, scales, zps = _q4(64, 48)  # [H, V]: transpose to the [V, H] embedding layout
    e_codes, e_scales, e_zps = codes.T.copy(), scales.T.copy(), zps.T.copy()
    ids, h = np.array([[3, 0, 47]], np.int64), _f(1, 3, 64)
    nodes = [
        helper.make_node("DequantizeLinear", ["c", "s", "z"], ["e"], axis=1, block_size=32),
        helper.make_node("Gather", ["e", "ids"], ["emb"]),
        helper.make_node("Transpose", ["e"], ["et"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "et"], ["logits"]),
    ]
    from onnx import TensorProto, numpy_helper

    graph = helper.make_graph(
        nodes, "t",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, None),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("emb", "logits")],
        [numpy_helper.from_array(a, n) for n, a in (("c", e_codes), ("s", e_scales),
                                                    ("z", e_zps))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10)
    feeds = {"ids": ids, "h": h}
    from fuselm.runtime_metal.loader import LoadedGraph
    from fuselm.runtime_metal.mlx_engine.plan import build_plan
    from fuselm.runtime_metal.mlx_engine.qweight import QWeight

    plan = build_plan(LoadedGraph(model, {"c": e_codes, "s": e_scales, "z": e_zps}, None))
    assert isinstance(plan.constants["e"], QWeight)  # packed once, no dense weight kept
    for g, o in zip(run_mlx(model, feeds), run_ort(model, feeds), strict=True):
        assert rel(g, o) <= 1e-5


def test_unknown_op_names_domain_op_and_opset() -> None:
    from fuselm.runtime_metal.errors import UnsupportedOpError

    node = helper.make_node("Frobnicate", ["x"], ["y"], domain="acme")
    model = node_model(node, {"x": _f(2)}, ["y"])
    model.opset_import.append(helper.make_opsetid("acme", 3))
    with pytest.raises(UnsupportedOpError, match=r"acme::Frobnicate at opset 3"):
        run_mlx(model, {"x": _f(2)})
