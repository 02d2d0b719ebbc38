"""4-bit block quantization: the formula, MLX's affine form, its options, whole models via
onnxruntime.

Models are tiny random HF checkpoints exported with torch.onnx.export (dynamo) until the
project's exporter lands; the pass is graph-shape agnostic, so any MatMul graph serves.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fuselm.passes import ops
from fuselm.passes.errors import PassesError
from fuselm.passes.manager import run_pipeline
from fuselm.passes.quant.options import BLOCK_SIZES, QuantOptions, quant_options
from fuselm.passes.quant.q4_math import quantize_array
from fuselm.passes.quant.quantize import QuantizeQ4
from fuselm.runtime_metal.ort_engine.session import make_session
from fuselm.runtime_metal.validate import rel  # the one error metric (docs/DESIGN.md)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def quantize_q4(model: onnx.ModelProto, **options: object) -> tuple[onnx.ModelProto, dict]:
    """The quantize pass alone on `model` (and cleanup, as always), data-free: no calibration
    tokens, no norm weighting; (the model, fuselm.json's quantization record)."""
    quantize = QuantizeQ4(QuantOptions(norm_importance=False, **options))  # type: ignore[arg-type]
    out, report = run_pipeline(model, [], quantize=quantize)
    (entry,) = [e for e in report.entries if e.name == quantize.name]
    info = entry.extra["quantization"]
    assert entry.matches == len(info["tensors"])
    return out, info


def formula_reference(w: np.ndarray, block: int, symmetric: bool) -> tuple[np.ndarray, ...]:
    """The module doc's formula, one block at a time (slow and obvious on purpose)."""
    k, n = w.shape
    nb = -(-k // block)
    codes = np.zeros((k, n), np.uint8)
    scales = np.zeros((nb, n), np.float16)
    zps = np.zeros((nb, n), np.uint8)
    for b in range(nb):
        for j in range(n):
            x = w[b * block : (b + 1) * block, j].astype(np.float32)
            if symmetric:
                s = np.float16(np.abs(x).max() / np.float32(7))
                z = 8
            else:
                lo, hi = min(x.min(), np.float32(0)), max(x.max(), np.float32(0))
                s = np.float16((hi - lo) / np.float32(15))
                z = 0 if s == 0 else int(np.clip(np.rint(-lo / np.float32(s)), 0, 15))
            q = np.full(x.shape, z) if s == 0 else np.clip(np.rint(x / np.float32(s)) + z, 0, 15)
            codes[b * block : (b + 1) * block, j] = q
            scales[b, j], zps[b, j] = s, z
    return codes, scales, zps


# ---------------------------------------------------------------------------------------------
# The formula
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize(
    "shape,block", [((96, 40), 32), ((40, 24), 32), ((256, 8), 128), ((64, 1100), 32)]
)
def test_quantize_matches_formula_and_onnx_dequantize(shape, block, symmetric) -> None:
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    w[:block, 0] = 0.0  # an all-zero block: scale 0, dequantizes to exact zeros
    w[:block, 1] = np.abs(w[:block, 1])  # an all-positive block: the range still holds 0
    q = quantize_array(w, block, symmetric, method="minmax")
    codes, scales, zps = formula_reference(w, block, symmetric)
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.scales.view(np.uint16), scales.view(np.uint16))
    np.testing.assert_array_equal(q.zero_points, zps)
    assert q.codes.max() <= 15 and q.zero_points.max() <= 15
    if symmetric:
        assert (q.zero_points == 8).all()
    # Every error is at most half a step, plus what float16's rounding of the scale can push an
    # extreme value past the last code (15 codes times 2^-11 of a step).
    deq = q.dequantize(np.float32)
    step = np.repeat(q.scales.astype(np.float32), block, axis=0)[: shape[0]]
    assert (np.abs(deq - w) <= (0.5 + 15 * 2**-11) * step + 1e-12).all()
    assert (deq[:block, 0] == 0).all()

    # onnxruntime's DequantizeLinear (graph as written) == ops.dequantize_reference, bit for bit.
    for sdtype, ttype in ((np.float32, TensorProto.FLOAT), (np.float16, TensorProto.FLOAT16)):
        model, _ = quantize_q4(
            _matmul_model(w.astype(sdtype), ttype), block_size=block, symmetric=symmetric,
            method="minmax",
        )
        inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
        graph = helper.make_graph(
            [dq],
            "dq",
            [],
            [helper.make_tensor_value_info(dq.output[0], ttype, None)],
            [t for t in model.graph.initializer if t.name in dq.input],
        )
        path = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))
        sess, _ = make_session(path, optimize=False)
        got = sess.run(None, {})[0]
        want = ops.dequantize_reference(
            inits[dq.input[0]].astype(np.uint8),
            inits[dq.input[1]],
            inits[dq.input[2]].astype(np.uint8),
            block,
        )
        assert got.dtype == want.dtype == sdtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        direct = quantize_array(w.astype(sdtype), block, symmetric, "minmax").dequantize(
            np.float32
        )
        np.testing.assert_array_equal(want, direct.astype(sdtype))


