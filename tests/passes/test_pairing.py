"""QKV and Gate/Up pairing, reorderQKVProjections: positive cases, every refusal, Q4 weights."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from passes_support import G, apply, functions_attached, layer_model, max_rel, op_counts, run

from fuselm.passes.manager import run_pipeline
from fuselm.passes.pair_gate_up import GateUpPairing
from fuselm.passes.pair_qkv import QKVPairing
from fuselm.passes.reorder import ReorderQKVProjections, peak_live


def _fused_attention(**kw) -> tuple[onnx.ModelProto, dict]:  # noqa: ANN003
    model, feeds = layer_model(**kw)
    out, _ = run_pipeline(model, ["dead_shape", "rope", "attention"])
    return out, feeds


@pytest.mark.parametrize("kw", [{}, {"bias": True}, {"kv": 4}, {"kv": 1, "qk_norm": True}])
def test_qkv_pairs_and_packs(kw: dict) -> None:
    model, feeds = _fused_attention(**kw)
    out, result = apply(model, QKVPairing())
    assert result.count == 1 and not result.refused
    qkv = next(n for n in out.graph.node if n.op_type == "FusedQKV")
    attrs = {a.name: a.i for a in qkv.attribute}
    kv = kw.get("kv", 2)
    assert (attrs["q_size"], attrs["k_size"], attrs["v_size"]) == (24, kv * 6, kv * 6)
    assert (len(qkv.input) == 5) == bool(kw.get("bias"))
    assert op_counts(out)["MatMul"] == 4  # o_proj and the MLP's gate, up, down remain
    assert functions_attached(out)
    assert max_rel(run(out, feeds), run(model, feeds)) <= 1e-5


def _qkv_graph(nq: int, nk: int, nv: int, heads: int, kv: int, *, hidden: int = 8,
               extra_projection: bool = False, prebias_read: bool = False) -> onnx.ModelProto:
    """x -> three projections -> FusedRoPE(q, k) -> Attention(q, k, v): the pairing's input."""
    from fuselm.passes import ops

    g = G()
    x = g.input("x", ["b", "s", hidden])
    pos = g.input("position_ids", ["b", "s"], TensorProto.INT64)
    q = g.op("MatMul", x, g.weight(hidden, nq))
    if prebias_read:
        g.output(q, "q_raw")
        q = g.op("Add", "q_raw", g.const(np.zeros(nq, np.float32)))
    k = g.op("MatMul", x, g.weight(hidden, nk))
    v = g.op("MatMul", x, g.weight(hidden, nv))
    d = nk // kv
    qr, kr = g.op("FusedRoPE", q, k, pos, n_out=2, domain="fuselm", head_dim=d, rotary_dim=d,
                  inv_freq=[1.0 / 10000 ** (i / d) for i in range(0, d, 2)])
    y = g.op("Attention", qr, kr, v, q_num_heads=heads, kv_num_heads=kv)
    g.output(y, "y")
    if extra_projection:
        g.output(g.op("MatMul", x, g.weight(hidden, nk)), "extra")
    m = helper.make_model(helper.make_graph(g.nodes, "g", g.inputs, g.outputs, g.inits),
                          opset_imports=[helper.make_opsetid("", 23),
                                         helper.make_opsetid("fuselm", 1)])
    m.ir_version = 10
    ops.attach_functions(m)
    return m


@pytest.mark.parametrize(
    ("case", "kwargs", "reason"),
    [
        ("four projections", dict(nq=24, nk=12, nv=12, heads=4, kv=2, extra_projection=True),
         "4 projections share one input"),
        ("K and V differ", dict(nq=24, nk=12, nv=18, heads=4, kv=2), "K and V output sizes differ"),
        ("Q smaller than K", dict(nq=6, nk=12, nv=12, heads=2, kv=2), "smaller than K"),
        ("too large", dict(nq=16400, nk=16400, nv=16400, heads=2050, kv=2050, hidden=2),
         "larger than 16384"),
        ("pre-bias output read", dict(nq=24, nk=12, nv=12, heads=4, kv=2, prebias_read=True),
         "not the q, k and v"),
    ],
)
def test_qkv_refusals(case: str, kwargs: dict, reason: str) -> None:
    model = _qkv_graph(**kwargs)
    out, result = apply(model, QKVPairing())
    assert result.count == 0, case
    assert len(result.refused) == 1 and reason in result.refused[0][1], result.refused
    assert "FusedQKV" not in op_counts(out)


