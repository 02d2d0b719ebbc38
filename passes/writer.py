"""Save a model with its weights streamed into one external data file, never all in memory.

The model's initializers come in three kinds (see passes/weights.py):

- references into an existing external data file (under `base_dir`): their bytes are copied
  across in chunks;
- data-less stand-ins named in `deferred`: their values are computed now (a packed weight is
  concatenated from its parts) or taken from the in-memory TensorProto they came from;
- ordinary in-memory tensors: written from their raw bytes.

Each tensor of `threshold` bytes or more goes to the data file at a 64-byte aligned offset (so
memory-mapped readers can use it in place); smaller ones are stored inline, as onnx.save_model
would. Tensors are written in initializer order, so the same model gives the same bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from fuselm.passes import weights

ALIGN = 64  # bytes, as the exporter aligns raw.onnx.data
THRESHOLD = 1024  # bytes: smaller tensors stay inline in the model file


def _raw(values: np.ndarray, data_type: int) -> bytes | memoryview:
    """ONNX raw bytes of an array (4-bit types packed two to a byte by onnx itself)."""
    if values.dtype.kind in "fiub" and values.dtype.isnative and (
        helper.np_dtype_to_tensor_dtype(values.dtype) == data_type
    ):  # the array's own bytes: no copy into a TensorProto (a 1 GB embedding table)
        return memoryview(np.ascontiguousarray(values)).cast("B")
    proto = numpy_helper.from_array(values)
    if proto.data_type != data_type:
        raise ValueError(f"computed values are {proto.data_type}, expected {data_type}")
    return proto.raw_data


def _set_external(t: TensorProto, location: str, offset: int, length: int) -> None:
    t.ClearField("raw_data")
    del t.external_data[:]
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value


def _set_inline(t: TensorProto, raw: bytes) -> None:
    del t.external_data[:]
    t.data_location = TensorProto.DEFAULT
    t.raw_data = raw


class DataFile:
    """An open data file that tensors are appended to, 64-byte aligned; each stored tensor
    becomes a reference into it (location, offset, length)."""

    def __init__(self, f: BinaryIO, location: str, offset: int = 0) -> None:
        self.f, self.location, self.offset = f, location, offset  # offset: f's current size

    def _align(self) -> int:
        pad = (-self.offset) % ALIGN
        self.f.write(b"\0" * pad)
        self.offset += pad
        return self.offset

    def put(self, t: TensorProto, raw: bytes | memoryview) -> None:
        start = self._align()
        self.f.write(raw)
        self.offset += len(raw)
        _set_external(t, self.location, start, len(raw))

    def copy(self, t: TensorProto, src: TensorProto, base_dir: str | Path) -> None:
        start = self._align()
        n = weights.copy_bytes(src, base_dir, self.f)
        self.offset += n
        _set_external(t, self.location, start, n)


def _store(
    t: TensorProto, lazy: LazyValues | None, base_dir: str | Path | None, out: DataFile,
    threshold: int,
) -> None:
    """Write one initializer's bytes (or inline them), reading at most this one tensor."""
    src = lazy.tensor if lazy is not None else t
    if weights.is_external(src):
        if base_dir is None:
            raise ValueError(f"tensor {t.name!r} is stored externally but no base_dir is given")
        _, _, length = weights.external_span(src, base_dir)
        if length >= threshold:
            out.copy(t, src, base_dir)
        else:
            _set_inline(t, weights.read_bytes(src, base_dir))
        return
    if lazy is not None and not src.HasField("raw_data"):  # computed (packed) values
        raw = _raw(weights.array(lazy), src.data_type)
    elif src.HasField("raw_data"):
        raw = src.raw_data
    else:
        return  # typed fields (int64_data, ...): small, left inline as onnx leaves them
    if len(raw) >= threshold:
        out.put(t, raw)
    elif src is not t:
        _set_inline(t, bytes(raw))


def write_model(
    model: onnx.ModelProto,
    path: str | Path,
    *,
    base_dir: str | Path | None = None,
    deferred: dict[str, LazyValues] | None = None,
    location: str | None = None,
    threshold: int = THRESHOLD,
) -> None:
    """Write `model` to `path` and its weights to `location` (default `<name>.data`) beside it.

    `base_dir` is where the model's external references resolve (the folder of the file it was
    loaded from); `deferred` holds the values of its data-less stand-ins (model_io.to_model).
    The model is modified in place: every initializer ends up inline or pointing into the new
    data file. The data file must not be one the model reads from.
    """
    path = Path(path)
    data = path.with_name(location or path.name + ".data")
    if base_dir is not None and any(
        weights.is_external(t) and weights.external_span(t, base_dir)[0] == data.resolve()
        for t in model.graph.initializer
    ):
        raise ValueError(f"{data} is both read from and written to")
    deferred = deferred or {}
    data.unlink(missing_ok=True)
    with data.open("wb") as f:
        out = DataFile(f, data.name)
        for t in model.graph.initializer:
            _store(t, deferred.get(t.name), base_dir, out, threshold)
    onnx.save_model(model, str(path))