def test_deterministic() -> None:
    w = np.random.default_rng(2).standard_normal((128, 64)).astype(np.float32)
    a, b = quantize_array(w), quantize_array(w.copy())
    for x, y in ((a.codes, b.codes), (a.scales, b.scales), (a.zero_points, b.zero_points)):
        assert x.tobytes() == y.tobytes()


def test_mlx_affine_form_reproduces_onnx_and_differs_from_mlx_quantize() -> None:
    """MLX stores a float bias per group, ONNX an integer zero point.

    With float16-representable scales, w = q*s + b with b = -zp*s (MLX's affine form, float32
    compute) is bit-identical to ONNX's (q - zp)*s: q*s, zp*s and their difference are exact in
    float32 (an 11-bit mantissa times a 4-bit integer). mx.quantize itself picks its own
    scale/bias (min/max without forcing 0 into the range, float bias), so its weights differ
    from ours by up to a step — equally accurate, not the same numbers.
    """
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(3)
    w_nk = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)  # MLX layout [N, K]
    q = quantize_array(w_nk.T, 32, method="minmax")  # ours: [K, N] along K; no clipping
    ours = q.dequantize(np.float32).T  # [N, K]

    codes_nk = q.codes.T.astype(np.uint32).reshape(48, -1, 8)
    packed = np.bitwise_or.reduce(codes_nk << (4 * np.arange(8, dtype=np.uint32)), axis=-1)
    s = q.scales.T.astype(np.float32)
    bias = -q.zero_points.T.astype(np.float32) * s
    mlx_ours = np.array(
        mx.dequantize(
            mx.array(packed.astype(np.uint32)), mx.array(s), mx.array(bias), group_size=32, bits=4
        )
    )
    np.testing.assert_array_equal(mlx_ours.view(np.uint32), ours.view(np.uint32))

    wq, ms, mb = mx.quantize(mx.array(w_nk), group_size=32, bits=4)
    mlx_own = np.array(mx.dequantize(wq, ms, mb, group_size=32, bits=4))
    err_ours, err_mlx = np.abs(ours - w_nk).max(), np.abs(mlx_own - w_nk).max()
    step = np.repeat(s, 32, axis=1)
    assert (np.abs(ours - w_nk) <= (0.5 + 15 * 2**-11) * step).all()
    assert err_mlx < 2 * err_ours  # comparable accuracy ...
    assert not np.array_equal(mlx_own, ours)  # ... but not the same numbers


# ---------------------------------------------------------------------------------------------
# Hand-built graphs: plain MatMul (incl. K % block != 0) and the fused ops
# ---------------------------------------------------------------------------------------------


def _save(model: onnx.ModelProto, _n: list[int] = [0]) -> str:  # noqa: B006 - a counter
    import tempfile

    _n[0] += 1
    path = Path(tempfile.mkdtemp(prefix="q4_")) / f"m{_n[0]}.onnx"
    onnx.save(model, str(path))
    return str(path)


def _matmul_model(w: np.ndarray, ttype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    k, n = w.shape
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("x", ttype, [1, "s", k])],
        [helper.make_tensor_value_info("y", ttype, [1, "s", n])],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])


