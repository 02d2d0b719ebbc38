"""Load an artifact's graph and weights: model.onnx + external data confined to the model dir.

Weights are read straight from model.onnx.data with one slice per tensor (no protobuf copy of
the whole file), so loading a 0.6B model costs its size once.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from fuselm.runtime_metal.artifact_paths import confined
from fuselm.runtime_metal.dtypes import onnx_dtype
from fuselm.runtime_metal.errors import RuntimeUserError

_FOUR_BIT = (TensorProto.UINT4, TensorProto.INT4)


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


def load_graph(model_file: str | Path) -> LoadedGraph:
    path = Path(model_file)
    root = path.parent
    if not path.is_file():
        raise RuntimeUserError(f"{path} not found; pass the folder `fuselm convert` wrote")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises several unrelated types for a corrupt file
        raise RuntimeUserError(f"{path} is not a readable ONNX model ({e}); re-convert") from e
    if not model.graph.node:
        raise RuntimeUserError(f"{path} has an empty graph; it is not a fuselm model")
    weights: dict[str, np.ndarray] = {}
    maps: dict[Path, mmap.mmap] = {}
    try:
        for t in model.graph.initializer:
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
                weights[t.name] = _from_bytes(memoryview(maps[file])[offset:offset + length], t)
            else:
                weights[t.name] = numpy_helper.to_array(t)
            # Drop the payload from the proto: the graph keeps only names and shapes.
            t.ClearField("raw_data")
    finally:
        for m in maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive; the OS frees it with the process
                pass
    return LoadedGraph(model, weights, path)
