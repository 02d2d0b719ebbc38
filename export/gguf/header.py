"""A GGUF file's header: metadata as plain Python values, and the tensor table, read with
buffered file reads.

`gguf.GGUFReader` (llama.cpp's reader) parses the same header, but it maps the whole file and
keeps a numpy view per metadata array entry: ~160 MB of objects for SmolLM2's 49k-token
vocabulary and merges (three times that for a 128k vocabulary), more than the tensor being
converted. This parser walks the format (GGUF v2/v3: https://github.com/ggml-org/ggml/blob/
master/docs/gguf.md) and keeps only the values: a string list is a Python list of str. The type
codes and block sizes are the `gguf` package's own (`GGUFValueType`, `GGML_QUANT_SIZES`).

Every length and count is checked against the bytes left in the file before anything is
allocated, so a corrupt header raises `HeaderError` instead of asking for terabytes.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from fuselm.input_files import open_regular

VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32  # llama.cpp's, when general.alignment is absent
# Arrays of arrays: llama.cpp writes none (its own reader refuses nesting); a few levels are
# allowed so a foreign writer's file still opens, a stack-exhausting depth is an error.
MAX_NESTING = 8


class HeaderError(ValueError):
    """The header is not a well-formed GGUF v2/v3 header (truncated or corrupt)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # numpy/torch order (llama.cpp's ne reversed)
    offset: int  # absolute byte offset in the file
    nbytes: int  # 0 when the type is unknown (the caller names it as unsupported)


@dataclass(frozen=True)
class Unreadable:
    """A metadata value that is not valid UTF-8 text; an error only if someone reads it."""

    reason: str


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size, self.pos = f, size, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise HeaderError(f"needs {n} bytes at offset {self.pos}, past the end of the file")
        data = self.f.read(n)
        if len(data) != n:
            raise HeaderError(f"short read at offset {self.pos}")
        self.pos += n
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))[0]

    def string(self) -> str | Unreadable:
        raw = self.take(self.unpack("Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return Unreadable(str(e))


def _scalar_formats() -> dict[int, str]:
    from gguf import GGUFValueType as T

    return {T.UINT8: "B", T.INT8: "b", T.UINT16: "H", T.INT16: "h", T.UINT32: "I",
            T.INT32: "i", T.FLOAT32: "f", T.BOOL: "?", T.UINT64: "Q", T.INT64: "q",
            T.FLOAT64: "d"}


def _value(r: _Reader, kind: int, formats: dict[int, str], depth: int = 0) -> Any:
    from gguf import GGUFValueType as T

    if kind in formats:
        return r.unpack(formats[kind])
    if kind == T.STRING:
        return r.string()
    if kind == T.ARRAY:
        if depth >= MAX_NESTING:  # each level is one Python call: refuse before the stack ends
            raise HeaderError(f"a metadata array nests more than {MAX_NESTING} levels deep")
        item, count = r.unpack("I"), r.unpack("Q")
        if item in formats:  # numbers: one read, one unpack
            fmt = formats[item]
            raw = r.take(count * struct.calcsize(fmt))
            return list(struct.unpack(f"<{count}{fmt}", raw))
        if count * 8 > r.size - r.pos:  # each entry takes at least 8 bytes
            raise HeaderError(f"array of {count} entries cannot fit in the file")
        values = [_value(r, item, formats, depth + 1) for _ in range(count)]
        bad = next((v for v in values if isinstance(v, Unreadable)), None)
        return bad if bad is not None else values
    raise HeaderError(f"unknown metadata value type {kind}")


def read_header(path: Path) -> tuple[dict[str, Any], dict[str, TensorEntry]]:
    """(metadata, tensors by name) of the GGUF file at `path`; raises HeaderError."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    formats = _scalar_formats()
    with open_regular(path) as f:
        r = _Reader(f, os.fstat(f.fileno()).st_size)
        if r.take(4) != b"GGUF":
            raise HeaderError("no GGUF magic")
        version = r.unpack("I")
        if version not in VERSIONS:
            raise HeaderError(f"GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = r.unpack("Q"), r.unpack("Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            if isinstance(key, Unreadable):
                raise HeaderError(f"a metadata key is not UTF-8 ({key.reason})")
            if key in metadata:
                raise HeaderError(f"metadata key {key} is written twice")
            metadata[key] = _value(r, r.unpack("I"), formats)
        table, seen = [], set()
        for _ in range(n_tensors):
            name = r.string()
            if isinstance(name, Unreadable):
                raise HeaderError(f"a tensor name is not UTF-8 ({name.reason})")
            n_dims = r.unpack("I")
            if n_dims > 8:
                raise HeaderError(f"tensor {name} has {n_dims} dimensions")
            dims = [r.unpack("Q") for _ in range(n_dims)]
            if name in seen:
                raise HeaderError(f"tensor {name} is listed twice in the tensor table")
            seen.add(name)
            table.append((name, r.unpack("I"), tuple(reversed(dims)), r.unpack("Q")))
    align = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0:
        raise HeaderError(f"general.alignment is {align!r}")
    start = -(-r.pos // align) * align
    tensors: dict[str, TensorEntry] = {}
    for name, kind, shape, offset in table:
        n = 1
        for d in shape:
            n *= d
        nbytes = 0
        with contextlib.suppress(ValueError):  # a type gguf does not know: size unknown (0)
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            nbytes = n // block * type_size
        tensors[name] = TensorEntry(name, kind, shape, start + offset, nbytes)
    return metadata, tensors
