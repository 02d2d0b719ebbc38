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


@dataclass
class WeightScreen:
    """Call once per tensor, with its checkpoint name, before it is cast to `out_dtype`."""

    out_dtype: Any  # torch.float16/float32, or its name ("float16"): the graph's dtype
    allow_nonfinite: bool = False
    nonfinite: list[str] = field(default_factory=list)  # tensors let through (allowed)

    def __call__(self, name: str, tensor: Any) -> None:
        """`tensor`: a torch tensor (the exporter's) or a NumPy array (the GGUF builder's)."""
        is_array = isinstance(tensor, np.ndarray)
        if is_array:
            if tensor.dtype.kind != "f" or tensor.size == 0:
                return
            chunks = np.array_split(tensor.reshape(-1), max(1, -(-tensor.size // _CHUNK)))
            minmax = ((c.min(), c.max()) for c in chunks)
        else:
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
