"""Candidate steps for blocks whose weights already sit on a coarser grid than min/max's.

A weight that was quantized before (a checkpoint dequantized from llama.cpp's Q5_0, Q8_0 or a
symmetric 4-bit type) holds, per block, values k_i * d with integer k_i and a step d. When its
codes do not reach both ends of our range (a Q5_0 block spans 16 + max(k) levels, not 255; a
reduced 4-bit block fewer than 15), min/max's step (hi - lo) / levels is not d and every value
rounds off its grid. The grid's own step is found from the values: the smallest gap g between
two of the block's distinct values is a multiple m * d (m = 1 whenever two values are adjacent
on the grid, which 32 values on at most 32 levels nearly always are), so n = rint(m * span / g)
for m = 1 .. MULTIPLES gives span / n = d for the right m, span = hi - lo with lo = min(w, 0)
and hi = max(w, 0) as min/max takes them. Each candidate step is only a candidate: the search
that asks (passes/quant/q4_search.py at 4 bits, passes/quant/q8_math.py at 8) keeps it for a
block only where that block's error drops, so a block off any grid keeps what it had.
"""

from __future__ import annotations

import numpy as np

MULTIPLES = 4  # smallest gap = 1..4 grid steps: 4 candidates per block at most
TOLERANCE = np.float32(1e-5)  # gaps below this share of the span are float noise, not grid steps


def min_gap(blocks: np.ndarray, span: np.ndarray) -> np.ndarray:
    """Per block [nb, n]: the smallest difference between two of its sorted values that is
    above TOLERANCE * span (inf if none); exact (differences of neighbours and a minimum)."""
    ordered = np.sort(blocks, axis=1)
    gaps = np.diff(ordered, axis=1)
    del ordered
    gaps[gaps <= (span * TOLERANCE)[:, None, :]] = np.inf
    return gaps.min(axis=1) if gaps.shape[1] else np.full(span.shape, np.inf, np.float32)


def grid_steps(gap: np.ndarray, span: np.ndarray, levels: int) -> list[np.ndarray]:
    """Candidate float32 steps [nb, n] (before float16 rounding) for blocks of range `span`
    and smallest gap `gap` ([nb, n] each; the symmetric form passes max|w| as the span), one
    array per multiple; a block with no candidate of at most `levels` steps gets NaN there."""
    out = []
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ratio = span / gap  # inf gap (one distinct value): 0, no candidate
        for m in range(1, MULTIPLES + 1):
            n = np.rint(ratio * np.float32(m))
            ok = (n >= 1) & (n <= levels)
            out.append(np.where(ok, span / np.where(ok, n, 1), np.nan).astype(np.float32))
    return out


def grid_candidates(blocks: np.ndarray, span: np.ndarray, levels: int) -> list[np.ndarray]:
    """grid_steps of every block, without the NaN-only arrays; nothing when the first column's
    blocks have no candidate. That probe costs 1/n of the sort and skips it for a float weight
    (a checkpoint's weights are on a grid in every column or in none: a slab whose first
    column is off-grid keeps its search as it was, never worse)."""
    probe = grid_steps(min_gap(blocks[:, :, :1], span[:, :1]), span[:, :1], levels)
    if all(np.isnan(g).all() for g in probe):
        return []
    return [g for g in grid_steps(min_gap(blocks, span), span, levels)
            if not np.isnan(g).all()]  # off-grid blocks: nothing to try
