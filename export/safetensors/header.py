"""A safetensors file's header, checked against the format before any tensor is read.

The header is JSON a user (or a broken download) controls: it must be an object of tensor
entries, each `{"dtype": str, "shape": [int >= 0, ...], "data_offsets": [begin, end]}`, the
byte range exactly dtype size x elements long, inside the file, and no two ranges overlapping.
Anything else is an ExportError naming the file, the tensor and the field, so the reader
(safetensors/checkpoint.py) only ever sees well-formed entries. Hand-written rather than a schema
library: four fields, and the checks that matter (sizes, bounds, overlaps) span entries.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fuselm.export.errors import ExportError
from fuselm.input_files import loads, open_regular

# Every dtype of the safetensors format, with its element size in bytes. (Whether fuselm can
# export a dtype is the reader's question; here only the layout is checked.)
ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
_MAX_HEADER = 100 << 20  # the format's own limit (100 MB); a larger length is corruption


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int


def _fail(path: Path, what: str) -> ExportError:
    return ExportError(
        f"{path} is not a valid safetensors file: {what}; re-download or re-save the checkpoint"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(path: Path, name: str, meta: Any, base: int, data_size: int) -> Entry:
    where = f"tensor {name!r}"
    if not isinstance(meta, dict):
        raise _fail(path, f"{where} is {json.dumps(meta)[:60]}, not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in meta:
            raise _fail(path, f"{where} has no {key!r}")
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEM_BYTES:
        raise _fail(path, f"{where} has unknown dtype {json.dumps(dtype)[:40]} "
                          f"(safetensors dtypes: {', '.join(ITEM_BYTES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(path, f"{where} has shape {json.dumps(shape)[:60]}; it must be a list of "
                          "integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _fail(path, f"{where} has data_offsets {json.dumps(offsets)[:60]}; they must be "
                          "[begin, end] with 0 <= begin <= end")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * ITEM_BYTES[dtype]:
        raise _fail(path, f"{where} ({dtype} {shape}) needs {numel * ITEM_BYTES[dtype]} bytes "
                          f"but its data_offsets span {end - begin}")
    if end > data_size:
        raise ExportError(
            f"{path} is truncated: tensor {name!r} ends at byte {base + end} but the file has "
            f"{base + data_size}; re-download or re-save the checkpoint"
        )
    return Entry(name, dtype, tuple(shape), base + begin, end - begin)


def read_header(path: Path) -> dict[str, Entry]:
    """The tensor entries of a safetensors file, every one checked (see the module doc)."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise _fail(path, "the file is shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise _fail(path, f"its header length {n} exceeds the file size {size}")
            header = loads(f.read(n))
    except PermissionError as e:
        raise ExportError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, JSONTooDeep: ValueErrors
        raise _fail(path, f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise _fail(path, f"its header is a JSON {type(header).__name__}, not an object")
    meta = header.get("__metadata__")
    if meta is not None and not isinstance(meta, dict):
        raise _fail(path, "its __metadata__ is not an object")
    base = 8 + n
    entries = [
        _entry(path, name, value, base, size - base)
        for name, value in header.items()
        if name != "__metadata__"
    ]
    spans = sorted((e.start, e.start + e.nbytes, e.name) for e in entries if e.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise _fail(path, f"the bytes of tensors {a!r} and {b!r} overlap")
    return {e.name: e for e in entries}
