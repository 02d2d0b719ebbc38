"""Q4: the MLX engine (quantized_matmul on the packed weights) vs onnxruntime at float compute."""

from __future__ import annotations

import numpy as np

from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.mlx_engine.qweight import QWeight
from fuselm.runtime_metal.validate import engine_logits, rel
from tests.runtime.conftest import convert, quantized_copy


def test_q4_mlx_matches_onnxruntime_float_compute(q4_artifact) -> None:  # noqa: ANN001
    mlx_engine = make_engine(q4_artifact, "mlx")
    ort_engine = make_engine(q4_artifact, "onnxruntime", accuracy_level=0)
    assert ort_engine.describe()["accuracy_level"] == 0
    packed = [v for v in mlx_engine.plan.constants.values() if isinstance(v, QWeight)]
    assert packed, "Q4 weights must become QWeights (one quantized matmul each)"
    # no dense float copy of a quantized weight is kept beside it
    dense = [k for k, v in mlx_engine.plan.constants.items()
             if k.endswith("weight") and not isinstance(v, QWeight) and getattr(v, "ndim", 0) == 2]
    assert not dense
    prompt = [int(i) for i in np.random.default_rng(2).integers(4, 384, 30)]
    a = engine_logits(mlx_engine, prompt, 8)
    b = engine_logits(ort_engine, prompt, 8)
    assert rel(a, b) <= 1e-3
    for t in (5, 9, 11):
        assert rel(mlx_engine.forward(np.array([[t]])), ort_engine.forward(np.array([[t]]))) <= 1e-3


def test_accuracy_level_is_set_and_reported(q4_artifact) -> None:  # noqa: ANN001
    fast = make_engine(q4_artifact, "onnxruntime")
    assert fast.describe()["accuracy_level"] == 4
    opts = fast.session.get_session_options()
    assert opts.get_session_config_entry("session.qdq_matmulnbits_accuracy_level") == "4"


def _lookup_tables(engine) -> tuple[list[QWeight], list[str]]:  # noqa: ANN001
    """The plan's row-gather QWeights, and any integer table still gathered from directly."""
    c = engine.plan.constants
    rows = [v for v in c.values() if isinstance(v, QWeight) and v.rows_only]
    raw = [s.inputs[0] for s in engine.plan.steps
           if s.op_type == "Gather" and not isinstance(c.get(s.inputs[0]), QWeight)
           and getattr(c.get(s.inputs[0]), "ndim", 0) == 2]
    return rows, raw


def test_tied_q4_embedding_shares_the_head_codes(q4_artifact) -> None:  # noqa: ANN001
    """The tied table is held once, packed (the LM head's arrays), not as a second one-byte-per-
    code copy; lookups dequantize the gathered rows to exactly the DequantizeLinear values."""
    mlx_engine = make_engine(q4_artifact, "mlx")
    rows, raw = _lookup_tables(mlx_engine)
    assert len(rows) == 1 and not raw
    heads = [v for v in mlx_engine.plan.constants.values()
             if isinstance(v, QWeight) and v.transposed and v.packed is rows[0].packed]
    assert len(heads) == 1 and heads[0].scales is rows[0].scales
    ort_engine = make_engine(q4_artifact, "onnxruntime", accuracy_level=0)
    ids = np.array([[0, 7, 383, 120, 7]])
    assert rel(mlx_engine.forward(ids), ort_engine.forward(ids)) <= 1e-3


def test_untied_q4_embedding_is_packed(family_models, tmp_path) -> None:  # noqa: ANN001
    out = quantized_copy(family_models["llama"][1], tmp_path / "llama_q4", embeddings=True)
    mlx_engine = make_engine(out, "mlx")
    rows, raw = _lookup_tables(mlx_engine)
    assert len(rows) == 1 and not raw and not rows[0].transposed
    ort_engine = make_engine(out, "onnxruntime", accuracy_level=0)
    prompt = [int(i) for i in np.random.default_rng(4).integers(0, 384, 20)]
    assert rel(engine_logits(mlx_engine, prompt, 4), engine_logits(ort_engine, prompt, 4)) <= 1e-3


