"""Cleanup: dead nodes and unused initializers/functions out, stable topological order.

Runs last (after quantization, too). Unused fuselm functions and the fuselm opset are
dropped (and the needed bodies attached) when the graph is written, by `model_io.to_model`.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from fuselm.passes.graph import PassResult, stable_toposort


def _used_functions(graph: gs.Graph) -> set[tuple[str, str]]:
    return {(n.domain or "", n.op) for n in graph.nodes}


class Cleanup:
    name = "cleanup"

    def run(self, graph: gs.Graph) -> PassResult:
        before = len(graph.nodes)
        graph.cleanup(remove_unused_graph_inputs=False, recurse_functions=False)
        used = _used_functions(graph)
        kept = [f for f in graph.functions if (f.domain or "", f.name) in used]
        dropped = len(graph.functions) - len(kept)
        graph.functions = kept
        stable_toposort(graph)
        return PassResult(count=before - len(graph.nodes) + dropped)