def test_gate_up_pairs_with_bias() -> None:
    g = G()
    x = g.input("x", ["b", "s", 8])
    gate = g.op("Add", g.op("MatMul", x, g.weight(8, 12)), g.const(np.full(12, 0.1, np.float32)))
    up = g.op("MatMul", x, g.weight(8, 12))
    g.output(g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up), "y")
    model = g.model()
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)}
    out, result = apply(model, GateUpPairing())
    assert result.count == 1
    assert op_counts(out)["FusedGateUp"] == 1
    assert not {"MatMul", "Sigmoid", "Mul"} & set(op_counts(out))
    assert functions_attached(out)
    assert max_rel(run(out, feeds), run(model, feeds)) <= 1e-5


def test_gate_up_refuses_shared_up() -> None:
    g = G()
    x = g.input("x", ["b", "s", 8])
    gate, up = g.op("MatMul", x, g.weight(8, 12)), g.op("MatMul", x, g.weight(8, 12))
    g.output(g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up), "y")
    g.output(up, "up_out")
    out, result = apply(g.model(), GateUpPairing())
    assert result.count == 0 and "up projection is also read" in result.refused[0][1]


def _q4(g: G, k: int, n: int) -> str:
    rng = g.rng
    codes = rng.integers(0, 16, (k, n))
    zps = rng.integers(0, 16, (k // 32, n))
    scales = (rng.random((k // 32, n)) * 0.05).astype(np.float32)
    c = g._name("codes")
    z = g._name("zp")
    g.inits.append(helper.make_tensor(c, TensorProto.UINT4, [k, n], codes.reshape(-1).tolist()))
    g.inits.append(helper.make_tensor(z, TensorProto.UINT4, [k // 32, n], zps.reshape(-1).tolist()))
    return g.op("DequantizeLinear", c, g.const(scales), z, axis=0, block_size=32)


def test_gate_up_pairs_quantized_projections() -> None:
    """Foreign graphs may arrive with DequantizeLinear + MatMul projections."""
    g = G()
    x = g.input("x", ["b", "s", 64])
    gate, up = g.op("MatMul", x, _q4(g, 64, 16)), g.op("MatMul", x, _q4(g, 64, 16))
    g.output(g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up), "y")
    model = g.model()
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 64)).astype(np.float32)}
    out, result = apply(model, GateUpPairing())
    assert result.count == 1
    node = next(n for n in out.graph.node if n.op_type == "FusedGateUp")
    assert len(node.input) == 4 and {a.name: a.i for a in node.attribute}["block_size"] == 32
    assert max_rel(run(out, feeds), run(model, feeds)) <= 1e-5


def test_reorder_makes_projections_adjacent() -> None:
    model, feeds = _fused_attention()
    # scatter K and V: move them to just before the node that first needs them
    nodes = list(model.graph.node)
    mms = [n for n in nodes if n.op_type == "MatMul"][:3]
    for mm in mms[1:]:
        nodes.remove(mm)
    rope = next(i for i, n in enumerate(nodes) if n.op_type == "FusedRoPE")
    nodes[rope:rope] = [mms[1]]
    attn = next(i for i, n in enumerate(nodes) if n.op_type == "Attention")
    nodes[attn:attn] = [mms[2]]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    out, result = apply(model, ReorderQKVProjections())
    assert result.count == 1
    assert result.extra["peak_live_after"] <= result.extra["peak_live_before"]
    order = [n.op_type for n in out.graph.node]
    i = order.index("MatMul")
    assert order[i - 1] == "RMSNormalization" and order[i : i + 3] == ["MatMul"] * 3
    assert max_rel(run(out, feeds), run(model, feeds)) == 0.0
    paired, _ = apply(out, QKVPairing())
    order = [n.op_type for n in paired.graph.node]
    assert order[order.index("FusedQKV") - 1] == "RMSNormalization"  # in place of the first


def test_peak_live_counts_stored_order() -> None:
    import onnx_graphsurgeon as gs

    a = gs.Variable("a", np.float32)
    b, c, d = (gs.Variable(n, np.float32) for n in "bcd")
    n1 = gs.Node("Relu", inputs=[a], outputs=[b])
    n2 = gs.Node("Relu", inputs=[a], outputs=[c])
    n3 = gs.Node("Add", inputs=[b, c], outputs=[d])
    graph = gs.Graph(nodes=[n1, n2, n3], inputs=[a], outputs=[d])
    assert peak_live(graph) == 3  # b and c await the Add, which produces d
