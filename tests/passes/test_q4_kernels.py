"""The compiled Q4 search (passes/quant/q4_kernels.py) against its NumPy form: the same scales, zero
points and codes bit for bit, for every option and the awkward blocks (all zero, signed zeros,
grid weights, a partial last block, one column, one block), so compiling changes no output."""

from __future__ import annotations

import numpy as np
import pytest

from fuselm.passes.quant import q4_math, q4_search


def _weights(rng: np.random.Generator, k: int, n: int, df: float = 3.0) -> np.ndarray:
    w = (rng.standard_t(df, (k, n)) * 0.02).astype(np.float16).astype(np.float32)
    w[: min(k, 32), 0] = 0.0  # an all-zero block
    if n > 2:
        w[:5, 1] = -0.0  # signed zeros
        w[: min(k, 32), 2] = np.abs(w[: min(k, 32), 2])  # an all-positive block
    if n > 3:  # a block on a 4-bit grid: (q - zp) * s, s a power of two, q spanning 0..15
        q = rng.integers(0, 16, min(k, 32))
        q[0], q[1] = 0, 15
        w[: min(k, 32), 3] = (q - 6) * 2.0**-9
    return w


def _both(monkeypatch: pytest.MonkeyPatch, fn):  # noqa: ANN001, ANN202
    out = []
    for compiled in (False, True):
        monkeypatch.setattr(q4_search, "COMPILED", compiled)
        out.append(fn())
    return out


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize(("block", "nb", "n"), [(32, 40, 300), (64, 3, 17), (17, 5, 2),
                                                (32, 1, 64), (32, 6, 1)])
def test_search_params_bit_equal(monkeypatch: pytest.MonkeyPatch, symmetric: bool,
                                 weighted: bool, block: int, nb: int, n: int) -> None:
    rng = np.random.default_rng(block * 1000 + nb * 10 + n)
    blocks = _weights(rng, nb * block, n).reshape(nb, block, n)
    imp = None
    if weighted:
        imp = rng.gamma(0.5, 1.0, (nb, block, 1)).astype(np.float32)
        imp[0, :3] = 0  # rows that do not count
    (s_ref, zp_ref), (s, zp) = _both(
        monkeypatch, lambda: q4_search.search_params(blocks, symmetric, imp))
    assert s.dtype == s_ref.dtype == np.float16
    np.testing.assert_array_equal(s.view(np.uint16), s_ref.view(np.uint16))
    np.testing.assert_array_equal(zp, zp_ref)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize(("k", "n", "block"), [(256, 2100, 32), (100, 1025, 32), (130, 70, 64)])
def test_quantize_array_bit_equal(monkeypatch: pytest.MonkeyPatch, symmetric: bool, k: int,
                                  n: int, block: int) -> None:
    """Tiles of blocks × slabs of columns, the threads, a partial last block, a one-column last
    slab (1025 = 1024 + 1), a float16 source and a transposed view: all equal to NumPy's."""
    rng = np.random.default_rng(k + n)
    w = _weights(rng, k, n).astype(np.float16)
    imp = rng.gamma(0.5, 1.0, k).astype(np.float32)
    monkeypatch.setattr(q4_math, "_TILE", 4096)  # several row tiles per slab at these sizes
    for src, i in ((w, imp), (np.ascontiguousarray(w.T).T, None)):
        ref, got = _both(monkeypatch, lambda src=src, i=i: q4_math.quantize_array(
            src, block, symmetric, "search", i))
        for field in ("codes", "zero_points"):
            np.testing.assert_array_equal(getattr(got, field), getattr(ref, field))
        np.testing.assert_array_equal(got.scales.view(np.uint16), ref.scales.view(np.uint16))
        # float64 sums here, float32 BLAS dots there: the error agrees to float32 accuracy
        assert got.rel_rms_error == pytest.approx(ref.rel_rms_error, rel=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_quantize_array_refuses_nonfinite_compiled(monkeypatch: pytest.MonkeyPatch, dtype: type,
                                                   bad: float) -> None:
    monkeypatch.setattr(q4_search, "COMPILED", True)
    w = np.ones((64, 8), dtype)
    w[40, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        q4_math.quantize_array(w, 32)


def test_small_models_search_without_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below COMPILED_MIN_WEIGHTS a model's searches run in NumPy (Numba's import costs more
    memory than SmolLM2's conversion may use); the same bits either way (tests above)."""
    monkeypatch.setattr(q4_search, "COMPILED", True)
    with q4_search.for_model(q4_search.COMPILED_MIN_WEIGHTS - 1):
        assert not q4_search.use_compiled()
    with q4_search.for_model(q4_search.COMPILED_MIN_WEIGHTS):
        assert q4_search.use_compiled()
    assert q4_search.use_compiled()
