"""RemoveDeadShapeOp: static shape arithmetic folds, dynamic stays, weights are never folded."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto
from passes_support import G, apply, max_rel, op_counts, run

from fuselm.passes.dead_shape import RemoveDeadShapeOp


def _torchscript_reshape(g: G, x: str) -> str:
    """x [b, s, 12] -> [b, s, 3, 4] with the target computed TorchScript-style at run time."""
    shape = g.op("Shape", x)

    def dim(i: int) -> str:
        picked = g.op("Gather", shape, g.const(np.array(i)), axis=0)
        return g.op("Unsqueeze", picked, g.const(np.array([0])))

    b, s, hd = dim(0), dim(1), dim(2)
    heads = g.op("Div", hd, g.const(np.array([4])))
    return g.op("Reshape", x, g.op("Concat", b, s, heads, g.const(np.array([4])), axis=0))


def test_folds_static_keeps_dynamic() -> None:
    g = G()
    x = g.input("x", ["batch", "seq", 12])
    y = _torchscript_reshape(g, x)
    g.op("Relu", x)  # dead
    g.output(g.op("Identity", y), "y")
    model = g.model()
    out, result = apply(model, RemoveDeadShapeOp())
    counts = op_counts(out)
    assert result.count > 0
    assert "Div" not in counts and "Relu" not in counts  # static head count folded; dead gone
    assert counts["Shape"] >= 1  # batch and seq are dynamic: their Shape stays
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 5, 12)).astype(np.float32)}
    assert max_rel(run(out, feeds), run(model, feeds)) == 0.0


def test_merges_duplicates_and_noop_casts() -> None:
    g = G()
    x = g.input("x", [2, 3])
    a = g.op("Cos", g.op("Cast", x, to=TensorProto.FLOAT))
    b = g.op("Cos", x)
    g.output(g.op("Add", a, b), "y")
    out, result = apply(g.model(), RemoveDeadShapeOp())
    assert op_counts(out)["Cos"] == 1 and "Cast" not in op_counts(out)


def test_never_folds_weights() -> None:
    """The tied LM head is MatMul(h, Transpose(embed)): folding it would copy the embedding."""
    g = G()
    h = g.input("h", ["b", 4])
    embed = g.const(np.random.default_rng(0).standard_normal((300, 4)).astype(np.float32))
    g.output(g.op("MatMul", h, g.op("Transpose", embed, perm=[1, 0])), "logits")
    out, _ = apply(g.model(), RemoveDeadShapeOp())
    assert op_counts(out)["Transpose"] == 1
    assert [tuple(t.dims) for t in out.graph.initializer] == [(300, 4)]


def test_idempotent_and_deterministic() -> None:
    g = G()
    x = g.input("x", ["batch", "seq", 12])
    g.output(_torchscript_reshape(g, x), "y")
    model = g.model()
    once, _ = apply(model, RemoveDeadShapeOp())
    again, _ = apply(model, RemoveDeadShapeOp())
    twice, result = apply(once, RemoveDeadShapeOp())
    assert once.SerializeToString() == again.SerializeToString()
    assert result.count == 0 and twice.SerializeToString() == once.SerializeToString()
