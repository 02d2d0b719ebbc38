"""Two ONNX graphs compared node for node, names aside: each node's op, domain, attributes and
inputs, an input being a graph input (by name), a parameter (by name: both exporters name
them after the clean decoder's parameters), a small constant (by dtype, shape and value), or
the output of an earlier node (by that node's index and output slot)."""

from __future__ import annotations

from typing import Any

import onnx
from onnx import helper, numpy_helper


def canonical(model: onnx.ModelProto, params: set[str] | None = None) -> list[tuple[Any, ...]]:
    """The graph as comparable tuples, one per node, in stored order. `params`: the
    initializer names compared by name (default: those with no inline value)."""
    inits = {t.name: t for t in model.graph.initializer}
    if params is None:
        params = {name for name, t in inits.items() if not t.raw_data}
    produced: dict[str, tuple[int, int]] = {}
    graph_inputs = {v.name for v in model.graph.input}
    out = []
    for index, node in enumerate(model.graph.node):
        ins: list[Any] = []
        for name in node.input:
            if not name:
                ins.append(None)
            elif name in produced:
                ins.append(("node", *produced[name]))
            elif name in graph_inputs:
                ins.append(("input", name))
            elif name in params:
                ins.append(("param", name))
            else:
                a = numpy_helper.to_array(inits[name])
                ins.append(("const", a.dtype.str, a.shape, a.tobytes()))
        attrs = sorted((a.name, repr(helper.get_attribute_value(a))) for a in node.attribute)
        outs = [o if o in {v.name for v in model.graph.output} else bool(o)
                for o in node.output]
        out.append((node.op_type, node.domain, attrs, ins, outs))
        for slot, name in enumerate(node.output):
            produced[name] = (index, slot)
    return out


def params(model: onnx.ModelProto) -> list[tuple[str, int, list[int]]]:
    """Every decoder parameter's initializer (name, type, dims), in stored order."""
    return [(t.name, t.data_type, list(t.dims)) for t in model.graph.initializer
            if not t.name.startswith(("val_", "const_", "scalar_tensor"))]
