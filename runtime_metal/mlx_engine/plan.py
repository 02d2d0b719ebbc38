"""Plan a graph once at load: order, constants resolved and folded, Q4 weights packed, dead work
dropped, and Attention nodes bound to KV-cache layers.

What stays is a flat list of steps (step.py); running it is a loop (executor.py) or one
compiled function (decode.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import onnx
from onnx import AttributeProto, helper, numpy_helper

from fuselm.passes import ops as contract
from fuselm.runtime_metal.dtypes import FOUR_BIT, to_device
from fuselm.runtime_metal.errors import RuntimeUserError
from fuselm.runtime_metal.graph_io import PAST, PRESENT
from fuselm.runtime_metal.loader import LoadedGraph
from fuselm.runtime_metal.mlx_engine import qweight
from fuselm.runtime_metal.mlx_engine.ops import lookup
from fuselm.runtime_metal.mlx_engine.q4_gather import Lineage, fuse_quantized_gathers
from fuselm.runtime_metal.mlx_engine.step import Plan, Step, call_step

# Integer/bool constants up to this size stay on the host: they are shapes, axes and indices.
_HOST_CONST_MAX = 4096


def attrs_of(node: onnx.NodeProto) -> dict[str, object]:
    out: dict[str, object] = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if a.type == AttributeProto.TENSOR:
            v = numpy_helper.to_array(v)
        elif a.type == AttributeProto.STRING:
            v = v.decode()
        elif a.type == AttributeProto.STRINGS:
            v = [s.decode() for s in v]
        elif a.type in (AttributeProto.INTS, AttributeProto.FLOATS):
            v = list(v)
        out[a.name] = v
    out["n_outputs"] = len(node.output)
    return out


def _constant_value(attrs: dict[str, object]) -> np.ndarray:
    for key, dtype in (("value", None), ("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    raise RuntimeUserError(f"Constant node with unsupported value attribute {sorted(attrs)}")


def _initial_constant(value: np.ndarray) -> object:
    if value.dtype.kind in "iub" and value.size <= _HOST_CONST_MAX:
        return value
    if value.dtype.kind in "iubf" or value.dtype.name == "bfloat16":
        return to_device(value)
    return value  # 4-bit codes stay NumPy until packed (or densified by DequantizeLinear)


def _try_pack(node: onnx.NodeProto, attrs: dict, consts: dict, six_bit: set[str]
              ) -> qweight.QWeight | None:
    """Fold a constant blocked DequantizeLinear (or fuselm.DequantizeAffine) into MLX's affine
    form, if it maps 1:1; codes named in `six_bit` (fuselm.UnpackUInt6's) at 6 bits."""
    names = list(node.input) + [""] * (3 - len(node.input))
    if not all(n == "" or n in consts for n in names):
        return None
    codes, scales = consts.get(names[0]), consts.get(names[1])
    offsets = consts.get(names[2]) if names[2] else None
    if isinstance(codes, mx.array) and codes.dtype == mx.uint8:  # 8-bit codes went to device
        codes = np.array(codes)
    if not isinstance(codes, np.ndarray) or scales is None:
        return None
    scales_np = np.array(scales) if isinstance(scales, mx.array) else scales
    axis, block = int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))
    if not qweight.can_pack(codes, scales_np, axis, block):
        return None
    off = None if offsets is None else np.asarray(offsets)
    if node.op_type == "DequantizeAffine":
        return None if off is None else qweight.from_dequantize_affine(
            codes, scales_np, off, axis, block)
    return qweight.from_dequantize_linear(codes, scales_np, off, axis, block,
                                          names[0] in six_bit)


def _bind_kv(steps: list[Step], graph_inputs: set[str]) -> tuple[int, bool]:
    pasts = sorted({int(m.group(1)) for n in graph_inputs if (m := PAST.match(n))})
    consumers: dict[str, int] = {}
    for s in steps:
        for n in s.inputs:
            consumers[n] = consumers.get(n, 0) + 1
    bound = set()
    for s in steps:
        if s.impl.op_type != "Attention" or len(s.inputs) < 6:
            continue
        pk, pv = PAST.match(s.inputs[4] or ""), PAST.match(s.inputs[5] or "")
        if not (pk and pv and pk.group(1) == pv.group(1)):
            continue
        layer = int(pk.group(1))
        outs = s.outputs + [""] * (3 - len(s.outputs))
        presents_ok = all(
            o == "" or (PRESENT.match(o) and PRESENT.match(o).group(1) == str(layer)
                        and consumers.get(o, 0) == 0)
            for o in outs[1:3]
        )
        only_here = consumers.get(s.inputs[4]) == 1 and consumers.get(s.inputs[5]) == 1
        if presents_ok and only_here and layer not in bound:
            s.layer = layer
            bound.add(layer)
    return len(pasts), bool(pasts) and bound == set(pasts)


