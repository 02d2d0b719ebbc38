"""Quantized embedding lookups as one gather of packed rows (plan time).

The Q4 pass writes a quantized embedding lookup as three Gathers (codes, scales, zero points;
the scales maybe Cast) feeding a DequantizeLinear along the row (passes/quantize.py). Run as
written, the codes table lives on the device one byte per code; for a tied embedding that is a
second copy of the LM head's weights (Llama-3.2-1B: 262 MB beside the head's 131 MB of packed
codes). Here the pattern becomes one Gather over a QWeight in MLX's packed affine form, which
dequantizes only the looked-up rows (QWeight.take_rows, what mlx-lm's QuantizedEmbedding does),
and when the table is the tied LM head's, the QWeight shares the head's arrays.
"""

from __future__ import annotations

import ml_dtypes
import mlx.core as mx
import numpy as np
from onnx import TensorProto, helper

from runtime_metal import qweight
from runtime_metal.ops import lookup
from runtime_metal.plan import Step


def fuse_quantized_gathers(steps: list[Step], consts: dict[str, object], opset: int) -> int:
    """Rewrite in place (the three Gathers and the Cast go dead unless read elsewhere);
    returns how many lookups were rewritten."""
    producer = {o: s for s in steps for o in s.outputs if o}
    rewritten = 0
    for i, s in enumerate(steps):
        if s.op_type != "DequantizeLinear" or s.impl.domain:
            continue
        found = _match(s, producer, consts)
        if found is None:
            continue
        ids, codes, scales, zp, block = found
        name = f"{s.outputs[0]}::q4_rows"
        consts[name] = _shared_with_head(
            qweight.from_dequantize_linear(codes, scales, zp, 1, block), consts)
        steps[i] = Step(lookup("", "Gather", opset, s.name), s.name, [name, ids],
                        list(s.outputs[:1]), {"axis": 0, "_n_outputs": 1})
        rewritten += 1
    return rewritten


def _gathered(name: str, producer: dict[str, Step], consts: dict[str, object]
              ) -> tuple[str, np.ndarray] | None:
    """(indices, constant table) when `name` = Gather(constant table, indices) on axis 0."""
    g = producer.get(name)
    if g is None or g.op_type != "Gather" or int(g.attrs.get("axis", 0)) != 0:
        return None
    table = consts.get(g.inputs[0])
    if isinstance(table, mx.array):
        table = np.array(table)
    return (g.inputs[1], table) if isinstance(table, np.ndarray) else None


def _match(s: Step, producer: dict[str, Step], consts: dict[str, object]
           ) -> tuple[str, np.ndarray, np.ndarray, np.ndarray | None, int] | None:
    ins = s.inputs + [""] * (3 - len(s.inputs))
    block = int(s.attrs.get("block_size", 0))
    codes = _gathered(ins[0], producer, consts)
    if codes is None or int(s.attrs.get("axis", 1)) != -1:
        return None
    table = _four_bit(codes[1])
    scale_name, scale_dtype = ins[1], None
    cast = producer.get(scale_name)
    if cast is not None and cast.op_type == "Cast":
        scale_name = cast.inputs[0]
        scale_dtype = helper.tensor_dtype_to_np_dtype(int(cast.attrs.get("to", TensorProto.FLOAT)))
    scales = _gathered(scale_name, producer, consts)
    zp = _gathered(ins[2], producer, consts) if ins[2] else None
    if scales is None or (ins[2] and zp is None):
        return None
    ids = codes[0]
    if scales[0] != ids or (zp is not None and zp[0] != ids):
        return None
    table_scales = scales[1] if scale_dtype is None else scales[1].astype(scale_dtype)
    if table is None or not qweight.can_pack(table, table_scales, 1, block):
        return None
    return ids, table, table_scales, None if zp is None else zp[1], block


def _four_bit(table: np.ndarray) -> np.ndarray | None:
    """Codes as 4-bit NumPy: folding the tied table's Transpose on the host widens them to
    (u)int8; the values are still 4-bit ones."""
    if table.dtype in (np.dtype(ml_dtypes.uint4), np.dtype(ml_dtypes.int4)):
        return table
    if table.dtype == np.uint8 and table.size and int(table.max()) < 16:
        return table.astype(ml_dtypes.uint4)
    if table.dtype == np.int8 and table.size and -8 <= int(table.min()) <= int(table.max()) < 8:
        return table.astype(ml_dtypes.int4)
    return None


def _shared_with_head(rows: qweight.QWeight, consts: dict[str, object]) -> qweight.QWeight:
    """The tied LM head already holds these codes as W.T packed along H: reuse its arrays."""
    for c in consts.values():
        if (isinstance(c, qweight.QWeight) and c.transposed and not c.rows_only
                and c.packed.shape == rows.packed.shape and c.group_size == rows.group_size
                and mx.array_equal(c.packed, rows.packed).item()
                and mx.array_equal(c.scales, rows.scales).item()
                and mx.array_equal(c.biases, rows.biases).item()):
            return qweight.QWeight(c.packed, c.scales, c.biases, c.group_size, False,
                                   rows.dtype, rows_only=True)
    rows.rows_only = True
    return rows
