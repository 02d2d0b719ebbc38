"""Bit allocation: a block size per tensor under a budget of bits per weight, or (`choose_bits`,
`--quant mixed`) 4, 6 or 8 bits per tensor under a budget of bits per weight.

Smaller blocks cost more bits (a float16 scale and a uint4 zero point per block: 4 + 20/B bits
per weight: 4.625 at B = 32, 4.3125 at 64, 4.15625 at 128) and cut the error. Tensors do not
gain equally: the rule measures, per tensor, the relative squared error
sum((w' - w)^2 * imp) / sum(w^2 * imp) at each block size (imp = the input channel's importance
with a calibration text, else 1) and spends the budget where the error drops most per bit:
every tensor starts at the largest block, then the step with the best error drop per added bit
(weighted by the tensor's share of the weights, so the objective is the weights' mean relative
squared error) is taken until the next step would exceed the budget.

The error is measured on an evenly strided subset of at most SAMPLE_COLUMNS (256) output columns
(columns are quantized independently, so the subset's error is the full tensor's in
expectation), keeping the measurement a fraction of the quantization itself. The bits count the
format as a float16 graph stores it (float16 scales); a float32 graph stores the same float16
values in float32 containers. Deterministic: fixed columns, fixed order, ties by name order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fuselm.passes.quant.q4_math import mixed_bits_per_weight, quantize_array
from fuselm.passes.quant.q8_math import quantize_wide

CHOICES = (32, 64)  # block sizes the allocation picks from
SAMPLE_COLUMNS = 256


def bits_per_weight(block_size: int) -> float:
    """4-bit codes + a float16 scale + a uint4 zero point per block."""
    return mixed_bits_per_weight(4, block_size)


def tensor_errors(
    w: np.ndarray, choices: Sequence[int], symmetric: bool, method: str,
    importance: np.ndarray | None, bits: int = 4,
) -> dict[int, float]:
    """Relative (importance-weighted) squared error of a [K, N] weight at each block size, in
    `bits`-bit blocks."""
    n = w.shape[1]
    step = max(1, -(-n // SAMPLE_COLUMNS))
    cols = np.ascontiguousarray(w[:, ::step], dtype=np.float32)
    imp = None if importance is None else np.asarray(importance, np.float64)[:, None]
    ref = cols.astype(np.float64) ** 2
    den = float((ref * imp).sum() if imp is not None else ref.sum())
    out: dict[int, float] = {}
    for b in choices:
        q = (quantize_wide(cols, b, symmetric, method == "search", bits) if bits != 4
             else quantize_array(cols, b, symmetric, method, importance))
        d = (q.dequantize(np.float32).astype(np.float64) - cols) ** 2
        num = float((d * imp).sum() if imp is not None else d.sum())
        out[b] = num / den if den > 0 else 0.0
    return out


def allocate_blocks(
    items: Sequence[tuple[str, Callable[[], np.ndarray], str | None]],
    default_block: int,
    budget: float | None,
    symmetric: bool = False,
    method: str = "search",
    importance: dict[str, np.ndarray] | None = None,
    choices: Sequence[int] = CHOICES,
) -> dict[str, int]:
    """Block size per tensor name. `items`: (name, [K, N] weight getter, activation name).

    budget None: every tensor gets `default_block`. Otherwise the greedy rule above over
    `choices`, keeping the mean bits per weight of the quantized tensors <= budget.
    """
    if budget is None:
        return {name: default_block for name, _, _ in items}
    choices = sorted(choices, reverse=True)  # largest block (fewest bits) first
    sizes: dict[str, int] = {}
    errs: dict[str, dict[int, float]] = {}
    for name, get, act in items:
        w = get()
        sizes[name] = w.size
        imp = None if importance is None or act is None else importance.get(act)
        errs[name] = tensor_errors(w, choices, symmetric, method, imp)
        del w
    if not sizes or sum(sizes.values()) == 0:
        return {}
    ladders = {n: [(bits_per_weight(c), errs[n][c]) for c in choices] for n in sizes}
    # the weights' mean relative squared error: each tensor's drop counts by its weights
    level = upgrade_greedily(ladders, sizes, budget, by_weights=True)
    return {n: choices[level[n]] for n in sizes}


def upgrade_greedily(ladders: dict[str, list[tuple[float, float]]], sizes: dict[str, int],
                     budget: float, by_weights: bool) -> dict[str, int]:
    """The greedy allocation both rules share: each tensor's ladder of options (bits per
    weight rising, error falling), every tensor starting at its first; then, while one fits
    the budget (a mean of `budget` bits per weight over all tensors' weights), the upgrade to
    a tensor's next option with the largest error drop per added bit of the model is taken
    (the drop times the tensor's weights when `by_weights`: the weights' mean error; else the
    drop itself: the sum of the tensors' errors); an upgrade that does not fit is passed over
    for the next. Ties by name order. Returns each tensor's index into its ladder."""
    total = sum(sizes.values())
    level = dict.fromkeys(sizes, 0)
    bits = sum(sizes[n] * ladders[n][0][0] for n in sizes)
    while True:
        best, best_gain = None, 0.0
        for n in sorted(sizes):
            h, i = ladders[n], level[n]
            if i + 1 >= len(h):
                continue
            cost = sizes[n] * (h[i + 1][0] - h[i][0])
            if bits + cost > budget * total:
                continue
            gain = (h[i][1] - h[i + 1][1]) * (sizes[n] if by_weights else 1) / cost
            if gain > best_gain:
                best, best_gain = n, gain
        if best is None:
            return level
        h, i = ladders[best], level[best]
        bits += sizes[best] * (h[i + 1][0] - h[i][0])
        level[best] = i + 1


WIDE_BLOCKS = (128, 64, 32)  # the 6- and 8-bit blocks choose_bits offers


def choose_bits(
    items: Sequence[tuple[str, Callable[[], np.ndarray], str | None]],
    budget: float,
    block: int,
    symmetric: bool = False,
    method: str = "search",
    importance: dict[str, np.ndarray] | None = None,
    no_six: frozenset[str] = frozenset(),
) -> dict[str, tuple[int, int]]:
    """`--quant mixed`: (bits, block size) per tensor name, 4-bit blocks of `block`, 6-bit
    blocks of 128, 64 or 32 (those that divide the tensor's K; K a multiple of 4, as four
    6-bit codes pack in three bytes) or 8-bit ones (those that divide K, and `block`), under a
    mean of `budget` bits per weight (mixed_bits_per_weight: float16 scales, as `fuselm
    quant-report` counts). `no_six`: tensors offered 4 or 8 bits only (an untied table, stored
    along its other axis, where the 6-bit packing does not run).

    Each tensor's options are measured (tensor_errors: the relative importance-weighted squared
    error, on the calibration activations' mean squares when given) and reduced to their lower
    convex hull in (bits, error); every tensor starts at 4 bits, then the upgrade with the
    largest drop of the sum of the tensors' relative squared errors per added bit of the model
    is taken, while it fits the budget (one that does not fit is passed over for the next).
    Summed per tensor, not per weight: a relative error e in one weight moves its output by ~e
    of that output whatever the weight's size, while its bits grow with the size, so of two
    tensors equally improved the smaller one goes first (on SmolLM2 a late layer's down_proj
    gains 19x the tied head's KL per bit; on Gemma 3 270M the layers gain ~3x the 262k-row
    table's perplexity per bit: BENCHMARKS.md). Deterministic: fixed columns, fixed order, ties
    by name."""
    hulls: dict[str, list[tuple[float, float, int, int]]] = {}
    sizes: dict[str, int] = {}
    for name, get, act in items:
        w = get()
        imp = None if importance is None or act is None else importance.get(act)
        eight = [b for b in WIDE_BLOCKS if b == block or w.shape[0] % b == 0]
        six = [] if name in no_six else [b for b in WIDE_BLOCKS if w.shape[0] % b == 0]
        opts = [(mixed_bits_per_weight(4, block),
                 tensor_errors(w, [block], symmetric, method, imp)[block], 4, block)]
        for nbits, blocks in ((6, six), (8, eight)):
            e = tensor_errors(w, blocks, symmetric, method, imp, bits=nbits)
            opts += [(mixed_bits_per_weight(nbits, b), e[b], nbits, b) for b in blocks]
        hulls[name], sizes[name] = _lower_hull(sorted(opts)), w.size
        del w
    level = upgrade_greedily({n: [o[:2] for o in h] for n, h in hulls.items()}, sizes, budget,
                             by_weights=False)
    return {n: hulls[n][level[n]][2:] for n in sizes}


def _lower_hull(opts: list[tuple[float, float, int, int]]) -> list[tuple[float, float, int, int]]:
    """The options (bits, error, ...) sorted by bits that lie on the lower convex hull: each
    step down in error costs more bits per unit of error than the one before (an option
    dominated or above the hull is never worth its bits in the greedy above)."""
    hull: list[tuple[float, float, int, int]] = []
    for o in opts:
        if hull and o[1] >= hull[-1][1]:
            continue  # more bits, no less error
        while len(hull) >= 2:
            (b0, e0, *_), (b1, e1, *_) = hull[-2], hull[-1]
            # drop the middle point when the new one gains more per bit from the first
            if (e0 - o[1]) * (b1 - b0) >= (e0 - e1) * (o[0] - b0):
                hull.pop()
            else:
                break
        hull.append(o)
    return hull
