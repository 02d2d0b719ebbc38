"""Error feedback for 4-bit blocks (the idea of GPTQ, written for fuselm's stored format).

Plain rounding treats each weight alone. With a calibration text we know the second moment of
each weight's inputs, H = sum over tokens of x x^T ([K, K] for a [K, N] weight), and the output
error of a rounded weight is (w' - w)^T H (w' - w) per column. Rounding the rows k = 0..K-1 in
order, the error made on row k can be pushed onto the rows not yet rounded so that the output
error it causes is cancelled as far as H allows (optimal brain surgeon's update, in GPTQ's
Cholesky form):

    U = upper Cholesky factor of (H + damp I)^-1
    row k rounded: e = (w_k - w'_k) / U[k, k];  rows j > k: w_j -= U[k, j] * e

The stored format does not change: when a block of B rows is reached, its scale and zero point
are chosen by quant/q4_search.py on the rows as updated so far (importance = diag H), then each
row is rounded to codes with them (clip(rint(w / s) + zp, 0, 15), true division), exactly the
rule every other path uses. Deterministic: float64 factorization, fixed order, no randomness.
"""

from __future__ import annotations

import numpy as np

from fuselm.passes.quant.q4_search import search_params

DAMP = 0.01  # of mean diag(H): keeps the factorization stable for near-dead input channels
SLAB = 2048  # columns at a time (see gptq_params)
_QMAX = 15


def inverse_cholesky(gram: np.ndarray, damp: float = DAMP) -> np.ndarray:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, float64 [K, K]."""
    h = np.array(gram, dtype=np.float64, copy=True)
    d = np.diag(h).copy()
    dead = d <= 0
    h[dead, dead] = 1.0  # an input channel that never fires: its rows get no feedback
    mean = float(d[~dead].mean()) if (~dead).any() else 1.0
    h[np.diag_indices_from(h)] += damp * mean
    lower = np.linalg.cholesky(h)
    inv = np.linalg.inv(lower)  # L^-1; (H)^-1 = L^-T L^-1
    hinv = inv.T @ inv
    return np.linalg.cholesky(hinv).T  # upper: hinv = U^T U


def gptq_params(
    w: np.ndarray, gram: np.ndarray, block_size: int, symmetric: bool = False,
    damp: float = DAMP,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes (uint8 [K, N]), float16 scales and float32 integral zero points ([nb, N]) for a
    [K, N] weight given its inputs' second-moment matrix `gram` ([K, K]).

    Columns are independent (each is its own least-squares problem under the same H), so they
    go SLAB at a time: the working copy stays a few MB where a whole LM head's would be as
    large as the weight (113 MB for SmolLM2's tied table)."""
    k, n = w.shape
    u = inverse_cholesky(gram, damp).astype(np.float32)
    diag_h = np.diag(np.asarray(gram, np.float64)).astype(np.float32)
    nb = -(-k // block_size)
    codes = np.empty((k, n), np.uint8)
    scales = np.empty((nb, n), np.float16)
    zps = np.empty((nb, n), np.float32)
    for c0 in range(0, n, SLAB):
        c1 = min(n, c0 + SLAB)
        work = np.array(w[:, c0:c1], dtype=np.float32, copy=True)
        if not np.isfinite(work).all():  # slab by slab: no whole-weight mask either
            raise ValueError("weight has NaN or Inf values; refusing to quantize")
        _gptq_slab(work, u, diag_h, block_size, symmetric, codes[:, c0:c1], scales[:, c0:c1],
                   zps[:, c0:c1])
    return codes, scales, zps


def _gptq_slab(work: np.ndarray, u: np.ndarray, diag_h: np.ndarray, block_size: int,
               symmetric: bool, codes: np.ndarray, scales: np.ndarray, zps: np.ndarray) -> None:
    """gptq_params on the columns `work` (a copy, updated in place) into the output views."""
    k, n = work.shape
    work[diag_h <= 0, :] = 0  # rows whose input is always 0 contribute nothing
    nb = -(-k // block_size)
    for b in range(nb):
        b0, b1 = b * block_size, min(k, (b + 1) * block_size)
        imp = np.maximum(diag_h[b0:b1], 0).reshape(1, b1 - b0, 1)
        s16, zp = search_params(work[None, b0:b1], symmetric, imp)
        s16, zp = s16[0], zp[0]
        s = s16.astype(np.float32)
        zero = s == 0
        safe = np.where(zero, np.float32(1), s)
        err = np.empty((b1 - b0, n), np.float32)
        for j in range(b1 - b0):
            r = b0 + j
            q = np.rint(work[r] / safe) + zp
            np.clip(q, 0, _QMAX, out=q)
            q[zero] = zp[zero]
            codes[r] = q.astype(np.uint8)
            e = (work[r] - (q - zp) * s) / u[r, r]
            err[j] = e
            if j + 1 < b1 - b0:  # feedback inside the block, row by row
                work[r + 1:b1] -= np.outer(u[r, r + 1:b1], e)
        if b1 < k:  # then onto every later row at once
            work[b1:] -= u[b0:b1, b1:].T @ err
        scales[b] = s16
        zps[b] = zp
