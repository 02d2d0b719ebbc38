"""A checkpoint seen through a change: every question goes to the base checkpoint unless the
view answers it itself. The LoRA merge (export/lora.py) and the AWQ / GPTQ reader
(export/quantized/checkpoint.py) are such views over the safetensors checkpoint; each
overrides only what it changes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fuselm.export.safetensors.checkpoint import Checkpoint

if TYPE_CHECKING:
    import torch


class CheckpointView:
    """Answers as `base` does: its folder, files, tensors, dtype and values."""

    def __init__(self, base: Checkpoint) -> None:
        self.base = base
        self.root, self.files = base.root, base.files

    @property
    def tensors(self) -> dict[str, Any]:
        return self.base.tensors

    @property
    def dtype_name(self) -> str:
        return self.base.dtype_name

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def nbytes(self) -> int:
        return self.base.nbytes

    def has(self, name: str) -> bool:
        return self.base.has(name)

    def info(self, name: str) -> Any:
        return self.base.info(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def array(self, name: str) -> np.ndarray:
        return self.base.array(name)

    def get(self, name: str) -> torch.Tensor:
        return self.base.get(name)

    def same_values(self, a: str, b: str) -> bool:
        return self.base.same_values(a, b)
