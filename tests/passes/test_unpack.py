"""Foreign-family forms on hand-written graphs: UnpackProjections (a fused projection cut into
parts becomes one projection per part, numerics unchanged; cuts that do not partition the
output stay) and the decomposed tanh-GELU gate that Gate/Up pairing takes as GeGLU."""

from __future__ import annotations

import numpy as np
import pytest
from passes_support import G, apply, max_rel, op_counts, run

from fuselm.passes.unpack import UnpackProjections

END = 2**63 - 1


def _model(cuts: list[tuple[int, int]] | str, bias: bool = False):  # noqa: ANN202
    g = G()
    x = g.input("x", ["b", "s", 8])
    y = g.op("MatMul", x, g.weight(8, 12))
    if bias:
        y = g.op("Add", y, g.const(g.rng.standard_normal(12) * 0.1))
    if cuts == "split":
        a, b = g.op("Split", y, axis=-1, num_outputs=2, n_out=2)
        outs = [a, b]
    else:
        outs = [g.op("Slice", y, g.const(np.array([s])), g.const(np.array([e])),
                     g.const(np.array([2]))) for s, e in cuts]
    for i, o in enumerate(outs):
        g.output(g.op("Relu", o), f"y{i}")
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)}
    return g.model(), feeds


@pytest.mark.parametrize(("cuts", "bias"), [
    ([(0, 6), (6, 9), (9, END)], False),  # q, k, v as Phi-3's export cuts qkv_proj
    ([(6, 9), (-3, END), (0, 6)], True),  # any order, negative starts, a bias
    ("split", False),  # gate, up as one Split
])
def test_unpacks_a_partition(cuts, bias: bool) -> None:  # noqa: ANN001
    model, feeds = _model(cuts, bias)
    out, result = apply(model, UnpackProjections())
    assert result.count == 1
    counts = op_counts(out)
    assert counts["MatMul"] == 3 - (cuts == "split") and "Slice" not in counts
    assert "Split" not in counts and counts["Add"] == (3 if bias else 0)
    assert max_rel(run(out, feeds), run(model, feeds)) == 0.0


@pytest.mark.parametrize("cuts", [
    [(0, 6), (4, END)],  # overlap
    [(0, 6), (7, END)],  # gap
    [(0, 6)],  # one part read, the rest dropped
])
def test_leaves_other_cuts_alone(cuts) -> None:  # noqa: ANN001
    model, feeds = _model(cuts)
    out, result = apply(model, UnpackProjections())
    assert result.count == 0
    assert op_counts(out) == op_counts(model)


def test_decomposed_gelu_tanh_pairs_as_geglu() -> None:
    """Below opset 20 torch writes Gemma's GeGLU gate as the tanh formula (no Gelu op); Gate/Up
    pairing takes it as FusedGateUp(activation="gelu_tanh")."""
    from fuselm.passes.pair_gate_up import GateUpPairing

    g = G()
    x = g.input("x", ["b", "s", 8])
    gate, up = g.op("MatMul", x, g.weight(8, 12)), g.op("MatMul", x, g.weight(8, 12))
    inner = g.op("Add", gate, g.op("Mul", g.const(np.float32(0.044715)),
                                   g.op("Pow", gate, g.const(np.float32(3.0)))))
    t = g.op("Tanh", g.op("Mul", g.const(np.float32(np.sqrt(2 / np.pi))), inner))
    act = g.op("Mul", gate, g.op("Mul", g.const(np.float32(0.5)),
                                 g.op("Add", t, g.const(np.float32(1.0)))))
    g.output(g.op("Mul", act, up), "y")
    model = g.model()
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)}
    out, result = apply(model, GateUpPairing())
    assert result.count == 1
    node = next(n for n in out.graph.node if n.op_type == "FusedGateUp")
    assert node.attribute[0].s == b"gelu_tanh"
    assert "Tanh" not in op_counts(out) and "Pow" not in op_counts(out)
    assert max_rel(run(out, feeds), run(model, feeds)) <= 1e-6
