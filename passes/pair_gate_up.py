"""Gate/Up pairing -> fuselm.FusedGateUp with packed weights and the SwiGLU epilogue (step 8).

Matches HF's `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with SiLU written as `Silu`/`Swish`
or as `x * Sigmoid(x)` (what torch exports), or tanh-GELU as ONNX `Gelu(approximate="tanh")`
or its decomposition below opset 20 (GeGLU): two projections of one activation, the gate's
output read only by its activation, the up's only by the product, equal output sizes.
"""

from __future__ import annotations

import math

import onnx_graphsurgeon as gs

from fuselm.passes import ops
from fuselm.passes.graph import (
    Namer,
    NoMatch,
    PassResult,
    Refused,
    insert_before,
    replace_all_uses,
    scalar,
)
from fuselm.passes.pair_qkv import shared_inputs
from fuselm.passes.projections import Projection, pack, projections_of

_SILU_OPS = ("Silu", "Swish", "SiLU")


def _only_user(t: gs.Tensor, op: str) -> gs.Node:
    if len(t.outputs) != 1 or t.outputs[0].op != op:
        raise NoMatch
    return t.outputs[0]


def _with_scalar(node: gs.Node, t: gs.Tensor, value: float) -> bool:
    """`node` is binary over `t` and a scalar constant equal to `value` (float32 rounding)."""
    other = node.inputs[1] if node.inputs[0] is t else node.inputs[0]
    s = scalar(other)
    return any(i is t for i in node.inputs) and s is not None and \
        math.isclose(s, value, rel_tol=1e-6)


def _decomposed_gelu_tanh(g: gs.Tensor) -> gs.Tensor:
    """g * (0.5 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 * g**3)))) as exporters below opset 20
    write GELU(approximate="tanh") (no Gelu op there); the three readers of g are its Pow, Add
    and the final Mul, every step in between read once."""
    users = list(g.outputs)
    pow_ = next((u for u in users if u.op == "Pow"), None)
    if len(users) != 3 or pow_ is None or pow_.inputs[0] is not g or \
            scalar(pow_.inputs[1]) != 3.0:
        raise NoMatch
    cube = _only_user(pow_.outputs[0], "Mul")
    inner = _only_user(cube.outputs[0], "Add")
    scaled = _only_user(inner.outputs[0], "Mul")
    tanh = _only_user(scaled.outputs[0], "Tanh")
    one_plus = _only_user(tanh.outputs[0], "Add")
    half = _only_user(one_plus.outputs[0], "Mul")
    out = _only_user(half.outputs[0], "Mul")
    if not (_with_scalar(cube, pow_.outputs[0], 0.044715) and any(i is g for i in inner.inputs)
            and _with_scalar(scaled, inner.outputs[0], math.sqrt(2 / math.pi))
            and _with_scalar(one_plus, tanh.outputs[0], 1.0)
            and _with_scalar(half, one_plus.outputs[0], 0.5)
            and {id(i) for i in out.inputs} == {id(g), id(half.outputs[0])}
            and {id(u) for u in users} == {id(pow_), id(inner), id(out)}):
        raise NoMatch
    return out.outputs[0]


def _activation_of(g: gs.Tensor) -> tuple[gs.Tensor, str]:
    """(act(g), the FusedGateUp activation) when everything reading g is one SiLU or tanh-GELU."""
    users = list(g.outputs)
    if len(users) == 3:
        return _decomposed_gelu_tanh(g), "gelu_tanh"
    if len(users) == 1 and users[0].op in _SILU_OPS:
        return users[0].outputs[0], "silu"
    if len(users) == 1 and users[0].op == "Gelu":
        if users[0].attrs.get("approximate", "none") != "tanh":
            raise NoMatch
        return users[0].outputs[0], "gelu_tanh"
    if len(users) != 2:
        raise NoMatch
    sig = next((u for u in users if u.op == "Sigmoid"), None)
    mul = next((u for u in users if u.op == "Mul"), None)
    if sig is None or mul is None or len(sig.outputs[0].outputs) != 1:
        raise NoMatch
    ins = list(mul.inputs)
    if not (any(t is g for t in ins) and any(t is sig.outputs[0] for t in ins)):
        raise NoMatch
    return mul.outputs[0], "silu"


def match_gate_up(
    graph: gs.Graph, projs: list[Projection]
) -> tuple[Projection, Projection, gs.Node, str]:
    for gate, up in ((projs[0], projs[1]), (projs[1], projs[0])):
        try:
            act, kind = _activation_of(gate.out)
        except NoMatch:
            continue
        if len(act.outputs) != 1:
            raise Refused("the gate activation is also read elsewhere")
        prod = act.outputs[0]
        if prod.op != "Mul" or not any(t is up.out for t in prod.inputs):
            raise NoMatch
        if len(up.out.outputs) != 1:
            raise Refused("the up projection is also read elsewhere")
        if gate.n != up.n:
            raise Refused(f"gate and up output sizes differ ({gate.n} vs {up.n})")
        if gate.k != up.k or gate.kind != up.kind:
            raise Refused("gate and up weights differ in shape or format")
        return gate, up, prod, kind
    raise NoMatch


class GateUpPairing:
    name = "gate_up"

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        namer = Namer(graph, "gate_up")
        for x in shared_inputs(graph):
            projs = projections_of(graph, x)
            if len(projs) != 2:
                continue
            try:
                gate, up, prod, kind = match_gate_up(graph, projs)
            except NoMatch:
                continue
            except Refused as e:
                result.refuse(projs[0].matmul, str(e))
                continue
            order = {id(n): i for i, n in enumerate(graph.nodes)}
            first = min((n for p in projs for n in p.nodes), key=lambda n: order[id(n)])
            out = prod.outputs[0]
            y = gs.Variable(namer("y"), dtype=out.dtype, shape=out.shape)
            attrs = ops.gate_up_attributes(kind,
                                           gate.block_size if gate.scales is not None else None)
            node = gs.Node("FusedGateUp", name=namer("node"), domain="fuselm",
                           inputs=[x, *pack(namer, [gate, up])], outputs=[y], attrs=attrs)
            insert_before(graph, first, node)
            replace_all_uses(graph, out, y)
            result.count += 1
        graph.cleanup(remove_unused_graph_inputs=False)
        return result
