"""One runtime path: the KV cache owns its buffers (allocate/reserve/write/trim), the write is
one function for a scalar or per-row offset, and both engines implement the whole Engine
protocol (no capability probes in the loop)."""

from __future__ import annotations

import inspect

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.engine import Engine, make_engine
from fuselm.runtime_metal.kv_cache import KVCache, write_rows
from fuselm.runtime_metal.validate import rel


def test_kv_cache_reserve_write_trim() -> None:
    c = KVCache()
    c.allocate(1, 2, 8, 4, mx.float32)
    assert c.capacity == 0 and c.offset == 0
    rng = np.random.default_rng(0)
    k1, v1 = (mx.array(rng.normal(size=(1, 2, 5, d)).astype(np.float32)) for d in (8, 4))
    keys, values = c.update_and_fetch(k1, v1)
    assert c.capacity == KVCache.step and c.offset == 5 and keys.shape == (1, 2, 5, 8)
    c.reserve(KVCache.step + 1)  # grows by whole blocks and keeps what is cached
    assert c.capacity == 2 * KVCache.step
    assert np.array_equal(np.array(c.state()[0]), np.array(k1))
    k2, v2 = (mx.array(rng.normal(size=(1, 2, 1, d)).astype(np.float32)) for d in (8, 4))
    keys, values = c.update_and_fetch(k2, v2)
    assert np.array_equal(np.array(keys), np.concatenate([np.array(k1), np.array(k2)], axis=2))
    assert np.array_equal(np.array(values), np.concatenate([np.array(v1), np.array(v2)], 2))
    c.trim(2)
    assert c.offset == 4 and c.capacity == 2 * KVCache.step


def test_write_rows_per_row_offsets() -> None:
    buf = mx.zeros((3, 2, 8, 4))
    rows = mx.arange(3 * 2 * 4, dtype=mx.float32).reshape(3, 2, 1, 4) + 1
    out = np.array(write_rows(buf, rows, mx.array([0, 5, 2], mx.int32)))
    for b, p in enumerate((0, 5, 2)):
        assert np.array_equal(out[b, :, p], np.array(rows)[b, :, 0])
        assert np.count_nonzero(out[b]) == 2 * 4


def test_engines_implement_the_protocol(qwen3_artifact) -> None:  # noqa: ANN001
    members = [n for n, _ in inspect.getmembers(Engine) if not n.startswith("_")]
    members += ["name", "device_loop"]
    engines = [make_engine(qwen3_artifact, n) for n in ("mlx", "onnxruntime")]
    for e in engines:
        missing = [m for m in members if not hasattr(e, m)]
        assert missing == [], (e.name, missing)
    mlx_e, ort_e = engines
    assert mlx_e.device_loop and not ort_e.device_loop
    # trim forgets the last positions on both: re-feeding them gives the same logits
    prompt = np.arange(5, 17, dtype=np.int64)[None]
    for e in engines:
        e.reset()
        want = e.forward(prompt)
        e.trim(3)
        assert e.offset == prompt.shape[1] - 3
        got = e.forward(prompt[:, -3:])
        assert rel(got, want) <= 1e-5, e.name
        step = np.asarray(e.decode_step(int(np.argmax(got))), np.float32)
        assert step.shape == want.shape and e.offset == prompt.shape[1] + 1


def test_prefix_prefill_matches_masked_prefill(qwen3_artifact) -> None:  # noqa: ANN001
    """A later prompt chunk over rows 0..offset+s with MLX's causal mask (prefix_prefill) gives
    the logits of the compiled call with the device mask over the whole capacity."""
    ids = np.random.default_rng(5).integers(4, 384, 300).astype(np.int64)[None]
    logits = {}
    for prefix in (False, True):
        engine = make_engine(qwen3_artifact, "mlx")
        engine.fast.prefix_prefill = prefix
        logits[prefix] = [engine.forward(ids[:, s:s + 64]) for s in range(0, 300, 64)]
    for a, b in zip(logits[True], logits[False], strict=True):
        assert rel(a, b) <= 1e-5
