"""Projections as the pairing passes see them: MatMul(x, W) [+ bias], W float or Q4.

A weight is a constant [K, N], or DequantizeLinear(codes [K, N], scales, zero_points, axis=0,
block_size) over constants — the standard Q4 form foreign graphs arrive in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from fuselm.passes import weights
from fuselm.passes.graph import is_graph_output, maybe_producer, tensor_type
from fuselm.passes.weights import PackedValues, Weight


@dataclass
class Projection:
    matmul: gs.Node
    weight: gs.Constant  # float [K, N] or Q4 codes [K, N]
    scales: gs.Constant | None
    zero_points: gs.Constant | None
    block_size: int
    bias_add: gs.Node | None
    bias: gs.Constant | None

    @property
    def k(self) -> int:
        return int(self.weight.shape[0])

    @property
    def n(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out(self) -> gs.Tensor:
        return (self.bias_add or self.matmul).outputs[0]

    @property
    def nodes(self) -> list[gs.Node]:
        dq = maybe_producer(self.matmul.inputs[1], "DequantizeLinear")
        return [n for n in (dq, self.matmul, self.bias_add) if n is not None]

    @property
    def kind(self) -> tuple:
        """What must agree for two projections to share one packed weight."""
        wdt = tensor_type(self.weight)
        sdt = tensor_type(self.scales) if self.scales is not None else None
        return (wdt, sdt, self.block_size if self.scales is not None else 0)


def projection(graph: gs.Graph, mm: gs.Node) -> Projection | None:
    """`mm` as a projection of its first input, or None if its weight is not constant."""
    if mm.op != "MatMul" or mm.domain:
        return None
    w = mm.inputs[1]
    scales = zps = None
    block = 0
    if isinstance(w, gs.Constant):
        weight = w
    else:
        dq = maybe_producer(w, "DequantizeLinear")
        if dq is None or len(dq.inputs) < 3 or len(w.outputs) != 1:
            return None
        weight, scales, zps = dq.inputs[0], dq.inputs[1], dq.inputs[2]
        if not all(isinstance(t, gs.Constant) for t in (weight, scales, zps)):
            return None
        if int(dq.attrs.get("axis", 1)) != 0 or len(scales.shape) != 2:
            return None
        block = int(dq.attrs.get("block_size", 0))
    if len(weight.shape) != 2:
        return None
    bias_add = bias = None
    out = mm.outputs[0]
    if len(out.outputs) == 1 and not is_graph_output(graph, out) and out.outputs[0].op == "Add":
        add = out.outputs[0]
        other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
        # The shape alone decides: reading a bias's values here would load stored weights.
        if isinstance(other, gs.Constant) and tuple(other.shape) == (weight.shape[1],):
            bias_add, bias = add, other
    return Projection(mm, weight, scales, zps, block, bias_add, bias)


def projections_of(graph: gs.Graph, x: gs.Tensor) -> list[Projection]:
    """Every projection reading `x`, in stored order."""
    found = []
    for user in x.outputs:
        if user.op == "MatMul" and user.inputs[0] is x:
            p = projection(graph, user)
            if p is not None:
                found.append(p)
    return found


def _packed(name: str, parts: list[gs.Constant], axis: int) -> gs.Constant:
    """The parts' concatenation as a lazy constant: a recipe, read only when its values are
    needed (quantization) or written (passes/writer.py), so pairing reads no weights."""
    sources = [weights.source(p) for p in parts]
    whole = weights.whole_of(sources, axis)  # a split checkpoint tensor packs back as itself
    return Weight(name, PackedValues(name, sources if whole is None else [whole], axis))


def _zeros(n: int, like: gs.Constant) -> gs.Constant:
    return gs.Constant(like.name + "_zeros", values=np.zeros(n, weights.np_dtype(like)))


def pack(namer, parts: list[Projection]) -> list[gs.Tensor]:  # noqa: ANN001 - graph.Namer
    """Packed [K, sum N] weight (and scales, zero points, bias) for one fused node's inputs.

    Concatenation along N, deferred: no weight value is read here.
    """
    first = parts[0]
    inputs: list[gs.Tensor] = [_packed(namer("weight"), [p.weight for p in parts], 1)]
    if first.scales is not None:
        inputs.append(_packed(namer("scales"), [p.scales for p in parts], 1))
        inputs.append(_packed(namer("zero_points"), [p.zero_points for p in parts], 1))
    else:
        inputs += [gs.Variable.empty(), gs.Variable.empty()]
    if any(p.bias is not None for p in parts):
        like = next(p.bias for p in parts if p.bias is not None)
        biases = [p.bias if p.bias is not None else _zeros(p.n, like) for p in parts]
        inputs.append(_packed(namer("bias"), biases, 0))
    while not inputs[-1].name:
        inputs.pop()
    return inputs
