"""Attention fusion -> ONNX Attention (opset 23) on 3-D q/k/v, GQA without repeat_kv.

Matches HF's `eager_attention_forward` / SDPA as exporters write them, on head views
(see passes.heads) of the 3-D projections:

    key_states, value_states = past_key_value.update(k, v)        # Concat(past, k, axis=-2)
    key_states = repeat_kv(key_states, n_rep)                      # Unsqueeze->Expand->Reshape
    attn = softmax(q @ key_states.T * scaling + causal_mask) @ value_states

- decomposed: MatMul(q*s1, kT*s2) [*s | /s] [cap*tanh(./cap)] [+ mask] -> Softmax
  [-> Where(IsNaN, 0, .)] -> MatMul; the soft-cap becomes Attention's `softcap`; kT as
  Transpose(0,1,3,2) or the Reshape/Transpose(0,2,1)/Reshape trick; a bool mask turned
  additive by Where(mask, 0, -big) is handed to Attention as the bool it was;
- ONNX Attention on 4-D q/k/v (torch.onnx at opset 23) with the repeat_kv and the KV concat
  outside it.

The output's Transpose(0,2,1,3) + Reshape back to [b, s, H*D] is absorbed; the KV concat
becomes Attention's past/present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from fuselm.passes.graph import (
    Namer,
    NoMatch,
    PassResult,
    Refused,
    axes_of,
    const,
    insert_before,
    is_graph_output,
    maybe_producer,
    only_consumer,
    producer,
    replace_all_uses,
    scalar,
    stable_toposort,
    variable,
)
from fuselm.passes.heads import head_view, width


@dataclass
class Core:
    anchor: gs.Node
    q4: gs.Tensor
    k4: gs.Tensor
    v4: gs.Tensor
    y4: gs.Tensor
    mask: gs.Tensor | None
    scale: float | None  # None: Attention's default 1/sqrt(D)
    is_causal: int = 0
    softcap: float = 0.0  # 0: none; else scores -> cap * tanh(scores / cap) before the mask


def _peel_scale(t: gs.Tensor) -> tuple[gs.Tensor, float]:
    """(x, s) for x * s, s * x or x / (1/s) with a scalar constant s; else (t, 1)."""
    node = maybe_producer(t, ("Mul", "Div"))
    if node is None:
        return t, 1.0
    if node.op == "Div":
        s = scalar(node.inputs[1])
        return (node.inputs[0], 1.0 / s) if s else (t, 1.0)
    for a, b in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        s = scalar(b)
        if s is not None:
            return a, s
    return t, 1.0


def _peel_softcap(t: gs.Tensor) -> tuple[gs.Tensor, float]:
    """(x, cap) for cap * tanh(x / cap) (Gemma 2's attention soft-capping, as exporters write
    it: Mul(Tanh(Div(x, cap) | Mul(x, 1/cap)), cap)); else (t, 0)."""
    mul = maybe_producer(t, "Mul")
    if mul is None:
        return t, 0.0
    for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        cap, tanh = scalar(b), maybe_producer(a, "Tanh")
        if cap is None or cap <= 0 or tanh is None:
            continue
        x, inv = _peel_scale(tanh.inputs[0])
        if x is not tanh.inputs[0] and math.isclose(inv * cap, 1.0, rel_tol=1e-6):
            return x, cap
    return t, 0.0


def _untranspose_k(kt: gs.Tensor) -> gs.Tensor:
    """k [b, h, t, D] from kT [b, h, D, t]."""
    tr = maybe_producer(kt, "Transpose")
    if tr is not None and list(tr.attrs.get("perm", [])) == [0, 1, 3, 2]:
        return tr.inputs[0]
    # Reshape(Transpose(Reshape(k, [-1, t, D]), (0, 2, 1)), [b, h, D, t]) (torch.onnx decomposition)
    r2 = producer(kt, "Reshape")
    tr = producer(r2.inputs[0], "Transpose")
    if list(tr.attrs.get("perm", [])) != [0, 2, 1]:
        raise NoMatch
    return producer(tr.inputs[0], "Reshape").inputs[0]


def _bool_mask(m: gs.Tensor) -> gs.Tensor:
    """The bool mask behind Where(mask, 0, -big); a float additive mask passes as it is."""
    w = maybe_producer(m, "Where")
    if w is not None:
        zero, big = scalar(w.inputs[1]), scalar(w.inputs[2])
        if zero == 0.0 and big is not None and big <= -1e4:
            return w.inputs[0]
    return m


def _decomposed_core(graph: gs.Graph, sm: gs.Node) -> Core:
    if int(sm.attrs.get("axis", -1)) not in (-1, 3):
        raise NoMatch
    probs = sm.outputs[0]
    users = list(probs.outputs)
    isnan = next((u for u in users if u.op == "IsNaN"), None)
    if isnan is not None:  # Where(IsNaN(p), 0, p): fully masked rows -> 0
        where = only_consumer(isnan.outputs[0], graph)
        if where.op != "Where" or where.inputs[2] is not probs or scalar(where.inputs[1]) != 0.0:
            raise NoMatch
        probs = where.outputs[0]
    pv = only_consumer(probs, graph)
    if pv.op != "MatMul" or pv.inputs[0] is not probs:
        raise NoMatch
    scores = sm.inputs[0]
    mask = None
    add = maybe_producer(scores, "Add")
    if add is not None:
        for s, m in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            inner, _ = _peel_scale(_peel_softcap(s)[0])
            if maybe_producer(inner, "MatMul") is not None:
                scores, mask = s, _bool_mask(m)
                break
        else:
            raise NoMatch
    scores, cap = _peel_softcap(scores)
    scores, s0 = _peel_scale(scores)
    qk = producer(scores, "MatMul")
    q4, s1 = _peel_scale(qk.inputs[0])
    kt, s2 = _peel_scale(qk.inputs[1])
    return Core(sm, q4, _untranspose_k(kt), pv.inputs[1], pv.outputs[0], mask, s0 * s1 * s2,
                softcap=cap)


def _op_core(node: gs.Node) -> Core:
    if len(node.inputs) > 4 and any(t.name for t in node.inputs[4:]):
        raise NoMatch  # already carries its own cache: a 3-D Attention we wrote, or foreign
    if int(node.attrs.get("qk_matmul_output_mode", 0)) != 0 or len(node.outputs) > 1:
        raise Refused("Attention exposes intermediate outputs")
    mask = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3].name else None
    scale = node.attrs.get("scale")
    return Core(node, node.inputs[0], node.inputs[1], node.inputs[2], node.outputs[0], mask,
                None if scale is None else float(scale), int(node.attrs.get("is_causal", 0)),
                float(node.attrs.get("softcap", 0.0)))


def _peel_repeat_kv(t: gs.Tensor) -> gs.Tensor:
    """x for Reshape(Expand(Unsqueeze(x, 2), [b, kv, n_rep, t, D]), [b, kv*n_rep, t, D])."""
    r = maybe_producer(t, "Reshape")
    if r is None:
        return t
    ex = maybe_producer(r.inputs[0], "Expand")
    un = maybe_producer(ex.inputs[0], "Unsqueeze") if ex is not None else None
    if un is None or axes_of(un) != [2]:
        return t
    return un.inputs[0]


def _peel_cache(t: gs.Tensor) -> tuple[gs.Tensor, gs.Tensor | None, gs.Tensor | None]:
    """(current, past, present) for present = Concat(past, current, axis=2)."""
    cat = maybe_producer(t, "Concat")
    if cat is None or len(cat.inputs) != 2 or int(cat.attrs.get("axis", 0)) not in (2, -2):
        return t, None, None
    # Other readers of the concat are safe: they get Attention's present output, the same value.
    return cat.inputs[1], cat.inputs[0], cat.outputs[0]


def _real_consumer(graph: gs.Graph, t: gs.Tensor) -> gs.Node:
    """The one consumer of `t` besides Shape ops (which only size later reshapes)."""
    users = [u for u in t.outputs if u.op != "Shape"]
    if len(users) != 1 or is_graph_output(graph, t):
        raise NoMatch
    return users[0]


def _rank4_view(node: gs.Node, d: int) -> bool:
    """A Reshape to [b, H, s, D] of a tensor already [b, H, s, D]: every static entry is
    0 / -1 or the head size last (the dynamic ones are the input's own dims)."""
    target = node.inputs[1]
    v = const(target)
    if v is not None:
        vals = [int(x) for x in v.reshape(-1)]
    else:
        cat = maybe_producer(target, "Concat")
        if cat is None:
            return False
        vals = []
        for t in cat.inputs:
            c = const(t)
            vals.append(int(c.reshape(-1)[0]) if c is not None and c.size == 1 else None)
    if len(vals) != 4 or vals[-1] not in (d, None, -1):
        return False
    return all(x in (None, 0, -1) for x in vals[:3])


class AttentionFusion:
    name = "attention"

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        namer = Namer(graph, "attention")
        for node in list(graph.nodes):
            try:
                if node.op == "Softmax" and not node.domain:
                    core = _decomposed_core(graph, node)
                elif node.op == "Attention" and not node.domain:
                    core = _op_core(node)
                else:
                    continue
                self._rewrite(graph, namer, core)
                result.count += 1
            except NoMatch:
                continue
            except Refused as e:
                result.refuse(node, str(e))
        graph.cleanup(remove_unused_graph_inputs=False)
        stable_toposort(graph)
        return result

    def _rewrite(self, graph: gs.Graph, namer: Namer, core: Core) -> None:
        q = head_view(core.q4)
        k_cur, past_k, present_k = _peel_cache(_peel_repeat_kv(core.k4))
        v_cur, past_v, present_v = _peel_cache(_peel_repeat_kv(core.v4))
        k, v = head_view(k_cur), head_view(v_cur)
        if any(h.norm is not None for h in (q, k, v)):
            raise Refused("a per-head norm is left between projection and attention "
                          "(RoPE fusion did not take it)")
        if (past_k is None) != (past_v is None):
            raise Refused("only one of K and V has a cache concat")
        if core.is_causal and past_k is not None:
            # torch aligns is_causal top-left, ONNX Attention with a past bottom-right
            raise Refused("is_causal over keys that include a past: alignment is ambiguous")
        d = q.head_dim
        if k.head_dim != d or v.head_dim != d:
            raise Refused("q, k and v head sizes differ")
        wq, wk, wv = width(q.x3), width(k.x3), width(v.x3)
        if None in (wq, wk, wv):
            raise Refused("projection widths are not static")
        if wq % d or wk % d or wk != wv or (wq // d) % (wk // d):
            raise Refused(f"heads do not group: q {wq}, k {wk}, v {wv}, head_dim {d}")
        # the output's head view back to [b, s, H*D]
        tr = _real_consumer(graph, core.y4)
        if tr.op == "Reshape" and _rank4_view(tr, d):  # TorchScript re-states [b, H, s, D]
            tr = _real_consumer(graph, tr.outputs[0])
        if tr.op != "Transpose" or list(tr.attrs.get("perm", [])) != [0, 2, 1, 3]:
            raise NoMatch
        rs = _real_consumer(graph, tr.outputs[0])
        shape = const(rs.inputs[1])
        cat = maybe_producer(rs.inputs[1], "Concat")
        rank = shape.size if shape is not None else (len(cat.inputs) if cat else None)
        if rs.op != "Reshape" or rank != 3:
            raise NoMatch
        y3 = rs.outputs[0]
        attrs: dict[str, object] = {
            "q_num_heads": wq // d,
            "kv_num_heads": wk // d,
            "scale": float(core.scale if core.scale is not None else 1.0 / math.sqrt(d)),
            "is_causal": core.is_causal,
        }
        if core.softcap:
            attrs["softcap"] = float(core.softcap)
        empty = gs.Variable.empty
        inputs = [q.x3, k.x3, v.x3, core.mask if core.mask is not None else empty()]
        outputs = [variable(namer, "y", y3.dtype, y3.shape)]
        if past_k is not None:
            inputs += [past_k, past_v]
            outputs += [variable(namer, "present_key", present_k.dtype, present_k.shape),
                        variable(namer, "present_value", present_v.dtype, present_v.shape)]
        while inputs and not inputs[-1].name:
            inputs.pop()
        node = gs.Node("Attention", name=namer("node"), inputs=inputs, outputs=outputs,
                       attrs=attrs)
        insert_before(graph, rs, node)
        replace_all_uses(graph, y3, outputs[0])
        if past_k is not None:
            replace_all_uses(graph, present_k, outputs[1])
            replace_all_uses(graph, present_v, outputs[2])
