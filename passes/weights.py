"""Weights that stay on disk: lazy values for the passes, read one tensor at a time.

A model loaded without its external data keeps every large initializer as a TensorProto that
only says where its bytes are (location, offset, length). The passes see such a tensor as an
`ExternalValues`; a packed projection weight the pairing passes build is a `PackedValues`, a
recipe (concatenate these parts) rather than an array. Neither holds data: values are read
(`load`) only where a pass truly needs them (quantization) or when the writer
(passes/writer.py) streams the final data file, and then one tensor at a time.

In the graph each of them is a `Weight`: an onnx-graphsurgeon constant that shows the library
only a data-less stand-in and keeps its lazy values in its own `source`, so every pass, the
exporter (model_io.to_model) and the writer reach them through public names.

Every decode of stored bytes into an array goes through `read_array` and is logged while a
`recording()` is open, so tests can check which weights a run read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data
from onnx_graphsurgeon.ir.tensor import LazyValues

_log: list[list[str]] = []  # the open recordings (nested ones all see every read)
_CHUNK = 16 << 20  # bytes per read when copying between files


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Names of the stored tensors decoded into arrays while the block runs, in read order."""
    names: list[str] = []
    _log.append(names)
    try:
        yield names
    finally:
        _log.remove(names)


def _note(name: str) -> None:
    for names in _log:
        names.append(name)


def numel(t: TensorProto) -> int:
    return int(np.prod([int(d) for d in t.dims], dtype=np.int64))


def is_external(t: TensorProto) -> bool:
    return t.data_location == TensorProto.EXTERNAL or uses_external_data(t)


def external_span(t: TensorProto, base_dir: str | Path) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor's bytes, the file checked to lie inside
    `base_dir` (a model must not point a reader at arbitrary files)."""
    info = ExternalDataInfo(t)
    base = Path(base_dir).resolve()
    path = (base / info.location).resolve()
    if base not in path.parents:
        raise ValueError(f"tensor {t.name!r}: external data {info.location!r} lies outside "
                         f"{base}")
    offset = int(info.offset or 0)
    length = info.length
    if length is None:
        length = path.stat().st_size - offset
    return path, offset, int(length)


def check_external(model: onnx.ModelProto, base_dir: str | Path) -> None:
    """Raise ValueError unless every external initializer's bytes exist under `base_dir` (what
    loading the data would have checked up front, before any pass runs)."""
    for t in model.graph.initializer:
        if not is_external(t):
            continue
        path, offset, length = external_span(t, base_dir)
        if not path.is_file():
            raise ValueError(f"tensor {t.name!r}: external data file {path} is missing")
        if offset + length > path.stat().st_size:
            raise ValueError(f"tensor {t.name!r}: external data {path} is shorter than "
                             f"offset {offset} + length {length}")


def _numpy_dtype(data_type: int) -> np.dtype | None:
    """The array dtype whose bytes are ONNX's raw bytes, or None for packed (4-bit) types."""
    if data_type in (TensorProto.UINT4, TensorProto.INT4, TensorProto.FLOAT4E2M1):
        return None
    if data_type == TensorProto.STRING:
        return None
    return np.dtype(helper.tensor_dtype_to_np_dtype(data_type))


def read_array(t: TensorProto, base_dir: str | Path) -> np.ndarray:
    """Decode one external tensor, exactly as numpy_helper.to_array would with its data loaded."""
    path, offset, length = external_span(t, base_dir)
    _note(t.name)
    dims = tuple(int(d) for d in t.dims)
    dtype = _numpy_dtype(t.data_type)
    if dtype is not None and dtype.isnative and length == dtype.itemsize * int(np.prod(dims)):
        # One allocation, no intermediate bytes object.
        return np.fromfile(path, dtype=dtype, count=int(np.prod(dims)), offset=offset).reshape(
            dims
        )
    with path.open("rb") as f:  # 4-bit and other packed layouts: let onnx unpack them
        f.seek(offset)
        raw = f.read(length)
    inline = TensorProto(name=t.name, data_type=t.data_type, dims=dims, raw_data=raw)
    return numpy_helper.to_array(inline)


