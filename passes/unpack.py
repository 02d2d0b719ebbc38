"""Unpack fused checkpoint projections into one projection per part, for the pairing passes.

Some checkpoints store projections already fused (Phi-3: `qkv_proj` = [Wq; Wk; Wv],
`gate_up_proj` = [Wg; Wu]). A foreign export of such a model computes one MatMul and cuts its
output along the last axis — with Slice nodes (q, k, v) or one Split (gate, up):

    y = x @ W [+ b];  q, k, v = y[..., 0:a], y[..., a:b], y[..., b:N]

This pass rewrites that as one MatMul per part over the matching columns of W (and of b), so
the graph reads like any other family's; RoPE/attention fusion and QKV/Gate-Up pairing then
apply unchanged, and pairing packs the parts back into the very tensor they came from
(passes/weights.py: SlicedValues, whole_of). No weight is read. Only float weights are unpacked;
cuts that do not partition the output exactly (gaps, overlaps, steps) stay as they are.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from fuselm.passes import weights
from fuselm.passes.graph import (
    Namer,
    NoMatch,
    PassResult,
    const,
    const_shape,
    insert_before,
    is_graph_output,
)

_BIG = 2**62  # exporters write "to the end" as INT64_MAX


def _last_axis(axis: int, rank: int) -> bool:
    return axis in (-1, rank - 1)


def _slice_range(node: gs.Node, n: int, rank: int) -> tuple[int, int]:
    vals = [const(t) for t in node.inputs[1:]]
    if len(vals) < 3 or any(v is None or v.size != 1 for v in vals):
        raise NoMatch
    start, stop, axis = (int(v.reshape(-1)[0]) for v in vals[:3])
    if len(vals) > 3 and int(vals[3].reshape(-1)[0]) != 1:
        raise NoMatch
    if not _last_axis(axis, rank):
        raise NoMatch
    start = start + n if start < 0 else start
    stop = n if stop >= _BIG else (stop + n if stop < 0 else stop)
    return max(0, min(start, n)), max(0, min(stop, n))


def _split_ranges(node: gs.Node, n: int, rank: int) -> list[tuple[int, int]]:
    if not _last_axis(int(node.attrs.get("axis", 0)), rank):
        raise NoMatch
    if len(node.inputs) > 1 and node.inputs[1].name:
        sizes = const(node.inputs[1])
        if sizes is None:
            raise NoMatch
        sizes = [int(s) for s in sizes.reshape(-1)]
    else:
        parts = int(node.attrs.get("num_outputs", len(node.outputs)))
        if parts != len(node.outputs) or n % parts:
            raise NoMatch  # uneven num_outputs splits are rare; leave them be
        sizes = [n // parts] * parts
    if len(sizes) != len(node.outputs) or sum(sizes) != n:
        raise NoMatch
    ranges, at = [], 0
    for s in sizes:
        ranges.append((at, at + s))
        at += s
    return ranges


def _cuts(graph: gs.Graph, y: gs.Tensor, n: int, rank: int) -> list[tuple[int, int, gs.Tensor]]:
    """(start, stop, tensor) for every part `y` is cut into, covering [0, n) exactly once."""
    if is_graph_output(graph, y) or not y.outputs:
        raise NoMatch
    cuts: list[tuple[int, int, gs.Tensor]] = []
    for user in y.outputs:
        if user.inputs[0] is not y or any(t is y for t in user.inputs[1:]):
            raise NoMatch
        if user.op == "Slice":
            start, stop = _slice_range(user, n, rank)
            cuts.append((start, stop, user.outputs[0]))
        elif user.op == "Split":
            ranges = _split_ranges(user, n, rank)
            cuts += [(a, b, t) for (a, b), t in zip(ranges, user.outputs, strict=True)]
        else:
            raise NoMatch
    cuts.sort(key=lambda c: (c[0], c[1]))
    at = 0
    for start, stop, _ in cuts:
        if start != at or stop <= start:
            raise NoMatch
        at = stop
    if at != n or len(cuts) < 2:
        raise NoMatch
    return cuts


class UnpackProjections:
    name = "unpack"

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        namer = Namer(graph, "unpack")
        for mm in [n for n in graph.nodes if n.op == "MatMul" and not n.domain]:
            w = mm.inputs[1]
            if not isinstance(w, gs.Constant) or len(w.shape) != 2 or \
                    weights.np_dtype(w).kind in "iub":  # integer codes: a Q4 form, not ours
                continue
            n = int(w.shape[1])
            x, y = mm.inputs[0], mm.outputs[0]
            bias = None
            add = y.outputs[0] if len(y.outputs) == 1 and not is_graph_output(graph, y) else None
            if add is not None and add.op == "Add":
                other = add.inputs[1] if add.inputs[0] is y else add.inputs[0]
                if isinstance(other, gs.Constant) and const_shape(other) == (n,):
                    bias, y = other, add.outputs[0]
            rank = len(x.shape) if x.shape is not None else None
            if rank is None:
                continue
            try:
                cuts = _cuts(graph, y, n, rank)
            except NoMatch:
                continue
            cutters = list(y.outputs)
            new: list[gs.Node] = []
            for start, stop, part in cuts:
                part.inputs.clear()
                wp = self._slice(namer, w, 1, start, stop)
                out = part if bias is None else gs.Variable(namer("y"), dtype=part.dtype)
                new.append(gs.Node("MatMul", name=namer("matmul"), inputs=[x, wp],
                                   outputs=[out]))
                if bias is not None:
                    bp = self._slice(namer, bias, 0, start, stop)
                    new.append(gs.Node("Add", name=namer("bias"), inputs=[out, bp],
                                       outputs=[part]))
            insert_before(graph, mm, *new)
            for node in cutters:
                node.outputs.clear()
            gone = {id(node) for node in cutters}
            graph.nodes = [node for node in graph.nodes if id(node) not in gone]
            result.count += 1
        graph.cleanup(remove_unused_graph_inputs=False)
        return result

    @staticmethod
    def _slice(namer: Namer, c: gs.Constant, axis: int, start: int, stop: int) -> gs.Constant:
        name = namer("weight" if axis == 1 else "bias")
        return weights.Weight(name, weights.SlicedValues(name, weights.source(c), axis, start,
                                                         stop))
