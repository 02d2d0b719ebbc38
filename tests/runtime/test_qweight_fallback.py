"""The dense fallback for weights a backend's multi-row Q4 kernel refuses gives the same result."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.mlx_engine.qweight import (
    _DENSE_ALL,
    _DENSE_ROWS,
    from_dequantize_linear,
    probe_kernels,
)


def test_dense_rows_fallback_matches_quantized_matmul() -> None:
    rng = np.random.default_rng(0)
    k, n = 128, 96
    codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
    scales = (rng.random((k // 32, n)) * 0.1 + 0.01).astype(np.float16)
    zps = rng.integers(0, 16, (k // 32, n)).astype(np.uint8)
    q = from_dequantize_linear(codes, scales, zps, axis=0, block_size=32)
    x = mx.array(rng.standard_normal((1, 7, k)).astype(np.float32))
    want = np.array(q.matmul(x))
    assert probe_kernels([q], mx.float32) == 0  # the CPU backend runs every shape
    q._cast[_DENSE_ROWS] = True
    got = np.array(q.matmul(x))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # the mark is shared with transposed/cast views of the same weight
    assert q.T().T()._cast.get(_DENSE_ROWS)
    q._cast[_DENSE_ALL] = True
    one = x[:, :1]
    got1 = np.array(q.matmul(one))
    assert np.abs(got1 - want[:, :1]).max() <= 1e-5 * np.abs(want).max()
