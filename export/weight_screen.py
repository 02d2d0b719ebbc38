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

import torch

from fuselm.export.errors import ExportError

_CHUNK = 1 << 22  # elements per reduction: cache-sized, so the screen adds one read pass
# Round-to-nearest-even sends |x| >= 65520 (halfway between float16's largest finite value,
# 65504, and the next power of two) to inf; anything below rounds to a finite float16.
_F16_OVERFLOW = 65520.0


@dataclass
class WeightScreen:
    """Call once per tensor, with its checkpoint name, before it is cast to `out_dtype`."""

    out_dtype: torch.dtype
    allow_nonfinite: bool = False
    nonfinite: list[str] = field(default_factory=list)  # tensors let through (allowed)

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        if not tensor.dtype.is_floating_point or tensor.numel() == 0:
            return
        lo, hi = math.inf, -math.inf
        for chunk in tensor.reshape(-1).split(_CHUNK):
            mn, mx = torch.aminmax(chunk)
            a, b = float(mn), float(mx)
            if not (math.isfinite(a) and math.isfinite(b)):
                self._nonfinite(name, tensor)
                return
            lo, hi = min(lo, a), max(hi, b)
        narrowing = self.out_dtype == torch.float16 and tensor.dtype != torch.float16
        if narrowing and max(-lo, hi) >= _F16_OVERFLOW:
            raise ExportError(
                f"tensor {name} holds values up to {max(-lo, hi):.4g}, beyond float16's range "
                f"(+-65504): as float16 they would become inf. Convert with --dtype float32"
            )

    def _nonfinite(self, name: str, tensor: torch.Tensor) -> None:
        if self.allow_nonfinite:
            self.nonfinite.append(name)
            return
        nans = int(torch.isnan(tensor).sum())  # the failure path: counting may cost a copy
        infs = int(torch.isinf(tensor).sum())
        raise ExportError(
            f"tensor {name} in the checkpoint holds non-finite values ({nans} NaN, {infs} inf "
            f"of {tensor.numel()}); the model would compute NaN logits. Fix or re-download the "
            "checkpoint, or pass --allow-nonfinite to convert it anyway"
        )
