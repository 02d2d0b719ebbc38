"""What per-row logprobs and logits processors cost, one JSON.

    python benchmarks/sampling_cost.py [--vocab 49152 151936] [--shape small|qwen3-0.6b]
                                       [-b 8] [--engine mlx|onnxruntime]

host: per row and token on the host, at each --vocab (random logits, a reply of 256 tokens so
far): the greedy argmax alone, the processors (presence + frequency penalties, 8 logit_bias
entries) with the greedy choice, and the logprobs with 5 and 20 alternatives
(sampling.process_logits / TokenSampler / token_logprobs); the median of -r runs of 200 calls.

batch: the batch decoder's step (runtime_metal/batch.py) with b rows of -p prompt tokens,
every row greedy (the device argmax, pipelined on MLX), then one row and then every row asking
for 5 logprobs, then one row with the penalties: the median step time of -r rounds of -n steps
after a warm-up round. The random-weight checkpoint of benchmarks/long_prompt.py (--shape, same
--work) or --artifact.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from long_prompt import SHAPES, artifact  # noqa: E402

from fuselm.runtime_metal.batch import BatchDecoder  # noqa: E402
from fuselm.runtime_metal.engine import make_engine  # noqa: E402
from fuselm.runtime_metal.sampling import (  # noqa: E402
    SamplingOptions,
    TokenSampler,
    token_logprobs,
)

PENALTIES = SamplingOptions(presence_penalty=0.5, frequency_penalty=0.5,
                            logit_bias=tuple((i * 7, 1.0) for i in range(8)))


def _median_us(fn, calls: int, runs: int) -> float:  # noqa: ANN001
    times = []
    for r in range(runs + 1):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if r:
            times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def host(vocab: int, runs: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, vocab).astype(np.float32)
    history = [int(t) for t in rng.integers(0, vocab, 512)]
    sampler = TokenSampler(PENALTIES)
    sampler(logits, history[:256])  # the prompt: the next calls' reply is history[256:]
    plain = TokenSampler(SamplingOptions())
    return {
        "vocab": vocab,
        "greedy_us": _median_us(lambda: plain(logits, history), 200, runs),
        "processors_greedy_us": _median_us(lambda: sampler(logits, history), 200, runs),
        "logprobs_top5_us": _median_us(lambda: token_logprobs(logits, 3, 5), 200, runs),
        "logprobs_top20_us": _median_us(lambda: token_logprobs(logits, 3, 20), 200, runs),
    }


def batch(engine, b: int, p: int, n: int, runs: int) -> list[dict[str, object]]:  # noqa: ANN001
    vocab = engine.manifest.model.vocab_size
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(4, min(1000, vocab), p)] for _ in range(b)]
    cases = {"all_greedy": (None, None, 0), "one_row_logprobs5": (None, 5, 1),
             "all_rows_logprobs5": (None, 5, b), "one_row_penalties": (PENALTIES, None, 1)}
    out = []
    for name, (opts, top, rows) in cases.items():
        dec = BatchDecoder(engine, max_batch=b, max_context=p + (runs + 1) * n + 8)
        for i, prompt in enumerate(prompts):
            dec.add(prompt, opts if i < rows else None, top_logprobs=top if i < rows else None)
        dec.step()
        times = []
        for r in range(runs + 1):
            t0 = time.perf_counter()
            for _ in range(n):
                dec.step()
            if r:
                times.append((time.perf_counter() - t0) / n * 1e3)
        out.append({"case": name, "batch": b, "mode": dec.mode,
                    "step_ms": statistics.median(times)})
    base = out[0]["step_ms"]
    for row in out:
        row["over_all_greedy"] = row["step_ms"] / base  # type: ignore[operator]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--engine", default="mlx")
    ap.add_argument("--artifact", type=Path)
    ap.add_argument("-b", type=int, default=8)
    ap.add_argument("-p", type=int, default=64)
    ap.add_argument("-n", type=int, default=16)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fuselm_long_prompt"))
    args = ap.parse_args()
    out_dir = args.artifact or artifact(args.work, args.shape, args.dtype, args.p + 4 * args.n)
    engine = make_engine(out_dir, args.engine)
    print(json.dumps({"host": platform.node(), "shape": str(args.artifact or args.shape),
                      "engine": engine.describe(),
                      "host_per_row": [host(v, args.r) for v in args.vocab],
                      "batch": batch(engine, args.b, args.p, args.n, args.r)}, indent=1))


if __name__ == "__main__":
    main()
