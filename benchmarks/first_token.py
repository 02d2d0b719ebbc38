"""A serving request's first token on the batch decoder (runtime_metal/batch.py): `add` (the
prompt's prefill into its blocks) and the first `step`, for prompts of lengths the process has
not met yet and then for the same lengths again, one JSON.

    python benchmarks/first_token.py --artifact DIR [--lengths 85 95] [--max-context 1024]
        [--shared 20 [--pad-after-prefix on|off]]

A server meets a new prompt length on most requests; where that costs a compiled trace of its
own, `new` stands above `again` by the trace. Each prompt is random ids, added to an otherwise
idle decoder (`--max-batch` slots, `--max-context`: the decoder's capacity, as `fuselm serve`
sets it) and removed after its first token. With `--shared N` every prompt starts with the same
N ids (a system prompt, a chat template's header: what a server's prompts share), which the
decoder takes from its prefix cache, prefilling the rest. Medians over the lengths of the wall
time and of the process's CPU time (the steadier figure on a shared CPU host, where MLX's CPU
backend is the device), and the compiled traces each pass made (`traces_new`, `traces_again`:
counted, so the same on any load).
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


def traces(engine: object) -> int:
    """Compiled traces of the engine's program so far: a compiled function calls the program's
    Python only when it traces (a new function or input shape), so its calls are counted."""
    program = engine.fast.program  # type: ignore[attr-defined]
    if "run" not in vars(program):
        run = program.run
        calls = [0]

        def counted(*a: object, **k: object) -> object:
            calls[0] += 1
            return run(*a, **k)
        counted.calls = calls  # type: ignore[attr-defined]
        program.run = counted
    return program.run.calls[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, required=True)
    ap.add_argument("--lengths", type=int, nargs=2, default=[85, 95],
                    help="prompt lengths from A to B - 1 (the chat template's ~60 tokens "
                    "around serve_bench's 24 words are ~85-95)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--shared", type=int, default=0,
                    help="ids every prompt starts with (taken from the prefix cache)")
    ap.add_argument("--pad-after-prefix", choices=("auto", "on", "off"), default="auto",
                    help="the rest after a reused prefix prefilled padded (BatchDecoder."
                    "pad_after_prefix; auto: the decoder's default, on a GPU only)")
    args = ap.parse_args()
    engine = make_engine(args.artifact, "mlx")
    dec = BatchDecoder(engine, max_batch=args.max_batch, max_context=args.max_context)
    if args.pad_after_prefix != "auto":
        dec.pad_after_prefix = args.pad_after_prefix == "on"
    vocab = engine.manifest.model.vocab_size
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(4, min(1000, vocab), args.shared)]

    def first_token(n: int) -> tuple[float, float]:
        prompt = shared + [int(t) for t in rng.integers(4, min(1000, vocab), n - len(shared))]
        t, c = time.perf_counter(), time.process_time()
        slot = dec.add(prompt)
        dec.step()
        out = ((time.perf_counter() - t) * 1e3, (time.process_time() - c) * 1e3)
        dec.remove(slot)
        return out

    for n in (args.shared + 3, args.shared + 5):  # warm-up: the decode step's trace, lengths
        # outside the measured ones
        first_token(n)
    lengths = range(*args.lengths)
    traced = traces(engine)
    new = [first_token(n) for n in lengths]
    traced_new = traces(engine) - traced
    again = [first_token(n) for n in lengths]
    traced_again = traces(engine) - traced - traced_new

    def med(xs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(x[i] for x in xs)

    print(json.dumps({
        "device": str(mx.default_device()), "host": platform.node(),
        "artifact": str(args.artifact), "engine": engine.describe(), "mode": dec.mode,
        "lengths": [args.lengths[0], args.lengths[1] - 1], "shared": args.shared,
        "reused_tokens": dec.reused_tokens, "pad_after_prefix": dec.pad_after_prefix,
        "new_ms": med(new, 0), "again_ms": med(again, 0),
        "new_cpu_ms": med(new, 1), "again_cpu_ms": med(again, 1),
        "new_over_again": med(new, 0) / med(again, 0),
        "traces_new": traced_new, "traces_again": traced_again}, indent=1))


if __name__ == "__main__":
    main()
