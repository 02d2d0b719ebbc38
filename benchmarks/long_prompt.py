"""Long-prompt prefill: time and peak memory of a 2,048- and an 8,192-token prompt, JSON out.

    python benchmarks/long_prompt.py [--shape small|qwen3-0.6b] [-p 2048 8192] [--chunk 512 2048]
        [--dtype float32|float16] [--quant q4 --group-size 32]

Builds (or reuses, under --work) a random-weight Qwen3 checkpoint of the shape, converts it
(--dtype, optionally --quant q4), and prefills each prompt length through the MLX engine, for
each --chunk size, three ways:
- "prefix": chunked, each later chunk attending rows 0..offset+s with MLX's fused causal
  attention (FastDecoder.prefix_prefill: the default path, compiled per chunk start);
- "mask": chunked, the compiled call with a device mask over the whole cache capacity (the
  path before);
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

from fuselm.converter.models.builtin import QWEN3_0_6B, TINY, build_model
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


def artifact(work: Path, shape: str, dtype: str, context: int, quant: str | None = None,
             group: int = 32) -> Path:
    """The converted random-weight checkpoint of `shape`, built once under `work`."""
    from fuselm.converter.pipeline import ConvertOptions, convert

    tag = f"_{quant}g{group}" if quant else ""
    out = work / f"{shape}_{dtype}{tag}_out"
    if not (out / "fuselm.json").exists():
        config = {**SHAPES[shape], "max_position_embeddings": max(context + 1024, 4096)}
        hf = work / f"{shape}_hf"
        if not (hf / "config.json").exists():
            build_model(hf, "qwen3", seed=0, **config)
        opts = ConvertOptions.from_flags(dtype=dtype, quant=quant, block_size=group) if quant \
            else ConvertOptions(dtype=dtype)
        convert(hf, out, opts)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("-p", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--chunk", type=int, nargs="+", default=[512])
    ap.add_argument("-r", type=int, default=1)
    ap.add_argument("--ways", nargs="+", default=["prefix", "mask", "oneshot"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quant", choices=("q4",), default=None)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--artifact", type=Path, help="a converted model to use instead of --shape's")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm_long_prompt"))
    args = ap.parse_args()
    art = args.artifact or artifact(args.work, args.shape, args.dtype, max(args.p), args.quant,
                                    args.group_size)
    engine = make_engine(art, "mlx")
    rows = []
    for n in args.p:
        for way in args.ways:
            for chunk in args.chunk if way != "oneshot" else [n]:
                rows.append(measure(engine, n, chunk, way, args.r))
                print(json.dumps(rows[-1]), flush=True)
    res = json.dumps({"device": str(mx.default_device()), "host": platform.node(),
                      "shape": args.shape, "artifact": str(art), "dtype": args.dtype,
                      "quant": args.quant,
                      "group_size": args.group_size, "prefill": engine.describe()["prefill"],
                      "rows": rows}, indent=1)
    if args.json_out:
        args.json_out.write_text(res)
    print(res)


if __name__ == "__main__":
    main()
