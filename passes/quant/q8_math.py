"""8-bit block quantization of a [K, N] weight (`--q-bits 8`): the min/max formula of
passes/quant/quantize.py with 255 steps instead of 15, uint8 codes and zero points.

    asymmetric:  lo = min(w, 0), hi = max(w, 0); s = fp16((hi - lo) / 255)
                 zp = clip(rint(-lo / s), 0, 255)
    symmetric:   s = fp16(max|w| / 127), zp = 128
    codes = clip(rint(w / s) + zp, 0, 255)

At 8 bits the rounding error is ~1/16 of 4-bit's, below what an error-minimizing search or
calibration would move, so neither runs (the record says "minmax"). Same container as 4-bit
(Q4Tensor: codes, float16 scales, zero points, block size, error).
"""

from __future__ import annotations

import numpy as np

from fuselm.passes.quant.q4_math import Q4Tensor, minmax_params

_SLAB = 4096  # columns at a time: bounds the float32 temporaries


def quantize_8bit(w: np.ndarray, block_size: int = 32, symmetric: bool = False) -> Q4Tensor:
    """[K, N] float weight → uint8 codes [K, N], float16 scales and uint8 zero points
    [ceil(K/B), N]; a partial last block from its own values (zero padding holds 0, which
    changes no min/max)."""
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D [K, N] weight, got shape {w.shape}")
    k, n = w.shape
    nb = -(-k // block_size)
    codes = np.empty((k, n), np.uint8)
    scales = np.empty((nb, n), np.float16)
    zps = np.empty((nb, n), np.uint8)
    sse = ssw = 0.0
    for c0 in range(0, n, _SLAB):
        c1 = min(n, c0 + _SLAB)
        wf = np.ascontiguousarray(w[:, c0:c1], dtype=np.float32)
        if not np.isfinite(wf).all():
            raise ValueError("weight has NaN or Inf values; refusing to quantize")
        pad = nb * block_size - k
        if pad:
            wf = np.concatenate([wf, np.zeros((pad, c1 - c0), np.float32)])
        blocks = wf.reshape(nb, block_size, c1 - c0)
        s16, s, zp, safe, zero = minmax_params(blocks, symmetric, bits=8)
        q = np.rint(np.divide(blocks, safe[:, None, :])) + zp[:, None, :]
        q = np.where(zero[:, None, :], zp[:, None, :], q)
        np.clip(q, 0, 255, out=q)
        d = (q - zp[:, None, :]) * s[:, None, :] - blocks
        sse += float(np.vdot(d, d))
        ssw += float(np.vdot(blocks, blocks))
        codes[:, c0:c1] = q.reshape(-1, c1 - c0)[:k]
        scales[:, c0:c1] = s16
        zps[:, c0:c1] = zp
    rel = float(np.sqrt(sse / ssw)) if ssw > 0 else 0.0
    return Q4Tensor(codes, scales, zps, block_size, rel)