def copy_bytes(t: TensorProto, base_dir: str | Path, out: BinaryIO) -> int:
    """Copy an external tensor's bytes into the open binary file `out` in chunks; the length."""
    path, offset, length = external_span(t, base_dir)
    left = length
    with path.open("rb") as f:
        f.seek(offset)
        while left:
            chunk = f.read(min(left, _CHUNK))
            if not chunk:
                raise ValueError(f"tensor {t.name!r}: external data ends before its length")
            out.write(chunk)
            left -= len(chunk)
    return length


def read_bytes(t: TensorProto, base_dir: str | Path) -> bytes:
    """An external tensor's raw bytes (for small tensors the writer stores inline)."""
    path, offset, length = external_span(t, base_dir)
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise ValueError(f"tensor {t.name!r}: external data ends before its length")
    return data


class ExternalValues(LazyValues):
    """A constant whose bytes live in an external data file under `base_dir`.

    onnx-graphsurgeon exports a LazyValues as its `tensor` itself, so an untouched external
    weight leaves the pipeline as the same small reference it came in as.
    """

    def __init__(self, tensor: TensorProto, base_dir: str | Path) -> None:
        super().__init__(tensor)
        self.base_dir = Path(base_dir)

    def load(self) -> np.ndarray:
        return read_array(self.tensor, self.base_dir)


class PackedValues(LazyValues):
    """The concatenation of other constants' values along `axis`, computed only on `load`.

    `tensor` is a data-less stand-in (name, type, dims) so the graph can be exported and
    checked; the bytes are produced by the writer or a pass that needs the values.
    """

    def __init__(self, name: str, parts: list[LazyValues | np.ndarray], axis: int) -> None:
        first = parts[0]
        data_type = _data_type(first)
        dims = list(_shape(first))
        dims[axis] = sum(int(_shape(p)[axis]) for p in parts)
        super().__init__(TensorProto(name=name, data_type=data_type, dims=dims))
        self.parts = parts
        self.axis = axis

    def load(self) -> np.ndarray:
        # Parts are read one by one; only the parts and the result are alive at once.
        return np.concatenate([array(p) for p in self.parts], self.axis)


class SlicedValues(PackedValues):
    """Columns [start, stop) of another constant along `axis`, computed only on `load`.

    A checkpoint's fused projection (Phi-3's qkv_proj, gate_up_proj) split back into its parts;
    a recipe like PackedValues (and handled wherever one is), so splitting reads no weights.
    """

    def __init__(self, name: str, whole: LazyValues | np.ndarray, axis: int, start: int,
                 stop: int) -> None:
        dims = list(_shape(whole))
        dims[axis] = stop - start
        LazyValues.__init__(self, TensorProto(name=name, data_type=_data_type(whole), dims=dims))
        self.parts = [whole]
        self.axis, self.start, self.stop = axis, start, stop

    def load(self) -> np.ndarray:
        index = [slice(None)] * len(self.tensor.dims)
        index[self.axis] = slice(self.start, self.stop)
        return np.ascontiguousarray(array(self.parts[0])[tuple(index)])


class ComputedValues(PackedValues):
    """Values that a function produces when read: the exporter's weights straight from the
    checkpoint (read, laid out and cast on demand, export/onnx_export.py), with no
    intermediate data file. A recipe like PackedValues, handled wherever one is."""

    def __init__(self, tensor: TensorProto, compute: Callable[[], np.ndarray]) -> None:
        LazyValues.__init__(self, tensor)
        self.parts = []
        self.axis = 0
        self.compute = compute

    def load(self) -> np.ndarray:
        _note(self.tensor.name)
        return self.compute()


