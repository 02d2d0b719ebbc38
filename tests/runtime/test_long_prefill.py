"""Long-prompt prefill paths: a later chunk attending the cached prefix with MLX's fused causal
attention (compiled once per chunk start), and Q4 matmuls of many rows through the dequantized
weight (FUSELM_PREFILL_DENSE, the MLX-CUDA default). Both against the paths they
replace, on any device (they run on CPU here and on the H200)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fuselm.config import resolve
from fuselm.runtime_metal.cuda_kernels import selection as kernels
from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.mlx_engine.qweight import set_dense_rows
from fuselm.runtime_metal.validate import rel


def _chunked(engine, ids: np.ndarray, chunk: int) -> list[np.ndarray]:  # noqa: ANN001
    engine.reset()
    engine.reserve(ids.size + 1)
    return [np.array(engine.forward(ids[None, s:s + chunk])) for s in range(0, ids.size, chunk)]


def test_prefix_chunks_match_one_call_and_reuse_traces(qwen3_artifact: Path) -> None:
    """Chunks of 64 after a cached prefix give the last-position logits of the whole prompt
    in one call (fresh: causal over its own rows), and the next token decodes the same; a
    second prompt of the same length traces no new chunk function."""
    ids = np.random.default_rng(11).integers(4, 384, 300).astype(np.int64)
    engine = make_engine(qwen3_artifact, "mlx")
    assert engine.fast.prefix_prefill
    got = _chunked(engine, ids, 64)[-1]
    step = np.array(engine.decode_step(mx.array(int(np.argmax(got)), mx.int32)))
    one = make_engine(qwen3_artifact, "mlx")
    one.reserve(ids.size + 1)
    want = np.array(one.forward(ids[None]))
    assert rel(got, want) <= 1e-5
    assert rel(step, np.array(one.decode_step(mx.array(int(np.argmax(want)), mx.int32)))) <= 1e-5
    before = engine.fast.compiled_prefixes
    _chunked(engine, ids[::-1].copy(), 64)
    assert engine.fast.compiled_prefixes == before == 4  # chunk starts 64, 128, 192, 256


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_dense_rows_match_quantized_matmul(dtype: mx.Dtype) -> None:
    """A Q4 matmul of many rows through the dequantized weight equals MLX's quantized matmul
    (both against the dequantized weight in float64); few rows keep the quantized matmul."""
    from tests.runtime.test_kernels import _q4_weight

    rng = np.random.default_rng(3)
    w, codes = _q4_weight(rng, 256, 96, 32)
    x = mx.array(rng.normal(size=(1, 300, 256)).astype(np.float32)).astype(dtype)
    s, b = w.affine(dtype)
    sf = np.array(s.astype(mx.float32)).astype(np.float64)
    bf = np.array(b.astype(mx.float32)).astype(np.float64)
    dense = codes * np.repeat(sf.T, 32, axis=0) + np.repeat(bf.T, 32, axis=0)
    want = np.array(x.astype(mx.float32)).astype(np.float64)[0] @ dense
    got = {}
    for rows in (0, 64):
        assert kernels.dense_prefill_rows(rows) == rows
        set_dense_rows([w], rows)
        got[rows] = np.array(w.matmul(x).astype(mx.float32))[0]
    tol = 2e-5 if dtype == mx.float32 else 4e-3
    # MLX's quantized matmul accumulates half-precision inputs in half precision (looser)
    assert rel(got[64], want) <= tol and rel(got[0], want) <= 3 * tol
    assert kernels.dense_prefill_rows(None) == (kernels.CUDA_DENSE_ROWS if kernels.cuda_device()
                                                else 0)


def test_dense_prefill_program_matches_quantized(q4_artifact: Path) -> None:
    """The compiled Q4 program's prefill chunks (64 rows) with the dense matmul on
    (FUSELM_PREFILL_DENSE=32) give the logits of MLX's quantized matmul (=0)."""
    ids = np.random.default_rng(12).integers(4, 384, 200).astype(np.int64)
    logits = {}
    for rows in ("0", "32"):
        engine = make_engine(q4_artifact, "mlx", resolve({"FUSELM_PREFILL_DENSE": rows}))
        assert engine.describe()["q4_dense_from_rows"] == int(rows)
        logits[rows] = _chunked(engine, ids, 64)
    for a, b in zip(logits["32"], logits["0"], strict=True):
        assert rel(a, b) <= 1e-4
