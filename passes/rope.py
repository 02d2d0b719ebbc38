"""RoPE fusion -> fuselm.FusedRoPE, folding a per-head q/k RMSNorm in (Qwen3, Gemma 3).

Matches the two forms exporters emit for HF's `apply_rotary_pos_emb`:

    q_embed = (q * cos) + (rotate_half(q) * sin)      # rotate_half: cat(-x2, x1)

- decomposed: Add(Mul(x, cos), Mul(Concat(Neg(Slice(x, D/2:)), Slice(x, :D/2)), sin));
- ONNX RotaryEmbedding(x, cos, sin) (torch.onnx at opset 23);

with cos/sin = Cos/Sin(cat(freqs, freqs)) [* attention_scale] built from
`freqs = position_ids[..., None].float() * inv_freq` — so FusedRoPE needs no tables, only the
inv_freq values. Each rotation acts on a head view of a 3-D projection; the q and the k rotation
of one layer are the two whose projections read the same activation with the same frequencies.
Also taken: partial rotary (Phi-3: Concat(rotate(x[..., :rd]), x[..., rd:]) -> rotary_dim),
LongRoPE's switch between two inv_freq tables (passes.heads.freqs_of -> long_inv_freq,
long_after), per-layer frequencies (Gemma 3's local base) and a per-head norm either side of
the head transpose (Gemma 3 at opset 23).

The rewrite puts one FusedRoPE on the 3-D projections and re-creates the head views the old
rotations produced, so the graph stays valid; attention fusion then peels those views.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from fuselm.passes.graph import (
    Namer,
    NoMatch,
    PassResult,
    Refused,
    axes_of,
    const,
    const_shape,
    constant,
    insert_before,
    is_graph_output,
    maybe_producer,
    producer,
    replace_all_uses,
    scalar,
    stable_toposort,
    variable,
)
from fuselm.passes.heads import Freqs, HeadView, freqs_of, head_view, width


@dataclass
class Rotation:
    node: gs.Node  # the node producing the rotated tensor
    x4: gs.Tensor
    freqs: gs.Tensor
    scale: float
    interleaved: int
    rotary_dim: int | None = None  # partial rotary: the leading dims rotated; None = all


def _trig(t: gs.Tensor, op: str) -> tuple[gs.Tensor, float]:
    """(angle tensor, attention_scale) for [Cast](Cos(e) [* scale])."""
    node = maybe_producer(t, "Cast")
    t = node.inputs[0] if node is not None else t
    scale = 1.0
    mul = maybe_producer(t, "Mul")
    if mul is not None:
        for a, b in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
            s = scalar(b)
            if s is not None:
                scale, t = s, a
                break
        else:
            raise NoMatch
    return producer(t, op).inputs[0], scale


def _half_angles(e: gs.Tensor) -> gs.Tensor:
    """freqs for emb = Concat(freqs, freqs, axis=-1)."""
    cat = producer(e, "Concat")
    if len(cat.inputs) != 2 or cat.inputs[0] is not cat.inputs[1]:
        raise NoMatch
    return cat.inputs[0]


def _rotate_half_of(t: gs.Tensor) -> tuple[gs.Tensor, int]:
    """(x, half) for Concat(Neg(Slice(x, half:)), Slice(x, :half)) on the last axis."""
    cat = producer(t, "Concat")
    if len(cat.inputs) != 2 or int(cat.attrs.get("axis", 0)) not in (-1, 3):
        raise NoMatch
    neg = producer(cat.inputs[0], "Neg")
    hi, lo = producer(neg.inputs[0], "Slice"), producer(cat.inputs[1], "Slice")
    if hi.inputs[0] is not lo.inputs[0]:
        raise NoMatch

    def bounds(s: gs.Node) -> tuple[int, int]:
        vals = [const(t) for t in s.inputs[1:]]
        if any(v is None for v in vals[:3]):
            raise Refused("rotate-half slice bounds are not static")
        starts, ends, axes = (int(v.reshape(-1)[0]) for v in vals[:3])
        if axes not in (-1, 3) or (len(vals) > 3 and int(vals[3].reshape(-1)[0]) != 1):
            raise Refused("rotate-half slices are not along the last axis with step 1")
        return starts, ends

    (hs, _), (ls, le) = bounds(hi), bounds(lo)
    if ls != 0 or hs != le:
        raise Refused("rotate-half slices do not split the head in two halves")
    return lo.inputs[0], le


def _freq_source(c: gs.Tensor, op: str) -> tuple[gs.Tensor, float]:
    """Peel the [b, 1, s, D] broadcast view of a [b, s, D] cos/sin table."""
    un = maybe_producer(c, "Unsqueeze")
    if un is not None:
        if axes_of(un) != [1]:
            raise NoMatch
        c = un.inputs[0]
    e, scale = _trig(c, op)
    return _half_angles(e), scale


def match_rotation(node: gs.Node) -> Rotation:
    if node.op == "RotaryEmbedding":
        if len(node.inputs) > 3 and node.inputs[3].name:
            raise Refused("RotaryEmbedding indexes a cos/sin table by position_ids")
        if int(node.attrs.get("rotary_embedding_dim", 0)) != 0:
            raise Refused("partial rotary (rotary_embedding_dim) is not fused")
        f, scale = _trig(node.inputs[1], "Cos")
        f_sin, scale_sin = _trig(node.inputs[2], "Sin")
        if f_sin is not f or scale_sin != scale:
            raise Refused("cos and sin come from different angles")
        return Rotation(node, node.inputs[0], f, scale, int(node.attrs.get("interleaved", 0)))
    if node.op != "Add":
        raise NoMatch
    m1, m2 = (producer(t, "Mul") for t in node.inputs)
    for a, b in ((m1, m2), (m2, m1)):
        for r, s in ((b.inputs[0], b.inputs[1]), (b.inputs[1], b.inputs[0])):
            try:
                x4, half = _rotate_half_of(r)
            except NoMatch:
                continue
            if not any(i is x4 for i in a.inputs):
                raise NoMatch
            c = a.inputs[1] if a.inputs[0] is x4 else a.inputs[0]
            f, scale = _freq_source(c, "Cos")
            f_sin, scale_sin = _freq_source(s, "Sin")
            if f_sin is not f or scale_sin != scale:
                raise Refused("cos and sin come from different angles")
            return Rotation(node, x4, f, scale, 0)
    raise NoMatch


def _slice_of(t: gs.Tensor) -> tuple[gs.Tensor, int, int] | None:
    """(x, start, end) for Slice(x, start, end) along the last axis with step 1 and static
    bounds (end as written: INT64_MAX for "to the end")."""
    s = maybe_producer(t, "Slice")
    if s is None:
        return None
    vals = [const(i) for i in s.inputs[1:]]
    if len(vals) < 3 or any(v is None or v.size != 1 for v in vals):
        return None
    start, end, axis = (int(v.reshape(-1)[0]) for v in vals[:3])
    if axis not in (-1, 3) or (len(vals) > 3 and int(vals[3].reshape(-1)[0]) != 1):
        return None
    return s.inputs[0], start, end


def widen_partial(graph: gs.Graph, rot: Rotation) -> Rotation:
    """HF's partial rotary (Phi-3 and kin) rotates the leading `rotary_dim` dims of each head
    and passes the rest through: Concat(rotate(Slice(x, 0:rd)), Slice(x, rd:)) on the last
    axis. Returns the rotation of the whole head with `rotary_dim` set; else `rot` as it was."""
    lead = _slice_of(rot.x4)
    out = rot.node.outputs[0]
    if lead is None or lead[1] != 0 or len(out.outputs) != 1 or is_graph_output(graph, out):
        return rot
    x, _, rd = lead
    cat = out.outputs[0]
    if cat.op != "Concat" or int(cat.attrs.get("axis", 0)) not in (-1, 3) or \
            len(cat.inputs) != 2 or cat.inputs[0] is not out:
        return rot
    rest = _slice_of(cat.inputs[1])
    if rest is None or rest[0] is not x or rest[1] != rd or rest[2] < 2**62 or rd <= 0:
        return rot
    return Rotation(cat, x, rot.freqs, rot.scale, rot.interleaved, rd)


def _source(x3: gs.Tensor) -> gs.Tensor:
    """The activation a projection reads: peel a constant bias Add, then the MatMul."""
    t = x3
    add = maybe_producer(t, "Add")
    if add is not None and any(isinstance(i, gs.Constant) for i in add.inputs):
        t = next(i for i in add.inputs if not isinstance(i, gs.Constant))
    mm = maybe_producer(t, "MatMul")
    return mm.inputs[0] if mm is not None else t


@dataclass
class _Found:
    rot: Rotation
    view: HeadView
    freqs: Freqs


class RoPEFusion:
    name = "rope"

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        namer = Namer(graph, "rope")
        groups: dict[tuple, list[_Found]] = {}
        for node in list(graph.nodes):
            if node.op not in ("Add", "RotaryEmbedding") or node.domain:
                continue
            try:
                rot = widen_partial(graph, match_rotation(node))
                view = head_view(rot.x4)
                freqs = freqs_of(rot.freqs)
            except NoMatch:
                continue
            except Refused as e:
                result.refuse(node, str(e))
                continue
            key = (id(_source(view.x3)), id(freqs.position_ids), freqs.key())
            groups.setdefault(key, []).append(_Found(rot, view, freqs))
        for found in groups.values():
            try:
                self._rewrite(graph, namer, found)
                result.count += 1
            except Refused as e:
                for f in found:
                    result.refuse(f.rot.node, str(e))
        graph.cleanup(remove_unused_graph_inputs=False)
        stable_toposort(graph)
        return result

    def _rewrite(self, graph: gs.Graph, namer: Namer, found: list[_Found]) -> None:
        if len(found) != 2:
            raise Refused(f"{len(found)} rotations read one activation; expected q and k")
        q, k = found
        if (width(k.view.x3) or 0) > (width(q.view.x3) or 0):
            q, k = k, q  # q has at least as many heads as k (GQA)
        d = q.view.head_dim
        if k.view.head_dim != d:
            raise Refused(f"q and k head sizes differ ({d} vs {k.view.head_dim})")
        rd = q.rot.rotary_dim or d
        if (k.rot.rotary_dim or d) != rd or rd > d:
            raise Refused("q and k rotate different numbers of dims")
        if q.freqs.inv_freq.size * 2 != rd:
            raise Refused(f"{q.freqs.inv_freq.size} frequencies for {rd} rotated dims")
        if (q.rot.scale, q.rot.interleaved) != (k.rot.scale, k.rot.interleaved):
            raise Refused("q and k rotate with different scale or layout")
        eps = {float(f.view.norm.attrs.get("epsilon", 1e-5)) for f in found if f.view.norm}
        if len(eps) > 1:
            raise Refused("q and k norms use different epsilons")
        for f in found:
            if f.view.norm is not None:
                if const_shape(f.view.norm.inputs[1]) != (d,):  # shape only: no weight read
                    raise Refused("per-head norm weight is not a constant [head_dim]")
        norms = [f.view.norm.inputs[1] if f.view.norm else gs.Variable.empty() for f in (q, k)]
        inputs = [q.view.x3, k.view.x3, q.freqs.position_ids]
        if any(n.name for n in norms):
            inputs += norms
        outs = [variable(namer, n, f.view.x3.dtype, f.view.x3.shape)
                for n, f in (("q_rot", q), ("k_rot", k))]
        attrs = {
            "head_dim": d,
            "rotary_dim": rd,
            "inv_freq": [float(v) for v in q.freqs.inv_freq],
            "attention_scale": float(q.rot.scale),
            "interleaved": int(q.rot.interleaved),
            "norm_eps": eps.pop() if eps else 1e-6,
        }
        if q.freqs.long_inv_freq is not None:
            attrs["long_inv_freq"] = [float(v) for v in q.freqs.long_inv_freq]
            attrs["long_after"] = q.freqs.long_after
        order = {id(n): i for i, n in enumerate(graph.nodes)}
        anchor = min((f.rot.node for f in found), key=lambda n: order[id(n)])
        fused = gs.Node("FusedRoPE", name=namer("node"), domain="fuselm", inputs=inputs,
                        outputs=outs, attrs=attrs)
        new_nodes = [fused]
        shape = constant(namer, "heads_shape", np.array([0, 0, -1, d], np.int64))
        for f, out in zip((q, k), outs, strict=True):
            r = gs.Node("Reshape", name=namer("reshape"), inputs=[out, shape],
                        outputs=[variable(namer, "heads", out.dtype)])
            t = gs.Node("Transpose", name=namer("transpose"), inputs=[r.outputs[0]],
                        outputs=[variable(namer, "view", out.dtype)], attrs={"perm": [0, 2, 1, 3]})
            new_nodes += [r, t]
            replace_all_uses(graph, f.rot.node.outputs[0], t.outputs[0])
        insert_before(graph, anchor, *new_nodes)
