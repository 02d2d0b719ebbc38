"""MLX's quantized matmul against dequantize-then-dense-matmul, by row count: where a Q4 matmul
of M rows should switch (kernels.CUDA_DENSE_ROWS). JSON out, medians of -r timed runs.

    python benchmarks/probes/q4_dense_crossover.py [-m 16 32 64 128 256 512 2048] [--group-size 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

SHAPES = [(1024, 4096), (1024, 6144), (3072, 1024), (2048, 16384), (4096, 28672)]  # (K, N)


def _time(fn, runs: int) -> float:  # noqa: ANN001
    mx.eval(fn())
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 2048])
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("-r", type=int, default=20)
    args = ap.parse_args()
    rows = []
    for k, n in SHAPES:
        w = mx.random.normal((n, k)).astype(mx.float16) * 0.02
        q, s, b = mx.quantize(w, group_size=args.group_size, bits=4)
        for m in args.m:
            x = mx.random.normal((m, k)).astype(mx.float16)
            qmm = _time(lambda x=x, w=(q, s, b): mx.quantized_matmul(
                x, *w, transpose=True, group_size=args.group_size, bits=4), args.r)
            dense = _time(lambda x=x, w=(q, s, b): x @ mx.dequantize(
                *w, group_size=args.group_size, bits=4).T, args.r)
            rows.append({"K": k, "N": n, "M": m, "qmm_ms": qmm * 1e3, "dense_ms": dense * 1e3,
                         "dense_faster": dense < qmm})
            print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"device": str(mx.default_device()), "group_size": args.group_size,
                      "rows": rows}))


if __name__ == "__main__":
    main()
