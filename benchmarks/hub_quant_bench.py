"""Reading AWQ / GPTQ packed layers into given blocks, as JSON: the median time to unpack one
layer (codes, scales, zero points re-laid out to [N, K]) and to dequantize it, per format.

    python benchmarks/hub_quant_bench.py [--k 4096] [--n 4096] [--group 128] [--repeats 7]

Random packed words (every nibble value occurs); one warm-up call per format first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _median(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    from fuselm.export.quantized.packing import awq_blocks, gptq_blocks

    k, n, g = args.k, args.n, args.group
    rng = np.random.default_rng(0)

    def words(*shape: int) -> np.ndarray:
        return rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32).view(np.int32)

    scales = rng.random((k // g, n)).astype(np.float16)
    qzeros = words(k // g, n // 8)
    awq, gptq = words(k, n // 8), words(k // 8, n)
    unpack = {"awq": lambda: awq_blocks(awq, qzeros, scales, g),
              "gptq": lambda: gptq_blocks(gptq, qzeros, scales, g, True)}
    out: dict[str, Any] = {"k": k, "n": n, "group": g, "repeats": args.repeats,
                           "load_avg": round(os.getloadavg()[0], 1)}
    for name, fn in unpack.items():
        blocks = fn()
        out[name] = {"unpack_s": round(_median(fn, args.repeats), 4),
                     "dequantize_s": round(_median(blocks.dequantize, args.repeats), 4)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
