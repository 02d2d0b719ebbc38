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
