"""RemoveDeadShapeOp (seed step 7): drop dead nodes, fold static shape arithmetic.

Exporters (TorchScript most of all) compute every reshape target at run time from
Shape -> Gather -> Unsqueeze -> Concat chains, even where the numbers are static. This pass
folds what is static and keeps what dynamic shapes (batch, sequence, past length) need:

- Constant nodes become initializers; Identity, one-input Concat and no-op Cast disappear;
- Shape (and Gather of a Shape) over statically known dims becomes a constant;
- any node whose inputs are all *small* constants is evaluated once (never over weights:
  the tied LM head's Transpose(embed_tokens) stays, folding it would copy the embedding);
- identical nodes over identical inputs are merged (exporters repeat Cos/Sin/Shape per layer);
- nodes whose outputs reach no graph output are removed.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from fuselm.passes.graph import (
    PassResult,
    const,
    is_graph_output,
    replace_all_uses,
    tensor_type,
)
from fuselm.passes.weights import stored

SMALL = 1024  # elements: shape arithmetic is tiny, weights are not
_NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                     "Multinomial", "Bernoulli"}


def _small_const(t: gs.Tensor) -> bool:
    # A stored weight is never shape arithmetic, however small (a [head_dim] norm weight):
    # folding or de-duplicating by value would read it from disk.
    return isinstance(t, gs.Constant) and int(np.prod(t.shape)) <= SMALL and not stored(t)


def _lift_constants(graph: gs.Graph) -> int:
    n = 0
    for node in graph.nodes:
        if node.op != "Constant" or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        if is_graph_output(graph, out):
            continue
        value = const(out)
        if value is None:
            continue
        c = gs.Constant(out.name + "_c", values=np.array(value))
        replace_all_uses(graph, out, c)
        node.outputs.clear()
        n += 1
    return n


def _is_noop(node: gs.Node) -> bool:
    if node.op == "Identity":
        return True
    if node.op == "Concat" and len(node.inputs) == 1:
        return True
    if node.op == "Cast" and node.inputs[0].dtype is not None:
        return tensor_type(node.inputs[0]) == int(node.attrs.get("to", 0))
    return False


def _bypass_noops(graph: gs.Graph) -> int:
    n = 0
    for node in graph.nodes:
        if len(node.outputs) != 1 or not node.inputs or not _is_noop(node):
            continue
        src, out = node.inputs[0], node.outputs[0]
        if is_graph_output(graph, out):
            if is_graph_output(graph, src) or not src.inputs:
                continue  # an output that is a graph input or another output: keep the copy
        replace_all_uses(graph, out, src)
        node.outputs.clear()
        n += 1
    return n


def _static_dims(t: gs.Tensor) -> list[int | None]:
    if t.shape is None:
        return []
    return [d if isinstance(d, int) and d >= 0 else None for d in t.shape]


def _fold_shapes(graph: gs.Graph) -> int:
    """Shape(x)[start:end], and Gather(Shape(x), i), where those dims of x are static."""
    n = 0
    for node in graph.nodes:
        if node.op != "Shape" or len(node.outputs) != 1 or node.inputs[0].shape is None:
            continue
        dims = _static_dims(node.inputs[0])
        rank = len(dims)
        start = int(node.attrs.get("start", 0))
        end = int(node.attrs.get("end", rank)) if "end" in node.attrs else rank
        start, end = (start + rank if start < 0 else start), (end + rank if end < 0 else end)
        sel = dims[max(start, 0) : min(end, rank)]
        out = node.outputs[0]
        if sel and all(d is not None for d in sel) and not is_graph_output(graph, out):
            replace_all_uses(graph, out, gs.Constant(out.name + "_c", np.array(sel, np.int64)))
            node.outputs.clear()
            n += 1
            continue
        for user in list(out.outputs):
            idx = const(user.inputs[1]) if user.op == "Gather" and len(user.inputs) > 1 else None
            if idx is None or int(user.attrs.get("axis", 0)) != 0:
                continue
            picked = [sel[int(i)] if -len(sel) <= int(i) < len(sel) else None
                      for i in idx.reshape(-1)]
            g_out = user.outputs[0]
            if any(d is None for d in picked) or is_graph_output(graph, g_out):
                continue
            value = np.array(picked, np.int64).reshape(idx.shape)
            replace_all_uses(graph, g_out, gs.Constant(g_out.name + "_c", value))
            user.outputs.clear()
            n += 1
    return n


def _evaluate(node: gs.Node) -> list[np.ndarray] | None:
    from onnx.reference import ReferenceEvaluator

    ins = [f"i{k}" for k in range(len(node.inputs))]
    outs = [f"o{k}" for k in range(len(node.outputs))]
    attrs = {k: v for k, v in node.attrs.items() if not isinstance(v, gs.Tensor | gs.Graph)}
    if len(attrs) != len(node.attrs):
        return None
    proto = helper.make_node(node.op, ins, outs, domain=node.domain or "", **attrs)
    graph = helper.make_graph(
        [proto], "fold",
        [helper.make_tensor_value_info(i, onnx.TensorProto.UNDEFINED, None) for i in ins],
        [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    try:
        feeds = {i: np.asarray(t.values) for i, t in zip(ins, node.inputs, strict=True)}
        return [np.asarray(r) for r in ReferenceEvaluator(model).run(None, feeds)]
    except Exception:  # noqa: BLE001 - an op the reference cannot run stays as it is
        return None


def _fold_constants(graph: gs.Graph) -> int:
    n = 0
    for node in graph.nodes:
        if (node.domain or node.op in _NONDETERMINISTIC or node.op == "Constant"
                or not node.outputs or not node.inputs
                or not all(_small_const(t) for t in node.inputs if t.name != "")
                or any(is_graph_output(graph, o) for o in node.outputs)):
            continue
        if any(t.name == "" for t in node.inputs):
            continue  # optional inputs left out: let the runtime decide
        values = _evaluate(node)
        if values is None or any(v.size > SMALL for v in values):
            continue
        for out, v in zip(list(node.outputs), values, strict=True):
            replace_all_uses(graph, out, gs.Constant(out.name + "_c", v))
        node.outputs.clear()
        n += 1
    return n


def _key(t: gs.Tensor) -> object:
    if _small_const(t):
        v = np.asarray(t.values)
        return ("c", str(v.dtype), v.shape, v.tobytes())
    return ("t", id(t))


def _merge_duplicates(graph: gs.Graph) -> int:
    seen: dict[tuple, gs.Node] = {}
    n = 0
    for node in graph.nodes:
        if (not node.outputs or node.op in _NONDETERMINISTIC
                or any(isinstance(v, gs.Graph) for v in node.attrs.values())):
            continue
        attrs = tuple(sorted((k, repr(v)) for k, v in node.attrs.items()))
        key = (node.domain, node.op, attrs, len(node.outputs),
               tuple(_key(t) for t in node.inputs))
        first = seen.setdefault(key, node)
        if first is node:
            continue
        if any(is_graph_output(graph, o) for o in node.outputs):
            continue
        for mine, theirs in zip(list(node.outputs), first.outputs, strict=True):
            replace_all_uses(graph, mine, theirs)
        node.outputs.clear()
        n += 1
    return n


class RemoveDeadShapeOp:
    name = "dead_shape"

    def run(self, graph: gs.Graph) -> PassResult:
        result = PassResult()
        for _ in range(16):  # to a fixed point; each round only shrinks the graph
            changed = (_lift_constants(graph) + _bypass_noops(graph) + _fold_shapes(graph)
                       + _fold_constants(graph) + _merge_duplicates(graph))
            graph.cleanup(remove_unused_graph_inputs=False)
            result.count += changed
            if not changed:
                break
        return result
