"""KV-cache memory per token with the cache in the activation dtype and quantized, JSON out.

    python benchmarks/kv_bytes.py ARTIFACT [-p 300] [--group-size 64]

Opens ARTIFACT with the MLX engine three times (float cache, `kv_bits=8`, `kv_bits=4`),
prefills a P-token prompt and reads the bytes the caches' buffers hold (KVCache.nbytes, every
layer, K and V, the quantized triples' scales and biases included) divided by their capacity:
the bytes one cached token costs. The float cache's dtype is the one the engine runs (the
graph's past_key_values dtype; on MLX's CPU a float16 artifact runs in float32); the quantized
caches keep their scales and biases in that dtype too. `float16` repeats the count for caches
of the same layout allocated in float16 (the GPU's dtype). A 4-bit cache's keys are stored per
channel with a float tail of the newest two key groups (128 positions) and one spare group per
row and layer (KVCache.fixed_nbytes): not per token, so reported apart, as
`fixed_bytes_per_row` (every layer).
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import numpy as np

from fuselm.runtime_metal.engine import make_engine
from fuselm.runtime_metal.kv_cache import KVCache, KVQuant


def per_token(artifact: str, prompt: int, bits: int | None, group: int
              ) -> tuple[float, str, int]:
    eng = make_engine(artifact, "mlx", **({"kv_bits": bits, "kv_group_size": group}
                                          if bits else {}))
    ids = np.random.default_rng(0).integers(4, 1000, size=(1, prompt))
    eng.forward(ids)
    caches = eng.caches  # type: ignore[attr-defined]
    fixed = sum(c.fixed_nbytes for c in caches)
    total = sum(c.nbytes for c in caches) - fixed
    dtype = caches[0].buffers()[1 if bits else 0].dtype
    return total / caches[0].capacity, str(dtype), fixed


def float16_per_token(artifact: str, bits: int | None, group: int) -> tuple[float, int]:
    """The same layout's caches allocated in float16 (256 positions): bytes per position,
    and the fixed bytes per row."""
    eng = make_engine(artifact, "mlx")
    total = fixed = 0
    for hk, dk, dv, _ in eng.plan.kv_layout():  # type: ignore[attr-defined]
        c = KVCache(KVQuant(bits, group) if bits else None)
        c.allocate(1, hk, dk, dv, mx.float16, KVCache.step)
        total += c.nbytes - c.fixed_nbytes
        fixed += c.fixed_nbytes
    return total / KVCache.step, fixed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("-p", type=int, default=300)
    ap.add_argument("--group-size", type=int, default=64)
    args = ap.parse_args()
    rows = {}
    for bits in (None, 8, 4):
        b, dtype, fixed = per_token(args.artifact, args.p, bits, args.group_size)
        rows["float" if bits is None else f"kv{bits}"] = {"bytes_per_token": b, "dtype": dtype,
                                                          "fixed_bytes_per_row": fixed}
    base = rows["float"]["bytes_per_token"]
    f16 = {b: float16_per_token(args.artifact, b, args.group_size) for b in (None, 8, 4)}
    for name, bits in (("kv8", 8), ("kv4", 4)):
        r = rows[name]
        r["vs_float"] = r["bytes_per_token"] / base - 1  # type: ignore[operator]
        r["float16_bytes_per_token"] = f16[bits][0]
        r["float16_fixed_bytes_per_row"] = f16[bits][1]
        r["float16_vs_float"] = f16[bits][0] / f16[None][0] - 1
    rows["float"]["float16_bytes_per_token"] = f16[None][0]
    print(json.dumps({"artifact": args.artifact, "group_size": args.group_size, **rows}))


if __name__ == "__main__":
    main()