def test_half_precision_artifact_keeps_affine_terms_once(family_models, tmp_path) -> None:  # noqa: ANN001
    """float16 activations: every QWeight's scales/biases are in the dtype float16 computes in
    (float16; float32 on MLX's CPU backend, dtypes.half) only, with no pair of the other dtype
    beside the cast, the tied table still shares the head's arrays, and the MLX engine agrees
    with onnxruntime to float16 precision."""
    import mlx.core as mx

    from fuselm.runtime_metal.dtypes import half

    out = convert(family_models["qwen3"][0], tmp_path / "q4_fp16", dtype="float16", quant="q4",
                  quant_lm_head=True, quant_embeddings=True)
    mlx_engine = make_engine(out, "mlx")
    packed = [v for v in mlx_engine.plan.constants.values() if isinstance(v, QWeight)]
    act = half()
    other = mx.float32 if act == mx.float16 else mx.float16
    assert packed and all(w.scales.dtype == w.biases.dtype == act for w in packed)
    assert not any(other in w._cast for w in packed)
    rows, raw = _lookup_tables(mlx_engine)
    assert len(rows) == 1 and not raw
    assert any(w is not rows[0] and w.packed is rows[0].packed and w.scales is rows[0].scales
               for w in packed)
    ort_engine = make_engine(out, "onnxruntime", accuracy_level=0)
    prompt = [int(i) for i in np.random.default_rng(6).integers(0, 384, 24)]
    assert rel(engine_logits(mlx_engine, prompt, 4), engine_logits(ort_engine, prompt, 4)) <= 2e-2


def test_default_q4_convert_quantizes_the_head_and_reports(family_models, tmp_path) -> None:  # noqa: ANN001
    """`convert --quant q4` with nothing else: the (untied, GQA) model's LM head is Q4, its
    embedding stays float, fuselm.json records both and a per-tensor error, quant-report prints
    the worst tensor first, and MLX matches onnxruntime (float compute) on that artifact."""
    import json

    from click.testing import CliRunner

    from fuselm.converter.cli.main import cli
    from fuselm.runtime_metal.artifact import read_manifest

    out = convert(family_models["qwen2"][0], tmp_path / "q4_default", quant="q4")
    record = read_manifest(out).quantization
    assert record["lm_head"] and not record["embeddings"] and record["method"] == "search"
    assert record["roles"]["lm_head"]["tensors"] == 1 and "embedding" not in record["roles"]
    assert 4.6 < record["bits_per_weight"] < record["bits_per_weight_overall"] < 32
    errs = [t["rel_rms_error"] for t in record["tensors"]]
    assert all(0 < e < 0.2 for e in errs)
    r = CliRunner().invoke(cli, ["quant-report", str(out), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["tensors"]
    assert [x["rel_rms_error"] for x in rows] == sorted(errs, reverse=True)
    assert "rel RMS err" in CliRunner().invoke(cli, ["quant-report", str(out)]).output
    bad = CliRunner().invoke(cli, ["quant-report", str(family_models["qwen2"][1])])
    assert bad.exit_code != 0 and "has no Q4 weights" in str(bad.exception)

    kept = convert(family_models["qwen2"][0], tmp_path / "q4_float_head", quant="q4",
                   quant_lm_head=False)
    assert not read_manifest(kept).quantization["lm_head"]

    mlx_engine = make_engine(out, "mlx")
    ort_engine = make_engine(out, "onnxruntime", accuracy_level=0)
    prompt = [int(i) for i in np.random.default_rng(8).integers(4, 384, 24)]
    assert rel(engine_logits(mlx_engine, prompt, 6), engine_logits(ort_engine, prompt, 6)) <= 1e-3
