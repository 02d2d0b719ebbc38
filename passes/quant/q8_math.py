"""8- and 6-bit block quantization of a [K, N] weight (`--q-bits 8`; `--quant mixed`'s 6- and
8-bit tensors): the min/max formula of passes/quant/quantize.py with L = 2^bits - 1 steps (255
at 8 bits, 63 at 6) instead of 15, codes and zero points one byte each (uint8 below 2^bits).

    asymmetric:  lo = min(w, 0), hi = max(w, 0); s = fp16((hi - lo) / L)
                 zp = clip(rint(-lo / s), 0, L)
    symmetric:   s = fp16(max|w| / (H - 1)), zp = H = 2^(bits-1) (128 at 8 bits, 32 at 6)
    codes = clip(rint(w / s) + zp, 0, L)

At 8 bits the rounding error is ~1/16 of 4-bit's (at 6 bits ~1/4), below what an
error-minimizing search or calibration would move, so neither runs. One search does: a block
whose values already sit on a grid of at most L steps that holds 0 (a checkpoint dequantized
from llama.cpp's Q8_0 or Q5_0 at 8 bits, Q5_0 or a 4-bit type without mins at 6) is stored on
that grid, exactly, where min/max's step would round every value off it: the candidate steps of
passes/quant/grid_steps.py, each kept for a block only where its squared error drops below
min/max's (the record says "minmax+grid"). Same container as 4-bit (Q4Tensor: codes, float16
scales, zero points, block size, error); 6-bit codes are packed when written
(passes/ops.py `pack_uint6`).
"""

from __future__ import annotations

import numpy as np

from fuselm.passes.quant.grid_steps import grid_candidates
from fuselm.passes.quant.q4_math import Q4Tensor, minmax_params

_SLAB = 4096  # columns at a time: bounds the float32 temporaries


WIDE_BITS = (6, 8)


def quantize_wide(w: np.ndarray, block_size: int = 32, symmetric: bool = False,
                  grid: bool = True, bits: int = 8) -> Q4Tensor:
    """[K, N] float weight → `bits`-bit codes [K, N] (uint8), float16 scales and uint8 zero
    points [ceil(K/B), N]; a partial last block from its own values (zero padding holds 0,
    which changes no min/max and sits on every grid). `grid`: the grid search (else min/max
    only)."""
    if bits not in WIDE_BITS:
        raise ValueError(f"{bits}-bit codes are not a wide form; valid: {WIDE_BITS}")
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
        s16, s, zp, _, _ = minmax_params(blocks, symmetric, bits=bits)
        if grid:
            s, zp = _grid_search(blocks, s, zp, symmetric, bits)
        s16 = s.astype(np.float16)
        q = _codes(blocks, s, zp, bits)
        d = (q - zp[:, None, :]) * s[:, None, :] - blocks
        sse += float(np.vdot(d, d))
        ssw += float(np.vdot(blocks, blocks))
        codes[:, c0:c1] = q.reshape(-1, c1 - c0)[:k]
        scales[:, c0:c1] = s16
        zps[:, c0:c1] = zp
    rel = float(np.sqrt(sse / ssw)) if ssw > 0 else 0.0
    return Q4Tensor(codes, scales, zps, block_size, rel)


def _codes(blocks: np.ndarray, s: np.ndarray, zp: np.ndarray, bits: int) -> np.ndarray:
    """clip(rint(w / s) + zp, 0, 2^bits - 1) as float32 [nb, B, n]; every code at zp where
    s == 0."""
    zero = s == 0
    q = np.rint(np.divide(blocks, np.where(zero, np.float32(1), s)[:, None, :]))
    q += zp[:, None, :]
    q = np.where(zero[:, None, :], zp[:, None, :], q)
    return np.clip(q, 0, (1 << bits) - 1, out=q)


def _sse(blocks: np.ndarray, s: np.ndarray, zp: np.ndarray, bits: int) -> np.ndarray:
    d = (_codes(blocks, s, zp, bits) - zp[:, None, :]) * s[:, None, :] - blocks
    return np.einsum("bkn,bkn->bn", d, d)


def _grid_search(blocks: np.ndarray, s: np.ndarray, zp: np.ndarray, symmetric: bool,
                 bits: int) -> tuple[np.ndarray, np.ndarray]:
    """min/max's (s, zp), moved per block to a grid step of passes/quant/grid_steps.py where
    that block's squared error is strictly smaller (ties keep min/max)."""
    levels, half = (1 << bits) - 1, 1 << (bits - 1)
    lo = np.minimum(blocks.min(axis=1), 0)
    span = np.abs(blocks).max(axis=1) if symmetric else np.maximum(blocks.max(axis=1), 0) - lo
    steps = grid_candidates(blocks, span, half if symmetric else levels)
    if not steps:
        return s, zp
    best = _sse(blocks, s, zp, bits)
    for step in steps:
        with np.errstate(over="ignore"):
            cs = np.where(np.isnan(step), s, step).astype(np.float16).astype(np.float32)
        if symmetric:
            czp = zp
        else:
            czp = np.clip(np.rint(-lo / np.where(cs == 0, np.float32(1), cs)), 0, levels)
            czp[cs == 0] = 0
        err = _sse(blocks, cs, czp, bits)
        better = err < best
        s, zp, best = (np.where(better, cs, s), np.where(better, czp, zp),
                       np.where(better, err, best))
    return s, zp
