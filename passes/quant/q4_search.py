"""Choose each 4-bit block's scale and zero point to minimize its reconstruction error.

The stored format does not change (uint4 codes, uint4 zero point, float16-representable scale,
w' = (q - zp) * s); only the choice of (s, zp) per block does. Plain min/max spends the grid on
the block's extremes: one outlier stretches the step for the other 31 weights. Here, per block:

1. a grid of clipping ranges: s = fp16(r * (hi - lo) / 15) for a few ratios r <= 1, zero point
   rint(-r * lo / s) (the range shrunk toward 0, which the grid always holds), r = 1 first: that
   candidate IS min/max;
   then the steps of a grid the block's values may already sit on with fewer levels than
   min/max spreads over them (passes/quant/grid_steps.py: a weight dequantized from a coarser
   or reduced 4-bit grid that holds 0 comes back exactly), zero point rint(-lo / s);
2. keep, per block, the candidate with the smallest sum of squared errors (ties keep the earlier,
   so min/max wins ties);
3. alternating least squares from the winner (the idea of llama.cpp's `make_qkx2_quants` and of
   HQQ's proximal updates, written for an integer zero point): with the codes fixed, fit
   w ~ a * q + b by least squares, take zp = rint(-b / a) (clipped to 0..15), refit s given zp,
   round it to float16, requantize, and accept the new (s, zp) only where a block's error drops.

Every candidate is evaluated exactly as it will be stored (float16 scale, codes =
clip(rint(w / s) + zp, 0, 15) with true division), and a block only ever moves to a strictly
smaller error, so no block is ever worse than min/max; a block that min/max reproduces exactly
(a weight on a 4-bit grid) stays exact, and so does one on a reduced grid that a grid step
finds. Pure NumPy on float32, no randomness: deterministic.

Optional per-row importance (a weight per input channel, e.g. mean squared activation) turns
the squared error into an importance-weighted one; the min/max guarantee then holds for that
weighted error.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from types import ModuleType

import numpy as np

from fuselm.passes.quant.grid_steps import grid_candidates

# Clipping ratios (r = 1 is min/max) and alternating steps. Measured on a Student-t (df 3)
# [1024, 2048] tensor at block 32 (relative RMS error; min/max 0.1022): one ALS step alone
# 0.1003, these five ratios + one step 0.0996, seven ratios + two steps 0.0995 at 1.8x the
# time, an exhaustive 141 ratios x 16 zero points 0.0997 (ALS may also raise the scale).
RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)
ALS_STEPS = 1
_QMAX = 15
_FP16_MAX = float(np.finfo(np.float16).max)
# Use the compiled loops (passes/quant/q4_kernels.py: same results, ~4x less CPU) when Numba is
# there; NumPy alone gives the same bits (the tests compare both forms bit for bit).
COMPILED = importlib.util.find_spec("numba") is not None
# ...but only for models of at least this many quantized weights: importing Numba costs ~112 MB
# of resident memory and ~1 s, more than the NumPy search costs a small model (SmolLM2's 134M
# weights: the GGUF conversion's peak must stay within 1.5x its float16 size, 403 MB).
COMPILED_MIN_WEIGHTS = 300_000_000
_small_model = False


@contextlib.contextmanager
def for_model(weights: int) -> Iterator[None]:
    """Within: the searches of one model of `weights` quantized weights (NumPy below
    COMPILED_MIN_WEIGHTS; the same bits either way)."""
    global _small_model
    before, _small_model = _small_model, weights < COMPILED_MIN_WEIGHTS
    try:
        yield
    finally:
        _small_model = before


def use_compiled() -> bool:
    return COMPILED and not _small_model
_NONE = np.zeros((0, 0), np.float32)  # "no importance" for the compiled loops


def kernels() -> ModuleType:
    """passes/quant/q4_kernels.py, imported on first use: Numba's import costs ~1 s, which every
    CLI command importing the converter would otherwise pay."""
    from fuselm.passes.quant import q4_kernels

    return q4_kernels


def _fp16(s: np.ndarray) -> np.ndarray:
    """Round onto the float16 grid (kept as float32); out-of-range values become inf."""
    with np.errstate(over="ignore"):
        return s.astype(np.float16).astype(np.float32)


def _centered_codes(
    blocks: np.ndarray, s: np.ndarray, zp: np.ndarray, out: np.ndarray
) -> np.ndarray:
    """q - zp for q = clip(rint(w / s) + zp, 0, 15), as float32 into `out` (zp is integral)."""
    safe = np.where(s == 0, np.float32(1), s)
    np.divide(blocks, safe[:, None, :], out=out)
    np.rint(out, out=out)
    np.maximum(out, -zp[:, None, :], out=out)
    np.minimum(out, (_QMAX - zp)[:, None, :], out=out)
    zero = s == 0
    if zero.any():  # a zero scale stores every code at the zero point
        out[np.broadcast_to(zero[:, None, :], out.shape)] = 0
    return out


def _sse(
    blocks: np.ndarray,
    c: np.ndarray,
    s: np.ndarray,
    importance: np.ndarray | None,
    tmp: np.ndarray,
) -> np.ndarray:
    """Per-block (importance-weighted) sum of squared errors of c * s against the weights."""
    np.multiply(c, s[:, None, :], out=tmp)
    np.subtract(tmp, blocks, out=tmp)
    np.multiply(tmp, tmp, out=tmp)
    if importance is not None:
        tmp *= importance
    return tmp.sum(axis=1)


def search_params(
    blocks: np.ndarray,
    symmetric: bool = False,
    importance: np.ndarray | None = None,
    ratios: tuple[float, ...] = RATIOS,
    als_steps: int = ALS_STEPS,
    grid: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Scales (float16) and zero points (float32, integral) for float32 blocks [nb, B, n].

    `importance`, if given, is [nb, B, 1] (one non-negative weight per row of each block).
    Symmetric mode keeps zp = 8 and searches the scale only (from max|w| / 7 down).
    `grid`: also try the steps of a grid the values already sit on (passes/quant/grid_steps.py).
    """
    # One column: NumPy sums it in another order (pairwise), which the compiled loops do not.
    fast = use_compiled() and blocks.dtype == np.float32 and blocks.shape[2] > 1
    if fast:
        c = tmp = blocks  # unused: the compiled loops make no temporaries
        # the compiled loops' importance: [nb, B] (or empty); None selects the NumPy forms
        kimp = _NONE if importance is None else np.ascontiguousarray(importance[:, :, 0])
        nb, _, n = blocks.shape
        raw_lo, hi, amax = (np.empty((nb, n), np.float32) for _ in range(3))
        kernels().block_range(blocks, raw_lo, hi, amax)
        lo = np.minimum(raw_lo, 0)
    else:
        kimp = None
        c = np.empty_like(blocks)
        tmp = np.empty_like(blocks)
        lo = np.minimum(blocks.min(axis=1), 0)
    if symmetric:
        span = amax if fast else np.abs(blocks).max(axis=1)
        base = span / np.float32(7)
    else:
        span = np.maximum(hi if fast else blocks.max(axis=1), 0) - lo
        base = span / np.float32(_QMAX)
    if float(base.max(initial=0.0)) > _FP16_MAX:
        raise ValueError("a block's range exceeds float16 scales (|w| > ~1e6); cannot quantize")
    best_s = best_zp = best_err = None
    # the clipping ratios, then the steps of a grid the block's values may already sit on
    # (a clipping candidate's zero point is of its range shrunk toward 0: lo * r)
    steps = [(base * np.float32(r), np.float32(r)) for r in ratios]
    if grid:
        # NumPy's sort in both forms: exact, so the same bits
        steps += [(g, np.float32(1))
                  for g in grid_candidates(blocks, span, 8 if symmetric else _QMAX)]
    for step, r in steps:
        s = _fp16(np.where(np.isnan(step), base, step))  # no grid step: min/max again
        if symmetric:
            zp = np.full(s.shape, 8, np.float32)
        else:
            safe = np.where(s == 0, np.float32(1), s)
            zp = np.clip(np.rint(-(lo * r) / safe), 0, _QMAX)
            zp[s == 0] = 0
        err = _errors(blocks, s, zp, importance, c, tmp, kimp)
        if best_err is None:
            best_s, best_zp, best_err = s, zp, err
            continue
        better = err < best_err
        best_s = np.where(better, s, best_s)
        best_zp = np.where(better, zp, best_zp)
        best_err = np.where(better, err, best_err)
    assert best_s is not None and best_zp is not None and best_err is not None
    for _ in range(als_steps):
        s, zp = _least_squares(blocks, best_s, best_zp, symmetric, importance, c, tmp,
                               kimp)
        err = _errors(blocks, s, zp, importance, c, tmp, kimp)
        better = err < best_err
        if not better.any():
            break
        best_s = np.where(better, s, best_s)
        best_zp = np.where(better, zp, best_zp)
        best_err = np.where(better, err, best_err)
    return best_s.astype(np.float16), best_zp


