"""Load an artifact's graph and weights: model.onnx + external data confined to the model dir.

Weights are read straight from model.onnx.data with one slice per tensor (no protobuf copy of
the whole file), so loading a 0.6B model costs its size once.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from fuselm.runtime_metal.artifact_paths import confined
from fuselm.runtime_metal.dtypes import onnx_dtype
from fuselm.runtime_metal.errors import RuntimeUserError

_FOUR_BIT = (TensorProto.UINT4, TensorProto.INT4)


@dataclass(frozen=True)
class Cut:
    """The part of a stored tensor to read (a rank's share of a sharded graph: mlx_engine/
    shard.py): index spans along one axis, joined in order (the whole tensor when spans is
    empty), of a tensor stored with `dims`."""

    dims: tuple[int, ...]
    axis: int = 0
    spans: tuple[tuple[int, int], ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        if not self.spans:
            return self.dims
        out = list(self.dims)
        out[self.axis] = sum(b - a for a, b in self.spans)
        return tuple(out)


@dataclass
class LoadedGraph:
    model: onnx.ModelProto  # initializers stripped of data: `weights` holds them
    weights: dict[str, np.ndarray]
    path: Path


def _external_info(t: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _confined(root: Path, location: str, tensor: str) -> Path:
    """The data file of `tensor`, refusing anything that resolves outside the model folder."""
    candidate = confined(root, location, f"tensor {tensor!r}'s external data location")
    if not candidate.is_file():
        raise RuntimeUserError(
            f"external data file {candidate} (for tensor {tensor!r}) is missing; copy the whole "
            "output folder, or re-run `fuselm convert`"
        )
    return candidate


def is_external(t: TensorProto) -> bool:
    """Whether the tensor's bytes live in a data file beside the model."""
    return t.data_location == TensorProto.EXTERNAL


def external_span(t: TensorProto, root: Path) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor's bytes, the file confined to `root`."""
    info = _external_info(t)
    path = _confined(root, info.get("location", ""), t.name)
    offset = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else path.stat().st_size - offset
    return path, offset, length


def read_bytes(t: TensorProto, root: Path) -> bytes:
    """An external tensor's raw bytes."""
    path, offset, length = external_span(t, root)
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise RuntimeUserError(f"tensor {t.name!r}: external data ends before its length")
    return data


def _map(file: Path) -> mmap.mmap:
    try:
        with open(file, "rb") as f:
            if not f.seek(0, 2):  # mmap refuses an empty file; say what it means instead
                raise RuntimeUserError(
                    f"external data file {file} is empty (0 bytes); copy the whole output "
                    "folder again, or re-run `fuselm convert`")
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except PermissionError:
        raise RuntimeUserError(f"cannot read {file}: permission denied; fix its permissions"
                               ) from None


