"""Projections over a dequantize node, rewritten so onnxruntime runs them as `MatMulNBits`.

onnxruntime fuses `DequantizeLinear` + `MatMul` into `MatMulNBits` (4- and 8-bit codes) only
when the MatMul reads the DequantizeLinear directly; it does not fold a constant
DequantizeLinear, so any other form dequantizes the whole weight on every call. Two forms in
fuselm's artifacts need help (passes/quant/quantize.py), and a third form's Cast is dropped:

- FusedQKV / FusedGateUp fed a float weight by a dequantize node (conversions with given
  blocks or 8-bit weights): their function body puts a CastLike between the two. Here they
  are written out as the body's ops without it — MatMul (+ Add bias), Split, the activation —
  the same computation (the lowered graph is float32 throughout, so the CastLike was a no-op).
- fuselm.DequantizeAffine (w = q·s + b per block of B along K): its body is dense. Here
  x @ W = x @ DQ(q, s, zero points 0) + BlockSum(x) @ b, where BlockSum(x) [.., K/B] sums each
  block of B inputs: the first term fuses into MatMulNBits, the second is a small [K/B, N]
  MatMul. Equal in exact arithmetic; in float32 the sums round in another order (~1e-7).
- a Cast to bfloat16 after the dequantize node (a bfloat16 graph's Q4/Q8 weights): a no-op
  in the float32 lowered graph, dropped.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_DEQUANT = ("DequantizeLinear", "DequantizeAffine")


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name),
                default)


def rewrite(g: onnx.GraphProto) -> int:
    """Rewrite the graph in place (see the module doc); the number of nodes rewritten."""
    count = _skip_half_casts(g)
    count += _expand_fused(g)
    return count + _split_affine(g)


def _skip_half_casts(g: onnx.GraphProto) -> int:
    """A bfloat16 graph's quantized weights are dequantized with float32 scales and Cast to
    bfloat16 (passes/quant/quantize.py): the projection then reads the Cast, not the dequantize
    node. The lowered graph is float32 throughout, so the Cast is a no-op: its readers read
    the dequantize node instead."""
    producer = {o: n for n in g.node for o in n.output}
    skip = {n.output[0]: n.input[0] for n in g.node
            if n.op_type == "Cast" and not n.domain
            and _attr(n, "to", 0) in (TensorProto.FLOAT16, TensorProto.BFLOAT16)
            and getattr(producer.get(n.input[0]), "op_type", "") in _DEQUANT}
    outputs = {o.name for o in g.output}
    skip = {k: v for k, v in skip.items() if k not in outputs}
    for n in g.node:
        for i, name in enumerate(n.input):
            if name in skip:
                n.input[i] = skip[name]
    kept = [n for n in g.node if not (n.op_type == "Cast" and n.output[0] in skip)]
    del g.node[:]
    g.node.extend(kept)
    return len(skip)


def _expand_fused(g: onnx.GraphProto) -> int:
    producer = {o: n for n in g.node for o in n.output}
    out: list[onnx.NodeProto] = []
    count = 0
    for n in g.node:
        src = producer.get(n.input[1]) if len(n.input) > 1 else None
        if (n.domain != "fuselm" or n.op_type not in ("FusedQKV", "FusedGateUp")
                or src is None or src.op_type not in _DEQUANT
                or (len(n.input) > 2 and n.input[2])):
            out.append(n)
            continue
        count += 1
        p = f"{n.name or n.output[0]}/x"
        y = p + "_mm"
        out.append(helper.make_node("MatMul", [n.input[0], n.input[1]], [y]))
        if len(n.input) > 4 and n.input[4]:
            out.append(helper.make_node("Add", [y, n.input[4]], [p + "_b"]))
            y = p + "_b"
        if n.op_type == "FusedQKV":
            sizes = [int(_attr(n, k, 0)) for k in ("q_size", "k_size", "v_size")]
            g.initializer.append(numpy_helper.from_array(np.array(sizes, np.int64), p + "_sizes"))
            out.append(helper.make_node("Split", [y, p + "_sizes"], list(n.output), axis=-1))
            continue
        gate, up = p + "_gate", p + "_up"
        out.append(helper.make_node("Split", [y], [gate, up], axis=-1, num_outputs=2))
        act = _attr(n, "activation", b"silu")
        if (act.decode() if isinstance(act, bytes) else act) == "gelu_tanh":
            out.append(helper.make_node("Gelu", [gate], [p + "_act"], approximate="tanh"))
        else:
            out += [helper.make_node("Sigmoid", [gate], [p + "_sig"]),
                    helper.make_node("Mul", [gate, p + "_sig"], [p + "_act"])]
        out.append(helper.make_node("Mul", [p + "_act", up], [n.output[0]]))
    del g.node[:]
    g.node.extend(out)
    return count


def _split_affine(g: onnx.GraphProto) -> int:
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    graph_outputs = {o.name for o in g.output}
    out: list[onnx.NodeProto] = []
    extra: list[onnx.NodeProto] = []
    count = 0
    for n in g.node:
        if n.op_type != "DequantizeAffine" or n.domain != "fuselm":
            out.append(n)
            continue
        codes, scales, biases = (inits.get(i) for i in n.input[:3])
        users = readers.get(n.output[0], [])
        if (codes is None or scales is None or biases is None or _attr(n, "axis", 0) != 0
                or n.output[0] in graph_outputs or not users
                or any(u.op_type != "MatMul" or list(u.input).index(n.output[0]) != 1
                       for u in users)):
            out.append(n)
            continue
        count += 1
        block = int(_attr(n, "block_size", 0))
        zp = n.output[0] + "/zp0"
        zeros = TensorProto(name=zp, data_type=codes.data_type, dims=list(scales.dims))
        numel = int(np.prod(scales.dims))
        width = 4 if codes.data_type == TensorProto.UINT4 else 8
        zeros.raw_data = bytes((numel * width + 7) // 8)
        g.initializer.append(zeros)
        out.append(helper.make_node("DequantizeLinear", [n.input[0], n.input[1], zp],
                                    [n.output[0]], name=n.name, axis=0, block_size=block))
        shape = n.output[0] + "/blocks"
        g.initializer.append(numpy_helper.from_array(np.array([0, 0, -1, block], np.int64),
                                                     shape))
        for u in users:
            x, y = u.input[0], u.output[0]
            p = f"{y}/affine"
            u.output[0] = p + "_q"
            extra += [
                helper.make_node("Reshape", [x, shape], [p + "_xb"]),
                helper.make_node("ReduceSum", [p + "_xb", p + "_axis"], [p + "_xs"],
                                 keepdims=0),
                helper.make_node("MatMul", [p + "_xs", n.input[2]], [p + "_b"]),
                helper.make_node("Add", [p + "_q", p + "_b"], [y]),
            ]
            g.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), p + "_axis"))
    del g.node[:]
    g.node.extend(out + extra)  # the caller sorts the graph topologically
    return count
