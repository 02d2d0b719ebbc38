"""6-bit weights as 8-bit codes for onnxruntime's CPU kernels, made at load.

A 6-bit weight is DequantizeLinear(fuselm.UnpackUInt6(packed), scales, uint8 zero points)
(passes/quant/quantize.py). onnxruntime's `MatMulNBits` and `GatherBlockQuantized` take 2-, 4-
or 8-bit codes (1.32 refuses bits=6), and it fuses a DequantizeLinear into `MatMulNBits` only
when its codes are an initializer that nothing else reads. So here each UnpackUInt6 of an
initializer is replaced by its codes unpacked once, one byte a code (passes/ops.py
`unpack_uint6_reference`, exact), under a name of its own for each node that reads them (the
tied table's head and its row lookup; one buffer behind the names): DequantizeLinear + MatMul
then runs as an 8-bit `MatMulNBits` on the same values. The artifact stays 6-bit; what
onnxruntime holds for such a weight is what it holds for an 8-bit one (1 byte a weight, 4/3 of
the packed codes; BENCHMARKS.md 'Gemma 3 270M'). The codes are handed over as OrtValues over our
own buffers, as ort_engine/int4.py does (`SessionOptions.add_external_initializers`): the
serialized model stays small.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from fuselm.passes.ops import DOMAIN, unpack_uint6_reference
from fuselm.runtime_metal.loader import is_external, read_bytes
from fuselm.runtime_metal.ort_engine.int4 import declare_in_memory


def _packed(t: TensorProto, base_dir: Path) -> np.ndarray:
    dims = [int(d) for d in t.dims]
    if is_external(t):
        return np.frombuffer(read_bytes(t, base_dir), np.uint8).reshape(dims)
    return numpy_helper.to_array(t)


def expand_six_bit(g: onnx.GraphProto, base_dir: Path) -> dict[str, object]:
    """Replace, in place, every UnpackUInt6 of an initializer by unpacked uint8 initializers
    (one per reading node); returns {initializer name: OrtValue}, the values to give
    onnxruntime with the model. `base_dir`: the folder of the graph's external data."""
    import onnxruntime as ort

    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    values: dict[str, object] = {}
    dropped: set[int] = set()
    for n in g.node:
        if n.domain != DOMAIN or n.op_type != "UnpackUInt6" or n.input[0] not in inits:
            continue
        codes = unpack_uint6_reference(_packed(inits[n.input[0]], base_dir))
        unpacked = ort.OrtValue.ortvalue_from_numpy(codes)
        dropped.add(id(n))
        for k, user in enumerate(readers.get(n.output[0], [])):
            name = f"{n.output[0]}__u8_{k}"
            declare_in_memory(g, name, TensorProto.UINT8, list(codes.shape), codes.size)
            values[name] = unpacked  # one buffer: the names keep the readers apart
            for i, x in enumerate(user.input):
                if x == n.output[0]:
                    user.input[i] = name
    if dropped:
        kept = [n for n in g.node if id(n) not in dropped]
        del g.node[:]
        g.node.extend(kept)
    return values