def _errors(
    blocks: np.ndarray,
    s: np.ndarray,
    zp: np.ndarray,
    importance: np.ndarray | None,
    c: np.ndarray,
    tmp: np.ndarray,
    kimp: np.ndarray | None,
) -> np.ndarray:
    """Per-block error of the candidate (s, zp): compiled when `kimp` is given, else NumPy."""
    if kimp is None:
        _centered_codes(blocks, s, zp, c)
        return _sse(blocks, c, s, importance, tmp)
    err = np.empty_like(s)
    kernels().sse(blocks, s, zp, kimp, err)
    return err


def _least_squares(
    blocks: np.ndarray,
    s0: np.ndarray,
    zp0: np.ndarray,
    symmetric: bool,
    importance: np.ndarray | None,
    c: np.ndarray,
    tmp: np.ndarray,
    kimp: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """One alternating step: given the codes q = c + zp of (s0, zp0), the (s, zp) that fit them
    best. The sums are compiled when `kimp` is given (see _errors), else NumPy.

    Asymmetric: least-squares line w ~ a*q + b, zp = clip(rint(-b/a)); then s given that zp.
    Symmetric: s only. Degenerate blocks (all codes equal, a <= 0, non-finite) keep s = 0,
    which the caller's error test then rejects unless the block is all zeros.
    """
    zp = zp0
    if kimp is None:
        c = _centered_codes(blocks, s0, zp0, c)

    def wsum(x: np.ndarray) -> np.ndarray:
        if importance is None:
            return x.sum(axis=1)
        np.multiply(x, importance, out=tmp)
        return tmp.sum(axis=1)

    if importance is None:
        sw = np.full(zp.shape, np.float32(blocks.shape[1]))
    elif kimp is None:
        sw = np.broadcast_to(importance, blocks.shape).sum(axis=1)
    else:  # the same sequential float32 sum as NumPy's, over [nb] instead of [nb, B, n]
        col = np.zeros(len(kimp), np.float32)
        for k in range(kimp.shape[1]):
            col += kimp[:, k]
        sw = np.broadcast_to(col[:, None], zp.shape)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if not symmetric:
            if kimp is None:
                q = c + zp[:, None, :]
                sq = wsum(q)
                sy = wsum(blocks)
                sqq = wsum(q * q)
                sqy = wsum(q * blocks)
            else:
                sq, sy, sqq, sqy = (np.empty_like(s0) for _ in range(4))
                kernels().line_sums(blocks, s0, zp0, kimp, sq, sy, sqq, sqy)
            den = sw * sqq - sq * sq
            a = (sw * sqy - sq * sy) / den
            b = (sy - a * sq) / sw
            zp = np.clip(np.rint(-b / a), 0, _QMAX)
            zp = np.where(np.isfinite(zp) & (a > 0), zp, 0).astype(np.float32)
            if kimp is None:
                c = q - zp[:, None, :]
        if kimp is None:
            s = wsum(c * blocks) / wsum(c * c)
        else:
            num, den = np.empty_like(s0), np.empty_like(s0)
            kernels().scale_sums(blocks, s0, zp0, zp, kimp, num, den)
            s = num / den
    s = np.where(np.isfinite(s) & (s > 0) & (s < _FP16_MAX), s, 0).astype(np.float32)
    return _fp16(s), zp