@pytest.mark.parametrize("k", [40, 64])
@pytest.mark.parametrize("ttype", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_matmul_graph_partial_block_and_fp16(k: int, ttype: int) -> None:
    dt = helper.tensor_dtype_to_np_dtype(ttype)
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((k, 24)) * 0.1).astype(dt)
    x = rng.standard_normal((1, 5, k)).astype(dt)
    model, res = quantize_q4(_matmul_model(w, ttype))
    (info,) = res["tensors"]
    assert info["partial_block"] == (k % 32 != 0)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert inits[info["scales"]].dtype == dt and inits[info["codes"]].shape == (k, 24)
    assert "w" not in inits
    wd = ops.dequantize_reference(
        inits[info["codes"]].astype(np.uint8),
        inits[info["scales"]],
        inits[info["zero_points"]].astype(np.uint8),
        32,
    )
    want = x.astype(np.float32) @ wd.astype(np.float32)
    path = _save(model)
    for optimize in (False, True):  # as written, and fused into MatMulNBits (float compute)
        sess, meta = make_session(path, accuracy_level=0, optimize=optimize)
        got = sess.run(None, {"x": x})[0]
        assert rel(got, want) <= (1e-5 if dt == np.float32 else 2e-3), meta
    if ttype == TensorProto.FLOAT16:
        # 4 bits + a float16 scale and a 4-bit zero point per 32 weights; a partial block costs
        # a whole block's scale.
        assert res["bits_per_weight"] == (4.625 if k % 32 == 0 else 5.0)


def test_fused_ops_take_codes_scales_zero_points() -> None:
    rng = np.random.default_rng(5)
    k, nq, nk, nv, inter = 64, 96, 48, 48, 96
    w_qkv = (rng.standard_normal((k, nq + nk + nv)) * 0.1).astype(np.float32)
    w_gu = (rng.standard_normal((k, 2 * inter)) * 0.1).astype(np.float32)
    bias = (rng.standard_normal(nq + nk + nv) * 0.1).astype(np.float32)
    nodes = [
        helper.make_node(
            "FusedQKV",
            ["x", "w_qkv", "", "", "b_qkv"],
            ["q", "k", "v"],
            domain=ops.DOMAIN,
            q_size=nq,
            k_size=nk,
            v_size=nv,
        ),
        helper.make_node("FusedGateUp", ["x", "w_gu"], ["y"], domain=ops.DOMAIN, activation="silu"),
    ]
    outs = [("q", nq), ("k", nk), ("v", nv), ("y", inter)]
    g = helper.make_graph(
        nodes,
        "fused",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", k])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, "s", n]) for o, n in outs],
        [
            numpy_helper.from_array(a, n)
            for a, n in ((w_qkv, "w_qkv"), (w_gu, "w_gu"), (bias, "b_qkv"))
        ],
    )
    model = helper.make_model(
        g, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(ops.DOMAIN, 1)]
    )
    ops.attach_functions(model)
    model, res = quantize_q4(model, block_size=32)
    assert len(res["tensors"]) == 2
    qkv, gu = model.graph.node
    assert len(qkv.input) == 5 and qkv.input[4] == "b_qkv" and len(gu.input) == 4
    assert {a.name: a.i for a in qkv.attribute}["block_size"] == 32
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert inits[qkv.input[1]].dtype.name == "uint4" and inits[qkv.input[1]].shape == w_qkv.shape
    onnx.checker.check_model(model)

    def q4(node: onnx.NodeProto) -> tuple[np.ndarray, ...]:
        c, s, z = (inits[i] for i in node.input[1:4])
        return c.astype(np.uint8), s, z.astype(np.uint8)

    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    want_q, want_k, want_v = ops.fused_qkv_reference(
        x, *q4(qkv), bias, q_size=nq, k_size=nk, v_size=nv, block_size=32
    )
    want_y = ops.fused_gate_up_reference(x, *q4(gu), block_size=32)
    sess, _ = make_session(_save(model), accuracy_level=0, optimize=False)
    got = sess.run(None, {"x": x})
    for a, b in zip(got, (want_q, want_k, want_v, want_y), strict=True):
        assert rel(a, b) <= 1e-5


def test_bad_block_size_lists_valid_values() -> None:
    with pytest.raises(PassesError, match="32, 64, 128"):
        quant_options("q4", block_size=48)
    with pytest.raises(PassesError, match="none, q4, q6, q8, mixed"):
        quant_options("q3")
    with pytest.raises(PassesError, match="32, 64, 128"):
        QuantOptions(block_size=48)  # made directly, checked the same way
    with pytest.raises(PassesError, match="4.3125 .. 4.625"):
        QuantOptions(bits_budget=5.0)
    assert quant_options("q4", block_size=64, symmetric=True).block_size == 64
    assert quant_options(None) is None and BLOCK_SIZES == (32, 64, 128)


