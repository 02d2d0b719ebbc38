"""Where the decoder layers are in a decoder graph's node list.

Exporters emit layers in order, so the graph's node list is periodic: one attention node per
layer, the same number of nodes between consecutive ones. The period is the nodes per layer;
a layer's window starts at the RMSNorm that feeds its attention block.
"""

from __future__ import annotations

from typing import Any

ATTENTION_OPS = ("Attention", "GroupQueryAttention", "MultiHeadAttention")
NORM_OPS = ("RMSNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
            "FusedAddRMSNorm")


def attention_positions(nodes: list[Any]) -> list[int]:
    return [i for i, n in enumerate(nodes) if n.op_type in ATTENTION_OPS]


def nodes_per_layer(nodes: list[Any]) -> int | None:
    """The period of the node list between attention nodes; None with fewer than 2 layers."""
    pos = attention_positions(nodes)
    if len(pos) < 2:
        return None
    return round((pos[-1] - pos[0]) / (len(pos) - 1))


def layer_window(nodes: list[Any], layer: int = 1) -> list[Any]:
    """The nodes of decoder layer `layer` (clamped to the layers present), in graph order."""
    pos = attention_positions(nodes)
    if not pos:
        return []
    layer = min(layer, len(pos) - 1)
    at = pos[layer]
    start = at
    while start > 0 and nodes[start].op_type not in NORM_OPS:
        start -= 1
    period = nodes_per_layer(nodes)
    if period is None:  # one layer: up to the final norm
        end = next((i for i in range(len(nodes) - 1, at, -1) if nodes[i].op_type in NORM_OPS),
                   len(nodes))
    else:
        end = start + period
    return nodes[start:end]


def residual_layer_sizes(nodes: list[Any]) -> list[int]:
    """Nodes per decoder layer on its residual path, one figure per layer.

    Layer i runs from its input `x_i` (what the norm feeding its FusedQKV reads) to `x_{i+1}`
    (the final norm's input after the last layer); its nodes are those that both read `x_i`
    (transitively) and feed `x_{i+1}`. What a graph computes once for all layers (masks,
    positions) or only for the cache (a sliding window's Slice of present K/V) is not on that
    path, so graphs from different exporters compare layer by layer. `nodes`: ONNX NodeProtos.
    """
    producer = {o: n for n in nodes for o in n.output}
    norms = [n for n in nodes if n.op_type in NORM_OPS]
    qkv_inputs = {n.input[0] for n in nodes if n.op_type == "FusedQKV"}
    starts = [n.input[0] for n in norms if n.output[0] in qkv_inputs]
    if not starts or not norms:
        return []
    bounds = [*starts, norms[-1].input[0]]
    readers: dict[str, list[Any]] = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def downstream(t: str) -> set[int]:
        seen: set[int] = set()
        todo = list(readers.get(t, []))
        while todo:
            n = todo.pop()
            if id(n) not in seen:
                seen.add(id(n))
                todo += [r for o in n.output for r in readers.get(o, [])]
        return seen

    def upstream(t: str) -> set[int]:
        seen: set[int] = set()
        todo = [producer[t]] if t in producer else []
        while todo:
            n = todo.pop()
            if id(n) not in seen:
                seen.add(id(n))
                todo += [producer[i] for i in n.input if i in producer]
        return seen

    return [len(downstream(a) & upstream(b)) for a, b in zip(bounds, bounds[1:], strict=False)]
