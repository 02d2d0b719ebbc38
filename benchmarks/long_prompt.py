"""Long-prompt prefill: time and peak memory of a 2,048- and an 8,192-token prompt, JSON out.

    python benchmarks/long_prompt.py [--shape small|qwen3-0.6b] [-p 2048 8192] [--chunk 512]

Builds (or reuses, under --work) a random-weight Qwen3 checkpoint of the shape, converts it
(float32), and prefills each prompt length through the MLX engine three ways:
- "prefix": chunked, each later chunk attending rows 0..offset+s with MLX's fused causal
  attention (FastDecoder.prefix_prefill, uncompiled);
- "mask": chunked, the compiled call with a device mask over the whole cache capacity (the
  default path);
- "oneshot": the whole prompt as one chunk (fresh: fused causal attention), for reference.
Peak memory is MLX's allocator peak (mx.get_peak_memory) over the prefill, the KV cache
included; `full_scores_bytes` is what one layer's materialized [heads, n, n] float32 score
matrix would take, which none of the paths builds on a GPU (on MLX's CPU backend the fused
kernel falls back to a per-chunk [heads, chunk, rows] score block).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from fuselm.converter.builtin import QWEN3_0_6B, TINY, build_model
from fuselm.runtime_metal.engine import make_engine

SMALL = {**TINY, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
         "vocab_size": 1024}
SHAPES = {"small": SMALL, "qwen3-0.6b": QWEN3_0_6B}


def _prefill(engine, ids: np.ndarray, chunk: int) -> None:  # noqa: ANN001
    engine.reset()
    engine.reserve(ids.size + 1)
    for s in range(0, ids.size, chunk):
        engine.forward(ids[None, s:s + chunk])


def measure(engine, n: int, chunk: int, way: str, runs: int) -> dict[str, object]:  # noqa: ANN001
    ids = np.random.default_rng(n).integers(4, 1000, n).astype(np.int64)
    size = n if way == "oneshot" else chunk
    engine.fast.prefix_prefill = way != "mask"
    _prefill(engine, ids, size)  # warm-up: traces and allocations
    times, peaks = [], []
    for _ in range(runs):
        mx.clear_cache()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        _prefill(engine, ids, size)
        times.append(time.perf_counter() - t0)
        peaks.append(mx.get_peak_memory())
    kv = sum(c.keys.nbytes + c.values.nbytes for c in engine.caches)
    heads = int(engine.manifest.model.num_heads)
    return {"tokens": n, "way": way, "chunk": size,
            "pp_tok_s": n / statistics.median(times),
            "peak_mib": max(peaks) / 2**20, "kv_cache_mib": kv / 2**20,
            "full_scores_bytes_one_layer_mib": heads * n * n * 4 / 2**20}


def artifact(work: Path, shape: str, dtype: str, context: int) -> Path:
    """The converted random-weight checkpoint of `shape`, built once under `work`."""
    from fuselm.converter.pipeline import ConvertOptions, convert

    out = work / f"{shape}_{dtype}_out"
    if not (out / "fuselm.json").exists():
        config = {**SHAPES[shape], "max_position_embeddings": max(context + 1024, 4096)}
        hf = build_model(work / f"{shape}_hf", "qwen3", seed=0, **config)
        convert(hf, out, ConvertOptions(dtype=dtype))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("-p", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("-r", type=int, default=1)
    ap.add_argument("--ways", nargs="+", default=["prefix", "mask", "oneshot"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm_long_prompt"))
    args = ap.parse_args()
    engine = make_engine(artifact(args.work, args.shape, args.dtype, max(args.p)), "mlx")
    rows = [measure(engine, n, args.chunk, way, args.r) for n in args.p for way in args.ways]
    print(json.dumps({"device": str(mx.default_device()), "host": platform.node(),
                      "shape": args.shape, "dtype": args.dtype,
                      "prefill": engine.describe()["prefill"],
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
