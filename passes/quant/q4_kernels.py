"""Compiled loops (Numba) for the Q4 search's heavy passes over every weight, bit-equal to NumPy.

quant/q4_search.py and quant/q4_math.py define the arithmetic; their NumPy forms make a
full-size float32 temporary per operation (codes, products, squares: ~75 passes over each weight
for the default search), which made the search ~95 % of an 8B conversion's CPU time. Each
function here does one of those sequences in a single pass, element by element, with the very
same float32 operations in the same order — true division, round-half-to-even, clip, product,
difference, square, importance weight, then a sequential sum over the block's rows, which is the
order NumPy's `sum(axis=1)` adds a [nb, B, n] array in — so the chosen scales, zero points and
codes are bit-identical (tests/passes/test_q4_kernels.py checks it against the NumPy forms).
No fast-math: LLVM must not fuse a product and a sum into one FMA, which rounds once instead of
twice. `nogil`, so the quantizer's threads run them on all cores.

Arrays: blocks [nb, B, n] float32; per-block values (s, zp, sums) [nb, n] float32; `imp` the
per-row importance [nb, B] float32, or an empty [0, 0] array for none.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_F0 = np.float32(0)
_F1 = np.float32(1)
_QMAX = np.float32(15)


@njit(cache=True, nogil=True)
def _code(w, sv, zv):  # noqa: ANN001, ANN202 - float32 scalars
    """q - zp for q = clip(rint(w / s) + zp, 0, 15); 0 where s == 0 (q4_search._centered_codes)."""
    if sv == _F0:
        return _F0
    c = np.rint(w / sv)
    c = max(c, -zv)
    return min(c, _QMAX - zv)


@njit(cache=True, nogil=True)
def block_range(blocks, lo, hi, amax):  # noqa: ANN001, ANN201
    """Per block: min(w, 0), max(w, 0)... as min(axis=1), max(axis=1), abs().max(axis=1) (order
    does not matter: min and max are exact); False if any weight is NaN or infinite."""
    nb, bs, n = blocks.shape
    finite = True
    for i in range(nb):
        for j in range(n):
            w = blocks[i, 0, j]
            lo[i, j] = w
            hi[i, j] = w
            amax[i, j] = abs(w)
        for k in range(bs):
            for j in range(n):
                w = blocks[i, k, j]
                if not np.isfinite(w):
                    finite = False
                lo[i, j] = min(lo[i, j], w)
                hi[i, j] = max(hi[i, j], w)
                amax[i, j] = max(amax[i, j], abs(w))
    return finite


@njit(cache=True, nogil=True)
def sse(blocks, s, zp, imp, out):  # noqa: ANN001, ANN201
    """Per block: sum over rows of imp * (c * s - w)^2 (q4_search._sse of _centered_codes)."""
    nb, bs, n = blocks.shape
    weighted = imp.shape[0] > 0
    for i in range(nb):
        for j in range(n):
            out[i, j] = _F0
        for k in range(bs):
            wk = imp[i, k] if weighted else _F1
            for j in range(n):
                w = blocks[i, k, j]
                sv = s[i, j]
                t = _code(w, sv, zp[i, j]) * sv
                t = t - w
                t = t * t
                if weighted:
                    t = t * wk
                out[i, j] += t


@njit(cache=True, nogil=True)
def line_sums(blocks, s, zp, imp, sq, sy, sqq, sqy):  # noqa: ANN001, ANN201
    """Per block, with q = c + zp the codes of (s, zp): the weighted sums of q, w, q*q and q*w
    (q4_search._least_squares' fit of w ~ a*q + b)."""
    nb, bs, n = blocks.shape
    weighted = imp.shape[0] > 0
    for i in range(nb):
        for j in range(n):
            sq[i, j] = _F0
            sy[i, j] = _F0
            sqq[i, j] = _F0
            sqy[i, j] = _F0
        for k in range(bs):
            wk = imp[i, k] if weighted else _F1
            for j in range(n):
                w = blocks[i, k, j]
                zv = zp[i, j]
                q = _code(w, s[i, j], zv) + zv
                a, b, c, d = q, w, q * q, q * w
                if weighted:
                    a, b, c, d = a * wk, b * wk, c * wk, d * wk
                sq[i, j] += a
                sy[i, j] += b
                sqq[i, j] += c
                sqy[i, j] += d


@njit(cache=True, nogil=True)
def scale_sums(blocks, s, zp, zp_new, imp, num, den):  # noqa: ANN001, ANN201
    """Per block, with c = (codes of (s, zp)) - zp_new: the weighted sums of c*w and c*c
    (q4_search._least_squares' scale given the new zero point)."""
    nb, bs, n = blocks.shape
    weighted = imp.shape[0] > 0
    for i in range(nb):
        for j in range(n):
            num[i, j] = _F0
            den[i, j] = _F0
        for k in range(bs):
            wk = imp[i, k] if weighted else _F1
            for j in range(n):
                w = blocks[i, k, j]
                zv = zp[i, j]
                c = (_code(w, s[i, j], zv) + zv) - zp_new[i, j]
                a, b = c * w, c * c
                if weighted:
                    a, b = a * wk, b * wk
                num[i, j] += a
                den[i, j] += b


@njit(cache=True, nogil=True)
def encode(blocks, s, zp, rows, codes):  # noqa: ANN001, ANN201
    """Store the codes clip(rint(w / s) + zp, 0, 15) (zp where s == 0) of the first `rows` rows
    into `codes` ([rows, n] uint8, any strides); return (sum (w' - w)^2, sum w^2) in float64."""
    nb, bs, n = blocks.shape
    sse_sum = 0.0
    ssw = 0.0
    for i in range(nb):
        for k in range(bs):
            row = i * bs + k
            for j in range(n):
                w = blocks[i, k, j]
                sv = s[i, j]
                zv = zp[i, j]
                if sv == _F0:
                    q = zv
                else:
                    q = np.rint(w / sv) + zv
                q = min(max(q, _F0), _QMAX)
                if row < rows:
                    codes[row, j] = np.uint8(q)
                d = (q - zv) * sv - w
                sse_sum += np.float64(d) * np.float64(d)
                ssw += np.float64(w) * np.float64(w)
    return sse_sum, ssw


# float16 bits -> float32, as NumPy converts them (exact; NaN payloads kept): a 256 KB table
# stands in for the half-precision type the compiled loops do not have.
HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


@njit(cache=True, nogil=True)
def load_half(bits, table, blocks):  # noqa: ANN001, ANN201
    """Rows of a float16 weight (`bits`: its uint16 view [rows, n], any strides) as float32
    blocks [nb, B, n], rows past the end zero (q4_math._blocks' padding); False if any value
    is NaN or infinite. One pass instead of a cast, a copy, a pad and a finiteness check."""
    nb, bs, n = blocks.shape
    rows = bits.shape[0]
    finite = True
    for i in range(nb):
        for k in range(bs):
            row = i * bs + k
            if row < rows:
                for j in range(n):
                    w = table[bits[row, j]]
                    blocks[i, k, j] = w
                    if not np.isfinite(w):
                        finite = False
            else:
                for j in range(n):
                    blocks[i, k, j] = _F0
    return finite
