"""Weights screened while they stream to model.onnx.data: NaN/Inf and float16 overflow.

A single NaN in one weight makes every logit NaN (greedy then prints token 0 forever), and a
bf16/float32 value beyond float16's range silently becomes inf under `--dtype float16`. Both
are caught here, naming the tensor, before the artifact exists. The screen runs on the tensor
the exporter has already read, one reduction (min and max) per chunk of it: no second copy
of the weights, a few bytes of temporaries, and NaN/Inf show up as a NaN/Inf min or max.
`--allow-nonfinite` turns the NaN/Inf refusal into a record of the tensors (fuselm.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fuselm.export.errors import ExportError

_CHUNK = 1 << 22  # elements per reduction: cache-sized, so the screen adds one read pass
# Round-to-nearest-even sends |x| >= 65520 (halfway between float16's largest finite value,
# 65504, and the next power of two) to inf; anything below rounds to a finite float16.
_F16_OVERFLOW = 65520.0
# float dtype name -> (unsigned type of its width, the bits of +inf: |x| bits >= it is NaN/Inf)
_FLOAT_BITS: dict[str, tuple[type, int]] = {
    "float16": (np.uint16, 0x7C00),
    "bfloat16": (np.uint16, 0x7F80),
    "float32": (np.uint32, 0x7F800000),
    "float64": (np.uint64, 0x7FF0000000000000),
}


@dataclass
class WeightScreen:
    """Call once per tensor, with its checkpoint name, before it is cast to `out_dtype`."""

    out_dtype: Any  # torch.float16/float32, or its name ("float16"): the graph's dtype
    allow_nonfinite: bool = False
    nonfinite: list[str] = field(default_factory=list)  # tensors let through (allowed)

    def __call__(self, name: str, tensor: Any) -> None:
        """`tensor`: a torch tensor (the exporter's) or a NumPy array (the graph builder's;
        bfloat16 as ml_dtypes', whose NumPy kind is "V")."""
        if isinstance(tensor, np.ndarray):
            if tensor.dtype.name in _FLOAT_BITS and tensor.size:
                self._screen_bits(name, tensor)
            return
        import torch

        if not tensor.dtype.is_floating_point or tensor.numel() == 0:
            return
        minmax = (torch.aminmax(c) for c in tensor.reshape(-1).split(_CHUNK))
        lo, hi = math.inf, -math.inf
        for mn, mx in minmax:
            a, b = float(mn), float(mx)
            if not (math.isfinite(a) and math.isfinite(b)):
                self._nonfinite(name, tensor)
                return
            lo, hi = min(lo, a), max(hi, b)
        narrowing = str(self.out_dtype).removeprefix("torch.") == "float16" and str(
            tensor.dtype).removeprefix("torch.") != "float16"
        if narrowing and max(-lo, hi) >= _F16_OVERFLOW:
            raise ExportError(
                f"tensor {name} holds values up to {max(-lo, hi):.4g}, beyond float16's range "
                f"(+-65504): as float16 they would become inf. Convert with --dtype float32"
            )

    def _screen_bits(self, name: str, a: np.ndarray) -> None:
        """The NumPy screen on the values' bits: |x| is x's bits without the sign bit, ordered
        as the magnitudes are, and NaN/Inf are the bit patterns from the infinity's up. One
        integer max per chunk, which NumPy vectorizes for every width (its float16 / bfloat16
        min and max run an element at a time: ~30x slower)."""
        uint, inf_bits = _FLOAT_BITS[a.dtype.name]
        mask = uint(np.iinfo(uint).max >> 1)
        flat = a.reshape(-1).view(uint)
        top = 0
        for c0 in range(0, flat.size, _CHUNK):
            top = max(top, int(np.bitwise_and(flat[c0:c0 + _CHUNK], mask).max()))
        if top >= inf_bits:
            self._nonfinite(name, a)
            return
        narrowing = str(self.out_dtype).removeprefix("torch.") == "float16" and \
            a.dtype.name != "float16"
        biggest = float(np.array([top], uint).view(a.dtype)[0])
        if narrowing and biggest >= _F16_OVERFLOW:
            raise ExportError(
                f"tensor {name} holds values up to {biggest:.4g}, beyond float16's range "
                f"(+-65504): as float16 they would become inf. Convert with --dtype float32"
            )

    def _nonfinite(self, name: str, tensor: Any) -> None:
        if self.allow_nonfinite:
            self.nonfinite.append(name)
            return
        # the failure path: counting may cost a copy
        nans = int(np.isnan(tensor).sum()) if isinstance(tensor, np.ndarray) else int(
            tensor.isnan().sum())
        infs = int(np.isinf(tensor).sum()) if isinstance(tensor, np.ndarray) else int(
            tensor.isinf().sum())
        size = tensor.size if isinstance(tensor, np.ndarray) else tensor.numel()
        raise ExportError(
            f"tensor {name} in the checkpoint holds non-finite values ({nans} NaN, {infs} inf "
            f"of {size}); the model would compute NaN logits. Fix or re-download the "
            "checkpoint, or pass --allow-nonfinite to convert it anyway"
        )
