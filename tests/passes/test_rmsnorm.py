"""RMSNorm fusion on hand-built graphs: the exporters' forms, per-head norms, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto
from passes_support import G, apply, max_rel, op_counts, run

from fuselm.passes.rmsnorm import RMSNormFusion


def _decomposed(g: G, x: str, *, form: str, axis: int = -1, weight: bool = True) -> str:
    xf = g.op("Cast", x, to=TensorProto.FLOAT) if form == "torchscript" else x
    sq = g.op("Mul", xf, xf) if form == "mul" else g.op("Pow", xf, g.const(np.float32(2)))
    mean = g.op("ReduceMean", sq, g.const(np.array([axis])), keepdims=1)
    std = g.op("Sqrt", g.op("Add", mean, g.const(np.float32(1e-5))))
    if form == "torchscript":
        normed = g.op("Cast", g.op("Mul", xf, g.op("Div", g.const(np.float32(1)), std)), to=1)
    elif form == "div":
        normed = g.op("Div", xf, std)
    else:
        normed = g.op("Mul", xf, g.op("Reciprocal", std))
    if not weight:
        return normed
    w = g.const((1 + 0.1 * g.rng.standard_normal(8)).astype(np.float32))
    return g.op("Mul", w, normed)


@pytest.mark.parametrize("form", ["dynamo", "torchscript", "mul", "div"])
def test_fuses_each_form(form: str) -> None:
    g = G()
    x = g.input("x", [2, 3, 8])
    g.output(_decomposed(g, x, form=form), "y")
    model = g.model()
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)}
    out, result = apply(model, RMSNormFusion())
    assert result.count == 1 and not result.refused
    assert op_counts(out) == {"RMSNormalization": 1} or op_counts(out)["RMSNormalization"] == 1
    assert not {"ReduceMean", "Sqrt", "Pow"} & set(op_counts(out))
    assert max_rel(run(out, feeds), run(model, feeds)) <= 1e-5


def test_per_head_norm_and_missing_weight() -> None:
    g = G()
    x = g.input("x", [2, 3, 4, 8])  # [b, s, heads, head_dim]: Qwen3's q/k norm
    g.output(_decomposed(g, x, form="dynamo"), "y")
    g.output(_decomposed(g, x, form="dynamo", weight=False), "z")
    model = g.model()
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 4, 8)).astype(np.float32)}
    out, result = apply(model, RMSNormFusion())
    assert result.count == 2
    assert op_counts(out)["RMSNormalization"] == 2
    assert max_rel(run(out, feeds), run(model, feeds)) <= 1e-5


def test_refuses_other_axis() -> None:
    g = G()
    x = g.input("x", [2, 3, 8])
    g.output(_decomposed(g, x, form="dynamo", axis=1), "y")
    out, result = apply(g.model(), RMSNormFusion())
    assert result.count == 0
    assert result.refused and "not the last axis" in result.refused[0][1]
    assert "RMSNormalization" not in op_counts(out)


def test_idempotent() -> None:
    g = G()
    x = g.input("x", [2, 3, 8])
    g.output(_decomposed(g, x, form="torchscript"), "y")
    once, _ = apply(g.model(), RMSNormFusion())
    twice, result = apply(once, RMSNormFusion())
    assert result.count == 0
    assert twice.SerializeToString() == once.SerializeToString()
