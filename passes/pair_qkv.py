"""QKV pairing -> fuselm.FusedQKV with packed weights (seed step 9).

Exactly three projections read one activation and feed one attention as its q, k and v:
through FusedRoPE (q -> input 0, k -> input 1) and Attention (v -> input 2), or straight into
Attention for models without RoPE. The roles come from where the outputs go, never from names.
Everything else is refused with its reason: four projections, K and V of different sizes, Q
smaller than K, mismatched reduction sizes or weight formats, an output larger than 16384.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from fuselm.passes import ops
from fuselm.passes.graph import (
    Namer,
    PassResult,
    Refused,
    insert_before,
    replace_all_uses,
    variable,
)
from fuselm.passes.projections import Projection, pack, projections_of

MAX_OUTPUT = 16384
_ROLES = {("FusedRoPE", 0): "q", ("FusedRoPE", 1): "k",
          ("Attention", 0): "q", ("Attention", 1): "k", ("Attention", 2): "v"}


def _role(p: Projection) -> str | None:
    roles = {_ROLES.get((u.op, i)) for u in p.out.outputs for i, t in enumerate(u.inputs)
             if t is p.out and u.op in ("FusedRoPE", "Attention")}
    roles.discard(None)
    return roles.pop() if len(roles) == 1 else None


def shared_inputs(graph: gs.Graph) -> list[gs.Tensor]:
    """Tensors read by at least two projections, in stored order (deterministic)."""
    seen: dict[int, gs.Tensor] = {}
    for t in graph.inputs:
        seen.setdefault(id(t), t)
    for node in graph.nodes:
        for t in node.outputs:
            seen.setdefault(id(t), t)
    return [t for t in seen.values()
            if sum(1 for u in t.outputs if u.op == "MatMul" and u.inputs[0] is t) >= 2]


def check_qkv(projs: list[Projection]) -> dict[str, Projection]:
    if len(projs) != 3:
        raise Refused(f"{len(projs)} projections share one input; QKV pairing needs exactly 3")
    roles: dict[str, Projection] = {}
    for p in projs:
        role = _role(p)
        if role is None or role in roles:
            raise Refused("the projections are not the q, k and v of one attention "
                          f"(an output goes to {sorted({u.op for u in p.out.outputs})})")
        roles[role] = p
    if set(roles) != {"q", "k", "v"}:
        raise Refused("the projections are not the q, k and v of one attention")
    q, k, v = roles["q"], roles["k"], roles["v"]
    if len({p.k for p in projs}) != 1:
        raise Refused(f"reduction sizes differ: {[p.k for p in (q, k, v)]}")
    if len({p.kind for p in projs}) != 1:
        raise Refused("weights differ in format (dtype, quantization or block size)")
    if k.n != v.n:
        raise Refused(f"K and V output sizes differ ({k.n} vs {v.n})")
    if q.n < k.n:
        raise Refused(f"Q output ({q.n}) is smaller than K's ({k.n})")
    if max(p.n for p in projs) > MAX_OUTPUT:
        raise Refused(f"an output is larger than {MAX_OUTPUT}")
    return roles


class QKVPairing:
    name = "qkv"

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        namer = Namer(graph, "qkv")
        for x in shared_inputs(graph):
            projs = projections_of(graph, x)
            if len(projs) < 3:
                continue  # a pair is Gate/Up's business
            try:
                roles = check_qkv(projs)
            except Refused as e:
                result.refuse(projs[0].matmul, str(e))
                continue
            order = {id(n): i for i, n in enumerate(graph.nodes)}
            first = min((n for p in projs for n in p.nodes), key=lambda n: order[id(n)])
            q, k, v = roles["q"], roles["k"], roles["v"]
            attrs = ops.qkv_attributes(q.n, k.n, v.n,
                                       q.block_size if q.scales is not None else None)
            outs = [variable(namer, r, p.out.dtype, p.out.shape)
                    for r, p in (("q", q), ("k", k), ("v", v))]
            node = gs.Node("FusedQKV", name=namer("node"), domain="fuselm",
                           inputs=[x, *pack(namer, [q, k, v])], outputs=outs, attrs=attrs)
            insert_before(graph, first, node)  # the paired op takes the place of the first
            for p, out in zip((q, k, v), outs, strict=True):
                replace_all_uses(graph, p.out, out)
            result.count += 1
        graph.cleanup(remove_unused_graph_inputs=False)
        return result
