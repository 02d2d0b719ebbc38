"""The NumPy core of 4-bit block quantization: the formula, vectorized, and uint4 packing.

passes/quant/quantize.py documents the scheme (rounding rule, symmetric form, partial blocks) and
applies it to graphs; this module only turns arrays into codes, scales and zero points.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from onnx import TensorProto

from fuselm.passes import ops
from fuselm.passes.quant import q4_search
from fuselm.passes.quant.q4_gptq import gptq_params
from fuselm.passes.quant.q4_search import search_params

SYMMETRIC_ZERO_POINT = 8
METHODS = ("search", "minmax")
_SLAB = 1024  # columns per slab in quantize_array: bounds the temporaries' size
# Slabs quantized at once (threads): one per core available to this process, at most 4, since
# each holds ~6 float32 temporaries of K x _SLAB (a 14336-row weight: ~60 MB each).
_CORES = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")  # Linux
          else os.cpu_count() or 1)  # macOS has no affinity call
THREADS = max(1, min(4, _CORES))
_FP16_MAX = float(np.finfo(np.float16).max)
# Elements per tile of the compiled search (passes/quant/q4_kernels.py): a column slab is cut into
# row tiles of whole blocks of about this size (4 MB of float32). Measured on [4096, 4096]:
# 2^16 → 0.51 s, 2^17 → 0.41 s, 2^20 → 0.32 s (fewer of the per-block NumPy steps, whose
# cost is per call); the tiles of all threads together stay far below the weight's own size.
_TILE = 1 << 20


@dataclass
class Q4Tensor:
    """A [K, N] weight quantized along axis 0 (codes uint8 in 0..15 until written)."""

    codes: np.ndarray  # uint8 [K, N], values 0..15
    scales: np.ndarray  # float16 [ceil(K/B), N]
    zero_points: np.ndarray  # uint8 [ceil(K/B), N], values 0..15
    block_size: int
    rel_rms_error: float | None = None  # sqrt(sum (w' - w)^2 / sum w^2), set by quantize_array

    def dequantize(self, dtype: np.dtype | type = np.float32) -> np.ndarray:
        return ops.dequantize_reference(
            self.codes, self.scales.astype(dtype), self.zero_points, self.block_size
        )


def mixed_bits_per_weight(bits: int, block_size: int) -> float:
    """Stored bits per weight of `bits`-bit blocks: the codes + a float16 scale + a zero point
    per block, uint4 with 4-bit codes, uint8 with 6- and 8-bit ones."""
    return bits + (16 + (4 if bits == 4 else 8)) / block_size


def _blocks(w: np.ndarray, block_size: int) -> tuple[np.ndarray, int]:
    """[K, N] -> [nb, B, N] with the partial last block padded with zeros.

    The range of a block always holds 0 (lo = min(w, 0), hi = max(w, 0)) and 0 is always
    reproduced exactly (code = zero point), so zero rows change no min/max, add no error to any
    candidate of the search, and never influence a scale or zero point; they are dropped after.
    """
    k, n = w.shape
    nb = -(-k // block_size)
    pad = nb * block_size - k
    if pad:
        w = np.concatenate([w, np.zeros((pad, n), w.dtype)], axis=0)
    return w.reshape(nb, block_size, n), pad


def quantize_array(
    w: np.ndarray,
    block_size: int = 32,
    symmetric: bool = False,
    method: str = "search",
    importance: np.ndarray | None = None,
    grid: bool = True,
) -> Q4Tensor:
    """Quantize a [K, N] float weight along K in blocks of `block_size` (see module doc).

    method "minmax": each block's scale and zero point from its range (passes/quant/quantize.py's
    formula); "search": chosen to minimize the block's reconstruction error
    (passes/quant/q4_search.py), never worse than min/max. `importance` ([K], non-negative, search
    only) weights each input row's squared error. `grid` (search only): also the steps of a grid
