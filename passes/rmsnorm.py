"""RMSNorm fusion -> ONNX RMSNormalization (opset 23).

Matches what exporters make of HF's `LlamaRMSNorm.forward`:

    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)

i.e. [Cast] -> Pow(x, 2) | Mul(x, x) -> ReduceMean(-1) -> Add(eps) -> Sqrt ->
(Reciprocal | Div(1, .)) -> Mul(x, .)  (or Div(x, Sqrt)) -> [Cast] -> Mul(weight, .).
The same pattern covers Qwen3's per-head q/k norms (over head_dim, on [b, s, heads, D]).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from fuselm.passes.graph import (
    Namer,
    NoMatch,
    PassResult,
    Refused,
    axes_of,
    const_shape,
    insert_before,
    maybe_producer,
    only_consumer,
    other_input,
    replace_all_uses,
    scalar,
    tensor_type,
    variable,
)


def _squared_input(node: gs.Node) -> gs.Tensor:
    """x for Pow(x, 2) or Mul(x, x)."""
    if node.op == "Pow" and scalar(node.inputs[1]) == 2.0:
        return node.inputs[0]
    if node.op == "Mul" and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    raise NoMatch


def _match(graph: gs.Graph, mean: gs.Node) -> tuple[gs.Tensor, float, gs.Node, gs.Tensor | None]:
    """(x, eps, last node, weight) for one RMSNorm anchored at its ReduceMean."""
    sq = maybe_producer(mean.inputs[0], ("Pow", "Mul"))
    if sq is None:
        raise NoMatch
    x = _squared_input(sq)
    add = only_consumer(mean.outputs[0], graph)
    if add.op != "Add":
        raise NoMatch
    eps = scalar(other_input(add, mean.outputs[0]))
    if eps is None:
        raise NoMatch
    sqrt = only_consumer(add.outputs[0], graph)
    if sqrt.op != "Sqrt":
        raise NoMatch
    nxt = only_consumer(sqrt.outputs[0], graph)
    if nxt.op == "Div" and nxt.inputs[0] is x:  # x / sqrt(.)
        normed = nxt
    else:
        if nxt.op == "Reciprocal":
            inv = nxt
        elif nxt.op == "Div" and scalar(nxt.inputs[0]) == 1.0:
            inv = nxt
        else:
            raise NoMatch
        normed = only_consumer(inv.outputs[0], graph)
        if normed.op != "Mul" or other_input(normed, inv.outputs[0]) is not x:
            raise NoMatch
    axes = axes_of(mean)
    rank = len(x.shape) if x.shape is not None else None
    last = axes in ([-1],) or (rank is not None and axes == [rank - 1])
    if not last or int(mean.attrs.get("keepdims", 1)) != 1:
        raise Refused(f"ReduceMean over axes {axes}, not the last axis alone")
    out_node = normed
    cast = None
    nxt = only_consumer(out_node.outputs[0], graph) if len(out_node.outputs[0].outputs) == 1 \
        else None
    if nxt is not None and nxt.op == "Cast":
        cast, nxt = nxt, (only_consumer(nxt.outputs[0], graph)
                          if len(nxt.outputs[0].outputs) == 1 else None)
    weight = None
    if nxt is not None and nxt.op == "Mul":
        src = (cast or out_node).outputs[0]
        w = other_input(nxt, src)
        ws = const_shape(w)  # the shape decides; the weight's values stay unread
        if ws is not None and len(ws) == 1 and x.shape is not None and \
                isinstance(x.shape[-1], int) and ws[0] == x.shape[-1]:
            weight, out_node = w, nxt
    if weight is None and cast is not None:
        out_node = cast
    return x, eps, out_node, weight


class RMSNormFusion:
    name = "rmsnorm"

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        namer = Namer(graph, "rmsnorm")
        for mean in [n for n in graph.nodes if n.op == "ReduceMean"]:
            try:
                x, eps, last, weight = _match(graph, mean)
            except NoMatch:
                continue
            except Refused as e:
                result.refuse(mean, str(e))
                continue
            if weight is None:
                dim = x.shape[-1] if x.shape is not None else None
                if not isinstance(dim, int):
                    result.refuse(mean, "no scale weight and the normalized size is not static")
                    continue
                x_type = tensor_type(x)
                dtype = helper.tensor_dtype_to_np_dtype(x_type) if x_type else np.float32
                weight = gs.Constant(namer("ones"), np.ones(dim, dtype))
            # Any Cast before the squares is a float32 upcast that RMSNormalization does itself
            # (stash_type=1); the output dtype follows the weight, as in HF.
            src = x
            up = maybe_producer(x, "Cast")
            if up is not None and up.attrs.get("to") == onnx.TensorProto.FLOAT:
                src = up.inputs[0]
            out = last.outputs[0]
            new = variable(namer, "y", out.dtype, out.shape)
            node = gs.Node("RMSNormalization", name=namer("node"), inputs=[src, weight],
                           outputs=[new], attrs={"axis": -1, "epsilon": float(eps),
                                                 "stash_type": 1})
            insert_before(graph, last, node)
            out_type, weight_type = tensor_type(out), tensor_type(weight)
            if None not in (out_type, weight_type, src.dtype) and weight_type != out_type:
                # weight and output dtypes differ: keep the exporter's final cast
                cast = gs.Node("Cast", name=namer("cast"), inputs=[new],
                               outputs=[variable(namer, "yc", out.dtype, out.shape)],
                               attrs={"to": out_type})
                insert_before(graph, last, cast)
                new = cast.outputs[0]
            replace_all_uses(graph, out, new)
            result.count += 1
        graph.cleanup(remove_unused_graph_inputs=False)
        return result