def test_eight_bit_options_and_what_they_refuse_by_name() -> None:
    assert quant_options(q_bits=8).bits == 8 and quant_options("q8").bits == 8
    assert not quant_options("q8").calibrates and quant_options("q4").calibrates
    with pytest.raises(PassesError, match="--q-bits 3"):
        QuantOptions(bits=3)
    with pytest.raises(PassesError, match="--bits-budget"):
        quant_options(q_bits=8, bits_budget=4.45)
    with pytest.raises(PassesError, match="--calibration"):
        quant_options("q8", calibration="text.txt")
    with pytest.raises(PassesError, match="contradict"):
        quant_options("q4", q_bits=8)
    with pytest.raises(PassesError, match="--q-bits needs"):
        quant_options("none", q_bits=8)


def test_six_bit_options_and_what_they_refuse_by_name() -> None:
    """`--quant q6` / `--q-bits 6` (and the API's quant="q6"): 6-bit blocks, no calibration;
    what shapes 4-bit rounding, and an untied table its codes cannot pack, refused by name."""
    from fuselm.converter.pipeline import ConvertOptions

    assert quant_options(q_bits=6) == quant_options("q6") == QuantOptions(bits=6)
    assert not quant_options("q6").calibrates
    assert ConvertOptions.from_flags(quant="q6", block_size=64).quant == QuantOptions(
        block_size=64, bits=6)
    with pytest.raises(PassesError, match="--bits-budget .*--q-bits 6"):
        quant_options("q6", bits_budget=4.45)
    with pytest.raises(PassesError, match="--calibration .*--q-bits 6"):
        quant_options(q_bits=6, calibration="text.txt")
    with pytest.raises(PassesError, match="--quant-embeddings"):
        quant_options("q6", quant_embeddings=True)
    with pytest.raises(PassesError, match="contradict"):
        quant_options("mixed", q_bits=6)


