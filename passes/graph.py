"""Small helpers over onnx-graphsurgeon graphs that every pass shares.

Matching is on structure and values: a helper follows producers and consumers and reads
constant values; it never looks at tensor or node names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper


@dataclass
class PassResult:
    """What one pass did: matches rewritten, matches refused (with the reason), extra figures."""

    count: int = 0
    refused: list[tuple[str, str]] = field(default_factory=list)
    extra: dict[str, object] = field(default_factory=dict)

    def refuse(self, node: gs.Node, reason: str) -> None:
        self.refused.append((node.name or node.op, reason))


class NoMatch(Exception):
    """A pattern does not apply here (silent), as opposed to a refusal (reported)."""


class Refused(Exception):
    """The pattern matched but rewriting it would be unsafe; the message says why."""


def producer(t: gs.Tensor | None, op: str | tuple[str, ...] | None = None) -> gs.Node:
    """The node producing `t` (of type `op` when given), else raise NoMatch."""
    if t is None or isinstance(t, gs.Constant) or len(t.inputs) != 1:
        raise NoMatch
    node = t.inputs[0]
    ops = (op,) if isinstance(op, str) else op
    if ops is not None and node.op not in ops:
        raise NoMatch
    return node


def maybe_producer(t: gs.Tensor | None, op: str | tuple[str, ...]) -> gs.Node | None:
    try:
        return producer(t, op)
    except NoMatch:
        return None


def const(t: gs.Tensor | None) -> np.ndarray | None:
    """Value of a constant tensor (initializer or Constant node output), else None."""
    if t is None:
        return None
    if isinstance(t, gs.Constant):
        return np.asarray(t.values)
    if len(t.inputs) == 1 and t.inputs[0].op == "Constant":
        value = t.inputs[0].attrs.get("value")
        if isinstance(value, gs.Constant):
            return np.asarray(value.values)
    return None


def scalar(t: gs.Tensor | None) -> float | None:
    """A constant holding one number (any rank), as a float; else None."""
    if isinstance(t, gs.Constant) and int(np.prod(t.shape)) != 1:
        return None  # decided by the shape: a weight's values are never read to find out
    v = const(t)
    if v is None or v.size != 1:
        return None
    return float(v.reshape(()))


def const_shape(t: gs.Tensor | None) -> tuple[int, ...] | None:
    """The shape of a constant (initializer or Constant node output), without its values."""
    if isinstance(t, gs.Constant):
        return tuple(int(d) for d in t.shape)
    if t is not None and len(t.inputs) == 1 and t.inputs[0].op == "Constant":
        value = t.inputs[0].attrs.get("value")
        if isinstance(value, gs.Constant):
            return tuple(int(d) for d in value.shape)
    return None


def last_const(t: gs.Tensor) -> int | None:
    """The last element of a 1-D shape tensor when it is known statically (e.g. head_dim).

    Exporters build reshape targets as Concat(dynamic batch, dynamic seq, -1, head_dim).
    """
    v = const(t)
    if v is not None:
        return int(v.reshape(-1)[-1]) if v.size else None
    node = maybe_producer(t, "Concat")
    if node is not None and node.inputs:
        return last_const(node.inputs[-1])
    return None


def consumers(t: gs.Tensor) -> list[gs.Node]:
    return list(t.outputs)


def is_graph_output(graph: gs.Graph, t: gs.Tensor) -> bool:
    return any(o is t for o in graph.outputs)


def only_consumer(t: gs.Tensor, graph: gs.Graph) -> gs.Node:
    """The single consumer of `t` (which must not also be a graph output), else NoMatch."""
    if len(t.outputs) != 1 or is_graph_output(graph, t):
        raise NoMatch
    return t.outputs[0]


def other_input(node: gs.Node, t: gs.Tensor) -> gs.Tensor:
    """For a binary node with `t` as one input, the other input."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is t else a


def int_attr(node: gs.Node, name: str, default: int | None = None) -> int | None:
    v = node.attrs.get(name, default)
    return None if v is None else int(v)


def axes_of(node: gs.Node) -> list[int] | None:
    """Axes of Unsqueeze/Squeeze/Reduce*: attribute (old opsets) or constant second input."""
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    if len(node.inputs) > 1:
        v = const(node.inputs[1])
        return None if v is None else [int(a) for a in v.reshape(-1)]
    return None


def replace_all_uses(graph: gs.Graph, old: gs.Tensor, new: gs.Tensor) -> None:
    """Point every consumer of `old` at `new`; graph outputs keep their tensor (and name).

    A graph output must keep its name, so when `old` is one, the producer of `new` is made to
    produce `old` itself instead.
    """
    for node in list(old.outputs):
        for i, t in enumerate(node.inputs):
            if t is old:
                node.inputs[i] = new
    if is_graph_output(graph, old):
        prod = new.inputs[0]
        for i, t in enumerate(prod.outputs):
            if t is new:
                for c in list(new.outputs):
                    for j, u in enumerate(c.inputs):
                        if u is new:
                            c.inputs[j] = old
                old.inputs.clear()
                prod.outputs[i] = old
                break


class Namer:
    """Deterministic fresh names: the same graph always gets the same names.

    Byte-identical output for the same input depends on it.
    """

    def __init__(self, graph: gs.Graph, prefix: str) -> None:
        self.taken = set(graph.tensors().keys()) | {n.name for n in graph.nodes}
        self.prefix = prefix
        self.i = 0

    def __call__(self, hint: str) -> str:
        while True:
            name = f"{self.prefix}/{hint}_{self.i}"
            self.i += 1
            if name not in self.taken:
                self.taken.add(name)
                return name


def tensor_type(t: gs.Tensor) -> int | None:
    """A tensor's ONNX element type (None: unknown). onnx-graphsurgeon gives a NumPy type, or
    the ONNX type itself where NumPy has none (bfloat16), so comparisons go through this."""
    if t.dtype is None:
        return None
    if isinstance(t.dtype, int):
        return t.dtype
    return helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype))


def variable(namer: Namer, hint: str, dtype: object = None, shape: object = None) -> gs.Variable:
    return gs.Variable(namer(hint), dtype=dtype, shape=shape)


def constant(namer: Namer, hint: str, value: np.ndarray) -> gs.Constant:
    return gs.Constant(namer(hint), values=np.ascontiguousarray(value))


def insert_before(graph: gs.Graph, anchor: gs.Node, *nodes: gs.Node) -> None:
    """Put `nodes` in stored order just before `anchor` (keeps the order stable and readable)."""
    i = next(k for k, n in enumerate(graph.nodes) if n is anchor)
    graph.nodes[i:i] = list(nodes)


def histogram(graph_or_nodes: gs.Graph | list[gs.Node]) -> Counter[str]:
    nodes = graph_or_nodes.nodes if isinstance(graph_or_nodes, gs.Graph) else graph_or_nodes
    return Counter(f"{n.domain}.{n.op}" if n.domain else n.op for n in nodes)


def stable_toposort(graph: gs.Graph) -> None:
    """Topological order that keeps the stored order wherever it is already valid.

    gs's own toposort reorders by depth, which would undo reorderQKVProjections' adjacency.
    """
    import heapq

    nodes = list(graph.nodes)
    index = {id(n): i for i, n in enumerate(nodes)}
    indeg = [0] * len(nodes)
    users: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for t in n.inputs:
            for p in t.inputs:
                j = index.get(id(p))
                if j is not None:
                    indeg[i] += 1
                    users[j].append(i)
    ready = [i for i, d in enumerate(indeg) if d == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        raise ValueError("graph has a cycle")
    graph.nodes = [nodes[i] for i in order]
