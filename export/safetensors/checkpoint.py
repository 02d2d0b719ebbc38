"""Reading HF checkpoints: safetensors only (single file or sharded), validated before use.

Pickle-based checkpoints (pytorch_model.bin, *.pt, *.ckpt) are refused, never loaded:
unpickling a user's file runs arbitrary code. Reading needs no torch: `array` gives NumPy
(bfloat16 as ml_dtypes'), `get` the torch tensor the tracing exporter wants.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from fuselm.export.errors import ExportError
from fuselm.export.safetensors.header import read_header
from fuselm.export.safetensors.shard_index import INDEX, shard_files
from fuselm.input_files import check_regular, open_regular

_PICKLE_GLOBS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
if TYPE_CHECKING:
    import torch

# safetensors dtype → NumPy dtype (its name is torch's too)
_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_FLOATS = ("float32", "float16", "bfloat16", "float64")
_SLAB = 16 << 20  # bytes compared at a time by same_values


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    import torch

    return getattr(torch, "bool" if dtype == np.bool_ else dtype.name)


def cast(a: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """`a` as `dtype` (itself when it already is): bfloat16 through torch, twice as fast as
    ml_dtypes' element loop, with the same round-to-nearest-even result."""
    if a.dtype == dtype:
        return a
    if a.dtype == ml_dtypes.bfloat16 and a.flags.c_contiguous and a.size:
        import torch

        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return t.to(torch_dtype(np.dtype(dtype))).numpy()
    return a.astype(dtype)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in `file`
    nbytes: int


class Checkpoint:
    """The tensors of a model directory, read lazily one at a time."""

    def __init__(self, model_dir: str | Path) -> None:
        self.root = Path(model_dir)
        self.files = self._find_files()
        self.tensors: dict[str, TensorInfo] = {}
        for file in self.files:
            for name, entry in read_header(file).items():  # checked: export/safetensors_header
                dtype = _DTYPES.get(entry.dtype)
                if dtype is None:
                    raise ExportError(f"{file}: tensor {name} has unsupported dtype {entry.dtype}")
                if name in self.tensors:
                    raise ExportError(
                        f"tensor {name!r} is stored twice, in {self.tensors[name].file.name} and "
                        f"{file.name}; re-save the checkpoint"
                    )
                self.tensors[name] = TensorInfo(
                    name, file, dtype, entry.shape, entry.start, entry.nbytes
                )

    def _find_files(self) -> list[Path]:
        single = self.root / "model.safetensors"
        if (self.root / INDEX).is_file():
            shards = shard_files(self.root)  # shape checked, paths confined: export/shard_index
            if single.is_file() and [p.name for p in shards] != [single.name]:
                # transformers loads model.safetensors and never reads the index: reading the
                # shards would convert another model than the one it runs
                raise ExportError(
                    f"{self.root} holds both model.safetensors and {INDEX} naming other shards; "
                    "transformers loads model.safetensors and ignores the index, so which "
                    "weights are meant is unclear. Remove the stale one")
            return shards
        # transformers' order: model.safetensors alone (another file beside it, such as an
        # adapter or a consolidated copy, is not the model's), else every *.safetensors
        files = [single] if os.path.lexists(single) else sorted(self.root.glob("*.safetensors"))
        for file in files:  # a directory or FIFO under a weight file's name: refused, not read
            check_regular(file)
        if files:
            return files
        pickles = [p.name for g in _PICKLE_GLOBS for p in self.root.glob(g)]
        if pickles:
            raise ExportError(
                f"{self.root} holds only pickle checkpoints ({', '.join(sorted(pickles))}); fuselm "
                "never unpickles user files. Convert it to safetensors first, e.g. "
                "`model.save_pretrained(dir, safe_serialization=True)` in a trusted environment"
            )
        raise ExportError(f"no *.safetensors weights in {self.root}; pass an HF model directory")

    @property
    def dtype_name(self) -> str:
        """The dominant floating dtype of the checkpoint (by element count): "bfloat16", ..."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if t.dtype.name in _FLOATS:
                n = 1
                for d in t.shape:
                    n *= d
                counts[t.dtype.name] = counts.get(t.dtype.name, 0) + n
        return max(counts, key=counts.__getitem__) if counts else "float32"

    @property
    def dtype(self) -> torch.dtype:
        """dtype_name as a torch dtype (the tracing exporter's)."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ExportError(
                f"tensor {name!r} is missing from the checkpoint in {self.root}; the checkpoint "
                "does not match its config.json"
            ) from None

    def same_values(self, a: str, b: str) -> bool:
        """Whether tensors `a` and `b` hold the same dtype, shape and bytes, compared a slab at
        a time (two embedding-sized tensors are never both in memory)."""
        x, y = self.info(a), self.info(b)
        if (x.dtype, x.shape, x.nbytes) != (y.dtype, y.shape, y.nbytes):
            return False
        with open_regular(x.file) as fx, open_regular(y.file) as fy:
            fx.seek(x.start)
            fy.seek(y.start)
            left = x.nbytes
            while left:
                n = min(left, _SLAB)
                if fx.read(n) != fy.read(n):
                    return False
                left -= n
        return True

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def get(self, name: str) -> torch.Tensor:
        """One tensor as torch's (`array`'s buffer, shared)."""
        import torch

        a = self.array(name)
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    def array(self, name: str) -> np.ndarray:
        """One tensor, read into its own buffer.

        Plain reads rather than a memory map: mapped pages count toward the process's resident
        memory until the map goes away, so mapping a whole checkpoint makes export cost grow
        with the model. A read buffer is freed as soon as its tensor is written out.
        """
        info = self.info(name)
        if not info.nbytes:
            return np.empty(info.shape, dtype=info.dtype)
        # Not a bytearray: the read fills it, so zeroing it first is wasted work. NumPy's, not
        # torch's: NumPy asks for huge pages on large buffers (36x fewer page faults, 3x less
        # system time measured on 117 MB buffers; an 8B model reads 16 GB through these).
        buf = np.empty(info.nbytes, np.uint8)
        with open_regular(info.file) as f:
            f.seek(info.start)
            if f.readinto(memoryview(buf)) != info.nbytes:
                raise ExportError(f"{info.file} is truncated while reading {name}")
        return buf.view(info.dtype).reshape(info.shape)