the values already sit on (passes/quant/grid_steps.py).

    Works on slabs of columns so the float32 temporaries stay in cache (about 4x faster than
    whole-tensor NumPy on a [1024, 151936] table); columns are independent, so the result is
    the same for any slab width and any number of threads working on the slabs.
    """
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D [K, N] weight, got shape {w.shape}")
    if method not in METHODS:
        raise ValueError(f"method {method!r} not supported; valid values: {METHODS}")
    k, n = w.shape
    nb = -(-k // block_size)
    imp = None
    if importance is not None:
        imp, _ = _blocks(np.asarray(importance, np.float32).reshape(k, 1), block_size)
    # Compiled: bit-equal scales, zero points and codes (tests/passes/test_q4_kernels.py); the
    # error sums are float64 there, float32 BLAS dots in the NumPy form (rel_rms_error may differ
    # in its last digits).
    compiled = q4_search.use_compiled() and method == "search"
    kernels = q4_search.kernels() if compiled else None
    half = compiled and w.dtype == np.float16
    bits = w.view(np.uint16) if half else None
    codes = np.empty((k, n), np.uint8)
    scales = np.empty((nb, n), np.float16)
    zps = np.empty((nb, n), np.uint8)

    def tile(c0: int, c1: int, b0: int, b1: int, buf: np.ndarray | None) -> tuple[float, float]:
        """Blocks b0..b1 of columns c0..c1 through the compiled search and encoder (`buf`: the
        slab's reused float32 tile, so no fresh pages are faulted in per tile)."""
        r0, r1 = b0 * block_size, min(k, b1 * block_size)
        if half:
            blocks = buf[: b1 - b0]
            finite = kernels.load_half(bits[r0:r1, c0:c1], kernels.HALF_TO_FLOAT, blocks)
        else:
            wf = np.ascontiguousarray(w[r0:r1, c0:c1], dtype=np.float32)
            finite = bool(np.isfinite(wf).all())
            blocks, _ = _blocks(wf, block_size)
        if not finite:
            raise ValueError("weight has NaN or Inf values; refusing to quantize")
        s16, zp = search_params(blocks, symmetric, None if imp is None else imp[b0:b1],
                                grid=grid)
        scales[b0:b1, c0:c1] = s16
        zps[b0:b1, c0:c1] = zp
        return kernels.encode(blocks, s16.astype(np.float32), zp, r1 - r0, codes[r0:r1, c0:c1])

    def slab(c0: int) -> tuple[float, float]:
        c1 = min(n, c0 + _SLAB)
        if compiled:
            step = min(nb, max(1, _TILE // (block_size * (c1 - c0))))
            buf = np.empty((step, block_size, c1 - c0), np.float32) if half else None
            sums = [tile(c0, c1, b0, min(nb, b0 + step), buf) for b0 in range(0, nb, step)]
            return sum(a for a, _ in sums), sum(b for _, b in sums)
        # C order per slab: a transposed view (tied or Transpose-fed weights) is re-laid out
        # one cache-sized slab at a time instead of as one slow whole-table transpose.
        wf = np.ascontiguousarray(w[:, c0:c1], dtype=np.float32)
        if not np.isfinite(wf).all():
            raise ValueError("weight has NaN or Inf values; refusing to quantize")
        blocks, _ = _blocks(wf, block_size)
        if method == "search":
            s16, zp = search_params(blocks, symmetric, imp, grid=grid)
            s = s16.astype(np.float32)
            safe = np.where(s == 0, np.float32(1), s)
            zero = s == 0
        else:
            s16, s, zp, safe, zero = minmax_params(blocks, symmetric)
        q = np.divide(blocks, safe[:, None, :])  # true division, not a reciprocal multiply
        np.rint(q, out=q)  # round half to even
        q += zp[:, None, :]
        if zero.any():  # a zero scale: every code is the zero point (dequantizes to 0)
            mask = np.broadcast_to(zero[:, None, :], q.shape)
            q[mask] = np.broadcast_to(zp[:, None, :], q.shape)[mask]
        np.clip(q, 0, 15, out=q)
        codes[:, c0:c1] = q.reshape(-1, c1 - c0)[:k]
        # The reconstruction error, accumulated here so no whole dequantized copy is made
        # (zero padding rows add nothing to either sum).
        d = np.subtract(q, zp[:, None, :])
        d *= s[:, None, :]
        d -= blocks
        scales[:, c0:c1] = s16
        zps[:, c0:c1] = zp
        return float(np.vdot(d, d)), float(np.vdot(blocks, blocks))  # BLAS: fast

    starts = range(0, n, _SLAB)
    if len(starts) > 1 and THREADS > 1:
        # Slabs are independent and NumPy releases the GIL inside its loops: the cores share
        # them. Each writes its own columns; the sums are added in slab order (deterministic).
        with ThreadPoolExecutor(THREADS) as pool:
            sums = list(pool.map(slab, starts))
    else:
        sums = [slab(c0) for c0 in starts]
    sse = sum(a for a, _ in sums)
    ssw = sum(b for _, b in sums)
    rel = float(np.sqrt(sse / ssw)) if ssw > 0 else 0.0
    return Q4Tensor(codes, scales, zps, block_size, rel)


def minmax_params(
    blocks: np.ndarray, symmetric: bool, bits: int = 4
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Plain min/max for `bits`-bit codes (4, or 6 and 8 for passes/quant/q8_math.py): float16
    scales, float32 scales, zero points, safe divisors, zero mask."""
    levels = (1 << bits) - 1  # 15 steps at 4 bits, 255 at 8
    half = 1 << (bits - 1)  # the symmetric zero point: 8 at 4 bits, 32 at 6, 128 at 8
    if symmetric:
        step = np.abs(blocks).max(axis=1) / np.float32(half - 1)
    else:
        lo = np.minimum(blocks.min(axis=1), 0)
        step = (np.maximum(blocks.max(axis=1), 0) - lo) / np.float32(levels)
    if float(step.max(initial=0.0)) > _FP16_MAX:
        bound = "1e6" if bits == 4 else "1e7"
        raise ValueError(f"a block's range exceeds float16 scales (|w| > ~{bound}); cannot "
                         "quantize")
    s16 = step.astype(np.float16)  # round-to-nearest-even onto the float16 grid
    s = s16.astype(np.float32)
    zero = s == 0
    safe = np.where(zero, np.float32(1), s)
    if symmetric:
        zp = np.full(s.shape, half, np.float32)
    else:
        zp = np.rint(-lo / safe)
        np.clip(zp, 0, levels, out=zp)
        zp[zero] = 0
    return s16, s, zp, safe, zero


def to_uint4(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.uint4)


def uint4_tensor(codes: np.ndarray, name: str) -> TensorProto:
    """A UINT4 initializer from uint8 values 0..15, packed as onnx packs it (first element in
    the low nibble, odd counts padded with a zero nibble); ~10x faster than numpy_helper's
    element-wise path on a 155M-entry table, and byte-identical to it."""
    flat = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    packed = flat[0::2] | (flat[1::2] << 4)
    t = TensorProto(name=name, data_type=TensorProto.UINT4, dims=list(codes.shape))
    t.raw_data = packed.tobytes()
    return t


def quantize_gptq(
    w: np.ndarray, gram: np.ndarray, block_size: int = 32, symmetric: bool = False
) -> Q4Tensor:
    """Quantize a [K, N] weight with error feedback on its inputs' second moments `gram`
    ([K, K]; passes/quant/q4_gptq.py). Same stored format as quantize_array."""
    if w.ndim != 2 or gram.shape != (w.shape[0], w.shape[0]):
        raise ValueError(f"expected [K, N] weight and [K, K] gram, got {w.shape}, {gram.shape}")
    wf = np.asarray(w, np.float32)
    codes, scales, zps = gptq_params(wf, gram, block_size, symmetric)  # checks finiteness
    q = Q4Tensor(codes, scales, zps.astype(np.uint8), block_size)
    # Never worse than the importance-weighted search on the calibration activations: keep
    # whichever has the smaller output error tr(D^T H D), D = w' - w (a guard, by construction).
    alt = quantize_array(wf, block_size, symmetric, "search", np.diag(gram))
    h = np.asarray(gram, np.float64)
    if output_error(alt, wf, h) < output_error(q, wf, h):
        q = alt
    sse = ssw = 0.0
    for c0, d in _differences(q, wf):
        sse += float(np.vdot(d, d))
        w = wf[:, c0:c0 + d.shape[1]]
        ssw += float(np.vdot(w, w))
    q.rel_rms_error = float(np.sqrt(sse / ssw)) if ssw > 0 else 0.0
    return q


_ERROR_SLAB = 1024  # columns per step of the error sums: float64 temporaries of K x 1024


def _differences(q: Q4Tensor, w: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(first column, w' - w in float64) for consecutive column slabs: a whole LM head's
    difference would be twice the weight's size."""
    for c0 in range(0, w.shape[1], _ERROR_SLAB):
        c1 = min(w.shape[1], c0 + _ERROR_SLAB)
        deq = ops.dequantize_reference(q.codes[:, c0:c1], q.scales[:, c0:c1].astype(np.float32),
                                       q.zero_points[:, c0:c1], q.block_size)
        yield c0, deq.astype(np.float64) - np.asarray(w[:, c0:c1], np.float64)


def output_error(q: Q4Tensor, w: np.ndarray, gram: np.ndarray) -> float:
    """Mean squared output error on the calibration activations: tr(D^T H D), D = w' - w."""
    return sum(float(np.einsum("kn,kn->", d, gram @ d)) for _, d in _differences(q, w))