def _from_bytes(buf: memoryview | bytes, t: TensorProto) -> np.ndarray:
    shape = tuple(t.dims)
    n = int(np.prod(shape)) if shape else 1
    if t.data_type in _FOUR_BIT:
        # Two 4-bit elements per byte, the first in the low nibble (ONNX's packing).
        raw = np.frombuffer(buf, dtype=np.uint8, count=(n + 1) // 2)
        codes = np.empty(raw.size * 2, np.uint8)
        codes[0::2] = raw & 0x0F
        codes[1::2] = raw >> 4
        # ml_dtypes' 4-bit types hold one element per byte in its low nibble: a view, not a
        # cast (the element-wise cast took most of an 8B model's load)
        return codes[:n].view(onnx_dtype(np, t.data_type)).reshape(shape)
    dtype = onnx_dtype(np, t.data_type)
    if len(buf) < n * dtype.itemsize:
        raise RuntimeUserError(f"tensor {t.name!r}: external data is truncated")
    return np.frombuffer(buf, dtype=dtype, count=n).reshape(shape).copy()


def read_model(model_file: str | Path) -> onnx.ModelProto:
    """The graph, initializers without their data (load_graph / read_weights read those)."""
    path = Path(model_file)
    if not path.is_file():
        raise RuntimeUserError(f"{path} not found; pass the folder `fuselm convert` wrote")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises several unrelated types for a corrupt file
        raise RuntimeUserError(f"{path} is not a readable ONNX model ({e}); re-convert") from e
    if not model.graph.node:
        raise RuntimeUserError(f"{path} has an empty graph; it is not a fuselm model")
    return model


def load_graph(model_file: str | Path) -> LoadedGraph:
    path = Path(model_file)
    model = read_model(path)
    return LoadedGraph(model, read_weights(model, path.parent), path)


def read_weights(model: onnx.ModelProto, root: Path, cuts: Mapping[str, Cut] | None = None
                 ) -> dict[str, np.ndarray]:
    """Every initializer's values, read from its external data file by one slice each. With
    `cuts` (a sharded graph: mlx_engine/shard.py), an initializer's dims are its cut's shape
    and only the cut's part of the stored tensor is read."""
    weights: dict[str, np.ndarray] = {}
    maps: dict[Path, mmap.mmap] = {}
    try:
        for t in model.graph.initializer:
            cut = cuts.get(t.name) if cuts is not None else None
            if t.data_location == TensorProto.EXTERNAL:
                info = _external_info(t)
                file = _confined(root, info.get("location", ""), t.name)
                if file not in maps:
                    maps[file] = _map(file)
                offset = int(info.get("offset", 0))
                length = int(info.get("length", len(maps[file]) - offset))
                if offset + length > len(maps[file]):
                    raise RuntimeUserError(
                        f"tensor {t.name!r}: external data {file.name} is shorter than the "
                        "model says (truncated copy?); re-convert or copy it again")
                buf = memoryview(maps[file])[offset:offset + length]
                weights[t.name] = _from_bytes(buf, t) if cut is None else _cut_from_bytes(
                    buf, t, cut)
            elif cut is None:
                weights[t.name] = numpy_helper.to_array(t)
            else:  # stored inside model.onnx: read with its stored dims, then cut
                weights[t.name] = _take(numpy_helper.to_array(_with_dims(t, cut.dims)), cut)
            # Drop the payload from the proto: the graph keeps only names and shapes.
            t.ClearField("raw_data")
    finally:
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive; the OS frees it with the process
                pass
    return weights


def _take(value: np.ndarray, cut: Cut) -> np.ndarray:
    if not cut.spans:
        return value
    index = [slice(None)] * value.ndim
    parts = []
    for a, b in cut.spans:
        index[cut.axis] = slice(a, b)
        parts.append(value[tuple(index)])
    return np.ascontiguousarray(np.concatenate(parts, axis=cut.axis))


def _with_dims(t: TensorProto, dims: tuple[int, ...]) -> TensorProto:
    out = TensorProto()
    out.CopyFrom(t)
    del out.dims[:]
    out.dims.extend(dims)
    return out


def _cut_from_bytes(buf: memoryview, t: TensorProto, cut: Cut) -> np.ndarray:
    """The cut's part of a stored tensor, touching only its bytes where the layout allows:
    4-bit codes two to a byte along the last axis, so a row range or an even column range of
    an even-width matrix is a range of whole bytes."""
    dims = cut.dims
    n = int(np.prod(dims)) if dims else 1
    if t.data_type in _FOUR_BIT:
        even = len(dims) == 2 and dims[1] % 2 == 0 and (
            cut.axis == 0 or all(a % 2 == 0 and b % 2 == 0 for a, b in cut.spans))
        if not even:
            return _take(_from_bytes(buf, _with_dims(t, dims)), cut)
        raw = np.frombuffer(buf, dtype=np.uint8, count=n // 2).reshape(dims[0], dims[1] // 2)
        half = cut if cut.axis == 0 else Cut(cut.dims, 1, tuple((a // 2, b // 2)
                                                                 for a, b in cut.spans))
        packed = _take(raw, half)
        codes = np.empty(packed.shape[:1] + (packed.shape[1] * 2,), np.uint8)
        codes[:, 0::2] = packed & 0x0F
        codes[:, 1::2] = packed >> 4
        return codes.view(onnx_dtype(np, t.data_type))
    dtype = onnx_dtype(np, t.data_type)
    if len(buf) < n * dtype.itemsize:
        raise RuntimeUserError(f"tensor {t.name!r}: external data is truncated")
    return _take(np.frombuffer(buf, dtype=dtype, count=n).reshape(dims), cut).copy()
