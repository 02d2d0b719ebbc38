"""A Q4 embedding lookup as onnxruntime's `GatherBlockQuantized` on the packed table.

The artifact looks rows of a Q4 table up with standard ops (quant/quantize.py `gather_nodes`):
codes and zero points Cast to uint8 (Gather takes no 4-bit tensors) and, for a table tied to
the LM head and stored in its [H, V] layout, Transposed; the gathered rows are dequantized.
onnxruntime folds those Casts and Transposes at session creation into an unpacked uint8 copy
of the whole table: one byte per weight, twice the packed codes (Qwen3-0.6B: a 155 MB copy
next to the head's own). `GatherBlockQuantized` (com.microsoft) gathers and dequantizes
straight from the packed uint4 codes, along either axis of the stored table (gather_axis 1,
quantize_axis 0 for the [H, V] layout), with the same zero points and scales: the same values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fuselm.runtime_metal.loader import is_external, read_bytes

MS = "com.microsoft"


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _half_exact(name: str, producer: dict[str, onnx.NodeProto],
                inits: dict[str, onnx.TensorProto], base_dir: Path) -> bool:
    """Whether the scales `name` (an initializer, or one read through Casts) survive the
    float16 round trip below unchanged: fuselm's own are float16 values; a checkpoint's given
    ones need not be (GGUF Q3_K's d·(sc - 32) in float32), and such a table keeps the plain
    lookup."""
    while name not in inits and getattr(producer.get(name), "op_type", "") == "Cast":
        name = producer[name].input[0]
    t = inits.get(name)
    if t is None:
        return False
    if t.data_type == TensorProto.FLOAT16:
        return True
    if is_external(t):
        a = np.frombuffer(read_bytes(t, base_dir), helper.tensor_dtype_to_np_dtype(t.data_type))
    else:
        a = numpy_helper.to_array(t)
    return bool(np.array_equal(a.astype(np.float16).astype(a.dtype), a))


def packed_gathers(g: onnx.GraphProto, base_dir: Path) -> int:
    """Replace each row lookup of a Q4 table (the pattern above) by GatherBlockQuantized, in
    place; the number replaced. Nodes left unread are the caller's to prune. `base_dir`:
    the folder of the graph's external data."""
    producer = {o: n for n in g.node for o in n.output}
    inits = {t.name: t for t in g.initializer}

    def chain(name: str) -> tuple[str, bool, str, str] | None:
        """Gather output -> (source tensor before the Cast, transposed?, ids, the Cast's
        output)."""
        gather = producer.get(name)
        if gather is None or gather.op_type != "Gather" or _attr(gather, "axis", 0) != 0:
            return None
        src, transposed = producer.get(gather.input[0]), False
        if src is not None and src.op_type == "Transpose":
            if list(_attr(src, "perm", [1, 0])) != [1, 0]:
                return None
            src, transposed = producer.get(src.input[0]), True
        if src is None or src.op_type != "Cast":
            return None
        return src.input[0], transposed, gather.input[1], src.output[0]

    new_nodes: dict[int, list[onnx.NodeProto]] = {}
    for dq in g.node:
        if dq.op_type != "DequantizeLinear" or len(dq.input) != 3:
            continue
        scale_back = producer.get(dq.input[1])
        links = [chain(dq.input[0]), chain(dq.input[2]),
                 chain(scale_back.input[0]) if scale_back is not None
                 and scale_back.op_type == "Cast" else None]
        if any(c is None for c in links):
            continue
        (codes, t0, ids, _), (zps, t1, ids1, _), (scale_src, t2, ids2, _) = links  # type: ignore[misc]
        code_t, zp_t = inits.get(codes), inits.get(zps)
        if (code_t is None or zp_t is None or code_t.data_type != TensorProto.UINT4
                or zp_t.data_type != TensorProto.UINT4 or not t0 == t1 == t2
                or not ids == ids1 == ids2 or _attr(dq, "axis", 1) not in (-1, 1)
                or not _half_exact(scale_src, producer, inits, base_dir)):
            continue
        out = dq.output[0]
        # The scales' own copy for the lookup: a round trip through float16 (exact, their
        # values are float16-representable) that onnxruntime can neither merge with the LM
        # head's scales nor drop, so the head's DequantizeLinear stays their only reader and is
        # still fused into MatMulNBits.
        gathered = out + "/gbq" if t0 else out
        nodes = [
            helper.make_node("Cast", [scale_src], [out + "/gbq_scales16"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", [out + "/gbq_scales16"], [out + "/gbq_scales"],
                             to=_attr(scale_back, "to", TensorProto.FLOAT)),
            helper.make_node(
            "GatherBlockQuantized", [codes, ids, out + "/gbq_scales", zps], [gathered],
            name=dq.name + "/gbq", domain=MS, gather_axis=1 if t0 else 0,
            quantize_axis=0 if t0 else 1, block_size=int(_attr(dq, "block_size", 0)))]
        if t0:  # gathered along axis 1 of [H, V]: [H, batch, seq] -> [batch, seq, H]
            nodes.append(helper.make_node("Transpose", [gathered], [out], perm=[1, 2, 0]))
        new_nodes[id(dq)] = nodes
    if not new_nodes:
        return 0
    kept: list[onnx.NodeProto] = []
    for n in g.node:
        kept.extend(new_nodes.get(id(n), [n]))
    del g.node[:]
    g.node.extend(kept)
    return len(new_nodes)