def whole_of(parts: list[LazyValues | np.ndarray], axis: int) -> LazyValues | np.ndarray | None:
    """The one constant that `parts` cut into consecutive slices along `axis`, covering all of
    it, in order; else None. Packing such parts back is the original tensor itself."""
    if not parts or not all(isinstance(p, SlicedValues) and p.axis == axis for p in parts):
        return None
    whole = parts[0].parts[0]
    end = 0
    for p in parts:
        if p.parts[0] is not whole or p.start != end:
            return None
        end = p.stop
    return whole if end == _shape(whole)[axis] else None


def _data_type(v: LazyValues | np.ndarray) -> int:
    if isinstance(v, LazyValues):
        return int(v.tensor.data_type)
    return helper.np_dtype_to_tensor_dtype(v.dtype)


def _shape(v: LazyValues | np.ndarray) -> tuple[int, ...]:
    return tuple(int(d) for d in (v.tensor.dims if isinstance(v, LazyValues) else v.shape))


class Weight(gs.Constant):
    """An initializer whose values stay where they are until read: a data file
    (ExternalValues), the checkpoint (ComputedValues), a recipe over other weights
    (PackedValues, SlicedValues) or a TensorProto in memory (LazyValues).

    onnx-graphsurgeon holds a data-less stand-in (name, type, dims: all that matching, shapes
    and export need), so an exported graph carries no weight bytes; `source` holds the values,
    for the passes that read them (quantization) and for model_io.to_model and the writer.
    `values` reads them on each access and keeps no copy in the graph.
    """

    def __init__(self, name: str, source: LazyValues) -> None:
        super().__init__(name, values=_stand_in(name, source.tensor))
        self.source = source

    @property
    def values(self) -> np.ndarray:
        return array(self.source)

    @values.setter
    def values(self, values: np.ndarray | LazyValues) -> None:
        if not isinstance(values, LazyValues):
            values = LazyValues(numpy_helper.from_array(np.asarray(values), self.name))
        self.source = values
        gs.Constant.values.fset(self, _stand_in(self.name, values.tensor))

    def copy(self) -> Weight:
        return Weight(self.name, self.source)


def _stand_in(name: str, t: TensorProto) -> LazyValues:
    stub = TensorProto(name=name, data_type=t.data_type)
    stub.dims.extend(t.dims)
    return LazyValues(stub)


def data_type(c: gs.Constant) -> int:
    """The ONNX element type of a constant's values, without reading them."""
    if isinstance(c, Weight):
        return int(c.source.tensor.data_type)
    dtype = c.dtype  # gs gives a NumPy type, or the ONNX type where NumPy has none (bfloat16)
    return dtype if isinstance(dtype, int) else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def np_dtype(c: gs.Constant) -> np.dtype:
    """The numpy dtype of a constant's ONNX values (ml_dtypes for bfloat16), without reading."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(data_type(c)))


def array(v: LazyValues | np.ndarray) -> np.ndarray:
    """Values of a lazy or loaded constant in ONNX's numpy form (ml_dtypes for bfloat16 and
    4-bit), without caching them anywhere."""
    if isinstance(v, LazyValues) and not isinstance(v, ExternalValues | PackedValues):
        return numpy_helper.to_array(v.tensor)  # in memory already; no gs cast warning
    if isinstance(v, LazyValues):
        return v.load()
    return np.asarray(v)


def source(c: gs.Constant) -> LazyValues | np.ndarray:
    """What a constant's values come from: a Weight's source; else (a small constant in
    memory) its array, read from a copy so the graph's own constant keeps its form."""
    return c.source if isinstance(c, Weight) else np.asarray(c.copy().values)


def read(c: gs.Constant) -> np.ndarray:
    """A constant's values, read now and kept nowhere (the caller drops them)."""
    return array(source(c))


def stored(t: gs.Tensor) -> bool:
    """A constant whose values are not in memory (on disk, or a packing recipe): reading it
    costs a real read, so structural matching must look only at its shape."""
    return isinstance(t, Weight) and isinstance(t.source, ExternalValues | PackedValues)