@pytest.mark.parametrize(("k", "symmetric"), [(64, True), (42, False)])
def test_six_bit_codes_pack_along_k_or_the_weight_takes_8_bits(k: int, symmetric: bool) -> None:
    """`--quant q6` on a MatMul: a K that is a multiple of 4 is stored packed ([3K/4, N] bytes
    through UnpackUInt6; --sym: zero point 32), another K in 8-bit blocks (recorded); both give
    x @ the record's dequantized weight in onnxruntime."""
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((k, 24)) * 0.1).astype(np.float32)
    x = rng.standard_normal((1, 3, k)).astype(np.float32)
    model, res = quantize_q4(_matmul_model(w), bits=6, symmetric=symmetric)
    (info,) = res["tensors"]
    bits = 6 if k % 4 == 0 else 8
    assert info["bits"] == bits and res["bits"] == bits and not res["norm_importance"]
    assert res["zero_point"] == ("fixed 32/128 (6/8 bits) (uint8)" if symmetric
                                 else "uint8 per block")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    codes = inits[info["codes"]]
    if bits == 6:
        assert codes.shape == (3 * k // 4, 24)
        codes = ops.unpack_uint6_reference(codes)
    if symmetric:
        assert (inits[info["zero_points"]] == 32).all()
    wd = ops.dequantize_reference(codes, inits[info["scales"]], inits[info["zero_points"]], 32)
    assert rel(wd, w) < 0.02
    ops.attach_functions(model)
    sess, _ = make_session(_save(model), accuracy_level=0, optimize=False)
    assert rel(sess.run(None, {"x": x})[0], x @ wd) <= 1e-5


def test_defaults_quantize_the_head_with_the_search() -> None:
    q = quant_options("q4")
    assert q == QuantOptions()  # `--quant q4` alone is the options' defaults
    assert q.lm_head and not q.embeddings and q.method == "search"  # the peers' default
    assert not quant_options("q4", quant_lm_head=False).lm_head  # --no-quant-lm-head
    assert quant_options("none", quant_lm_head=False) is None
    with pytest.raises(PassesError, match="search, minmax"):
        quant_options("q4", quant_method="gptq")
    with pytest.raises(PassesError, match="need --quant q4"):
        quant_options("none", quant_lm_head=True)
    with pytest.raises(PassesError, match="--calibration needs --quant q4"):
        quant_options(None, calibration="text.txt")
    with pytest.raises(PassesError, match="contradict"):
        quant_options("q4", calibration="text.txt", default_calibration=False)


def test_block_size_and_budget_are_what_was_asked() -> None:
    """Block 32 everywhere unless a block size or a bits budget is asked for (the default has
    no budget, calibrated or not)."""
    assert QuantOptions().blocks() == (32, None)
    assert QuantOptions(block_size=64).blocks() == (64, None)
    assert QuantOptions(bits_budget=4.5).blocks() == (32, 4.5)
    for quant in ("none", None):  # nothing quantized: refused by name, never dropped
        with pytest.raises(PassesError, match="--block-size/--bits-budget"):
            quant_options(quant, block_size=64)
        with pytest.raises(PassesError, match="--block-size/--bits-budget"):
            quant_options(quant, bits_budget=4.5)


# ---------------------------------------------------------------------------------------------
# Whole models: tiny HF checkpoints exported by torch.onnx.export
# ---------------------------------------------------------------------------------------------


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones_like(input_ids)
        return self.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits


def _export(model: torch.nn.Module, path: Path) -> Path:
    ids = torch.zeros((1, 7), dtype=torch.int64)
    seq = torch.export.Dim("seq", min=1, max=256)
    prog = torch.onnx.export(
        _Logits(model),
        (ids,),
        dynamo=True,
        opset_version=23,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": {1: seq}},
        verbose=False,
    )
    prog.save(str(path))
    return path


def _load(ckpt: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


# qwen3: tied embedding/LM head, GQA, head_dim != hidden/heads.
# llama: untied head, q/k/v biases, intermediate 80 (down_proj's K is not a multiple of 32).
MODELS = {
    "qwen3": dict(family="qwen3"),
    "llama": dict(
        family="llama", tie_word_embeddings=False, attention_bias=True, intermediate_size=80
    ),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    from fuselm.converter.models.builtin import build_model

    out = {}
    for name, kw in MODELS.items():
        root = tmp_path_factory.mktemp(name)
        ckpt = build_model(root / "ckpt", tokenizer=False, **kw)
        out[name] = (ckpt, _export(_load(ckpt), root / "model.onnx"))
    return out


def _dequantize_hf(model: torch.nn.Module, block: int, lm_head: bool, embeddings: bool) -> None:
    """Replace HF weights by their dequantized values (quantized as the pass does: along K).

    A tied embedding/LM head is one parameter: it is replaced once, when either flag is set.
    """
    tied = model.config.tie_word_embeddings
    done: set[int] = set()
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear):
                wanted = name != "lm_head" or lm_head or (tied and embeddings)
            elif isinstance(mod, torch.nn.Embedding):
                wanted = embeddings or (tied and lm_head)
            else:
                continue
            if not wanted or mod.weight.data_ptr() in done:
                continue
            done.add(mod.weight.data_ptr())
            w = mod.weight.numpy()  # [N, K] (Linear) or [V, H] (Embedding): blocks along dim 1
            mod.weight.copy_(torch.from_numpy(quantize_array(w.T, block).dequantize().T))


@pytest.mark.parametrize(
    "name,lm_head,embeddings",
    [
        ("qwen3", True, False),
        ("qwen3", False, False),
        ("llama", True, True),
        ("llama", False, True),
    ],
)
def test_q4_model_equals_hf_with_dequantized_weights(exported, name, lm_head, embeddings) -> None:
    ckpt, path = exported[name]
    model, info = quantize_q4(onnx.load(str(path)), lm_head=lm_head, embeddings=embeddings)
    roles = [t["role"] for t in info["tensors"]]
    if name == "qwen3":
        tied = lm_head or embeddings
        assert info["tied"] == (["model.lm_head.weight"] if tied else []) or info["tied"]
        assert ("tied_embedding_lm_head" in roles) == tied
        assert info["lm_head"] == info["embeddings"] == tied
    else:
        assert info["tied"] == [] and ("lm_head" in roles) == lm_head
        assert ("embedding" in roles) == embeddings
        assert any(t["partial_block"] for t in info["tensors"])  # down_proj, K = 80
    # 7 linear weights per layer, 2 layers
    assert roles.count("linear") == 14
    q4_path = _save(model)

    hf = _load(ckpt)
    _dequantize_hf(hf, 32, lm_head, embeddings)
    ids = np.random.default_rng(6).integers(0, hf.config.vocab_size, (1, 11))
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    sess, meta = make_session(q4_path, accuracy_level=0)
    assert meta["accuracy_level"] == 0
    got = sess.run(None, {"input_ids": ids})[0]
    assert rel(got, want) <= 1e-4

    # On ordinary random weights, report (not assert) the error against the float model.
    float_sess, _ = make_session(str(path), optimize=False)
    ref = float_sess.run(None, {"input_ids": ids})[0]
    int8, _ = make_session(q4_path, accuracy_level=4)
    print(
        f"{name} lm_head={lm_head} emb={embeddings}: rel vs float {rel(got, ref):.3g} "
        f"(float compute), {rel(int8.run(None, {'input_ids': ids})[0], ref):.3g} (int8 act)"
    )


def _to_grid(w: torch.Tensor, gen: np.random.Generator, block: int = 32) -> torch.Tensor:
    """[N, K] on a 4-bit grid per block of K: (q - zp) * s, q in 0..15, both 0 and 15 used."""
    n, k = w.shape
    nb = k // block
    q = gen.integers(0, 16, (n, nb, block))
    pos = np.argsort(gen.random((n, nb, block)), axis=-1)[..., :2]  # two distinct slots
    np.put_along_axis(q, pos[..., :1], 0, axis=-1)
    np.put_along_axis(q, pos[..., 1:], 15, axis=-1)
    zp = gen.integers(0, 16, (n, nb, 1))
    s = 2.0 ** gen.integers(-8, -5, (n, nb, 1))
    return torch.from_numpy(((q - zp) * s).reshape(n, k).astype(np.float32))


def test_weights_on_the_grid_quantize_exactly(tmp_path) -> None:
    from fuselm.converter.models.builtin import build_model

    ckpt = build_model(tmp_path / "ckpt", "qwen3", tokenizer=False)
    hf = _load(ckpt)
    gen = np.random.default_rng(7)
    with torch.no_grad():
        for mod in hf.modules():
            if isinstance(mod, torch.nn.Linear | torch.nn.Embedding):
                mod.weight.copy_(_to_grid(mod.weight, gen))  # tied: one tensor, blocks along H
    grid_ckpt = tmp_path / "grid"
    hf.save_pretrained(grid_ckpt)
    path = _export(_load(grid_ckpt), tmp_path / "grid.onnx")
    float_model = onnx.load(str(path))
    before = {t.name: numpy_helper.to_array(t) for t in float_model.graph.initializer}
    model, res = quantize_q4(onnx.load(str(path)), lm_head=True)
    assert len(res["tensors"]) == 15 and res["tied"]
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for t in res["tensors"]:
        deq = ops.dequantize_reference(
            inits[t["codes"]].astype(np.uint8),
            inits[t["scales"]],
            inits[t["zero_points"]].astype(np.uint8),
            32,
        )
        orig = before[t["name"]]
        orig = orig.T if t["axis"] == 1 or t["role"] == "tied_embedding_lm_head" else orig
        assert deq.tobytes() == np.ascontiguousarray(orig).tobytes(), t["name"]

    ids = gen.integers(0, 384, (1, 13))
    q4_path = _save(model)
    ref = make_session(str(path), optimize=False)[0].run(None, {"input_ids": ids})[0]
    as_written = make_session(q4_path, optimize=False)[0].run(None, {"input_ids": ids})[0]
    np.testing.assert_array_equal(as_written, ref)  # same weights, same ops: same logits
    fused = make_session(q4_path, accuracy_level=0)[0].run(None, {"input_ids": ids})[0]
    assert rel(fused, ref) <= 1e-5  # MatMulNBits at float compute: only summation order differs


@pytest.mark.parametrize("shape", [(4, 6), (3, 5)])  # even and odd element counts
def test_uint4_packing_matches_onnx(shape) -> None:
    from fuselm.passes.quant.q4_math import to_uint4, uint4_tensor

    codes = np.random.default_rng(8).integers(0, 16, shape).astype(np.uint8)
    ours = uint4_tensor(codes, "c")
    ref = numpy_helper.from_array(to_uint4(codes), "c")
    assert ours.SerializeToString() == ref.SerializeToString()
    np.testing.assert_array_equal(numpy_helper.to_array(ours).astype(np.uint8), codes)


def test_threaded_slabs_equal_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """quantize_array's slabs run on several cores: codes, scales, zero points and the error
    are exactly those of one thread (columns are independent; sums are added in slab order)."""
    from fuselm.passes.quant import q4_math

    w = (np.random.default_rng(3).standard_normal((96, 2500)) * 0.02).astype(np.float16)
    results = []
    for threads in (1, 3):
        monkeypatch.setattr(q4_math, "THREADS", threads)
        results.append(q4_math.quantize_array(w, 32))
    a, b = results
    for field in ("codes", "scales", "zero_points"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert a.rel_rms_error == b.rel_rms_error
