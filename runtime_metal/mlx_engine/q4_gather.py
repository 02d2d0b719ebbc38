"""Quantized embedding lookups as one gather of packed rows (plan time).

The Q4 pass writes a quantized embedding lookup as three Gathers (codes, scales, zero points;
the scales maybe Cast) feeding a DequantizeLinear along the row (passes/quant/quantize.py). Run as
written, the codes table lives on the device one byte per code; for a tied embedding that is a
second copy of the LM head's weights (Qwen3-0.6B: 156 MB beside the head's 78 MB of packed
codes). Here the pattern becomes one Gather over a QWeight in MLX's packed affine form, which
dequantizes only the looked-up rows (QWeight.take_rows, what mlx-lm's QuantizedEmbedding does).
A tied table (its codes, scales and zero points are Transposes of the head's) reuses the head's
QWeight arrays, found by lineage, so nothing is packed twice, even transiently.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import mlx.core as mx
import numpy as np
from onnx import TensorProto, helper

from fuselm.runtime_metal.dtypes import FOUR_BIT, like_dtype, to_host
from fuselm.runtime_metal.mlx_engine import qweight
from fuselm.runtime_metal.mlx_engine.ops import lookup
from fuselm.runtime_metal.mlx_engine.step import Step


@dataclass
class Lineage:
    """What build_plan folded: constants made by a [1, 0] Transpose ("T") or by a Cast that
    keeps every value ("="), and which DequantizeLinear inputs (codes, scales, zero points;
    "" when absent) each packed QWeight came from."""

    derived: dict[str, tuple[str, str]] = field(default_factory=dict)
    packed_from: dict[tuple[str, ...], qweight.QWeight] = field(default_factory=dict)

    def note_fold(self, op_type: str, attrs: dict[str, object], ins: list[str], out: str,
                  consts: dict[str, object]) -> None:
        if op_type == "Transpose" and list(attrs.get("perm", [1, 0])) == [1, 0]:  # type: ignore[call-overload]
            self.derived[out] = ("T", ins[0])
        elif op_type == "Cast" and _exact_cast(consts.get(ins[0]), consts.get(out)):
            self.derived[out] = ("=", ins[0])

    def note_pack(self, inputs: list[str], packed: qweight.QWeight) -> None:
        self.packed_from[_dq_inputs(inputs)] = packed

    def source(self, name: str) -> str | None:
        """The constant `name` is exactly the transpose of (through exact Casts), or None."""
        transposes = 0
        while name in self.derived:
            op, name = self.derived[name]
            transposes += op == "T"
        return name if transposes == 1 else None


def _dq_inputs(inputs: list[str]) -> tuple[str, str, str]:
    """DequantizeLinear's (codes, scales, zero points), "" for an absent zero point."""
    a, b, c = (list(inputs) + ["", ""])[:3]
    return a, b, c


_CHECK_MAX = 1 << 24  # elements: float casts are compared value by value up to this size


def _int_range(dt: np.dtype) -> tuple[int, int] | None:
    if dt in FOUR_BIT:
        return (0, 15) if dt == np.dtype(ml_dtypes.uint4) else (-8, 7)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return int(info.min), int(info.max)
    return None


def _exact_cast(a: object, b: object) -> bool:
    """An integer cast whose target range holds the source's, or a float cast that changed no
    value (compared when small: what this is for, scale tables, is 1/block of the codes)."""
    if a is None or b is None or getattr(a, "shape", None) != getattr(b, "shape", None):
        return False
    if isinstance(a, qweight.QWeight):  # a packed weight cast to its MatMul's type (bfloat16)
        return False
    ra, rb = _int_range(like_dtype(np, a)), _int_range(like_dtype(np, b))
    if ra is not None:
        return rb is not None and rb[0] <= ra[0] and ra[1] <= rb[1]
    if rb is not None or int(np.prod(getattr(a, "shape", ()))) > _CHECK_MAX:
        return False
    return bool(np.array_equal(to_host(b).astype(np.float64), to_host(a).astype(np.float64)))


