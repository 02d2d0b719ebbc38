"""Gate/Up pairing -> fuselm.FusedGateUp with packed weights and the SwiGLU epilogue (step 8).

Matches HF's `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with SiLU written as `Silu`/`Swish`
or as `x * Sigmoid(x)` (what torch exports), or tanh-GELU as ONNX `Gelu(approximate="tanh")`
(GeGLU): two projections of one activation, the gate's output read only by its activation, the
up's only by the product, equal output sizes.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from fuselm.passes.graph import Namer, NoMatch, PassResult, Refused, insert_before, replace_all_uses
from fuselm.passes.pair_qkv import shared_inputs
from fuselm.passes.projections import Projection, pack, projections_of

_SILU_OPS = ("Silu", "Swish", "SiLU")


def _activation_of(g: gs.Tensor) -> tuple[gs.Tensor, str]:
    """(act(g), the FusedGateUp activation) when everything reading g is one SiLU or tanh-GELU."""
    users = list(g.outputs)
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
            attrs: dict[str, object] = {"activation": kind}
            if gate.scales is not None:
                attrs["block_size"] = gate.block_size
            node = gs.Node("FusedGateUp", name=namer("node"), domain="fuselm",
                           inputs=[x, *pack(namer, [gate, up])], outputs=[y], attrs=attrs)
            insert_before(graph, first, node)
            replace_all_uses(graph, out, y)
            result.count += 1
        graph.cleanup(remove_unused_graph_inputs=False)
        return result
