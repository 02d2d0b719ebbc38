"""The Q4 scale/zero-point search (quant/q4_search.py): never worse than min/max on any block,
exact on grid weights, deterministic, and measurably better on heavy-tailed weights."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuselm.passes.quant.q4_math import quantize_array


def _block_sse(w: np.ndarray, method: str, block: int, symmetric: bool, imp=None) -> np.ndarray:  # noqa: ANN001
    """Per-block sum of squared errors [nb, N] of the stored (dequantized) weights."""
    q = quantize_array(w, block, symmetric, method=method, importance=imp)
    d = (q.dequantize(np.float32).astype(np.float64) - w.astype(np.float64)) ** 2
    if imp is not None:
        d *= imp[:, None]
    k = w.shape[0]
    pad = (-k) % block
    d = np.concatenate([d, np.zeros((pad, w.shape[1]))])
    return d.reshape(-1, block, w.shape[1]).sum(axis=1)


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    k=st.sampled_from([32, 40, 64, 96]),
    n=st.integers(1, 24),
    block=st.sampled_from([32, 64]),
    df=st.sampled_from([1.5, 3.0, 30.0]),
    symmetric=st.booleans(),
    weighted=st.booleans(),
)
def test_search_never_worse_than_minmax_on_any_block(  # noqa: PLR0913
    seed: int, k: int, n: int, block: int, df: float, symmetric: bool, weighted: bool
) -> None:
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(df, (k, n)) * 0.02).astype(np.float32)
    w[: min(k, block), 0] = 0.0  # an all-zero block
    if n > 1:
        w[: min(k, block), 1] = np.abs(w[: min(k, block), 1])  # an all-positive block
    imp = rng.gamma(0.5, 1.0, k).astype(np.float32) if weighted else None
    search = _block_sse(w, "search", block, symmetric, imp)
    minmax = _block_sse(w, "minmax", block, symmetric, imp)
    # float64 evaluation of float32 arithmetic: allow the last float32 bit of each sum
    assert (search <= minmax * (1 + 1e-6) + 1e-30).all()
    assert search[0, 0] == 0  # the all-zero block stays exact zeros


def test_search_is_exact_on_grid_weights() -> None:
    """A block on a 4-bit grid (q - zp) * s, s a power of two, codes spanning 0..15: min/max
    reproduces it exactly, and the search keeps it (it only moves to a strictly smaller error)."""
    rng = np.random.default_rng(5)
    k, n = 96, 20
    codes = rng.integers(0, 16, (k, n))
    codes[0::32], codes[1::32] = 0, 15  # every block spans the full range
    zp = np.repeat(rng.integers(0, 16, (3, n)), 32, axis=0)
    s = np.repeat(2.0 ** rng.integers(-12, -4, (3, n)), 32, axis=0)
    w = ((codes - zp) * s).astype(np.float32)
    for method in ("search", "minmax"):
        q = quantize_array(w, 32, method=method)
        assert q.dequantize(np.float32).tobytes() == w.tobytes(), method
        assert q.rel_rms_error == 0.0


def test_search_is_deterministic_and_slab_independent() -> None:
    rng = np.random.default_rng(6)
    w = (rng.standard_t(3, (64, 2100)) * 0.02).astype(np.float32)  # wider than one slab
    a, b = quantize_array(w), quantize_array(w.copy())
    part = quantize_array(np.ascontiguousarray(w[:, 1000:1100]))
    for x, y in ((a.codes, b.codes), (a.scales, b.scales), (a.zero_points, b.zero_points)):
        assert x.tobytes() == y.tobytes()
    assert a.codes[:, 1000:1100].tobytes() == part.codes.tobytes()
    assert a.scales[:, 1000:1100].tobytes() == part.scales.tobytes()


@pytest.mark.parametrize("block", [32, 64])
def test_search_lowers_error_on_heavy_tails(block: int) -> None:
    """Student-t (df 3): the search's relative RMS error is lower than min/max's; the recorded
    rel_rms_error is the one the dequantized weights have."""
    w = (np.random.default_rng(7).standard_t(3, (256, 512)) * 0.02).astype(np.float32)
    errs = {}
    for method in ("search", "minmax"):
        q = quantize_array(w, block, method=method)
        d = q.dequantize(np.float32).astype(np.float64) - w
        errs[method] = float(np.sqrt((d**2).sum() / (w.astype(np.float64) ** 2).sum()))
        assert q.rel_rms_error == pytest.approx(errs[method], rel=1e-4)
    assert errs["search"] < 0.99 * errs["minmax"], errs