def build_plan(loaded: LoadedGraph) -> Plan:
    model = loaded.model
    graph = model.graph
    opsets = {o.domain or "": o.version for o in model.opset_import}
    opsets.setdefault("", contract.ONNX_OPSET)
    init_names = {t.name for t in graph.initializer}
    inputs = {i.name: i.type for i in graph.input if i.name not in init_names}
    outputs = [o.name for o in graph.output]
    consts: dict[str, object] = {n: _initial_constant(v) for n, v in loaded.weights.items()}
    steps: list[Step] = []
    folded = 0
    lineage = Lineage()
    six_bit: set[str] = set()  # 6-bit codes, as fuselm.UnpackUInt6 folded them
    for node in graph.node:
        domain = node.domain or ""
        if domain == "ai.onnx":
            domain = ""
        attrs = attrs_of(node)
        if domain == "" and node.op_type == "Constant":
            consts[node.output[0]] = _initial_constant(_constant_value(attrs))
            folded += 1
            continue
        if (domain, node.op_type) in (("", "DequantizeLinear"),
                                      (contract.DOMAIN, "DequantizeAffine")):
            packed = _try_pack(node, attrs, consts, six_bit)
            if packed is not None:
                consts[node.output[0]] = packed
                lineage.note_pack(list(node.input), packed)
                folded += 1
                continue
        opset = opsets.get(domain, 1)
        impl = lookup(domain, node.op_type, opset, node.name)
        ins = list(node.input)
        if domain == contract.DOMAIN and node.op_type in ("FusedQKV", "FusedGateUp"):
            ins = _pack_fused_weight(node, ins, attrs, consts)
        step = Step(impl, node.name or f"{node.op_type}_{len(steps)}", ins, list(node.output),
                    attrs)
        if ins and all(n == "" or n in consts for n in ins):
            values = call_step(step, [consts[n] if n else None for n in ins])
            for name, v in zip(step.outputs, values, strict=False):
                if name:
                    consts[name] = v
            lineage.note_fold(node.op_type, attrs, ins, node.output[0], consts)
            if (domain, node.op_type) == (contract.DOMAIN, "UnpackUInt6"):
                six_bit.add(node.output[0])
            folded += 1
            continue
        steps.append(step)
    fuse_quantized_gathers(steps, consts, opsets[""], lineage)
    live, dropped = _drop_dead(steps, outputs)
    _send_weights_to_device(live, consts)
    num_layers, bound = _bind_kv(live, set(inputs))
    used = {n for s in live for n in s.inputs} | set(outputs)
    consts = {k: v for k, v in consts.items() if k in used}
    return Plan(live, consts, inputs, outputs, num_layers, bound, dropped + folded,
                {"nodes": len(graph.node), "steps": len(live), "folded": folded,
                 "dead": dropped})


def _pack_fused_weight(node: onnx.NodeProto, ins: list[str], attrs: dict,
                       consts: dict) -> list[str]:
    """FusedQKV/FusedGateUp with constant Q4 inputs: the packed weight becomes one QWeight."""
    ins = ins + [""] * (5 - len(ins))
    if not ins[2] or not all(n in consts for n in ins[1:4] if n):
        return ins
    codes, scales = consts[ins[1]], consts[ins[2]]
    zp = consts[ins[3]] if ins[3] else None
    if not isinstance(codes, np.ndarray):
        return ins
    scales_np = np.array(scales) if isinstance(scales, mx.array) else np.asarray(scales)
    block = int(attrs.get("block_size", 32))
    if not qweight.can_pack(codes, scales_np, 0, block):
        return ins
    name = f"{ins[1]}::q4"
    if name not in consts:
        consts[name] = qweight.from_dequantize_linear(
            codes, scales_np, None if zp is None else np.asarray(zp), 0, block)
    return [ins[0], name, "", "", ins[4]]


def _drop_dead(steps: list[Step], outputs: list[str]) -> tuple[list[Step], int]:
    needed = set(outputs)
    live: list[Step] = []
    for s in reversed(steps):
        if any(o and o in needed for o in s.outputs):
            live.append(s)
            needed.update(n for n in s.inputs if n)
    live.reverse()
    return live, len(steps) - len(live)


def _send_weights_to_device(steps: list[Step], consts: dict[str, object]) -> None:
    """Host constants read by device ops become MLX arrays once, not on every call."""
    for s in steps:
        if s.impl.host:
            continue
        for i, n in enumerate(s.inputs):
            if n in consts and i not in s.impl.static and isinstance(consts[n], np.ndarray):
                if consts[n].dtype.kind in "iubf" or consts[n].dtype in FOUR_BIT:
                    consts[n] = to_device(consts[n])  # 4-bit codes: as uint8/int8, once
