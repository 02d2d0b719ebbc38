"""A serving request's first token on the batch decoder (runtime_metal/batch.py): `add` (the
prompt's prefill into its blocks) and the first `step`, for prompts of lengths the process has
not met yet and then for the same lengths again, one JSON.

    python benchmarks/first_token.py --artifact DIR [--lengths 85 95] [--max-context 1024]

A server meets a new prompt length on most requests; where that costs a compiled trace of its
own, `new` stands above `again` by the trace. Each prompt is random ids, added to an otherwise
idle decoder (`--max-batch` slots, `--max-context`: the decoder's capacity, as `fuselm serve`
sets it) and removed after its first token. Medians over the lengths of the wall time and of
the process's CPU time (the steadier figure on a shared CPU host, where MLX's CPU backend is the
device).
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

from fuselm.runtime_metal.batch import BatchDecoder
from fuselm.runtime_metal.engine import make_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--lengths", type=int, nargs=2, default=[85, 95],
                    help="prompt lengths from A to B - 1 (the chat template's ~60 tokens "
                    "around serve_bench's 24 words are ~85-95)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=1024)
    args = ap.parse_args()
    engine = make_engine(args.artifact, "mlx")
    dec = BatchDecoder(engine, max_batch=args.max_batch, max_context=args.max_context)
    vocab = engine.manifest.model.vocab_size
    rng = np.random.default_rng(0)

    def first_token(n: int) -> tuple[float, float]:
        prompt = [int(t) for t in rng.integers(4, min(1000, vocab), n)]
        t, c = time.perf_counter(), time.process_time()
        slot = dec.add(prompt)
        dec.step()
        out = ((time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3)
        dec.remove(slot)
        return out

    for n in (3, 5):  # warm-up: the decode step's trace, lengths outside the measured ones
        first_token(n)
    lengths = range(*args.lengths)
    new = [first_token(n) for n in lengths]
    again = [first_token(n) for n in lengths]

    def med(xs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(x[i] for x in xs)

    print(json.dumps({
        "device": str(mx.default_device()), "host": platform.node(),
        "artifact": str(args.artifact), "engine": engine.describe(), "mode": dec.mode,
        "lengths": [args.lengths[0], args.lengths[1] - 1],
        "new_ms": med(new, 0), "again_ms": med(again, 0),
        "new_cpu_ms": med(new, 1), "again_cpu_ms": med(again, 1),
        "new_over_again": med(new, 0) / med(again, 0)}, indent=1))


if __name__ == "__main__":
    main()
