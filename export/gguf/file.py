"""A GGUF file for fuselm: its metadata and tensor table, and tensors read one at a time.

The header and metadata are parsed by export/gguf/header.py; tensor bytes are read with plain
file reads, one tensor at a time, and dequantized by `gguf.quants.dequantize`. Plain reads
rather than the reader's memory map: mapped pages count toward the process's resident memory
until the map goes away, so touching every tensor through the map makes conversion's peak
memory grow with the file (export/safetensors/checkpoint.py does the same for safetensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fuselm.export.errors import ExportError
from fuselm.export.gguf.blocks import EXACT_TYPES
from fuselm.export.gguf.header import HeaderError, Unreadable, read_header
from fuselm.input_files import check_regular, open_regular

# Tensor types fuselm reads, each dequantized to float32 by gguf's own dequantize: floats and
# the block types a conversion keeps exactly (export/gguf/blocks.py; a tensor whose blocks do
# not reproduce gguf's weights there goes to the nearest format it stores, 8-bit blocks, its
# error recorded in quant-report).
FLOAT_TYPES = ("F32", "F16", "BF16")
SUPPORTED_TYPES = FLOAT_TYPES + EXACT_TYPES
MAGIC = b"GGUF"
SLAB_BYTES = 16 << 20  # float32 output bytes dequantized at a time


def is_gguf(path: str | Path) -> bool:
    """A .gguf file, or any file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return p.suffix.lower() == ".gguf"
    if p.suffix.lower() == ".gguf":
        return True
    with open_regular(p) as f:
        return f.read(4) == MAGIC


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # GGMLQuantizationType name, e.g. "Q4_1"
    shape: tuple[int, ...]  # numpy/torch order (llama.cpp's ne reversed): [rows, cols]
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Metadata (`metadata`, read with `value`) and tensor table of one GGUF file, validated
    on open."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        check_regular(self.path)  # a FIFO would block the first read forever
        if not self.path.is_file():
            raise ExportError(f"{self.path} does not exist; pass a .gguf file or an HF model dir")
        try:
            import gguf  # noqa: F401 - the type codes and dequantizers come from it
        except ImportError as e:  # a dependency of fuselm; only a broken install lacks it
            raise ExportError(f"reading GGUF needs the `gguf` package ({e}); pip install gguf") \
                from e
        with open_regular(self.path) as f:
            if f.read(4) != MAGIC:
                raise ExportError(
                    f"{self.path} is not a GGUF file (no GGUF magic); pass a .gguf model")
        try:
            # plain values, not a numpy view per vocabulary entry (export/gguf/header.py)
            self.metadata, entries = read_header(self.path)
        except HeaderError as e:
            raise ExportError(
                f"{self.path} is not a valid GGUF file ({e}); it is truncated or corrupt — "
                "re-download it") from None
        size = self.path.stat().st_size
        self.tensors: dict[str, GGUFTensor] = {}
        for e in entries.values():
            info = GGUFTensor(e.name, _type_name(e.ggml_type), e.shape, e.offset, e.nbytes)
            if info.offset + info.nbytes > size:
                raise ExportError(
                    f"{self.path} is truncated: tensor {e.name} ends at byte "
                    f"{info.offset + info.nbytes} but the file has {size}; re-download it")
            self.tensors[e.name] = info
        _check_overlaps(self.path, self.tensors)
        bad = sorted({(t.type_name, n) for n, t in self.tensors.items()
                      if t.type_name not in SUPPORTED_TYPES}, key=lambda x: x[1])
        if bad:
            kinds = sorted({k for k, _ in bad})
            raise ExportError(
                f"{self.path}: tensor type {', '.join(kinds)} is not supported (tensor "
                f"{bad[0][1]}); supported: {', '.join(SUPPORTED_TYPES)}. Re-quantize the model "
                "to one of these, e.g. with llama.cpp's llama-quantize")

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (str, int, float, bool, or a list of them)."""
        v = self.metadata.get(key, default)
        if isinstance(v, Unreadable):
            raise ExportError(f"{self.path}: metadata {key} cannot be read ({v.reason})")
        return v

    def raw(self, name: str) -> np.ndarray:
        """One tensor's stored bytes (uint8), as the file holds them."""
        t = self.tensors[name]
        buf = bytearray(t.nbytes)
        with open_regular(self.path) as f:
            f.seek(t.offset)
            if f.readinto(buf) != t.nbytes:
                raise ExportError(f"{self.path} is truncated while reading {name}")
        return np.frombuffer(buf, dtype=np.uint8)

    def read(self, name: str) -> np.ndarray:
        """One tensor dequantized to float32, shaped as in numpy/torch (ne reversed)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        raw = self.raw(name)
        qtype = GGMLQuantizationType[t.type_name]
        try:
            if t.type_name in ("F32", "F16"):
                return np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(t.shape)
            # Block formats: one row of bytes per output row, dequantized a slab of rows at a
            # time into the result, so the dequantizer's float32 temporaries stay at one slab
            # instead of twice the tensor (+120 MB on a 49152 x 576 embedding).
            rows = raw.reshape(_rows(t.shape), -1)
            out = np.empty((rows.shape[0], t.shape[-1]), np.float32)
            step = max(1, SLAB_BYTES // (4 * t.shape[-1]))
            for r in range(0, rows.shape[0], step):
                out[r : r + step] = dequantize(rows[r : r + step], qtype)
        except NotImplementedError as e:  # a gguf package older than this type's decoder
            raise ExportError(
                f"{self.path}: tensor {name} is {t.type_name}, which the installed gguf package "
                f"cannot dequantize ({e}); pip install -U gguf") from None
        return out.reshape(t.shape)


def _check_overlaps(path: Path, tensors: dict[str, GGUFTensor]) -> None:
    """Two tensors reading the same bytes are a corrupt (or crafted) file: one weight would
    silently be another's (export/safetensors/header.py refuses the same in safetensors)."""
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise ExportError(f"{path} is not a valid GGUF file: the data of tensors {a} and {b} "
                              "overlap; it is corrupt — re-download it")


def _rows(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape[:-1]:
        n *= d
    return n


def _type_name(code: int) -> str:
    """GGMLQuantizationType name of a tensor type code (unknown codes named by number)."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(code).name
    except ValueError:
        return f"type {code}"
