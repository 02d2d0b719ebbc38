"""reorderQKVProjections (seed step 9): each layer's Q, K and V projections adjacent.

In stored order the three projections of one activation (with their bias Adds and any
DequantizeLinear) move to right after the node producing that activation, so a runtime walking
the stored order issues them back to back and QKV pairing can put the fused op in their place.
Moving them earlier is always valid: they read only that activation and constants.
Reported: the peak number of live intermediate tensors over the stored order, before -> after.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from fuselm.passes.graph import PassResult, is_graph_output
from fuselm.passes.pair_qkv import shared_inputs
from fuselm.passes.projections import projections_of


def peak_live(graph: gs.Graph) -> int:
    """Max over the stored order of tensors produced and still awaiting a consumer (or output)."""
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    end = len(graph.nodes)
    events = [0] * (end + 2)
    for i, node in enumerate(graph.nodes):
        for t in node.outputs:
            last = end if is_graph_output(graph, t) else max(
                (index.get(id(u), i) for u in t.outputs), default=i)
            events[i] += 1
            events[last + 1] -= 1
    peak = live = 0
    for e in events:
        live += e
        peak = max(peak, live)
    return peak


class ReorderQKVProjections:
    name = "reorder_qkv"

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        before = peak_live(graph)
        for x in shared_inputs(graph):
            projs = projections_of(graph, x)
            if len(projs) != 3:
                continue
            group = [n for p in projs for n in p.nodes]
            ids = {id(n) for n in group}
            rest = [n for n in graph.nodes if id(n) not in ids]
            at = 0
            if x.inputs:
                at = next(i for i, n in enumerate(rest) if n is x.inputs[0]) + 1
            new = rest[:at] + group + rest[at:]
            if all(a is b for a, b in zip(new, graph.nodes, strict=True)):
                continue
            old, current = graph.nodes, peak_live(graph)
            graph.nodes = new
            if peak_live(graph) > current:  # adjacency must not cost memory
                graph.nodes = old
                result.refuse(projs[0].matmul, "moving would raise the peak of live tensors")
                continue
            result.count += 1
        result.extra["peak_live_before"] = before
        result.extra["peak_live_after"] = peak_live(graph)
        return result