def fuse_quantized_gathers(steps: list[Step], consts: dict[str, object], opset: int,
                           lineage: Lineage) -> int:
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
        ids, tables, scale_dtype = found
        rows = _tied(tables, scale_dtype, lineage) or _pack(tables, scale_dtype, s, consts)
        if rows is None:
            continue
        name = f"{s.outputs[0]}::q4_rows"
        consts[name] = rows
        steps[i] = Step(lookup("", "Gather", opset, s.name), s.name, [name, ids],
                        list(s.outputs[:1]), {"axis": 0, "n_outputs": 1})
        rewritten += 1
    return rewritten


def _gathered(name: str, producer: dict[str, Step], consts: dict[str, object]
              ) -> tuple[str, str] | None:
    """(indices, constant table name) when `name` = Gather(constant table, indices), axis 0."""
    g = producer.get(name)
    if g is None or g.op_type != "Gather" or int(g.attrs.get("axis", 0)) != 0:
        return None
    return (g.inputs[1], g.inputs[0]) if g.inputs[0] in consts else None


def _match(s: Step, producer: dict[str, Step], consts: dict[str, object]
           ) -> tuple[str, tuple[str, str, str], np.dtype | None] | None:
    """(indices, (codes, scales, zero points) table names, the scales' Cast dtype)."""
    ins = _dq_inputs(s.inputs)
    if int(s.attrs.get("axis", 1)) != -1:
        return None
    codes = _gathered(ins[0], producer, consts)
    scale_name, scale_dtype = ins[1], None
    cast = producer.get(scale_name)
    if cast is not None and cast.op_type == "Cast":
        scale_name = cast.inputs[0]
        scale_dtype = helper.tensor_dtype_to_np_dtype(int(cast.attrs.get("to", TensorProto.FLOAT)))
    scales = _gathered(scale_name, producer, consts)
    zp = _gathered(ins[2], producer, consts) if ins[2] else None
    if codes is None or scales is None or (ins[2] and zp is None):
        return None
    ids = codes[0]
    if scales[0] != ids or (zp is not None and zp[0] != ids):
        return None
    return ids, (codes[1], scales[1], zp[1] if zp else ""), scale_dtype


def _tied(tables: tuple[str, str, str], scale_dtype: np.dtype | None, lineage: Lineage
          ) -> qweight.QWeight | None:
    """The head's QWeight when every table is a Transpose of that head's DequantizeLinear input
    (blocked along H there, W.T packed along H: the rows, exactly)."""
    sources = tuple((lineage.source(t) or "\0") if t else "" for t in tables)
    head = lineage.packed_from.get(sources)
    if head is None or not head.transposed:
        return None
    dtype = head.dtype if scale_dtype is None else like_dtype(mx, np.empty(0, scale_dtype))
    return qweight.QWeight(head.packed, head.scales, head.biases, head.group_size, False, dtype,
                           rows_only=True, bits=head.bits)


def _pack(tables: tuple[str, str, str], scale_dtype: np.dtype | None, s: Step,
          consts: dict[str, object]) -> qweight.QWeight | None:
    """An untied table: packed from its own codes."""
    codes = _four_bit(to_host(consts[tables[0]]))
    scales = to_host(consts[tables[1]])
    if scale_dtype is not None:
        scales = scales.astype(scale_dtype)
    block = int(s.attrs.get("block_size", 0))
    if codes is None or not qweight.can_pack(codes, scales, 1, block):
        return None
    zp = to_host(consts[tables[2]]) if tables[2] else None
    rows = qweight.from_dequantize_linear(codes, scales, zp, 1, block)
    rows.rows_only = True
    return rows


def _four_bit(table: np.ndarray) -> np.ndarray | None:
    """Codes as 4-bit NumPy: a table folded on the host may have been widened to (u)int8; its
    values are still 4-bit ones."""
    if table.dtype in FOUR_BIT:
        return table
    if table.dtype == np.uint8 and table.size and int(table.max()) < 16:
        return table.view(ml_dtypes.uint4)  # one element a byte: the same bytes
    if table.dtype == np.int8 and table.size and -8 <= int(table.min()) <= int(table.max()) < 8:
        return table.astype(ml_dtypes.int4)
    return None
