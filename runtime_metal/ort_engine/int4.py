"""Symmetric Q4 tensors as int4 without zero points, for onnxruntime's fast MatMulNBits path.

A Q4 tensor whose zero points are all 8 (what `--sym` writes, passes/quant/quantize.py) means
w = (q - 8) * s. onnxruntime fuses DequantizeLinear + MatMul into `MatMulNBits`, and keeps a
zero-point input whenever the DequantizeLinear has one, or has uint4 codes (it then adds zeros):
its CPU kernel for one row of activations (a decode step) then unpacks a zero point per block,
~25 % slower on this machine's AVX2 than the same tensor without (BENCHMARKS.md 'CPU:
onnxruntime engine against onnxruntime-genai').
Stored as int4 codes q - 8 with no zero point, the same weights fuse into MatMulNBits without
one (onnxruntime adds the 8 back into its own uint4 layout, MatMulNBits' default zero point).

The int4 code of q - 8 is q with its top bit flipped (two's complement on 4 bits), so each
packed byte is the uint4 byte XOR 0x88: exact, no unpacking. The rewritten codes are handed to
onnxruntime as OrtValues over our own buffers (`SessionOptions.add_external_initializers`, for
initializers the model declares as external): the serialized model stays small (no 2 GB
protobuf limit), the artifact is never written, and the buffers are dropped once the session
exists (onnxruntime has repacked them into MatMulNBits' layout by then; the tests read logits
after that). A codes tensor also read by other nodes (the tied table's packed lookup,
ort_gather_q4.py) keeps its uint4 original for them; an asymmetric one gets a private copy for
its projection, as onnxruntime does not fuse a DequantizeLinear whose weight has other readers.
A fused projection (FusedQKV / FusedGateUp) with a symmetric weight is inlined into its ONNX
body, where the zero point can be absent.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
from onnx import TensorProto

from fuselm.runtime_metal.loader import external_span, is_external, read_bytes

# The location the in-memory initializers declare; onnxruntime takes their values from the
# OrtValues instead and never opens it.
MEMORY_FILE = "fuselm-lowered-in-memory.bin"
# node op_type -> (codes input, zero-point input); fuselm's fused projections take their Q4
# weight as inputs 1..3 (passes/ops.py), a plain projection is DequantizeLinear(codes, s, zp).
_Q4_INPUTS = {"DequantizeLinear": (0, 2), "FusedQKV": (1, 3), "FusedGateUp": (1, 3)}


def _raw(t: TensorProto, base_dir: Path) -> bytes:
    return read_bytes(t, base_dir) if is_external(t) else t.raw_data


def _all_eight(t: TensorProto, base_dir: Path) -> bool:
    """Every stored uint4 value is 8 (a padding nibble past an odd count is not a value)."""
    raw = np.frombuffer(_raw(t, base_dir), np.uint8)
    n = int(np.prod([int(d) for d in t.dims], dtype=np.int64))
    if raw.size != (n + 1) // 2 or n == 0:
        return False
    nibbles = np.stack([raw & 0x0F, raw >> 4], axis=1).reshape(-1)[:n]
    return bool((nibbles == 8).all())


def declare_in_memory(g: onnx.GraphProto, name: str, data_type: int, dims: list[int],
                      length: int) -> None:
    """Append initializer `name` whose values onnxruntime takes from an OrtValue given with the
    model: external data of `length` bytes at a location it never opens (MEMORY_FILE)."""
    t = TensorProto(name=name, data_type=data_type, dims=dims,
                    data_location=TensorProto.EXTERNAL)
    for key, value in (("location", MEMORY_FILE), ("offset", "0"), ("length", str(length))):
        t.external_data.add(key=key, value=value)
    g.initializer.append(t)


def _in_memory(g: onnx.GraphProto, name: str, src: TensorProto, data_type: int, xor: int,
               base_dir: Path, values: dict[str, object]) -> None:
    """A new 4-bit initializer `name` holding `src`'s packed bytes ^ xor, given to onnxruntime
    as an OrtValue over our own buffer (external data it never reads from disk)."""
    import onnxruntime as ort

    dims = [int(d) for d in src.dims]
    numel = int(np.prod(dims, dtype=np.int64))
    size = (numel + 1) // 2
    declare_in_memory(g, name, data_type, dims, size)
    # onnxruntime takes a 4-bit OrtValue's shape from a numpy array of one byte per element
    # and reads the packed bytes from its start: only that first half is ever written, so only
    # it is resident. The buffer is its own anonymous mapping, so dropping it after the session
    # is built gives the memory back to the system (freed heap blocks of a few MB would stay
    # in the process).
    buf = np.frombuffer(mmap.mmap(-1, max(numel, 1)), np.uint8)[:numel].reshape(dims)
    head = buf.reshape(-1)[:size]
    if is_external(src):
        path, offset, length = external_span(src, base_dir)
        if length != size:
            raise ValueError(f"tensor {src.name!r}: {length} stored bytes, expected {size}")
        with path.open("rb") as f:
            f.seek(offset)
            if f.readinto(memoryview(head)) != size:
                raise ValueError(f"tensor {src.name!r}: external data ends before its length")
    else:
        head[:] = np.frombuffer(src.raw_data, np.uint8)
    if xor:
        np.bitwise_xor(head, np.uint8(xor), out=head)
    values[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(buf, data_type)
    assert values[name].tensor_size_in_bytes() == size  # type: ignore[attr-defined]


def symmetric_to_int4(model: onnx.ModelProto, base_dir: Path) -> dict[str, object]:
    """Rewrite, in place, every Q4 projection whose zero points are all 8 to int4 codes with no
    zero point, and give every other Q4 projection whose codes another node also reads (the
    tied table's packed lookup, ort_gather_q4.py) a private copy of them: onnxruntime fuses a
    DequantizeLinear into MatMulNBits only when nothing else reads its weight. Returns
    {initializer name: OrtValue} — the values to give onnxruntime with the model
    (`SessionOptions.add_external_initializers`)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    eight: dict[str, bool] = {}
    new: dict[tuple[str, bool], str] = {}  # (uint4 codes, symmetric) -> the copy's name
    values: dict[str, object] = {}
    fused: set[str] = set()
    for n in g.node:
        slots = _Q4_INPUTS.get(n.op_type)
        if slots is None or n.domain not in ("", "fuselm") or len(n.input) <= slots[1]:
            continue
        codes, zp = inits.get(n.input[slots[0]]), inits.get(n.input[slots[1]])
        if (codes is None or zp is None or codes.data_type != TensorProto.UINT4
                or zp.data_type != TensorProto.UINT4):
            continue
        if zp.name not in eight:
            eight[zp.name] = _all_eight(zp, base_dir)
        sym = eight[zp.name]
        if not sym and readers[codes.name] == 1:
            continue
        key = (codes.name, sym)
        if key not in new:
            new[key] = f"{codes.name}__int4" if sym else f"{codes.name}__own"
            _in_memory(g, new[key], codes, TensorProto.INT4 if sym else TensorProto.UINT4,
                       0x88 if sym else 0, base_dir, values)
        n.input[slots[0]] = new[key]
        if not sym:
            continue
        n.input[slots[1]] = ""
        if n.domain == "fuselm":
            fused.add(n.op_type)
    if fused:
        # Inlined, the fused op's body reads its missing zero point as an empty input name,
        # and onnxruntime fuses a DequantizeLinear into MatMulNBits only when it has no third
        # input at all (an empty one is read as a non-constant zero point).
        inlined = onnx.inliner.inline_selected_functions(
            model, [("fuselm", op) for op in sorted(fused)])
        model.CopyFrom(inlined)
        _tidy(model.graph)
    return values


def _tidy(g: onnx.GraphProto) -> None:
    """Trailing empty inputs dropped (an absent optional input); each CastLike of a
    DequantizeLinear's output bypassed: the lowered graph computes in float32 and its scales
    are float32 (ort_lowering's _to_float32), so the cast is the identity, and onnxruntime
    fuses DequantizeLinear into MatMulNBits only when the MatMul reads it directly."""
    dq_out = {n.output[0] for n in g.node if n.op_type == "DequantizeLinear"}
    alias = {}
    for n in g.node:
        while n.input and not n.input[-1]:
            del n.input[-1]
        if n.op_type == "CastLike" and n.input[0] in dq_out:
            alias[n.output[0]] = n.input[0]
    if not alias:
        return
    kept = [n for n in g.node if not (n.op_type == "CastLike" and n.output[0] in alias)]
    for n in kept:
        for i, name in enumerate(n.input):
            n.input[i] = alias.get(name, name)
    for o in g.output:
        if o.name in alias:
            raise ValueError(f"{o.name}: a graph output straight from a dequantized weight")
    del g.node[:]
    g.node.extend(kept)
