"""Q4: the MLX engine (quantized_matmul on the packed weights) vs onnxruntime at float compute."""

from __future__ import annotations

import numpy as np

from runtime_metal.engine import make_engine
from runtime_metal.qweight import QWeight
from runtime_metal.validate import engine_logits, rel


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
